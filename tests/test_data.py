"""Corpus reading and validation, vocabularies, batching."""
import os
import re

import numpy as np
import pytest

from dtmt_models.data import batching
from dtmt_models.data import corpus as data
from dtmt_models.data.vocabulary import BOS, EOS, PAD, Vocabulary


def _write(path, content: bytes):
    path.write_bytes(content)
    return str(path)


def test_read_parallel_ok(tmp_path):
    src = _write(tmp_path / "a.es", "hola mundo\r\nadiós\n".encode())
    tgt = _write(tmp_path / "a.en", "hello world\ngoodbye".encode())
    assert data.read_parallel(src, tgt) == [("hola mundo", "hello world"), ("adiós", "goodbye")]


def test_a_file_changed_while_read_is_refused_not_cut(tmp_path):
    """iter_parallel (dtmt prepare files) counts both files, then reads them: a file shortened, grown or replaced in
    between
    (truncated by another process, still being written by zcat) ended the pairs at the shorter one, or cut a
    sentence, with exit 0 and a shorter corpus. Now a CorpusError after the pairs read, naming the file; a file
    whose time alone changed is read as it is."""
    lines = [f"line {i}\n".encode() for i in range(50)]
    for change, read_after in ((lambda p: p.write_bytes(b"".join(lines[:20]) + b"line 2"), 10),   # shortened
                               (lambda p: p.write_bytes(p.read_bytes() + b"one more\n"), 49),      # grown
                               (lambda p: os.replace(_write(tmp_path / "b.en", b"".join(lines)), p), 0)):   # another
        src = _write(tmp_path / "a.es", b"".join(lines))
        tgt = tmp_path / "a.en"
        tgt.write_bytes(b"".join(lines))
        pairs = data.iter_parallel(src, str(tgt))
        got = [next(pairs) for _ in range(read_after + 1)]   # (the reader holds its first buffer by now)
        change(tgt)
        with pytest.raises(data.CorpusError, match=rf"a\.en changed while it was read \(50 lines when counted, "
                                                   rf"\d+ pairs read\); read it again once it is complete"):
            got += list(pairs)
    assert len(list(data.iter_parallel(src, str(tgt)))) == 50   # (unchanged since counted: read as it is)
    pairs = data.iter_parallel(src, str(tgt))
    got = [next(pairs)]
    os.utime(tgt, ns=(1, 1))   # (touched alone, as a backup tool or `touch` does: read as it is)
    assert len(got + list(pairs)) == 50


def test_byte_order_mark_is_not_text(tmp_path):
    """A UTF-8 BOM (Windows editors) starts the file, not the first sentence; elsewhere U+FEFF is kept."""
    src = _write(tmp_path / "a.es", "\ufeffhola\nmundo \ufeff\n".encode())
    tgt = _write(tmp_path / "a.en", b"hello\nworld\n")
    assert data.read_parallel(src, tgt) == [("hola", "hello"), ("mundo \ufeff", "world")]


def test_bad_inputs_are_reported_with_file_and_line(tmp_path):
    good = _write(tmp_path / "g.en", b"one\ntwo\nthree\n")
    bad_utf8 = _write(tmp_path / "b.es", b"uno\ndos \xff\xfe\ntres\n")
    with pytest.raises(data.CorpusError, match=r"b\.es:2: invalid UTF-8"):
        data.read_parallel(bad_utf8, good)
    empty = _write(tmp_path / "e.es", b"uno\n  \ntres\n")
    with pytest.raises(data.CorpusError, match=r"e\.es:2: empty line"):
        data.read_parallel(empty, good)
    short = _write(tmp_path / "s.es", b"uno\ndos\n")
    with pytest.raises(data.CorpusError,
                       match=r"s\.es has 2 lines, .*g\.en has 3 \(.*g\.en line 3 has no counterpart\)"):
        data.read_parallel(short, good)
    with pytest.raises(data.CorpusError, match="no such file"):
        data.read_parallel(str(tmp_path / "missing"), good)
    # a device is read whole: refused by its kind, not called missing (/dev/zero never ends)
    with pytest.raises(data.CorpusError, match=r"\n  /dev/zero: not a regular file$"):
        data.read_parallel("/dev/zero", good)
    with pytest.raises(data.CorpusError, match="^/dev/null: not a regular file$"):
        data.scan_file("/dev/null")
    # a split's source file that is a pipe is named so, as its target file is (it was called missing)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    data.write_manifest(str(corpus), "es", "en", {"test": 1}, origin="test")
    os.mkfifo(corpus / "test.es")
    with pytest.raises(data.CorpusError, match=r"test\.es: not a regular file \(the corpus lists a test split\)"):
        data.corpus_paths(str(corpus), "test")


def test_a_missing_corpus_folder_is_named_as_missing(tmp_path):
    """A --data folder that is not there (a typo) is said to be missing, after the advice to make a corpus there, a
    file given for it is said to be a file; a folder that is there without corpus.json (a run's folder) gets the
    advice alone."""
    typo = str(tmp_path / "bilbe")
    with pytest.raises(data.CorpusError, match=re.escape(f"{typo}: no corpus.json; make the corpus with `dtmt prepare "
                                                         f"bible --out {typo}`")) as exc:
        data.read_manifest(typo)
    assert str(exc.value).endswith(f" (there is no folder {typo})")
    with pytest.raises(data.CorpusError) as exc:
        data.read_manifest(str(tmp_path))
    assert str(exc.value).endswith(f"--out {tmp_path}`")
    (tmp_path / "afile").write_text("x\n")   # (a file given for the folder)
    with pytest.raises(data.CorpusError, match=re.escape(f"({tmp_path / 'afile'} is a file, not a folder)")):
        data.read_manifest(str(tmp_path / "afile"))


def test_a_manifest_naming_files_outside_its_folder_is_refused(tmp_path, capsys):
    """corpus.json's languages and splits name the folder's files {split}.{lang}; a crafted split "../victim/x" made
    `dtmt prepare files --out` over that folder remove victim/x.es beside it, exit 0 (and train or evaluate read
    files outside it). Now read_manifest refuses such a name in one line, and prepare refuses the folder as one it
    did not write (exit 2): nothing is touched."""
    import json

    from dtmt_models.cli import prepare as prepare_cli

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "x.es").write_text("precious\n")
    out = tmp_path / "out"
    out.mkdir()
    for langs, counts, odd in ((("es", "en"), {"train": 1, "../victim/x": 1}, "../victim/x"),
                               (("es", "/../x"), {"train": 1}, "/../x"), (("es", "en"), {"": 1}, "")):
        (out / data.MANIFEST).write_text(json.dumps({"src_lang": langs[0], "tgt_lang": langs[1], "counts": counts,
                                                     "origin": "files"}))
        with pytest.raises(data.CorpusError, match=f"{data.MANIFEST}: {odd!r} names no file of the folder"):
            data.read_manifest(str(out))
    (out / data.MANIFEST).write_text(json.dumps({"src_lang": "es", "tgt_lang": "en", "origin": "files",
                                                 "counts": {"train": 1, "../victim/x": 1}}))
    src, tgt = _write(tmp_path / "a.es", b"hola\n"), _write(tmp_path / "a.en", b"hello\n")
    assert prepare_cli.main(["files", "--src", src, "--tgt", tgt, "--out", str(out), "--no-binarize"]) == 2
    assert "is not a corpus of dtmt prepare" in capsys.readouterr().err
    assert (victim / "x.es").read_text() == "precious\n" and os.listdir(out) == [data.MANIFEST]


def test_files_a_prepared_corpus_does_not_name_are_the_users(tmp_path, capsys):
    """Once --out held a prepared corpus, every name prepare writes counted as its own: the user's dev.es and dev.en
    beside a corpus without a dev split were replaced by --holdout's, and files of another language pair beside a
    stage a killed run left were overwritten, exit 0. Only the files a manifest (the folder's, or a stage's) names
    are an earlier corpus's: the others are refused, untouched; the corpus's own are replaced as before."""
    from dtmt_models.cli import prepare as prepare_cli

    lines = b"".join(b"w%d x%d\n" % (i, i % 7) for i in range(30))
    src, tgt = _write(tmp_path / "a.es", lines), _write(tmp_path / "a.en", lines.upper())
    out = tmp_path / "out"
    out.mkdir()
    own = {name: _write(out / name, lines) for name in ("dev.es", "dev.en")}   # (read from there: a corpus of them)
    assert prepare_cli.main(["files", "--src", own["dev.es"], "--tgt", own["dev.en"], "--out", str(out),
                             "--no-binarize"]) == 0
    capsys.readouterr()
    code = prepare_cli.main(["files", "--src", src, "--tgt", tgt, "--out", str(out), "--holdout", "5",
                             "--no-binarize"])
    assert code == 2 and capsys.readouterr().err == (
        f"dtmt prepare files: error: --out {out}: holds dev.es, dev.en beside a corpus of dtmt prepare, whose "
        f"{data.MANIFEST} does not name them; prepare would overwrite or remove them: use a new or empty folder\n")
    assert all(open(p, "rb").read() == lines for p in own.values())
    for p in own.values():   # (the user's files gone: the corpus's own are replaced, as before)
        os.remove(p)
    assert prepare_cli.main(["files", "--src", src, "--tgt", tgt, "--out", str(out), "--no-binarize"]) == 0
    assert (out / "train.es").read_bytes() == lines
    (out / ".prepare.tmp-999999").mkdir()   # (a run killed before it moved anything: no manifest there)
    theirs = {name: _write(out / name, b"mine\n") for name in ("train.de", "train.fr")}
    capsys.readouterr()
    code = prepare_cli.main(["files", "--src", src, "--tgt", tgt, "--src-lang", "de", "--tgt-lang", "fr",
                             "--out", str(out), "--no-binarize"])
    assert code == 2 and "holds train.de, train.fr beside a corpus of dtmt prepare" in capsys.readouterr().err
    assert all(open(p, "rb").read() == b"mine\n" for p in theirs.values())


def test_prepare_says_how_far_it_is_in_long_work(tmp_path, capsys, monkeypatch):
    """Copying and encoding a corpus of millions of pairs printed one line each at its end: minutes without a word.
    Both say how far they are, at most once every TICK_S seconds (here 0: every 65,536 pairs copied, every chunk
    encoded)."""
    from dtmt_models import progress
    from dtmt_models.cli import prepare as prepare_cli

    monkeypatch.setattr(progress, "TICK_S", 0.0)
    n = 70_000
    src = _write(tmp_path / "a.es", b"".join(b"w%d x\n" % (i % 50) for i in range(n)))
    tgt = _write(tmp_path / "a.en", b"".join(b"W%d X\n" % (i % 50) for i in range(n)))
    assert prepare_cli.main(["files", "--src", src, "--tgt", tgt, "--out", str(tmp_path / "out"),
                             "--vocab-size", "60", "--workers", "1"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert "train: copying: 65,536 pairs copied" in err, err
    encoded = [line for line in err if line.startswith("train: encoding: ")]
    assert encoded[0] == f"train: encoding: 4,096 of {n:,} pairs (6%)" and encoded[-1] == (
        f"train: encoding: {n:,} of {n:,} pairs (100%)"), encoded


def test_a_line_past_the_bound_is_read_in_pieces_and_the_lines_after_it_keep_their_numbers(tmp_path, monkeypatch):
    """A line past the bound is not read whole (a file of old Mac line ends, \\r alone, is one line: 2 GB of it had
    been read into memory before the bound refused it; a review found it): the readers take at most LINE_READ bytes
    of it, skip the rest, and go on at the next line with its number; the message says what a \\r in it means."""
    import tracemalloc

    from dtmt_models.data import binarized

    monkeypatch.setattr(data, "MAX_LINE_BYTES", 1000)
    monkeypatch.setattr(data, "LINE_READ", 1005)
    src = _write(tmp_path / "a.es", b"uno\n" + b"hola\r" * 1_600_000 + b"\ntres\n\ncinco\n")   # (8 MB line 2; 4 empty)
    tgt = _write(tmp_path / "t.en", b"one\ntwo\nthree\nfour\nfive\n")
    with open(src, "rb") as f:
        assert [len(raw) for raw in data.bounded_lines(f)] == [4, 1005, 5, 1, 6]
    tracemalloc.start()
    try:
        with pytest.raises(data.CorpusError) as error:
            list(data.iter_parallel(src, tgt))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3_000_000, peak   # (the line is 8 MB; counting the lines reads 1 MiB blocks)
    assert str(error.value).splitlines()[1:] == [
        f"  {src}:2: a line of more than 1,000 bytes; with carriage returns (\\r) in it: old Mac line ends? convert "
        f"them first (tr '\\r' '\\n')", f"  {src}:4: empty line"], str(error.value)
    assert list(binarized._sample_lines(src, [0, 2, 4])) == ["uno", "tres", "cinco"]   # (the vocabulary's sample)


def test_a_line_past_the_bound_is_refused_before_it_is_encoded(tmp_path, monkeypatch):
    """A corpus line of more than MAX_LINE_BYTES (dtmt translate's bound) is refused naming file and line, by every
    reader of corpus text: dtmt prepare files took a 50 MB line of words and encoded it (1.4 GB of memory; a 1 GB line
    all of it), exit 0. A line of exactly the bound is read, with or without its \\r\\n."""
    from dtmt_models.cli import prepare as prepare_cli
    from dtmt_models.data import binarized

    big = _write(tmp_path / "big.es", b"uno\n" + b"hola " * ((data.MAX_LINE_BYTES + 5) // 5) + b"\ntres\n")
    tgt = _write(tmp_path / "t.en", b"one\ntwo\nthree\n")
    assert prepare_cli.main(["files", "--src", big, "--tgt", tgt, "--out", str(tmp_path / "c"), "--workers", "1",
                             "--vocab-size", "30"]) == 1
    assert not os.path.exists(tmp_path / "c")
    monkeypatch.setattr(data, "MAX_LINE_BYTES", 8)
    src = _write(tmp_path / "a.es", b"12345678\r\n123456789\n12345678\n")
    message = r"a\.es:2: a line of more than 8 bytes; is it a text file\?"
    for read in (data.read_parallel, lambda s, t: list(data.iter_parallel(s, t))):
        with pytest.raises(data.CorpusError, match=message):
            read(src, tgt)
    corpus = tmp_path / "d"
    corpus.mkdir()
    for lang, path in (("es", src), ("en", tgt)):
        (corpus / f"train.{lang}").write_bytes(open(path, "rb").read())
    data.write_manifest(str(corpus), "es", "en", {"train": 3}, origin="test")
    with pytest.raises(data.CorpusError, match=r"train\.es:2: a line of more than 8 bytes"):
        binarized.binarize(str(corpus), 30, workers=1, log=lambda m: None)
    (corpus / "train.es").write_bytes(b"12345678\r\n1234567\n12345678")
    assert binarized.BinarizedCorpus(binarized.binarize(str(corpus), 30, workers=1, log=lambda m: None))


def test_write_parallel_round_trip_and_length_filter(tmp_path):
    pairs = [("a b", "c"), ("d", "e f g")]
    data.write_parallel(pairs, str(tmp_path / "x.src"), str(tmp_path / "x.tgt"))
    assert data.read_parallel(str(tmp_path / "x.src"), str(tmp_path / "x.tgt")) == pairs
    pairs = [([1] * 3, [2] * 2), ([1] * 5, [2]), ([1] * 4, [2] * 4), ([1], [2] * 5)]   # max_len itself is kept
    kept, dropped = data.filter_by_length(pairs, max_len=4)
    assert kept == [([1] * 3, [2] * 2), ([1] * 4, [2] * 4)] and dropped == 2


def test_vocabulary_train_round_trip(tmp_path):
    text = ["el perro come la manzana", "la casa es grande", "el gato duerme en la casa"] * 20
    vocab = Vocabulary.train(text, vocab_size=40)
    ids = vocab.encode("el gato come")
    assert all(i > EOS for i in ids)
    assert vocab.decode(ids + [EOS, PAD]) == "el gato come"
    path = str(tmp_path / "v.model")
    vocab.save(path)
    assert Vocabulary.load(path).encode("la casa") == vocab.encode("la casa")
    assert Vocabulary.train(text, vocab_size=40).proto == vocab.proto   # deterministic


def test_encode_with_most_gives_a_head_of_the_whole_texts_pieces():
    """encode(text, most): a long text gives a head of more than `most` pieces whose first `most` are the whole
    text's, without encoding the whole text (a 16 MB line had taken 11 s and 700 MB for translate's first 250), on
    random texts of words, spaces, runs of spaces and unknown characters, for BPE and unigram. A model whose pieces
    span a word boundary encodes the whole text."""
    import random

    rng = random.Random(3)
    words = ["el", "perro", "come", "la", "manzana", "casa", "es", "grande", "gato", "duerme", "en",
             "ñandú", "中文", "\u00a0", "qqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqq", "é"]
    train = ["el perro come la manzana", "la casa es grande", "el gato duerme en la casa"] * 20
    for model_type in ("bpe", "unigram"):
        vocab = Vocabulary.train(train, vocab_size=40, model_type=model_type)
        assert vocab._words_apart()
        for trial in range(60):
            text = "".join(rng.choice(words) + " " * rng.choice([1, 1, 1, 2, 40]) for _ in range(rng.randint(1, 400)))
            if trial % 7 == 0:
                text = " " * 3000 + text   # (a head of only spaces: its reach grows)
            whole = vocab.encode(text)
            for most in (1, 5, 30):
                head = vocab.encode(text, most=most)
                assert head[:most] == whole[:most], (model_type, trial, most)
                assert (len(head) > most) == (len(whole) > most)
    long = "el perro come la manzana " * 40_000   # (1 MB)
    assert len(vocab.encode(long, most=250)) < 20 * 252 < len(vocab.encode(long))
    from dtmt_models.data.vocabulary import _train_proto

    for model_type in ("bpe", "unigram"):   # (pieces such as "\u2581la\u2581casa")
        spanning = Vocabulary(_train_proto(iter(train), 60, model_type, 1.0, split_by_whitespace=False))
        assert not spanning._words_apart() and spanning.encode(long, most=5) == spanning.encode(long)


def test_bpe_on_word_counts_is_the_bpe_on_sentences(tmp_path):
    """SentencePiece's BPE from the words' counts is the model from the sentences, byte for byte, on random
    lines of accents, ligatures, full-width letters, spaces of every kind SentencePiece keeps, drops or turns
    into a space (NBSP, ideographic, zero-width, tabs, carriage returns, vertical tab, FS, NEL, runs), control
    characters and emoji. The counts split only at the spaces, tabs and carriage returns that SentencePiece
    itself splits at, as binarized._word_counts does."""
    import collections
    import random

    from dtmt_models.data import binarized

    rng = random.Random(5)
    alphabet = (list("abcdeéñüxyz ") * 3 + ["ﬁ", "Ａ", "e\u0301", "🙂", "中", ".", "\x07", "\u00a0", "\u3000", "\u200b",
                                            "\t", "\r", "\x0b", "\x1c", "\x85", "\u2028", "\ufeff", "  "])
    lines = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))).strip() or "a" for _ in range(500)]
    lines += ["el perro come la manzana", "la casa es grande"] * 50
    # SentencePiece leaves out a sentence of more than 4,192 bytes (not characters): the counts must too
    lines += [("gato " * 1000)[:4191] + "x", "ñ" + ("zorro " * 1000)[:4190] + "x"]
    assert [len(line.encode()) for line in lines[-2:]] == [4192, 4193]
    path = tmp_path / "train.es"
    path.write_bytes("".join(line + "\n" for line in lines).encode())
    counts = binarized._word_counts(str(path), None, block=64)
    assert counts["la"] == 100 and counts["perro"] == 50   # (the random lines have no l, p or r)
    assert counts["gato"] == 838 and counts["zorro"] == 0
    for size in (80, 150, 400):
        expected = Vocabulary.train(lines, vocab_size=size, model_type="bpe")
        got = Vocabulary.train_bpe_on_word_counts(counts, vocab_size=size)
        assert got.proto == expected.proto
        assert got.encode(lines[3]) == expected.encode(lines[3])
    # the same counts split at every whitespace Python knows would not be the same model: the splitting matters
    python_split = collections.Counter(" ".join(lines).split())
    assert Vocabulary.train_bpe_on_word_counts(python_split, vocab_size=150).proto != \
        Vocabulary.train(lines, vocab_size=150, model_type="bpe").proto

def test_token_batches_respect_budget_and_seed():
    lengths = [(n % 17 + 1, n % 13 + 1) for n in range(200)]
    batches = batching.token_batches(lengths, max_tokens=64, seed=3, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(200))
    for b in batches:
        assert len(b) == 1 or max(max(lengths[i]) + 1 for i in b) * len(b) <= 64
    assert batches == batching.token_batches(lengths, max_tokens=64, seed=3, epoch=0)
    assert batches != batching.token_batches(lengths, max_tokens=64, seed=3, epoch=1)


def test_token_batches_sort_by_lengths_in_memory_of_the_pairs_not_of_the_longest_squared():
    """The sort by (longer side, target length) against numpy's lexsort, stable among equals, on random corpora; and
    its memory: the counting sort had counted over every key up to the largest, (longest + 1)^2 int64 twice (1.7
    GB for a 10,000-token dev pair among short ones, found by a review). Now the keys present: well under 1 MB for
    one 3,000-token pair among 100 short ones (it was 72 MB an array)."""
    import tracemalloc

    rng = np.random.default_rng(5)
    for _ in range(50):
        n = int(rng.integers(0, 2000))
        lengths = rng.integers(0, int(rng.choice([3, 40, 400])), size=(n, 2)).astype(np.int16)
        order = rng.permutation(n).astype(np.int32)[:int(rng.integers(0, n + 1))]
        want = order[np.lexsort((lengths[order, 1], lengths[order].max(axis=1)))] if len(order) else order
        assert np.array_equal(batching._stable_sort_by_lengths(order, lengths), want)
    lengths = np.full((101, 2), 3, dtype=np.int32)
    lengths[100] = (3000, 2999)
    tracemalloc.start()
    try:
        batches = batching.token_batches(lengths, max_tokens=10 ** 5, shuffle=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert list(batches) == [list(range(100)), [100]] and peak < 1 << 20, peak


def test_token_batches_bounded_in_sentences_too():
    """max_sentences (paper 004's batches of 80): no batch has more pairs, the token budget still holds, and with a
    budget that any max_sentences pairs fit, every batch but the epoch's last of the sorted order has exactly that
    many; without it the batches are those of the budget alone; below 1 it is refused."""
    lengths = [(n % 17 + 1, n % 13 + 1) for n in range(200)]
    for budget, k in ((64, 5), (10 ** 6, 7)):
        batches = batching.token_batches(lengths, max_tokens=budget, seed=3, epoch=0, max_sentences=k)
        assert sorted(i for b in batches for i in b) == list(range(200))
        for b in batches:
            assert len(b) <= k and (len(b) == 1 or max(max(lengths[i]) + 1 for i in b) * len(b) <= budget)
    assert sorted(len(b) for b in batches) == [200 % 7] + [7] * (200 // 7)
    assert batching.token_batches(lengths, 64, seed=3, max_sentences=None) == batching.token_batches(lengths, 64, seed=3)
    assert max(len(b) for b in batching.token_batches(lengths, 64, seed=3)) > 5    # (the bound above did bind)
    with pytest.raises(ValueError, match="max_sentences must be an integer >= 1 or None, got 0"):
        batching.token_batches(lengths, 64, max_sentences=0)
    # a review's: a NaN or infinite budget made one batch of everything, a fractional max_sentences turned the bound
    # off, a negative kept index read a pair from the end; each is refused, by both batchers
    for kwargs, message in ((dict(max_tokens=float("nan")), "max_tokens must be an integer >= 1, got nan"),
                            (dict(max_tokens=float("inf")), "max_tokens must be an integer >= 1, got inf"),
                            (dict(max_tokens=True), "max_tokens must be an integer >= 1, got True"),
                            (dict(max_tokens=64, max_sentences=1.5), "max_sentences must be an integer >= 1 or None, "
                                                                     "got 1.5")):
        with pytest.raises(ValueError, match=re.escape(message)):
            batching.token_batches(lengths, **kwargs)
        with pytest.raises(ValueError, match=re.escape(message)):
            batching.length_batches([n for n, _ in lengths], **kwargs)
    for keep in ([-1], [200], [0.5]):
        with pytest.raises(ValueError, match=re.escape("keep must hold pair indices in [0, 200)")):
            batching.token_batches(lengths, 64, keep=keep)
    assert batching.token_batches(lengths, np.int64(64), seed=3, max_sentences=np.int32(5)) == \
        batching.token_batches(lengths, 64, seed=3, max_sentences=5)


def test_collate():
    src, lengths, prev, target = batching.collate([([5, 6, 7], [8]), ([9], [10, 11])])
    assert src.tolist() == [[5, 6, 7], [9, PAD, PAD]] and lengths.tolist() == [3, 1]
    assert prev.tolist() == [[BOS, 8, PAD], [BOS, 10, 11]]
    assert target.tolist() == [[8, EOS, PAD], [10, 11, EOS]]
    # padded with a model's own pad_id where it is another (its loss counted PAD padding as targets: 12 tokens of 9)
    from dtmt_models.models.registry import build_model

    pairs = [([5, 6, 7], [8, 9]), ([5], [8, 9, 10, 11, 12])]
    model = build_model("dtmt", 20, 20, embed_dim=16, hidden_size=16, pad_id=4)
    src, lengths, prev, target = batching.collate(pairs, pad_id=4)
    assert src.tolist()[1] == [5, 4, 4] and target.tolist()[0] == [8, 9, EOS, 4, 4, 4]
    assert int(model.loss(src, lengths, prev, target)[2]) == 9


def test_a_stream_is_read_as_a_file_is_and_a_line_without_end_is_bounded():
    """read_stream_lines (`dtmt evaluate --hyp -`, a pipe) gives read_lines' lines for the same bytes, and stops at
    a first line longer than MAX_LINE_BYTES (a device that never ends, /dev/zero) with read_lines' message."""
    import io

    body = data.BOM + "uno\r\n\ndos  \ntrés".encode()
    assert data.read_stream_lines(io.BytesIO(body), "<stdin>", allow_empty=True) == ["uno", "", "dos", "trés"]
    with pytest.raises(data.CorpusError, match=r"<stdin>:2: empty line"):
        data.read_stream_lines(io.BytesIO(body), "<stdin>")
    endless = io.BytesIO(b"\0" * (data.MAX_LINE_BYTES + 100) + b"\nnever read\n")
    with pytest.raises(data.CorpusError, match=r"<stdin>:1: a line of more than 16,777,216 bytes; is it a text "):
        data.read_stream_lines(endless, "<stdin>")
    assert endless.tell() == data.LINE_READ


def test_vocabulary_refuses_in_one_line_what_sentencepiece_failed_on_deep_inside():
    """Vocabulary: bytes that are no model, a string given as the sentences (trained on as its characters), no text
    or a vocab_size below the special ids (SentencePiece's INTERNAL errors) are refused in one line; decode takes a
    tensor (a TypeError) and refuses an id outside the vocabulary (a negative one was dropped without a word)."""
    import torch

    from dtmt_models.data.vocabulary import Vocabulary

    with pytest.raises(ValueError, match=r"^Vocabulary: 4 bytes that are not a SentencePiece model$"):
        Vocabulary(b"junk")
    with pytest.raises(TypeError, match="give the sentences as a list of strings, not one string"):
        Vocabulary.train("alpha beta gamma")
    with pytest.raises(ValueError, match=r"no text to train on \(2 sentences, none with a word\)"):
        Vocabulary.train(["", "  "], vocab_size=10)
    with pytest.raises(ValueError, match=r"vocab_size must be an int >= 5 .*, got 3$"):
        Vocabulary.train(["a b"], vocab_size=3)
    v = Vocabulary.train(["hola mundo", "el sol sale", "la casa es grande"] * 20, vocab_size=40)
    ids = v.encode("hola sol")
    assert v.decode(torch.tensor(ids)) == v.decode(ids) == v.decode(iter(ids)) == "hola sol"
    for bad in (-7, len(v)):
        with pytest.raises(ValueError, match=rf"^Vocabulary.decode: ids must be in \[0, {len(v)}\), got {bad}$"):
            v.decode([5, bad])
    with pytest.raises(ValueError, match=r"one sentence's ids, 1-D; got 2-D"):   # (a batch read as one sentence)
        v.decode(torch.tensor([ids, ids]))
    with pytest.raises(ValueError, match=r"^Vocabulary.train: SentencePiece refused it: Vocabulary size is smaller "
                                         r"than required_chars"):
        Vocabulary.train(["hola mundo grande", "xyzw qrst"], vocab_size=12)
