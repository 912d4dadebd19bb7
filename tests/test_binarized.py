"""The binarized corpus (dtmt_models.data.binarized, issue 24): the ids read back from the memory-mapped shards
equal the text pipeline's (`Vocabulary.encode` of each stripped line, with SentencePiece trained on the same
lines), the sample is the seeded draw it claims, bad text and interruptions leave nothing a reader accepts, and
the numpy batching equals a plain reference."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from dtmt_models.cli import prepare as prepare_cli
from dtmt_models.data import batching, binarized
from dtmt_models.data import corpus as data
from dtmt_models.data.vocabulary import Vocabulary

# Text with what tempts a word cache into error: accents, decomposed accents (NFKC composes them), ligatures and
# full-width letters (NFKC rewrites them), non-breaking and ideographic spaces, tabs, runs of spaces, control
# characters, emoji, CJK, characters the vocabulary has never seen, and a byte-order mark on the first line.
SRC = ["\ufeffEl niño comió pan.", "La cafe\u0301 está ﬁrme", "Ｆｕｌｌ width y\u00a0espacio duro",
       "tab\there  y   espacios", "a\u3000b 中文 字", "emoji 🙂 fin", "ctrl\x07char", "¿Qué?¡Sí!",
       "El niño come pan otra vez.", "x"]
TGT = ["The child ate bread.", "The coffee is firm", "Full width and hard space", "tab here and spaces",
       "a b Chinese text", "emoji end", "control char", "What? Yes!", "The child eats bread again.", "y"]


def write_corpus(directory, src, tgt, splits=("train",)):
    os.makedirs(directory, exist_ok=True)
    for split in splits:
        for lang, side in (("es", src), ("en", tgt)):
            with open(os.path.join(directory, f"{split}.{lang}"), "w", encoding="utf-8") as f:
                f.write("".join(line + "\n" for line in side))
    data.write_manifest(str(directory), "es", "en", {s: len(src) for s in splits}, origin="test")
    return str(directory)


def text_pipeline(directory, split, vocab_size, vocab_type="bpe"):
    """The reference: read_parallel, SentencePiece on all training lines per side, encode line by line."""
    train = data.read_parallel(*data.corpus_paths(directory, "train"))
    sv = Vocabulary.train([s for s, _ in train], vocab_size, vocab_type)
    tv = Vocabulary.train([t for _, t in train], vocab_size, vocab_type)
    pairs = data.read_parallel(*data.corpus_paths(directory, split))
    return (sv, tv), [(sv.encode(s), tv.encode(t)) for s, t in pairs]


@pytest.mark.parametrize("vocab_type,workers", [("bpe", 1), ("unigram", 1), ("bpe", 2)])
def test_ids_equal_the_text_pipeline(tmp_path, vocab_type, workers):
    rng = random.Random(0)
    src = SRC + [" ".join(rng.choice(SRC[i % len(SRC)].split()) for _ in range(rng.randint(1, 9))) for i in range(300)]
    tgt = TGT + [" ".join(rng.choice(TGT[i % len(TGT)].split()) for _ in range(rng.randint(1, 9))) for i in range(300)]
    d = write_corpus(tmp_path / "c", src, tgt, splits=("train", "dev"))
    binarized.binarize(d, 70, vocab_type, workers=workers, log=lambda m: None)
    corpus = binarized.open_binarized(d, vocab_type, 70)
    refs = {}
    for split in ("train", "dev"):
        (sv, tv), ref = refs[split] = text_pipeline(d, split, 70, vocab_type)
        assert tuple(corpus.protos) == (sv.proto, tv.proto)
        part = corpus.split(split)
        assert len(part) == len(ref)
        assert part.pairs(range(len(part))) == ref
        assert part.lengths().tolist() == [[len(s), len(t)] for s, t in ref]
        for k, side in enumerate(("src", "tgt")):   # the files are plain arrays that numpy maps
            ids, offsets = part.memmap(side)
            assert [ids[offsets[i]:offsets[i + 1]].tolist() for i in range(len(part))] == [p[k] for p in ref]
        assert part.lengths(np.uint8, chunk=7).tolist() == [[min(len(s), 255), min(len(t), 255)] for s, t in ref]
    m = corpus.manifest
    assert m["dtype"] == "uint16" and m["sample"] == {"size": len(src), "of": len(src), "seed": 1}
    for split, (_, ref) in refs.items():
        assert m["splits"][split]["tokens"] == {"src": sum(len(s) for s, _ in ref), "tgt": sum(len(t) for _, t in ref)}
        assert m["splits"][split]["pairs"] == len(ref)
    assert m["train_sha1"] == data.corpus_fingerprint(d)["train_sha1"]


def test_word_cache_is_exact_on_random_text():
    """The cache (ids of a line = its words' ids) against SentencePiece on whole lines, over random lines of
    letters, accents, spaces of several kinds and symbols; lines it cannot vouch for go to SentencePiece whole."""
    rng = random.Random(1)
    alphabet = list("abcdeéñü  ") + ["\u00a0", "\t", "ﬁ", "Ａ", "e\u0301", "🙂", "中", ".", ",", "\x07"]
    lines = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))).strip() or "a" for _ in range(400)]
    for vocab_type in ("bpe", "unigram"):
        proto = Vocabulary.train(lines[:300], 60, vocab_type).proto
        enc = binarized._CachedEncoder(proto)
        reference = Vocabulary(proto)
        got = []
        for part in (lines, lines[::-1]):
            ids, lengths = enc.encode(part)
            assert len(lengths) == len(part)
            got += [ids[e - n:e].tolist() for e, n in zip(np.cumsum(lengths), lengths)]
        assert got == [reference.encode(s) for s in lines + lines[::-1]]
        assert enc.exact and len(enc.index) > 10


def test_sample_is_the_seeded_draw(tmp_path):
    src = [f"linea {i} {'abcdefghij'[i % 10] * (i % 5 + 1)}" for i in range(200)]
    tgt = [f"line {i} {'klmnopqrst'[i % 10] * (i % 7 + 1)}" for i in range(200)]
    d = write_corpus(tmp_path / "c", src, tgt)
    binarized.binarize(d, 40, sample=50, seed=3, workers=1, log=lambda m: None)
    corpus = binarized.open_binarized(d, "bpe", 40)
    chosen = sorted(random.Random(3).sample(range(200), 50))
    assert corpus.protos[0] == Vocabulary.train([src[i] for i in chosen], 40).proto
    assert corpus.protos[1] == Vocabulary.train([tgt[i] for i in chosen], 40).proto
    assert corpus.manifest["sample"] == {"size": 50, "of": 200, "seed": 3}
    sv = Vocabulary(corpus.protos[0])
    assert corpus.split("train").pairs([0, 199])[1][0] == sv.encode(src[199])   # every line is encoded
    binarized.binarize(d, 40, sample=50, seed=4, workers=1, log=lambda m: None)
    assert binarized.open_binarized(d, "bpe", 40).protos[0] != corpus.protos[0]


@pytest.mark.parametrize("content,message", [
    ((b"uno\n\xff\xfe dos\n", b"one\ntwo\n"), r"train\.es:2: invalid UTF-8"),
    ((b"uno\n \n", b"one\ntwo\n"), r"train\.es:2: empty line"),
    ((b"uno\ndos\n", b"one\n"), r"train\.es has 2 lines, .*train\.en has 1"),
])
def test_bad_text_is_reported_and_nothing_is_left(tmp_path, content, message):
    d = str(tmp_path / "c")
    os.makedirs(d)
    for lang, body in zip(("es", "en"), content):
        with open(os.path.join(d, f"train.{lang}"), "wb") as f:
            f.write(body)
    data.write_manifest(d, "es", "en", {"train": 2}, origin="test")
    with pytest.raises(data.CorpusError, match=message):
        binarized.binarize(d, 20, workers=1, log=lambda m: None)
    assert sorted(os.listdir(d)) == ["corpus.json", "train.en", "train.es"]


def test_bad_lines_are_counted_across_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(binarized, "CHUNK_LINES", 3)
    src = [f"s{i}" for i in range(30)]
    src[4], src[25] = " ", "   "
    d = write_corpus(tmp_path / "c", src, [f"t{i}" for i in range(30)])
    with pytest.raises(data.CorpusError, match=r"2 problem\(s\)\n  .*train\.es:5: empty line\n  .*train\.es:26: empty"):
        binarized.binarize(d, 20, workers=2, log=lambda m: None)
    assert not [e for e in os.listdir(d) if "bin-" in e]


def test_an_interrupted_build_leaves_no_corpus_and_keeps_the_old_one(tmp_path):
    d = write_corpus(tmp_path / "c", SRC, TGT)

    def interrupt(message):
        if message.startswith("train:"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        binarized.binarize(d, 80, workers=1, log=interrupt)
    assert not [e for e in os.listdir(d) if "bin-" in e]
    with pytest.raises(data.CorpusError, match="no binarized corpus for bpe 80.*dtmt prepare binarize"):
        binarized.open_binarized(d, "bpe", 80)
    binarized.binarize(d, 80, workers=1, log=lambda m: None)
    before = binarized.open_binarized(d, "bpe", 80).split("train").pairs(range(len(SRC)))
    with pytest.raises(KeyboardInterrupt):   # a rebuild that stops half way: the earlier copy stays as it was
        binarized.binarize(d, 80, seed=9, workers=1, log=interrupt)
    assert binarized.open_binarized(d, "bpe", 80).split("train").pairs(range(len(SRC))) == before
    assert sorted(e for e in os.listdir(d) if "bin-" in e) == ["bin-bpe80"]


def test_a_killed_build_leaves_a_leftover_that_nothing_reads_and_the_next_build_removes(tmp_path):
    d = write_corpus(tmp_path / "c", SRC * 50, TGT * 50)
    code = ("import os, sys; from dtmt_models.data import binarized\n"
            "def log(m):\n"
            "    if m.startswith('vocabularies'): os._exit(9)   # as a kill would, nothing cleaned up\n"
            f"binarized.binarize({d!r}, 80, workers=1, log=log)\n")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 9
    leftovers = [e for e in os.listdir(d) if "bin-" in e]
    assert len(leftovers) == 1 and leftovers[0].startswith(".bin-bpe80.tmp-")
    with pytest.raises(data.CorpusError, match="no binarized corpus"):
        binarized.open_binarized(d, "bpe", 80)
    binarized.binarize(d, 80, workers=1, log=lambda m: None)
    assert sorted(e for e in os.listdir(d) if "bin-" in e) == ["bin-bpe80"]


def test_changed_text_is_noticed_and_a_touched_file_is_not(tmp_path):
    d = write_corpus(tmp_path / "c", SRC, TGT)
    binarized.binarize(d, 80, workers=1, log=lambda m: None)
    path = os.path.join(d, "train.en")
    os.utime(path, ns=(1, 1))                       # same bytes, another time: still this corpus
    hashed = []
    real = binarized._file_sha1
    binarized._file_sha1 = lambda p: hashed.append(p) or real(p)
    try:
        binarized.open_binarized(d, "bpe", 80)
        binarized.open_binarized(d, "bpe", 80)      # the new time was kept: nothing is read again
    finally:
        binarized._file_sha1 = real
    assert hashed == [path]
    with open(path, "r+", encoding="utf-8") as f:    # same size, other bytes
        text = f.read()
        f.seek(0)
        f.write(text.replace("child", "chilD"))
    with pytest.raises(binarized.NotBinarized, match=r"\(changed: train\.en\); rebuild it with `dtmt prepare binarize"):
        binarized.open_binarized(d, "bpe", 80)
    # (the note had read "the splits, now dev, train changed")
    data.write_manifest(d, "es", "en", {"train": len(SRC), "dev": len(SRC)}, origin="test")
    with pytest.raises(binarized.NotBinarized, match=r"\(changed: the splits, now dev, train\); "):
        binarized.open_binarized(d, "bpe", 80)
    data.write_manifest(d, "es", "en", {"train": len(SRC)}, origin="test")
    with open(os.path.join(d, "bin-bpe80", "binarized.json"), "w") as f:   # a damaged manifest: one line too
        f.write("{")
    with pytest.raises(binarized.NotBinarized, match=r"binarized\.json: unreadable"):
        binarized.open_binarized(d, "bpe", 80)


@pytest.mark.parametrize("damage", ["no text", "text a string", "file a number", "file in a folder", "bytes a string",
                                    "languages a list"])
def test_a_manifest_with_malformed_text_records_is_not_binarized(tmp_path, damage):
    """A manifest whose records of the text files (what `stale` compares) are missing or of the wrong type is
    NotBinarized, which dtmt train rebuilds; it was a KeyError or TypeError traceback."""
    d = write_corpus(tmp_path / "c", SRC, TGT)
    binarized.binarize(d, 80, workers=1, log=lambda m: None)
    path = os.path.join(d, "bin-bpe80", "binarized.json")
    with open(path) as f:
        manifest = json.load(f)
    text = manifest["splits"]["train"]["text"]
    if damage == "no text":
        del manifest["splits"]["train"]["text"]
    elif damage == "text a string":
        manifest["splits"]["train"]["text"] = "x"
    elif damage == "file a number":
        text["src"]["file"] = 5
    elif damage == "file in a folder":
        text["src"]["file"] = "../elsewhere/train.es"
    elif damage == "bytes a string":
        text["tgt"]["bytes"] = "12"
    else:
        manifest["languages"] = ["es", "en"]
    with open(path, "w") as f:
        json.dump(manifest, f)
    with pytest.raises(binarized.NotBinarized, match=r"binarized\.json: malformed .*rebuild it"):
        binarized.open_binarized(d, "bpe", 80)


def test_a_copy_missing_a_file_is_not_binarized(tmp_path):
    """A binarized copy with a split's file deleted (or cut short) is NotBinarized when opened, which dtmt train
    rebuilds; it was a FileNotFoundError traceback when the split was read."""
    d = write_corpus(tmp_path / "c", SRC, TGT)
    binarized.binarize(d, 80, workers=1, log=lambda m: None)
    os.remove(os.path.join(d, "bin-bpe80", "train.tgt.bin"))
    with pytest.raises(binarized.NotBinarized, match=r"train\.tgt\.bin is missing; rebuild"):
        binarized.open_binarized(d, "bpe", 80)
    binarized.binarize(d, 80, workers=1, log=lambda m: None)
    with open(os.path.join(d, "bin-bpe80", "train.src.bin"), "r+b") as f:
        f.truncate(2)
    with pytest.raises(binarized.NotBinarized, match="not as long as its index says"):
        binarized.open_binarized(d, "bpe", 80)


def test_crafted_manifests_and_models_are_one_line(tmp_path):
    """A corpus.json or binarized.json of brackets nested 100,000 deep was a RecursionError traceback (dtmt train,
    dtmt evaluate); a src.model that SentencePiece cannot load, SentencePiece's own. Each is a CorpusError naming
    the file (dtmt train and evaluate: one line)."""
    d = write_corpus(tmp_path / "c", SRC, TGT)
    binarized.binarize(d, 80, workers=1, log=lambda m: None)
    copy = os.path.join(d, "bin-bpe80")
    sv, tv = binarized.BinarizedCorpus(copy).vocabularies()
    assert (len(sv), len(tv)) == (80, 80)
    model = os.path.join(copy, "src.model")
    with open(model, "wb") as f:
        f.write(b"\x00garbage" * 10)
    with pytest.raises(data.CorpusError, match=re_escape(f"{model}: not the model the shards were encoded with")):
        binarized.BinarizedCorpus(copy)
    import hashlib
    record = json.loads(open(os.path.join(copy, binarized.MANIFEST)).read())   # (its SHA-1 recorded as well)
    record["models"]["src.model"] = hashlib.sha1(b"\x00garbage" * 10).hexdigest()
    with open(os.path.join(copy, binarized.MANIFEST), "w") as f:
        json.dump(record, f)
    with pytest.raises(data.CorpusError, match=re_escape(f"{model}: not a SentencePiece model this reads (")):
        binarized.BinarizedCorpus(copy).vocabularies()
    deep = "[" * 100_000
    for path in (os.path.join(copy, binarized.MANIFEST), os.path.join(d, data.MANIFEST)):
        with open(path, "w") as f:
            f.write(deep)
        with pytest.raises(data.CorpusError, match=re_escape(f"{path}: unreadable (nested too deeply)")):
            binarized.BinarizedCorpus(copy) if path.startswith(copy) else data.read_manifest(d)
    assert binarized.known_train_sha1(d) is None


def test_files_that_are_no_regular_files_are_refused_without_reading_them(tmp_path):
    """A review's: a src.model that is a FIFO hung `dtmt train` before its first line (open waited for a writer, in
    the fingerprint of every bin-* copy), one linked to /dev/zero read until memory ran out; a corpus.json or shard
    that is a FIFO was said as missing. Each is a CorpusError naming the file as not a regular file (dtmt train
    rebuilds a copy: NotBinarized); a model past MAX_SMALL_FILE_BYTES is not read whole. A split named "../x" in
    binarized.json named a file outside the folder; the id named by verify() is the one refused (it named the
    largest of its chunk)."""
    import threading

    d = write_corpus(tmp_path / "c", SRC, TGT)
    copy = binarized.binarize(d, 80, workers=1, log=lambda m: None)
    model = os.path.join(copy, "src.model")
    os.rename(model, model + ".kept")
    os.mkfifo(model)
    # (without the check, the open waits for a writer: this one comes after 3 s, the read gets nothing)
    writer = threading.Timer(3, lambda: os.close(os.open(model, os.O_WRONLY | os.O_NONBLOCK)))
    writer.start()
    try:
        with pytest.raises(binarized.NotBinarized, match=re_escape(f"{model}: not a regular file (a folder, a pipe "
                                                                   f"or a device); rebuild")):
            binarized.open_binarized(d, "bpe", 80)
    finally:
        writer.cancel()
        writer.join()
    os.remove(model)
    os.symlink("/dev/zero", model)
    with pytest.raises(data.CorpusError, match=re_escape(f"{model}: not a regular file (a folder, a pipe or a")):
        binarized.BinarizedCorpus(copy)
    os.remove(model)
    os.mkdir(model)   # (a folder: the descriptor's own error, "Is a directory: 3", and the descriptor leaked)
    with pytest.raises(data.CorpusError, match=re_escape(f"{model}: not a regular file (a folder, a pipe or a")):
        binarized.BinarizedCorpus(copy)
    os.rmdir(model)
    with open(model, "wb") as f:   # (sparse: no disk)
        f.truncate(data.MAX_SMALL_FILE_BYTES + 1)
    with pytest.raises(data.CorpusError, match=re_escape(f"{model}: more than {data.MAX_SMALL_FILE_BYTES:,} bytes")):
        binarized.BinarizedCorpus(copy)
    os.replace(model + ".kept", model)
    shard = os.path.join(copy, "train.src.bin")
    os.rename(shard, shard + ".kept")
    os.mkfifo(shard)
    with pytest.raises(binarized.NotBinarized, match=re_escape(f"{shard} is not a regular file (a folder, a pipe")):
        binarized.open_binarized(d, "bpe", 80)
    os.replace(shard + ".kept", shard)
    manifest = os.path.join(d, data.MANIFEST)
    os.rename(manifest, manifest + ".kept")
    os.mkfifo(manifest)
    with pytest.raises(data.CorpusError, match=re_escape(f"{manifest}: not a regular file (a folder, a pipe or a ")):
        data.read_manifest(d)
    record_path = os.path.join(copy, binarized.MANIFEST)   # (a FIFO binarized.json had been "no binarized corpus yet")
    os.rename(record_path, record_path + ".kept")
    os.mkfifo(record_path)
    with pytest.raises(binarized.NotBinarized, match=re_escape(f"{record_path}: not a regular file")):
        binarized.open_binarized(d, "bpe", 80)
    os.replace(record_path + ".kept", record_path)
    os.replace(manifest + ".kept", manifest)
    record_path = os.path.join(copy, binarized.MANIFEST)
    record = json.loads(open(record_path).read())
    for bad in ({"../x": record["splits"]["train"]}, {**record["splits"], "dev": 1}):
        with open(record_path, "w") as f:
            json.dump({**record, "splits": bad}, f)
        with pytest.raises(data.CorpusError, match=re_escape(f"{record_path}: malformed (") + ".*names letters"):
            binarized.BinarizedCorpus(copy)
    for key in ("splits", "dtype", "languages"):   # (said as "format 3, this dtmt reads format 3")
        with open(record_path, "w") as f:
            json.dump({k: v for k, v in record.items() if k != key}, f)
        with pytest.raises(data.CorpusError, match=re_escape(f"{record_path}: malformed (")):
            binarized.BinarizedCorpus(copy)
    with open(record_path, "w") as f:
        json.dump(record, f)
    split = binarized.BinarizedCorpus(copy).split("train")
    ids = np.fromfile(shard, dtype=split.dtype)
    ids[:5], ids[5], ids[9] = 4, 60, 79   # (of a vocabulary of 80, not of 50: the first past 50 is the one said)
    ids.tofile(shard)
    pair = int(np.searchsorted(split.memmap("src")[1], 5, side="right")) - 1
    with pytest.raises(data.CorpusError, match=re_escape(f"{shard}: pair {pair} holds id 60, beyond the src "
                                                         f"vocabulary's 50")):
        split.verify([50, 80])


def test_models_swapped_or_replaced_are_refused(tmp_path):
    """src.model and tgt.model swapped (or one replaced by another model of as many pieces) passed every id check:
    dtmt train trained on ids that meant other pieces, and its checkpoint held the wrong models, without a word. The
    copy records the models' SHA-1 and is NotBinarized naming the file (dtmt train rebuilds it); a copy of format 2
    (no record) is rebuilt too."""
    d = write_corpus(tmp_path / "c", SRC, TGT)
    copy = binarized.binarize(d, 80, workers=1, log=lambda m: None)
    sv, tv = binarized.BinarizedCorpus(copy).vocabularies()
    assert len(sv) == len(tv) and sv.proto != tv.proto
    src, tgt = os.path.join(copy, "src.model"), os.path.join(copy, "tgt.model")
    os.rename(src, src + ".x")
    os.rename(tgt, src)
    os.rename(src + ".x", tgt)
    with pytest.raises(binarized.NotBinarized, match=re_escape(f"{src}: not the model the shards were encoded with")):
        binarized.open_binarized(d, "bpe", 80)
    binarized.binarize(d, 80, workers=1, log=lambda m: None)
    assert binarized.open_binarized(d, "bpe", 80).protos == [sv.proto, tv.proto]
    manifest = json.loads(open(os.path.join(copy, binarized.MANIFEST)).read())
    manifest["format"] = 2
    del manifest["models"]
    with open(os.path.join(copy, binarized.MANIFEST), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(binarized.NotBinarized, match="format 2, this dtmt reads format 3"):
        binarized.open_binarized(d, "bpe", 80)


def test_a_vocabulary_smaller_than_asked_is_said(tmp_path):
    """BPE stops when the sample's words are whole pieces: a --vocab-size past that gives fewer pieces, which the log
    now warns of (the folder's name says the size asked for; it was said only in the pieces' count)."""
    d = write_corpus(tmp_path / "c", SRC, TGT)
    said = []
    path = binarized.binarize(d, 5000, workers=1, log=said.append)
    pieces = json.load(open(os.path.join(path, binarized.MANIFEST)))["pieces"]
    assert max(pieces.values()) < 5000
    warning = [m for m in said if m.startswith("warning: --vocab-size 5,000: the sample's text gives fewer pieces")]
    assert warning == [f"warning: --vocab-size 5,000: the sample's text gives fewer pieces (src {pieces['src']:,}, "
                       f"tgt {pieces['tgt']:,}); bin-bpe5000 holds those"], said
    said.clear()
    binarized.binarize(d, 80, workers=1, log=said.append)   # (80 pieces a side: as asked)
    assert not [m for m in said if m.startswith("warning")], said


def test_a_rebuild_never_removes_what_it_did_not_write(tmp_path, capsys):
    """A binarized copy holding what binarize does not write (a run's folder given as dtmt train --out inside it) is
    not rebuilt: the rebuild replaced the folder whole and the run went with it, exit 0. binarize says so
    (CorpusError: dtmt train's own rebuild), dtmt prepare before any work (exit 2); nothing is changed."""
    d = write_corpus(tmp_path / "c", SRC, TGT)
    copy = binarized.binarize(d, 80, workers=1, log=lambda m: None)
    os.makedirs(os.path.join(copy, "myrun"))
    with open(os.path.join(copy, "myrun", "last.pt"), "wb") as f:
        f.write(b"a run's state")
    before = sorted(os.listdir(copy))
    with pytest.raises(data.CorpusError, match=re_escape(f"{copy} holds what dtmt prepare did not write there "
                                                         f"(myrun), which rebuilding it would remove")):
        binarized.binarize(d, 80, workers=1, log=lambda m: None)
    assert prepare_cli.main(["binarize", "--data", d, "--vocab-size", "80", "--workers", "1"]) == 2
    assert "move them out of it first" in capsys.readouterr().err
    assert sorted(os.listdir(copy)) == before and os.path.isfile(os.path.join(copy, "myrun", "last.pt"))
    os.remove(os.path.join(copy, "myrun", "last.pt"))
    os.rmdir(os.path.join(copy, "myrun"))
    assert prepare_cli.main(["binarize", "--data", d, "--vocab-size", "80", "--workers", "1"]) == 0


@pytest.mark.parametrize("workers", [1, 2])
def test_shard_checksums_are_the_files_and_any_changed_byte_is_refused(tmp_path, workers):
    """Each shard's SHA-1 in the manifest is hashlib's of the file as written (computed while writing, chunk by
    chunk, on 1 or 2 processes); verify() refuses a file with one byte changed, in each of the four files,
    naming it; a copy of format 1 (no checksums) is not binarized, which dtmt train rebuilds."""
    import hashlib
    import shutil

    d = write_corpus(tmp_path / "c", SRC * 30, TGT * 30, splits=("train", "dev"))
    path = binarized.binarize(d, 80, workers=workers, log=lambda m: None)
    corpus = binarized.open_binarized(d, "bpe", 80)
    sizes = [len(Vocabulary(p)) for p in corpus.protos]
    for split in ("train", "dev"):
        recorded = corpus.manifest["splits"][split]["shards"]
        for name in ("src.bin", "src.idx", "tgt.bin", "tgt.idx"):
            with open(os.path.join(path, f"{split}.{name}"), "rb") as f:
                assert recorded[name] == hashlib.sha1(f.read()).hexdigest()
        corpus.split(split).verify(sizes)
    for name in ("src.bin", "src.idx", "tgt.bin", "tgt.idx"):
        copy = tmp_path / f"copy-{name}"
        shutil.copytree(path, copy)
        file = copy / f"train.{name}"
        # a change the other checks cannot see: the last id to another inside the vocabulary, or the second-last
        # offset one lower (still between its neighbours: two pairs' lengths change)
        values = np.fromfile(file, dtype=corpus.dtype if name.endswith(".bin") else np.int64)
        if name.endswith(".bin"):
            values[-1] = (int(values[-1]) + 1) % 60
        else:
            assert values[-3] < values[-2] - 1
            values[-2] -= 1
        values.tofile(file)
        split = binarized.BinarizedCorpus(str(copy)).split("train")
        with pytest.raises(data.CorpusError, match=rf"train\.{re_escape(name)}: its bytes are not those written"):
            split.verify(sizes)
    # a control symbol where a piece should be (the checksum recorded anew, as a crafted copy would): refused by what
    # it is (a pair of PAD ids trained on as a pair of nothing, silently)
    for control in (0, 2, 3):
        copy = tmp_path / f"copy-control-{control}"
        shutil.copytree(path, copy)
        values = np.fromfile(copy / "train.tgt.bin", dtype=corpus.dtype)
        values[7] = control
        values.tofile(copy / "train.tgt.bin")
        info = corpus.manifest["splits"]["train"]
        split = binarized.BinarizedSplit(str(copy), "train", corpus.dtype, info["pairs"], dict(
            info["shards"], **{"tgt.bin": hashlib.sha1(values.tobytes()).hexdigest()}))
        pair = int(np.searchsorted(split.memmap("tgt")[1], 7, side="right")) - 1
        with pytest.raises(data.CorpusError, match=rf"train\.tgt\.bin: pair {pair} holds id {control}, a control "
                                                   rf"symbol \(padding, BOS or EOS\)"):
            split.verify(sizes)
    manifest = json.loads((tmp_path / "c" / "bin-bpe80" / "binarized.json").read_text())
    manifest["format"] = 1
    for info in manifest["splits"].values():
        del info["shards"]
    (tmp_path / "c" / "bin-bpe80" / "binarized.json").write_text(json.dumps(manifest))
    with pytest.raises(binarized.NotBinarized, match=f"format 1, this dtmt reads format {binarized.FORMAT}"):
        binarized.open_binarized(d, "bpe", 80)


def re_escape(text):
    import re

    return re.escape(text)


def test_the_training_text_checksum_comes_from_a_fresh_copy(tmp_path):
    """`dtmt train` takes the resume fingerprint's SHA-1 from a binarized copy whose record of the training files'
    size and time matches them (known_train_sha1), not by reading the text again; a touched or changed file, or
    no copy, and it reads the text."""
    d = write_corpus(tmp_path / "c", SRC, TGT)
    assert binarized.known_train_sha1(d) is None
    binarized.binarize(d, 80, workers=1, log=lambda m: None)
    known = binarized.known_train_sha1(d)
    assert known == data.corpus_fingerprint(d)["train_sha1"]
    assert data.corpus_fingerprint(d, train_sha1=known) == data.corpus_fingerprint(d)
    path = os.path.join(d, "train.es")
    os.utime(path, ns=(1, 1))
    assert binarized.known_train_sha1(d) is None
    binarized.open_binarized(d, "bpe", 80)      # same bytes: the copy records the new time and vouches again
    assert binarized.known_train_sha1(d) == known
    with open(path, "a", encoding="utf-8") as f:
        f.write("otra línea\n")
    assert binarized.known_train_sha1(d) is None
    assert data.corpus_fingerprint(d)["train_sha1"] != known


@pytest.mark.parametrize("vocab_type", ["bpe", "unigram"])
@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_vocabulary_sentencepiece_cannot_build_is_one_line(tmp_path, capsys, workers, vocab_type):
    """--vocab-size below the text's characters, a side of invisible characters only, and a side of only lines
    SentencePiece's trainer leaves out (over 4,192 bytes): one line, exit 1, in our words (SentencePiece's advice named
    its own --character_coverage), no build left. With --workers 1 both were a traceback: the except clause named
    concurrent.futures.process, a submodule only a process pool had loaded; unigram's were tracebacks too (a
    review found it: Vocabulary.train's ValueError), and the long lines' blamed the size."""
    small = write_corpus(tmp_path / "small", ["hola", "adios amigo", "uno dos"], ["hello", "bye friend", "one two"])
    blank = write_corpus(tmp_path / "blank", ["\u200b"] * 3, ["hello", "bye friend", "one two"])
    long = write_corpus(tmp_path / "long", ["hola amigo " * 400] * 3, ["hello", "bye friend", "one two"])
    for d, message in ((small, f"--vocab-size 8: too small for the training text of {small}: SentencePiece needs "
                                "at least 16 pieces there (one per character the text has, and 4 special ones)"),
                       (blank, f"{blank}: a side's training text has no character SentencePiece keeps"),
                       (long, "every sampled line of the training text train.es is longer than 4,192 bytes, which "
                              "SentencePiece's trainer leaves out: no vocabulary can be built")):
        assert prepare_cli.main(["binarize", "--data", d, "--vocab-size", "8", "--workers", workers,
                                 "--vocab-type", vocab_type]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"dtmt prepare binarize: error: {message}"), err
        assert sorted(os.listdir(d)) == ["corpus.json", "train.en", "train.es"]


@pytest.mark.parametrize("vocab_type", ["bpe", "unigram"])
def test_lines_sentencepiece_leaves_out_are_counted_in_the_log(tmp_path, vocab_type):
    """The log said "trained on ... 51 of 51 training lines" where 50 of them, over 4,192 bytes, were left out by
    SentencePiece's trainer (a review found it: a vocabulary of one line's characters, its text said to be all). The
    lines left out are counted per side and the model is the one of the lines kept."""
    long = [f"palabra{i} " * 500 for i in range(5)]   # (5,000+ bytes each)
    src = SRC + long
    d = write_corpus(tmp_path / "c", src, TGT + ["x"] * 5)
    said = []
    path = binarized.binarize(d, 60, vocab_type=vocab_type, workers=1, log=said.append)
    warning = [m for m in said if m.startswith("warning: SentencePiece's trainer leaves out")]
    assert warning == ["warning: SentencePiece's trainer leaves out a line of more than 4,192 bytes: the vocabularies "
                       "were learnt without 5 of the src side's 15 sampled lines"], said
    want = Vocabulary.train([line.strip() for line in SRC], 60, vocab_type) if vocab_type == "unigram" else \
        Vocabulary.train_bpe_on_word_counts(binarized._count_words(line.strip() for line in SRC), 60)
    assert open(os.path.join(path, "src.model"), "rb").read() == want.proto
    said.clear()
    binarized.binarize(write_corpus(tmp_path / "short", SRC, TGT), 60, vocab_type=vocab_type, workers=1,
                       log=said.append)
    assert not [m for m in said if "leaves out" in m], said


def test_prepare_cli_binarize_and_options(tmp_path, capsys):
    d = write_corpus(tmp_path / "c", SRC, TGT)
    assert prepare_cli.main(["binarize", "--data", d, "--vocab-size", "80", "--workers", "1"]) == 0
    assert "wrote" in capsys.readouterr().err
    with open(os.path.join(d, "bin-bpe80", "binarized.json")) as f:
        assert json.load(f)["splits"]["train"]["pairs"] == len(SRC)
    assert prepare_cli.main(["binarize", "--data", d, "--vocab-size", "2"]) == 2
    assert "--vocab-size 2: must be an integer in [8, " in capsys.readouterr().err
    assert prepare_cli.main(["binarize", "--data", str(tmp_path / "none")]) == 2   # an option that cannot work
    assert "--data " + str(tmp_path / "none") + ": no such folder" in capsys.readouterr().err
    os.makedirs(tmp_path / "empty")
    assert prepare_cli.main(["binarize", "--data", str(tmp_path / "empty")]) == 2    # a folder, not a corpus
    assert "not a corpus folder written by dtmt prepare (no corpus.json)" in capsys.readouterr().err
    src, tgt = os.path.join(d, "train.es"), os.path.join(d, "train.en")
    assert prepare_cli.main(["files", "--src", src, "--tgt", tgt, "--out", str(tmp_path / "t"), "--no-binarize"]) == 0
    assert not [e for e in os.listdir(tmp_path / "t") if "bin-" in e]


def test_token_batches_equal_a_plain_reference():
    """The chunked counting sort and the cut against a direct formulation: the same shuffled order, a stable sort
    by (longer side, target), the greedy cut, the same batch permutation."""
    rng = np.random.default_rng(5)
    n = 3000
    lengths = np.stack([rng.integers(0, 60, n), rng.integers(0, 70, n)], axis=1).astype(np.uint8)
    keep = batching.kept_indices(lengths, 50)
    assert keep.tolist() == [i for i in range(n) if 1 <= lengths[i].min() and lengths[i].max() <= 50]
    old = batching._CHUNK
    try:
        batching._CHUNK = 256   # several chunks
        got = batching.token_batches(lengths, 300, seed=7, epoch=2, keep=keep)
    finally:
        batching._CHUNK = old
    g = np.random.Generator(np.random.PCG64(batching._seed_of(7, 2)))
    order = keep.copy()
    g.shuffle(order)
    order = order[np.lexsort((lengths[order, 1], lengths[order].max(axis=1)))]   # lexsort is stable
    batches, cur, longest = [], [], 0
    for i in order.tolist():
        s = int(lengths[i].max()) + 1
        if cur and max(longest, s) * (len(cur) + 1) > 300:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, s)
    batches.append(cur)
    perm = np.arange(len(batches))
    g.shuffle(perm)
    assert list(got) == [batches[k] for k in perm]
    assert list(got[1::2]) == [batches[k] for k in perm[1::2]]
    assert batching.token_batches(lengths, 300, seed=7, epoch=2, keep=keep) == got
    assert batching.token_batches(lengths, 300, seed=7, epoch=3, keep=keep) != got


def test_batches_sorted_by_the_longer_side_pad_less_than_by_the_source():
    """The sort key against the (source, target) key it replaced, on lengths shaped like a parallel corpus (target
    = source +- noise): fewer batches under the same budget, and fewer padded target positions, the positions
    every decoder step computes."""
    rng = np.random.default_rng(3)
    src = rng.integers(5, 60, 4000)
    lengths = np.stack([src, np.clip(src + rng.integers(-8, 9, 4000), 1, 80)], axis=1)

    def padded(batches):
        return sum(len(b) * (int(lengths[b, 1].max()) + 1) for b in map(list, batches))

    now = batching.token_batches(lengths, 2000, shuffle=False)
    order = np.lexsort((lengths[:, 1], lengths[:, 0]))        # the former key, (source, target)
    bounds = batching._cut_bounds(order, lengths, 2000)
    before = [order[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:])]
    assert sorted(i for b in now for i in b) == list(range(4000))
    assert len(now) < len(before)
    assert padded(now) < 0.97 * padded(before)


def test_a_long_pair_left_out_does_not_size_the_sort():
    lengths = np.array([[3, 4]] * 1000 + [[60000, 60000]], dtype=np.uint16)   # counts would need 3.6 G keys
    keep = batching.kept_indices(lengths, 100)
    batches = batching.token_batches(lengths, 50, keep=keep)
    assert sorted(i for b in batches for i in b) == list(range(1000))


def test_length_dtype_saturates_safely():
    assert batching.length_dtype(100) == np.uint8 and batching.length_dtype(255) == np.uint16
    lengths = np.minimum(np.array([[3, 1000], [100, 100]]), 255).astype(batching.length_dtype(100))
    assert batching.kept_indices(lengths, 100).tolist() == [1]


def test_a_build_put_in_place_meanwhile_by_another_process_is_kept(tmp_path, monkeypatch):
    """Two `dtmt train` runs started at once on a new corpus both build its binarized form; the one that renames
    second finds the other's in place (it was not there when it looked): it keeps that one, removes its own
    temporary directory and returns the path, instead of failing (a CI flake of test_bench_quality_quick)."""
    src = [f"linea {i}" for i in range(60)]
    tgt = [f"line {i}" for i in range(60)]
    d = write_corpus(tmp_path / "c", src, tgt)
    final = binarized.binarize(d, 30, workers=1, log=lambda m: None)
    first = os.stat(final).st_ino   # (the first build, by its folder's inode)
    real_exists = os.path.exists
    monkeypatch.setattr(binarized.os.path, "exists", lambda p: False if p == final else real_exists(p))
    said = []
    assert binarized.binarize(d, 30, workers=1, log=said.append) == final
    assert os.stat(final).st_ino == first and "another process" in said[-1]
    assert not [n for n in os.listdir(d) if ".tmp-" in n]
