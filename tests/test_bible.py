"""The embedded Bible corpus (dtmt_models.data.bible) and `dtmt prepare` (dtmt_models.data.prepare), contract §5-6.

Crafted OSIS strings and mod2imp dumps cover every cleaning rule, the pairing, the versification rule and the
book split; a fake `mod2imp` (a small Python script) drives prepare_bible end to end. One integration test reads
the real Debian modules and is skipped when they are not installed.
"""
import json
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from dtmt_models import cli
from dtmt_models.cli import prepare
from dtmt_models.data import bible
from dtmt_models.data import corpus as data

INSTALL = "apt-get install sword-text-sparv sword-text-web libsword-utils"


# ---------------------------------------------------------------------------------------------- cleaning
@pytest.mark.parametrize("raw, expected", [
    # a footnote between two words leaves a space, not a glued word
    ('<w lemma="strong:H0430">God</w><note placement="foot"><reference type="annotateRef">1:1 </reference>The '
     'Hebrew word rendered “God” is “אֱלֹהִ֑ים” (Elohim).</note><w lemma="strong:H1254">created</w> the earth.',
     "God created the earth."),
    ('<w>only</w> born</q><note placement="foot"><reference type="annotateRef">3:16 </reference>The phrase '
     '<catchWord>only born</catchWord> …</note><q marker="" who="Jesus"><w>Son</w>, that whoever',
     "only born Son, that whoever"),
    # a cross-reference before a space; a note before punctuation leaves no space
    ('is evaluated,<note type="crossReference"><reference subType="x-origin" type="annotateRef">12:4 </reference>'
     '<reference>Exodus 30:12</reference></note> <w>and</w> <w>money</w><note placement="foot">x</note>.',
     "is evaluated, and money."),
    # punctuation spacing around removed tags
    ('<w>Y dijo</w> <w>Dios</w>: <w>Sea</w> <w>la luz</w>: <w>y fué</w> <w>la luz</w>.',
     "Y dijo Dios: Sea la luz: y fué la luz."),
    ('<w>God</w> <w>said</w>, <q>“<w>Let</w> <w>there</w> <w>be</w> <w>light</w>,”</q><w>and</w> there was.',
     "God said, “Let there be light,” and there was."),
    ('¿<w>Tienes</w> <w>aquí</w> <w>alguno</w>?<w>Yernos</w>; ¡<w>OH</w> <w>Jehová</w>!',
     "¿Tienes aquí alguno? Yernos; ¡OH Jehová!"),
    ('(<w>a</w>)<w>b</w> [<w>c</w>] «<w>d</w>»<w>e</w> ‘<w>f</w>’<w>g</w>—<w>h</w>—<w>i</w>',
     "(a) b [c] «d» e ‘f’ g—h—i"),
    ("<w>God</w>’s <w>Spirit</w>", "God’s Spirit"),
    # canonical titles (psalm superscriptions) are text, other titles are not
    ('<div type="x-milestone" subType="x-preverse" sID="pv4877"/><title canonical="true" type="psalm">A Psalm by '
     'David, when he fled from Absalom his son.</title> <lg sID="gen7860"/> <l level="1" sID="gen7861"/>'
     '<div type="x-milestone" subType="x-preverse" eID="pv4877"/>Yahweh, how <w>my</w> adversaries',
     "A Psalm by David, when he fled from Absalom his son. Yahweh, how my adversaries"),
    ('<title level="1" type="main">Génesis</title><div sID="gen3" type="x-p"/><w>EN el principio</w>',
     "EN el principio"),
    ("<title>Heading</title>Text", "Text"),
    # speaker labels go
    ('<div type="x-p"/><speaker>Beloved</speaker> <lg sID="gen15617"/> <l level="1" sID="a"/>Let <w>him</w> '
     'kiss me<l eID="a"/><lb type="x-p"/>', "Let him kiss me"),
    # the glossary after the book's end is cut; other end markers are not the book's
    ('<w>Amen</w>.<div eID="gen2" type="x-p"/><chapter eID="Rev.22"/><div canonical="true" eID="gen1234" '
     'osisID="Rev" type="book"/> <div sID="g1" type="glossary"/><title>Glossary</title>Abaddon is the angel',
     "Amen."),
    ('<w>end</w>.<div type="book" eID="b9"/>after', "end."),
    # entities are decoded after the tags are gone, so an escaped "<" stays text
    ("<w>salt</w> &amp; <w>light</w> &lt;x&gt; &quot;q&quot; &#8212;", 'salt & light <x> "q" —'),
    # whitespace, line breaks and empty verses
    ("  <w>a</w>\n   <w>b</w>  ", "a b"),
    ('<chapter eID="Acts.19"/><div eID="gen5" type="x-p"/>', ""),
    ("", ""),
])
def test_clean_osis(raw, expected):
    assert bible.clean_osis(raw) == expected


@pytest.mark.parametrize("raw, joined, plain", [
    ('<w>sáca</w><transChange type="added">lo</transChange> <w>de</w>', "sácalo de", "sáca lo de"),
    ('<w>dió</w><transChange type="added">les</transChange>.', "dióles.", "dió les."),
    ('<w>dí</w><transChange type="added">me</transChange>', "díme", "dí me"),
    # the exception: a name, not a verb ("Josué los circuncidó", Joshua 5:4)
    ('<w>Josué</w><transChange type="added">los</transChange> <w>circuncidó</w>', "Josué los circuncidó",
     "Josué los circuncidó"),
    # not a clitic, or glued on the right too, or not glued on the left: no join
    ('<w>hay allí</w><transChange type="added">también</transChange><w>bdelio</w>', "hay allí también bdelio",
     "hay allí también bdelio"),
    ('<w>a</w><transChange type="added">lo</transChange><w>x</w>', "a lo x", "a lo x"),
    ('<w>y</w> <transChange type="added">lo</transChange> <w>dijo</w>', "y lo dijo", "y lo dijo"),
    ('<w>Y</w> <w>dijo</w>,<transChange type="added">se</transChange> <w>fué</w>', "Y dijo, se fué", "Y dijo, se fué"),
])
def test_spanish_clitics_rejoined(raw, joined, plain):
    assert bible.clean_osis(raw, join_clitics=True) == joined
    assert bible.clean_osis(raw) == plain


# ------------------------------------------------------------------------------------------- imp dumps
def imp(records):
    """A mod2imp dump from (key, text) records."""
    return "".join(f"$$${key}\n{text}\n" for key, text in records) + "\n"


def test_parse_imp():
    dump = imp([("[ Module Heading ]", ""), ("[ Testament 1 Heading ]", '<milestone type="x-importer"/>'),
                ("Genesis 0:0", "<title>Génesis</title>"), ("Genesis 1:0", '<chapter sID="Gen.1"/>'),
                ("Genesis 1:1", "<w>EN el principio</w>"), ("Genesis 1:2", ""), ("Genesis 1:10", "a\nb"),
                ("Song of Solomon 1:2", "<speaker>Beloved</speaker>Let"), ("I Samuel 2:0", "intro")])
    assert bible.parse_imp(dump) == {("Genesis", 1, 1): "<w>EN el principio</w>", ("Genesis", 1, 2): "",
                                     ("Genesis", 1, 10): "a\nb",
                                     ("Song of Solomon", 1, 2): "<speaker>Beloved</speaker>Let"}
    assert bible.parse_imp("") == {}
    with pytest.raises(bible.BibleFormatError, match="Genesis 1:1 twice"):
        bible.parse_imp(imp([("Genesis 1:1", "a"), ("Genesis 1:1", "b")]))
    with pytest.raises(bible.BibleFormatError, match="not a mod2imp dump"):
        bible.parse_imp("hello\n" + imp([("Genesis 1:1", "a")]))


def test_invalid_utf8_in_a_dump_is_reported_not_replaced():
    raw = imp([("Genesis 1:1", "ok"), ("Genesis 1:2", "x")]).encode().replace(b"x", b"bad \xff byte")
    with pytest.raises(bible.BibleFormatError, match=r"mod2imp engWEB2015eb.*not valid UTF-8.*'Genesis 1:2'"):
        bible.decode_dump(raw, "engWEB2015eb")
    assert bible.decode_dump("$$$Génesis 1:1\nñ\n".encode(), "m") == "$$$Génesis 1:1\nñ\n"


# --------------------------------------------------------------------------- pairing, versification, split
def mini_bible():
    """A crafted Spanish / English pair of modules: 5 shared books, deuterocanon in English only."""
    es = {
        ("Genesis", 1, 1): "g1.1", ("Genesis", 1, 2): "", ("Genesis", 1, 3): "g1.3",  # an empty es side
        ("Genesis", 2, 1): "g2.1", ("Genesis", 2, 2): "g2.2",  # chapter 2 ends at 2 (en: 3) ...
        ("Genesis", 3, 1): "g3.1",  # ... so chapters 2 and 3 go
        ("Genesis", 4, 1): "g4.1", ("Genesis", 4, 2): "g4.2",
        ("Ruth", 1, 1): "r1.1", ("Ruth", 1, 2): "r1.2",
        ("Ruth", 4, 1): "r4.1", ("Ruth", 4, 2): "r4.2",  # the last chapter differs (en 4:3): no chapter 5 to drop
        ("Nehemiah", 1, 1): "n1.1", ("Nehemiah", 1, 2): "",  # both empty: not a drop
        ("Nehemiah", 1, 3): "n1.3",
        ("Acts", 8, 36): "a8.36", ("Acts", 8, 37): "a8.37", ("Acts", 8, 38): "a8.38",  # en 8:37 empty
        ("Jonah", 1, 1): "j1.1",  # Jonah chapter 2 only in en: a mismatch (0 vs 1), drops Jonah 2 and 3
        ("Jonah", 3, 1): "j3.1", ("Jonah", 4, 1): "j4.1",
        ("Malachi", 1, 1): "",  # a book without text in es
    }
    en = {
        ("Genesis", 1, 1): "G1.1", ("Genesis", 1, 2): "G1.2", ("Genesis", 1, 3): "G1.3",
        ("Genesis", 2, 1): "G2.1", ("Genesis", 2, 2): "G2.2", ("Genesis", 2, 3): "G2.3",
        ("Genesis", 3, 1): "G3.1",
        ("Genesis", 4, 1): "G4.1", ("Genesis", 4, 2): "G4.2",
        ("Ruth", 1, 1): "R1.1", ("Ruth", 1, 2): "R1.2",
        ("Ruth", 4, 1): "R4.1", ("Ruth", 4, 2): "R4.2", ("Ruth", 4, 3): "R4.3",
        ("Nehemiah", 1, 1): "N1.1", ("Nehemiah", 1, 2): "", ("Nehemiah", 1, 3): "N1.3",
        ("Tobit", 1, 1): "T1.1",  # deuterocanon: one module only
        ("Acts", 8, 36): "A8.36", ("Acts", 8, 37): "", ("Acts", 8, 38): "A8.38",
        ("Jonah", 1, 1): "J1.1", ("Jonah", 2, 1): "J2.1", ("Jonah", 3, 1): "J3.1", ("Jonah", 4, 1): "J4.1",
        ("Malachi", 1, 1): "M1.1",
    }
    return es, en


def test_align_and_split_mini_bible():
    es, en = mini_bible()
    al = bible.align(es, en)
    assert al.shared_books == ["Genesis", "Ruth", "Nehemiah", "Jonah", "Acts"]  # canonical order
    assert al.only_src_books == [] and al.only_tgt_books == ["Malachi", "Tobit"]
    # text on one side only: Genesis 1:2, 2:3, Ruth 4:3, Jonah 2:1 (en); Acts 8:37 (es)
    assert (al.empty_src, al.empty_tgt) == (4, 1)
    assert al.mismatches == [("Genesis", 2, 2, 3), ("Ruth", 4, 2, 3), ("Jonah", 2, 0, 1)]
    assert al.excluded_chapters == [("Genesis", 2), ("Genesis", 3), ("Ruth", 4), ("Jonah", 2), ("Jonah", 3)]
    assert al.dropped_by_versification == 2 + 1 + 2 + 1  # Genesis 2:1-2, 3:1, Ruth 4:1-2, Jonah 3:1
    assert al.paired == len(al.pairs) + 6
    splits = bible.split_by_book(al.pairs)
    assert {k: [(bible.format_ref(r), s, t) for r, s, t in v] for k, v in splits.items()} == {
        "train": [("Genesis 1:1", "g1.1", "G1.1"), ("Genesis 1:3", "g1.3", "G1.3"),
                  ("Genesis 4:1", "g4.1", "G4.1"), ("Genesis 4:2", "g4.2", "G4.2")],
        "dev": [("Ruth 1:1", "r1.1", "R1.1"), ("Ruth 1:2", "r1.2", "R1.2"),
                ("Jonah 1:1", "j1.1", "J1.1"), ("Jonah 4:1", "j4.1", "J4.1")],
        "test": [("Nehemiah 1:1", "n1.1", "N1.1"), ("Nehemiah 1:3", "n1.3", "N1.3"),
                 ("Acts 8:36", "a8.36", "A8.36"), ("Acts 8:38", "a8.38", "A8.38")],
    }


def test_pairs_follow_canonical_order_not_dump_order():
    es = {("Acts", 1, 1): "a", ("Nehemiah", 1, 1): "n", ("Genesis", 1, 10): "g10", ("Genesis", 1, 9): "g9"}
    en = {("Genesis", 1, 9): "G9", ("Nehemiah", 1, 1): "N", ("Acts", 1, 1): "A", ("Genesis", 1, 10): "G10"}
    refs = [bible.format_ref(r) for r, _, _ in bible.align(es, en).pairs]
    assert refs == ["Genesis 1:9", "Genesis 1:10", "Nehemiah 1:1", "Acts 1:1"]
    assert bible.split_of("Esther") == "dev" and bible.split_of("Esther (Greek)") == "train"


# ------------------------------------------------------------------------ prepare_bible with a fake mod2imp
def fake_mod2imp(tmp_path, dumps, name="mod2imp"):
    """An executable that prints dumps[module] (bytes) like mod2imp, or fails like it on an unknown module."""
    store = tmp_path / "dumps"
    store.mkdir(exist_ok=True)
    for module, raw in dumps.items():
        (store / module).write_bytes(raw)
    exe = tmp_path / "bin" / name
    exe.parent.mkdir(exist_ok=True)
    exe.write_text(f"#!{sys.executable}\n" + textwrap.dedent(f"""\
        import os, sys
        path = os.path.join({str(store)!r}, sys.argv[1])
        if not os.path.exists(path):
            sys.stderr.write("mod2imp: Couldn't find module: " + sys.argv[1] + "\\n")
            sys.exit(255)
        sys.stdout.buffer.write(open(path, "rb").read())
        """))
    exe.chmod(0o755)
    return str(exe)


def osis_dumps():
    """imp dumps of the mini Bible, the verse texts wrapped in markup that cleaning must remove."""
    es, en = mini_bible()

    def dump(verses, wrap):
        return imp([("[ Module Heading ]", ""), ("Genesis 0:0", "<title>intro</title>")]
                   + [(bible.format_ref(r), wrap(t) if t else "") for r, t in verses.items()]).encode()

    return {"spaRV1909eb": dump(es, lambda t: f'<w lemma="strong:H1">{t}</w><transChange type="added">lo</transChange>.'),
            "engWEB2015eb": dump(en, lambda t: f'<w>{t}</w><note placement="foot">a note</note> <q>“end.”</q>')}


def test_prepare_bible_writes_aligned_files_refs_and_manifest(tmp_path):
    exe = fake_mod2imp(tmp_path, osis_dumps())
    out, logs = tmp_path / "corpus", []
    counts = bible.prepare_bible(str(out), log=logs.append, mod2imp=exe)
    assert counts == {"train": 4, "dev": 4, "test": 4}
    assert (out / "test.es").read_text(encoding="utf-8").splitlines() == [
        "n1.1lo.", "n1.3lo.", "a8.36lo.", "a8.38lo."]
    assert (out / "test.en").read_text(encoding="utf-8").splitlines() == [
        "N1.1 “end.”", "N1.3 “end.”", "A8.36 “end.”", "A8.38 “end.”"]
    assert (out / "test.ref").read_text(encoding="utf-8").splitlines() == [
        "Nehemiah 1:1", "Nehemiah 1:3", "Acts 8:36", "Acts 8:38"]
    assert (out / "dev.ref").read_text(encoding="utf-8").splitlines() == ["Ruth 1:1", "Ruth 1:2", "Jonah 1:1",
                                                                          "Jonah 4:1"]
    assert data.read_parallel(str(out / "train.es"), str(out / "train.en"))[0] == ("g1.1lo.", "G1.1 “end.”")
    manifest = data.read_manifest(str(out))
    assert manifest["origin"] == "bible" and (manifest["src_lang"], manifest["tgt_lang"]) == ("es", "en")
    assert manifest["counts"] == counts
    assert manifest["dropped"] == {"empty_es": 4, "empty_en": 1, "versification": 6}
    assert manifest["excluded_chapters"] == ["Genesis 2", "Genesis 3", "Ruth 4", "Jonah 2", "Jonah 3"]
    assert data.corpus_paths(str(out), "dev") == (str(out / "dev.es"), str(out / "dev.en"))
    log = "\n".join(logs)
    assert "dropped 4 with an empty es side and 1 with an empty en side" in log
    assert "3 chapters end on a different verse" in log and "Genesis 2 (2/3)" in log
    assert "5 chapters, 6 pairs" in log and "train 4, dev 4, test 4" in log
    assert "docs/contract.md §5 expects" in log  # the mini Bible is not the real one
    assert not list(out.glob("*.tmp"))


def test_prepare_bible_missing_module_or_bad_output(tmp_path):
    dumps = osis_dumps()
    exe = fake_mod2imp(tmp_path, {"spaRV1909eb": dumps["spaRV1909eb"]})
    with pytest.raises(bible.BibleUnavailable, match=r"engWEB2015eb.*Couldn't find module.*" + INSTALL):
        bible.prepare_bible(str(tmp_path / "out"), log=lambda m: None, mod2imp=exe)
    assert not (tmp_path / "out" / "corpus.json").exists()
    exe = fake_mod2imp(tmp_path, {"spaRV1909eb": dumps["spaRV1909eb"].replace(b"n1.3", b"n1\xe9"),
                                  "engWEB2015eb": dumps["engWEB2015eb"]})
    with pytest.raises(bible.BibleFormatError, match=r"spaRV1909eb.*not valid UTF-8.*'Nehemiah 1:3'"):
        bible.prepare_bible(str(tmp_path / "out"), log=lambda m: None, mod2imp=exe)


def test_prepare_bible_without_mod2imp(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no mod2imp there
    with pytest.raises(bible.BibleUnavailable) as info:
        bible.prepare_bible(str(tmp_path / "out"), log=lambda m: None)
    assert isinstance(info.value, RuntimeError)
    assert "`mod2imp` was not found" in str(info.value) and INSTALL in str(info.value)
    assert prepare.main(["bible", "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "dtmt prepare bible: error:" in err and INSTALL in err and "setup.sh" in err and "Traceback" not in err


def test_prepare_bible_command_with_fake_mod2imp_on_path(tmp_path, monkeypatch, capsys):
    fake_mod2imp(tmp_path, osis_dumps())
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert cli.main(["prepare", "bible", "--out", str(tmp_path / "c")]) == 0
    assert "wrote " in capsys.readouterr().err
    assert json.loads((tmp_path / "c" / "corpus.json").read_text())["counts"] == {"train": 4, "dev": 4, "test": 4}


def test_a_failed_prepare_leaves_the_earlier_corpus_whole(tmp_path, monkeypatch, capsys):
    """A prepare that fails after its text is valid (a vocabulary SentencePiece cannot build) replaced the corpus in
    --out by its new text anyway (the old dev/test removed, exit 1); now the corpus and its binarized copy are
    written into a stage inside --out and moved into place only when all has worked: the earlier corpus stays
    byte for byte, nothing of the stage is left, a new --out is not made; then a run that works replaces it."""
    a, b = numbered(tmp_path, 30, stem="c")
    out = tmp_path / "out"
    assert prepare.main(["files", "--src", a, "--tgt", b, "--out", str(out), "--holdout", "3", "--vocab-size", "40",
                         "--workers", "1"]) == 0
    capsys.readouterr()
    before = snapshot(out)
    assert {"train.es", "dev.es", "test.en", "corpus.json", "bin-bpe40/binarized.json"} <= set(before)
    c, d = numbered(tmp_path, 12, stem="d")
    for extra in ([], ["--no-binarize", "--holdout", "40"]):   # (SentencePiece refuses; the text itself refused)
        assert prepare.main(["files", "--src", c, "--tgt", d, "--out", str(out), "--vocab-size", "8", "--workers",
                             "1", *extra]) == 1
        err = capsys.readouterr().err
        assert "error:" in err and ".prepare.tmp" not in err and "removed" not in err and "wrote" not in err, err
        assert snapshot(out) == before
    assert prepare.main(["files", "--src", c, "--tgt", d, "--out", str(tmp_path / "new"), "--vocab-size", "8"]) == 1
    assert not (tmp_path / "new").exists()
    capsys.readouterr()
    fake_mod2imp(tmp_path, osis_dumps())   # the Bible too
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert cli.main(["prepare", "bible", "--out", str(tmp_path / "bible"), "--vocab-size", "8"]) == 1
    assert "--vocab-size 8: too small for the training text of " + str(tmp_path / "bible") in capsys.readouterr().err
    assert not (tmp_path / "bible").exists()
    assert prepare.main(["files", "--src", c, "--tgt", d, "--out", str(out), "--vocab-size", "40"]) == 0
    assert "wrote " + str(out) + ": train 12 pairs" in capsys.readouterr().err
    assert sorted(os.listdir(out)) == ["bin-bpe40", "corpus.json", "train.en", "train.es"]
    assert data.read_parallel(*data.corpus_paths(str(out), "train")) == data.read_parallel(c, d)


# ------------------------------------------------------------------------------------------ prepare files
def write(path, content):
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return str(path)


def numbered(tmp_path, n, stem="c"):
    src = write(tmp_path / f"{stem}.es", "".join(f"frase {i}\n" for i in range(n)))
    tgt = write(tmp_path / f"{stem}.en", "".join(f"sentence {i}\n" for i in range(n)))
    return src, tgt


def test_prepare_files_copies_and_writes_manifest(tmp_path, capsys):
    src = write(tmp_path / "a.es", "hola mundo\r\nadiós\n")
    tgt = write(tmp_path / "a.en", "hello world\ngoodbye")
    dsrc, dtgt = write(tmp_path / "d.es", "uno\n"), write(tmp_path / "d.en", "one\n")
    out = tmp_path / "out"
    assert prepare.main(["files", "--src", src, "--tgt", tgt, "--dev-src", dsrc, "--dev-tgt", dtgt,
                         "--out", str(out)]) == 0
    assert (out / "train.es").read_bytes() == "hola mundo\nadiós\n".encode()
    assert (out / "train.en").read_text() == "hello world\ngoodbye\n"
    assert data.read_parallel(*data.corpus_paths(str(out), "dev")) == [("uno", "one")]
    manifest = data.read_manifest(str(out))
    assert manifest["origin"] == "files" and manifest["counts"] == {"train": 2, "dev": 1}
    assert (manifest["src_lang"], manifest["tgt_lang"]) == ("es", "en")
    assert not (out / "test.es").exists()
    assert "train 2, dev 1" in capsys.readouterr().err
    # other languages name the files
    assert prepare.main(["files", "--src", src, "--tgt", tgt, "--src-lang", "ca", "--tgt-lang", "en-GB",
                         "--out", str(tmp_path / "o2")]) == 0
    assert (tmp_path / "o2" / "train.ca").exists() and (tmp_path / "o2" / "train.en-GB").exists()


@pytest.mark.parametrize("src, tgt, message", [
    (b"uno\ndos \xff\xfe\ntres\n", b"one\ntwo\nthree\n", r"bad\.es:2: invalid UTF-8"),
    (b"uno\n  \ntres\n", b"one\ntwo\nthree\n", r"bad\.es:2: empty line"),
    (b"uno\ntr\x00es\ntres\n", b"one\ntwo\nthree\n", r"bad\.es:2: a NUL byte at byte 2"),   # (was copied as text)
    (b"uno\ndos\ntres\n", b"one\n\nthree\n", r"bad\.en:2: empty line"),
    (b"uno\ndos\n", b"one\ntwo\nthree\n", r"bad\.es has 2 lines, .*bad\.en has 3"),
    (b"", b"", r"bad\.es and .*bad\.en hold no sentences"),   # 0-byte files: refused, not "0 pairs, valid"
])
def test_prepare_files_rejects_bad_input(tmp_path, capsys, src, tgt, message):
    args = ["files", "--src", write(tmp_path / "bad.es", src), "--tgt", write(tmp_path / "bad.en", tgt),
            "--out", str(tmp_path / "out")]
    assert prepare.main(args) == 1
    err = capsys.readouterr().err
    assert "dtmt prepare files: error:" in err and "Traceback" not in err
    assert re.search(message, err), err
    assert not (tmp_path / "out").exists()   # the folder made for the corpus goes with it


def test_prepare_files_bad_dev_file_and_bad_options(tmp_path, capsys):
    src, tgt = numbered(tmp_path, 10)
    dsrc, dtgt = write(tmp_path / "dev.es", b"a\nb\n"), write(tmp_path / "dev.en", b"a\n\xc3\n")
    base = ["files", "--src", src, "--tgt", tgt, "--out", str(tmp_path / "out")]
    assert prepare.main(base + ["--dev-src", dsrc, "--dev-tgt", dtgt]) == 1
    err = capsys.readouterr().err   # (named by its options, and found before the training text is copied: it had
    assert "error: --dev-src / --dev-tgt: parallel corpus: 1 problem(s) | " in err, err   # come after the whole of it)
    assert "dev.en:2: invalid UTF-8" in err and "train: " not in err, err
    assert prepare.main(base + ["--holdout", "5"]) == 1  # 2 x 5 leaves no training pair
    assert "--holdout 5 asks for 10 held-out pairs" in capsys.readouterr().err
    fifo = str(tmp_path / "fifo")   # (`--dev-tgt <(zcat x.gz)`: refused before it is opened, which would block)
    os.mkfifo(fifo)
    # options that cannot work (contract §6): exit 2, one line, nothing read or written
    for bad, message in ((["--dev-src", dsrc], "--dev-src and --dev-tgt go together"),
                         (["--src-lang", "en"], "must differ"), (["--src-lang", "e s"], "not a language code"),
                         (["--src-lang", "EN"], "--src-lang EN and --tgt-lang en differ only in case"),   # (one file on macOS)
                         (["--dev-src", dsrc, "--dev-tgt", fifo], f"--dev-tgt {fifo}: not a regular file (a pipe"),
                         (["--dev-src", "/dev/null", "--dev-tgt", dtgt], "--dev-src /dev/null: not a regular file"),
                         (["--holdout", "-1"], "--holdout -1: must be an integer"),
                         (["--dev-src", dsrc, "--dev-tgt", dtgt, "--test-src", dsrc, "--test-tgt", dtgt, "--holdout",
                           "1"], "nothing to hold out"),
                         (["--dev-src", dsrc, "--dev-tgt", str(tmp_path)], "--dev-tgt " + str(tmp_path) +
                          ": is a directory"),
                         (["--dev-src", dsrc, "--dev-tgt", str(tmp_path / "none")], "no such file")):
        assert prepare.main(base + bad) == 2, bad
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
        assert not (tmp_path / "out").exists()
    assert prepare.main(["files", "--src", src, "--tgt", tgt, "--out", src]) == 2
    assert f"--out {src}: exists and is not a directory" in capsys.readouterr().err
    assert prepare.main(["files", "--src", src, "--tgt", tgt, "--out", os.path.join(src, "sub")]) == 2
    assert f"{src} is a file, not a directory" in capsys.readouterr().err
    dangling = tmp_path / "dangling"   # (a link to nothing: "cannot be written (File exists)")
    dangling.symlink_to(tmp_path / "gone")
    for out in (dangling, dangling / "sub"):
        assert prepare.main(["files", "--src", src, "--tgt", tgt, "--out", str(out)]) == 2
        assert (f"--out {out}: {dangling} is a symbolic link to {tmp_path / 'gone'}, which does not exist"
                in capsys.readouterr().err)
    assert prepare.main(["binarize", "--data", str(tmp_path / "nowhere")]) == 2
    assert "--data " + str(tmp_path / "nowhere") + ": no such folder" in capsys.readouterr().err
    assert prepare.main(base + ["--holdout", "x"]) == 2  # argparse usage error
    assert prepare.main([]) == 2
    capsys.readouterr()
    assert prepare.main(["files", "--help"]) == 0
    assert "--holdout" in capsys.readouterr().out


def test_one_prepare_at_a_time_writes_a_folder(tmp_path, capsys):
    """A prepare on a folder that another one is writing (its lock held) is refused in one line naming that
    process, exit 2, nothing written; once that one has ended, the folder is free. The lock file is there only while
    a prepare holds the folder; a failed prepare leaves no folder of its own behind."""
    import subprocess as sp

    from dtmt_models.run_lock import PREPARE_LOCK_NAME

    src, tgt = numbered(tmp_path, 12)
    out = tmp_path / "out"
    holder = sp.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from dtmt_models.run_lock import PREPARE_LOCK_NAME, RunLock
        lock = RunLock({str(out)!r}, "--out", "dtmt prepare", PREPARE_LOCK_NAME).acquire()
        print("held", flush=True)
        sys.stdin.readline()
        """)], stdin=sp.PIPE, stdout=sp.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        assert holder.stdout.readline().strip() == "held"
        for args in (["files", "--src", src, "--tgt", tgt, "--out", str(out), "--no-binarize"],
                     ["binarize", "--data", str(out)]):
            if args[0] == "binarize":
                data.write_manifest(str(out), "es", "en", {"train": 0}, "files")   # (a corpus folder, as binarize asks)
            assert prepare.main(args) == 2
            err = capsys.readouterr().err
            option = "--data" if args[0] == "binarize" else "--out"
            assert err.count("\n") == 1 and f"{option} {out} is in use by another dtmt prepare (process " \
                f"{holder.pid})" in err, err
        assert sorted(os.listdir(out)) == sorted([PREPARE_LOCK_NAME, data.MANIFEST])
    finally:
        holder.communicate("\n", timeout=30)
    assert prepare.main(["files", "--src", src, "--tgt", tgt, "--out", str(out), "--no-binarize"]) == 0
    assert sorted(os.listdir(out)) == sorted([data.MANIFEST, "train.es", "train.en"])
    # a holder lets go of its own lock file only: one made after a user removed its file stays its maker's
    from dtmt_models.run_lock import RunLock
    first = RunLock(str(out), "--out", "dtmt prepare", PREPARE_LOCK_NAME).acquire()
    os.remove(out / PREPARE_LOCK_NAME)
    second = RunLock(str(out), "--out", "dtmt prepare", PREPARE_LOCK_NAME).acquire()
    first.release()
    assert (out / PREPARE_LOCK_NAME).read_text() == f"{os.getpid()}\n"
    second.release()
    assert not (out / PREPARE_LOCK_NAME).exists()
    bad = write(tmp_path / "bad.es", b"a\n\n")
    assert prepare.main(["files", "--src", bad, "--tgt", bad, "--out", str(tmp_path / "new")]) == 1
    assert not (tmp_path / "new").exists()
    capsys.readouterr()


def test_a_write_error_inside_the_stage_keeps_its_message(tmp_path):
    """An OSError without a file name (a full disk as the package's own WriteError says it) raised inside
    staged_corpus keeps its message: setting its filename to None made it '[Errno None] None: None'."""
    from dtmt_models.data.prepare import staged_corpus

    for error, shown in ((OSError("cannot write x: No space left on device"), "cannot write x: No space left"),
                         (OSError(28, "No space left on device"), "[Errno 28] No space left on device")):
        with pytest.raises(OSError) as caught:
            with staged_corpus(str(tmp_path / "out"), (), print):
                raise error
        assert str(caught.value) == shown or str(caught.value).startswith(shown), str(caught.value)
        assert "None" not in str(caught.value)


def test_prepare_files_holdout_is_deterministic_and_disjoint(tmp_path):
    src, tgt = numbered(tmp_path, 50)

    def run(out, seed):
        assert prepare.main(["files", "--src", src, "--tgt", tgt, "--out", str(tmp_path / out), "--holdout", "5",
                             "--seed", str(seed)]) == 0
        return {split: data.read_parallel(*data.corpus_paths(str(tmp_path / out), split))
                for split in ("train", "dev", "test")}

    a, b, c = run("a", 7), run("b", 7), run("c", 8)
    assert a == b and a != c
    assert {k: len(v) for k, v in a.items()} == {"train": 40, "dev": 5, "test": 5}
    everything = a["train"] + a["dev"] + a["test"]
    assert sorted(everything) == sorted(data.read_parallel(src, tgt))  # disjoint, nothing lost
    for part in a.values():  # each split keeps the file order
        assert part == sorted(part, key=lambda p: int(p[0].split()[1]))
    assert data.read_manifest(str(tmp_path / "a"))["counts"] == {"train": 40, "dev": 5, "test": 5}
    # given dev files: only test is held out
    dsrc, dtgt = write(tmp_path / "d.es", "x\n"), write(tmp_path / "d.en", "y\n")
    assert prepare.main(["files", "--src", src, "--tgt", tgt, "--out", str(tmp_path / "a"), "--holdout", "3",
                         "--dev-src", dsrc, "--dev-tgt", dtgt]) == 0
    assert data.read_manifest(str(tmp_path / "a"))["counts"] == {"train": 47, "dev": 1, "test": 3}
    # no holdout: the stale dev/test files of the earlier corpus in the directory are removed
    assert prepare.main(["files", "--src", src, "--tgt", tgt, "--out", str(tmp_path / "a")]) == 0
    assert sorted(os.listdir(tmp_path / "a")) == ["bin-bpe4000", "corpus.json", "train.en", "train.es"]
    # ... but never an input file: training files named dev.* in the output directory stay
    dsrc, dtgt = write(tmp_path / "a" / "dev.es", "x\n"), write(tmp_path / "a" / "dev.en", "y\n")
    assert prepare.main(["files", "--src", dsrc, "--tgt", dtgt, "--out", str(tmp_path / "a")]) == 0
    assert data.read_manifest(str(tmp_path / "a"))["counts"] == {"train": 1}
    assert (tmp_path / "a" / "dev.es").read_text() == "x\n"


def test_replacing_a_bible_corpus_removes_its_verse_references(tmp_path, capsys):
    """A corpus of `prepare files` in the folder of a `prepare bible` one: the Bible's {split}.ref files (its
    manifest's references) stayed beside the new corpus's splits without a word (a review found 28,777 verse
    references beside 300 pairs). They are removed with a line saying so; a name that is not a file of the folder
    (a crafted manifest's) is not touched."""
    import json

    src, tgt = numbered(tmp_path, 30)
    out = tmp_path / "c"
    assert prepare.main(["files", "--src", src, "--tgt", tgt, "--out", str(out), "--holdout", "5",
                         "--no-binarize"]) == 0
    manifest = json.loads((out / "corpus.json").read_text())   # as prepare_bible writes it
    manifest["references"] = {split: f"{split}.ref" for split in ("train", "dev", "test")}
    manifest["references"]["other"] = "../outside.ref"
    (out / "corpus.json").write_text(json.dumps(manifest))
    for split in ("train", "dev", "test"):
        write(out / f"{split}.ref", "Genesis 1:1\n")
    outside = write(tmp_path / "outside.ref", "mine\n")
    capsys.readouterr()
    assert prepare.main(["files", "--src", src, "--tgt", tgt, "--out", str(out), "--no-binarize"]) == 0
    err = capsys.readouterr().err
    assert sorted(os.listdir(out)) == ["corpus.json", "train.en", "train.es"], os.listdir(out)
    assert f"removed {out / 'train.ref'} (left from an earlier corpus; this one has no verse references)" in err, err
    assert open(outside).read() == "mine\n"



def snapshot(folder):
    """Every file under `folder` (links not followed) and its bytes: what "nothing written" compares."""
    found = {}
    for root, dirs, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            found[os.path.relpath(path, folder)] = b"" if os.path.islink(path) else open(path, "rb").read()
    return found


def test_prepare_files_never_overwrites_an_input(tmp_path, capsys):
    """--out the folder of the inputs, whose names are the corpus's own: the 160-line train.es was replaced by the
    140-line training split (exit 0). Any input that prepare would write, replace or remove is refused before any
    work: exit 2, one line naming the option, nothing written (contract §6), through symlinks and hard links too."""
    d = tmp_path / "D"
    d.mkdir()
    src, tgt = numbered(d, 160, stem="train")
    before = snapshot(tmp_path)

    def refused(argv, option, clash):
        assert prepare.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("dtmt prepare files: error: " + option), err
        assert "would overwrite" in err and clash in err, err
        assert snapshot(tmp_path) == before, argv

    refused(["files", "--src", src, "--tgt", tgt, "--out", str(d), "--holdout", "10", "--vocab-size", "60"],
            f"--src {src}:", "train split's source file")
    refused(["files", "--src", src, "--tgt", tgt, "--out", str(d), "--no-binarize"], f"--src {src}:", "train")
    os.symlink(src, tmp_path / "link.es")
    os.link(tgt, tmp_path / "hard.en")
    before = snapshot(tmp_path)
    refused(["files", "--src", str(tmp_path / "link.es"), "--tgt", str(tmp_path / "hard.en"), "--out", str(d)],
            f"--src {tmp_path / 'link.es'}:", f"it is {os.path.join(str(d), 'train.es')}")
    refused(["files", "--src", str(tmp_path / "link.es"), "--tgt", str(tmp_path / "hard.en"), "--out", str(d),
             "--src-lang", "x"], f"--tgt {tmp_path / 'hard.en'}:", "train split's target file")
    # dev and test files are inputs too, and a held-out split writes its files
    a, b = numbered(tmp_path, 50, stem="c")
    dev, dtgt = numbered(d, 5, stem="dev")
    before = snapshot(tmp_path)
    refused(["files", "--src", a, "--tgt", b, "--dev-src", dev, "--dev-tgt", dtgt, "--out", str(d)],
            f"--dev-src {dev}:", "dev split's source file")
    refused(["files", "--src", a, "--tgt", b, "--test-src", dev, "--test-tgt", dtgt, "--out", str(d),
             "--holdout", "2"], f"--test-src {dev}:", "dev split's source file")   # dev is held out into D/dev.*
    # a prepared corpus: its manifest and its binarized copy (replaced as a whole) are not inputs either
    out = tmp_path / "out"
    assert prepare.main(["files", "--src", a, "--tgt", b, "--out", str(out), "--vocab-size", "60",
                         "--workers", "1"]) == 0
    capsys.readouterr()
    before = snapshot(tmp_path)
    model = str(out / "bin-bpe60" / "src.model")
    refused(["files", "--src", str(out / "corpus.json"), "--tgt", b, "--out", str(out)], "--src", "manifest")
    refused(["files", "--src", a, "--tgt", model, "--out", str(out), "--vocab-size", "60"], f"--tgt {model}:",
            "binarized corpus")
    stale = write(out / ".notes.tmp4000000", "not ours")   # what remove_stale_temporaries would take
    before = snapshot(tmp_path)
    refused(["files", "--src", stale, "--tgt", b, "--out", str(out)], "--src", "temporary file")
    # where nothing is in the way, the same folder works: the inputs' folder, names that are not the corpus's
    assert prepare.main(["files", "--src", a, "--tgt", b, "--out", str(tmp_path), "--no-binarize"]) == 0
    assert (tmp_path / "c.es").read_bytes() == before["c.es"] and (tmp_path / "train.es").exists()


@pytest.mark.parametrize("source", ["files", "bible"])
def test_prepare_never_overwrites_a_folder_that_is_not_a_corpus(tmp_path, capsys, source):
    """--out a folder of the user's own that holds files named like a corpus's (train.es, test.en, corpus.json,
    bin-bpe4000) but no manifest of dtmt prepare: the user's test.* were removed "left from an earlier corpus", and
    train.* and corpus.json replaced, exit 0. Now refused before any work: exit 2, one line naming the files,
    nothing changed; a folder that holds an earlier corpus is still replaced by the new one."""
    a, b = numbered(tmp_path, 20, stem="c")
    argv = {"files": ["files", "--src", a, "--tgt", b, "--no-binarize"], "bible": ["bible", "--no-binarize"]}[source]
    for names in (["train.es", "train.en", "test.es", "test.en"], ["corpus.json"], ["dev.en"], ["bin-bpe4000/x"]):
        proj = tmp_path / f"proj{len(os.listdir(tmp_path))}"
        for name in names:
            os.makedirs(os.path.dirname(proj / name), exist_ok=True)
            write(proj / name, '{"my": "settings"}\n' if name == "corpus.json" else "mine\n")
        before = snapshot(tmp_path)
        run = argv + ["--out", str(proj)] if names != ["bin-bpe4000/x"] else [
            arg for arg in argv if arg != "--no-binarize"] + ["--out", str(proj)]
        assert prepare.main(run) == 2, names
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--out {proj}: holds {names[0].split('/')[0]}" in err, err
        assert "is not a corpus of dtmt prepare (no readable corpus.json)" in err
        assert snapshot(tmp_path) == before
    if source == "files":   # an earlier corpus of prepare: replaced, its stale test split removed
        out = str(tmp_path / "corpus")
        assert prepare.main(argv + ["--out", out, "--holdout", "2"]) == 0
        assert prepare.main(argv + ["--out", out]) == 0
        assert data.read_manifest(out)["counts"] == {"train": 20} and not os.path.exists(os.path.join(out, "test.es"))


@pytest.mark.parametrize("source", ["files", "bible", "binarize"])
@pytest.mark.parametrize("option, value, message", [
    ("--vocab-size", "99999999999", "--vocab-size 99999999999: must be an integer in [8, 1,000,000]"),
    ("--vocab-size", "2147483648", "--vocab-size 2147483648: must be an integer in [8, 1,000,000]"),
    ("--vocab-size", "7", "--vocab-size 7: must be an integer in [8, 1,000,000]"),
    ("--workers", "100000", "--workers 100000: must be an integer in [0, "),
    ("--workers", "-1", "--workers -1: must be an integer in [0, "),
    ("--sample", "0", "--sample 0: must be an integer in [1, 1,000,000,000]"),
    ("--sample", "10000000000", "--sample 10000000000: must be an integer in [1, 1,000,000,000]"),
    ("--sample-seed", "-1", "--sample-seed -1: must be an integer in [0, 4,294,967,295]"),
    ("--sample-seed", "4294967296", "--sample-seed 4294967296: must be an integer in [0, 4,294,967,295]"),
    ("--holdout", "99999999999", "--holdout 99999999999: must be an integer in [0, 1,000,000,000]"),
    ("--seed", "-1", "--seed -1: must be an integer in [0, 4,294,967,295]"),
    ("--seed", "18446744073709551616", "--seed 18446744073709551616: must be an integer in [0, 4,294,967,295]"),
])
def test_prepare_numeric_options_are_bounded(tmp_path, capsys, monkeypatch, source, option, value, message):
    """Every numeric option in a range, checked before any work: --vocab-size 99999999999 was a 60-line traceback
    from a SentencePiece process after the text was written; --workers 100000 started over 1,100 processes and
    hung. Now one line, exit 2, nothing written (and no process started)."""
    import concurrent.futures

    def no_pool(*args, **kwargs):
        raise AssertionError("a process pool was started for an option that cannot work")

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", no_pool)
    src, tgt = numbered(tmp_path, 40)
    corpus = tmp_path / "corpus"
    assert prepare.main(["files", "--src", src, "--tgt", tgt, "--out", str(corpus), "--no-binarize"]) == 0
    capsys.readouterr()
    argv = {"files": ["files", "--src", src, "--tgt", tgt, "--out", str(tmp_path / "out")],
            "bible": ["bible", "--out", str(tmp_path / "out")],
            "binarize": ["binarize", "--data", str(corpus)]}[source]
    if option in ("--holdout", "--seed") and source != "files":
        assert prepare.main(argv + [option, value]) == 2   # not an option of this subcommand: argparse says so
        return
    before = snapshot(tmp_path)
    assert prepare.main(argv + [option, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dtmt prepare {source}: error: {message}") and err.count("\n") == 1, err
    assert snapshot(tmp_path) == before


def test_prepare_workers_limit_is_in_the_help(capsys):
    assert prepare.main(["files", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert f"at most {prepare.MAX_WORKERS} here" in text and "8 to 1,000,000" in text


def test_prepare_checks_options_before_removing_leftovers(tmp_path, capsys):
    """A refused option writes nothing, not even the removal of what an interrupted run left in --out."""
    import subprocess as sp

    out = tmp_path / "out"
    out.mkdir()
    gone = sp.Popen(["true"])
    gone.wait()
    stale = write(out / f".train.es.tmp{gone.pid}", "left")
    assert prepare.main(["files", "--src", str(tmp_path / "none.es"), "--tgt", str(tmp_path / "none.en"),
                         "--out", str(out)]) == 2
    assert "--src " + str(tmp_path / "none.es") + ": no such file" in capsys.readouterr().err
    assert os.path.exists(stale)

def test_prepare_removes_what_an_interrupted_run_left(tmp_path, capsys):
    """A prepare killed midway leaves its temporaries (its stage .prepare.tmp-PID, a binarized build folder
    .bin-*.tmp-PID); the next run removes those whose process is gone, and leaves a running process' own (issue 71
    item 5). An atomic write's temporary is no prepare's there (it writes in its stage): a user's .backup.tmp99999
    had been removed (a review found it)."""
    import subprocess as sp

    from dtmt_models.atomic import remove_stale_temporaries

    src, tgt = numbered(tmp_path, 50)
    out = tmp_path / "out"
    out.mkdir()
    gone = sp.Popen(["true"])
    gone.wait()   # a process id that no process has now
    stale = [out / f".prepare.tmp-{gone.pid}"]
    stale[0].mkdir()
    write(stale[0] / "train.es", "x" * 1000)
    (out / f".bin-bpe4000.tmp-{gone.pid}").mkdir()
    write(out / f".bin-bpe4000.tmp-{gone.pid}" / "train.bin", "x")
    running = write(out / f".notes.txt.tmp{os.getppid()}", "a running process' own")
    # names like a temporary's that none of the package's writers makes: a user's own, kept (the loose pattern
    # before removed them all, and the last one's 20 digits were an OverflowError's traceback)
    keep = [write(out / ".hidden.tmpfile", "x"), write(out / f".thesis.tmp{gone.pid}.bak", "x"),
            write(out / f".notes.tmp{gone.pid}-old", "x"), write(out / ".x.tmp99999999999999999999", "x"),
            write(out / ".big.tmp5000000", "x"),   # (past any process id Linux gives)
            write(out / f".backup.tmp{gone.pid}", "x"), write(out / f".curve.png.tmp{gone.pid}.png", "x")]
    (out / ".backup.tmp-20240101").mkdir()
    keep.append(write(out / ".backup.tmp-20240101" / "notes.txt", "a user's folder"))
    (out / f".mine.tmp-{gone.pid}").mkdir()
    keep.append(out / f".mine.tmp-{gone.pid}")
    assert prepare.main(["files", "--src", src, "--tgt", tgt, "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert all(not os.path.exists(p) for p in stale) and not (out / f".bin-bpe4000.tmp-{gone.pid}").exists()
    assert err.count("left by an interrupted run") == 2, err
    assert os.path.isfile(running) and all(os.path.exists(p) for p in keep)
    assert data.read_manifest(str(out))["counts"] == {"train": 50}
    assert remove_stale_temporaries(str(tmp_path / "nowhere")) == []


def test_prepare_over_a_binarized_copy_that_is_no_folder(tmp_path, capsys):
    """A file (or a link to nothing) where the binarized copy's folder goes: prepare removed the earlier corpus's
    manifest, then failed ("Not a directory", naming its stage), and every later run refused the folder as not a
    corpus. Now refused before anything, the earlier corpus whole. A link to a folder elsewhere is replaced by the
    new copy and the link goes, what it pointed to stays (a .bin-*.tmp-PID link was left behind)."""
    src, tgt = numbered(tmp_path, 60)
    out = tmp_path / "c"
    assert prepare.main(["files", "--src", src, "--tgt", tgt, "--out", str(out), "--vocab-size", "40",
                         "--no-binarize"]) == 0
    for make in (lambda p: p.write_text("notes\n"), lambda p: p.symlink_to(tmp_path / "nowhere")):
        make(out / "bin-bpe40")
        before = snapshot(out)
        capsys.readouterr()
        assert prepare.main(["files", "--src", src, "--tgt", tgt, "--out", str(out), "--vocab-size", "40",
                             "--holdout", "5"]) == 2
        kind = "a link to nothing" if (out / "bin-bpe40").is_symlink() else "a file"
        assert capsys.readouterr().err == (f"dtmt prepare files: error: {out / 'bin-bpe40'} is {kind}, where dtmt "
                                           f"prepare writes the binarized copy's folder; move it aside first\n")
        assert snapshot(out) == before and data.read_manifest(str(out))["counts"] == {"train": 60}
        (out / "bin-bpe40").unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / "bin-bpe40").symlink_to(elsewhere)
    assert prepare.main(["files", "--src", src, "--tgt", tgt, "--out", str(out), "--vocab-size", "40"]) == 0
    assert (out / "bin-bpe40").is_dir() and not (out / "bin-bpe40").is_symlink()
    assert sorted(os.listdir(out)) == ["bin-bpe40", "corpus.json", "train.en", "train.es"]
    assert elsewhere.is_dir()


def test_prepare_of_a_file_whose_name_is_not_utf8(tmp_path):
    """An input whose name holds bytes that are not UTF-8 (a traceback writing the manifest, exit 1): prepared, its
    path in the manifest with those bytes written as \\xNN."""
    src, tgt = numbered(tmp_path, 20)
    odd = os.path.join(os.fsencode(str(tmp_path)), b"bad\xffname.es")
    shutil.copyfile(src, odd)
    out = tmp_path / "c"
    assert prepare.main(["files", "--src", os.fsdecode(odd), "--tgt", tgt, "--out", str(out), "--no-binarize"]) == 0
    assert data.read_manifest(str(out))["sources"]["train"][0] == str(tmp_path / "bad\\xffname.es")
    assert (out / "train.es").read_bytes() == open(src, "rb").read()


def test_prepare_warns_of_carriage_returns_inside_lines(tmp_path, capsys):
    """Old Mac line ends (\\r alone) made a file one line, taken without a word (1 pair where 3 were meant); a \\r
    inside a line is now counted and said, with how to convert. CRLF line ends are not (their \\r ends the line).
    Two files of old Mac line ends, of 3 and 5 lines, were one pair with that warning, exit 0: a split of one
    line holding a \\r is refused, naming the file, and nothing is written."""
    src = write(tmp_path / "inner.es", b"uno dos\rtres cuatro\ncinco seis\n")
    tgt = write(tmp_path / "inner.en", b"one two three four\nfive six\n")
    assert prepare.main(["files", "--src", src, "--tgt", tgt, "--out", str(tmp_path / "i"), "--no-binarize"]) == 0
    err = capsys.readouterr().err
    assert ("warning: train: 1 pairs hold a carriage return (\\r) inside a line, read as a space; a file with old Mac "
            "line ends (\\r alone) is one line to prepare: convert them to \\n first (tr '\\r' '\\n')") in err, err
    src = write(tmp_path / "mac.es", b"uno dos\rtres cuatro\rcinco seis\r")
    tgt = write(tmp_path / "mac.en", b"one\rtwo\rthree\rfour\rfive\r")
    assert prepare.main(["files", "--src", src, "--tgt", tgt, "--out", str(tmp_path / "m"), "--no-binarize"]) == 1
    err = capsys.readouterr().err
    assert err == (f"dtmt prepare files: error: {src}: one line holding carriage returns (\\r) and no line feed: a "
                   f"file of old Mac line ends, which prepare splits at \\n only; convert them first (tr '\\r' "
                   f"'\\n')\n"), err
    assert not (tmp_path / "m").exists()
    # a corpus of one pair whose line holds a \r, ended by \n: text, taken with the warning (a review's case)
    src = write(tmp_path / "one.es", b"uno\rdos\n")
    tgt = write(tmp_path / "one.en", b"one two\n")
    assert prepare.main(["files", "--src", src, "--tgt", tgt, "--out", str(tmp_path / "o"), "--no-binarize"]) == 0
    assert "warning: train: 1 pairs hold a carriage return" in capsys.readouterr().err
    src = write(tmp_path / "dos.es", b"uno dos\r\ntres cuatro\r\n")
    tgt = write(tmp_path / "dos.en", b"one two\r\nthree four\r\n")
    assert prepare.main(["files", "--src", src, "--tgt", tgt, "--out", str(tmp_path / "d"), "--no-binarize"]) == 0
    assert "carriage return" not in capsys.readouterr().err


def test_prepare_warns_of_a_file_given_twice(tmp_path, capsys):
    """A dev file that is the training file (dev scores of training text), or one file as both sides of a split,
    was taken without a word."""
    src, tgt = numbered(tmp_path, 30)
    assert prepare.main(["files", "--src", src, "--tgt", tgt, "--dev-src", src, "--dev-tgt", src, "--out",
                         str(tmp_path / "c"), "--no-binarize"]) == 0
    err = capsys.readouterr().err
    assert (f"warning: --dev-src and --dev-tgt are one file ({src}): the dev split translates a text into itself"
            in err), err
    assert (f"warning: --dev-src is --src ({src}): the dev split is training text, whose scores say nothing of new "
            f"text") in err and "--dev-tgt is --tgt" not in err, err
    # the test files that are the dev files: test scores of the text the best checkpoint was chosen on (a review)
    dev_src, dev_tgt = numbered(tmp_path, 5, stem="dev")
    assert prepare.main(["files", "--src", src, "--tgt", tgt, "--dev-src", dev_src, "--dev-tgt", dev_tgt,
                         "--test-src", dev_src, "--test-tgt", dev_tgt, "--out", str(tmp_path / "e"),
                         "--no-binarize"]) == 0
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("warning")] == [
        f"warning: --test-{side} is --dev-{side} ({path}): the test split is the text the best checkpoint was chosen "
        f"on, whose scores flatter it" for side, path in (("src", dev_src), ("tgt", dev_tgt))], err
    assert prepare.main(["files", "--src", src, "--tgt", tgt, "--out", str(tmp_path / "d"), "--no-binarize"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_a_ctrl_c_while_prepare_puts_its_corpus_in_place(tmp_path):
    """Ctrl-C while the corpus is put in place (its files renamed, an earlier corpus's other splits removed) is held
    back until all of it is done: it left the earlier corpus's dev and test files beside the new one, and said
    "interrupted" of a corpus that had been replaced. Now the new corpus is whole, said so, then exit 130."""
    src, tgt = numbered(tmp_path, 60)
    out = tmp_path / "c"
    assert prepare.main(["files", "--src", src, "--tgt", tgt, "--out", str(out), "--holdout", "5",
                         "--no-binarize"]) == 0
    script = textwrap.dedent(f"""
        import os, signal, sys
        from dtmt_models.data import prepare as staging
        real, commit = os.replace, staging._commit
        def interrupted(*args, **kwargs):   # the commit's first rename: a Ctrl-C now
            os.replace = real
            os.kill(os.getpid(), signal.SIGINT)
            return real(*args, **kwargs)
        def committing(*args, **kwargs):
            os.replace = interrupted
            return commit(*args, **kwargs)
        staging._commit = committing
        from dtmt_models import cli
        sys.exit(cli.main(["prepare", "files", "--src", {src!r}, "--tgt", {tgt!r}, "--out", {str(out)!r},
                           "--src-lang", "xx", "--tgt-lang", "yy", "--no-binarize"]))
        """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(__file__)))
    assert r.returncode == 130, r.stderr
    assert sorted(os.listdir(out)) == ["corpus.json", "train.xx", "train.yy"], r.stderr
    assert f"note: the interrupt came as {out} was put in place: it is written whole" in r.stderr, r.stderr
    assert data.read_manifest(str(out))["counts"] == {"train": 60}


def test_a_sigterm_while_prepare_works_removes_what_it_made(tmp_path):
    """SIGTERM (`timeout`, Slurm, `docker stop`) while its worker processes encode: the process died on the spot and
    left its staged copy of the corpus, its lock and the --out folder it had made, without a word (rc 143). Now it
    ends as after Ctrl-C: its workers stopped (a chunk at work is waited for STOP_WAIT_S at most, this one's for a
    minute: its worker killed), nothing left, one line, exit 143."""
    src, tgt = numbered(tmp_path, 60)
    out, marker = tmp_path / "new" / "c", tmp_path / "worker.pid"
    script = textwrap.dedent(f"""
        import os, signal, sys, threading, time
        from dtmt_models.data import binarized
        def stuck(*args):   # an encoding worker that would work for a minute
            open({str(marker)!r}, "w").write(str(os.getpid()))
            time.sleep(60)
        binarized._encode_in_worker = stuck
        def terminate():   # SIGTERM to the main process once a worker is at work
            while not os.path.exists({str(marker)!r}) or not open({str(marker)!r}).read():
                time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGTERM)
        threading.Thread(target=terminate, daemon=True).start()
        from dtmt_models import cli
        sys.exit(cli.main(["prepare", "files", "--src", {src!r}, "--tgt", {tgt!r}, "--out", {str(out)!r},
                           "--vocab-size", "60", "--workers", "2"]))
        """)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(__file__)))
    assert r.returncode == 143 and time.monotonic() - t0 < 40, r.stderr
    assert r.stderr.endswith("dtmt prepare: terminated (SIGTERM)\n"), r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "new").exists(), r.stderr
    with pytest.raises(ProcessLookupError):   # (the worker ended with it)
        for _ in range(100):
            os.kill(int(marker.read_text()), 0)
            time.sleep(0.05)


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_to_prepare_s_process_group_ends_it_cleanly(tmp_path, sig):
    """Ctrl-C or `timeout` signal the whole process group, encoding workers included: an idle worker interrupted
    printed its traceback, and a worker ended by SIGTERM part-way through sending its chunk left the pool waiting
    for the rest for ever (prepare hung, its lock held; 2 runs in 10). The workers leave the signals to prepare,
    which lets the chunks at work finish and stops them: one line, nothing left, the signal's status."""
    src, tgt = numbered(tmp_path, 60)
    out, marker = tmp_path / "new" / "c", tmp_path / "worker.pid"
    script = textwrap.dedent(f"""
        import os, sys, time
        from dtmt_models.data import binarized
        encode = binarized._encode_in_worker
        def slow(*args):   # a chunk that takes a second
            open({str(marker)!r}, "w").write(str(os.getpid()))
            time.sleep(1.0)
            return encode(*args)
        binarized._encode_in_worker = slow
        from dtmt_models import cli
        sys.exit(cli.main(["prepare", "files", "--src", {src!r}, "--tgt", {tgt!r}, "--out", {str(out)!r},
                           "--vocab-size", "60", "--workers", "2"]))
        """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=os.path.dirname(os.path.dirname(__file__)), start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while not (marker.exists() and marker.read_text()) and time.monotonic() < deadline:
            time.sleep(0.02)
        os.killpg(p.pid, getattr(signal, sig))
        _, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 128 + getattr(signal, sig), err
    assert "Traceback" not in err and err.endswith("\ndtmt prepare: interrupted\n" if sig == "SIGINT" else
                                                   "dtmt prepare: terminated (SIGTERM)\n"), err
    assert not (tmp_path / "new").exists()


def test_python_m_prepare_reports_errors_without_traceback(tmp_path, monkeypatch, capsys):
    bad = write(tmp_path / "x.es", b"ok\n\xff\n")
    good = write(tmp_path / "x.en", b"ok\nfine\n")
    # what `python -m dtmt_models.cli.prepare files ...` runs, in this process (a fresh interpreter costs seconds)
    monkeypatch.setattr(sys, "argv", ["prepare.py", "files", "--src", bad, "--tgt", good, "--out", str(tmp_path)])
    monkeypatch.delitem(sys.modules, "dtmt_models.cli.prepare")  # as in a fresh `python -m` (and no runpy warning)
    with pytest.raises(SystemExit) as info:
        runpy.run_module("dtmt_models.cli.prepare", run_name="__main__")
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert "x.es:2: invalid UTF-8" in err and "Traceback" not in err
    # the problems of a corpus in one line, as every error (contract §6): a line each had followed the count
    bad = write(tmp_path / "y.es", b"ok\n\xff\n\n")
    good = write(tmp_path / "y.en", b"ok\nfine\nthree\n")
    assert prepare.main(["files", "--src", bad, "--tgt", good, "--out", str(tmp_path / "y"), "--no-binarize"]) == 1
    assert capsys.readouterr().err == (f"dtmt prepare files: error: parallel corpus: 2 problem(s) | {bad}:2: invalid "
                                       f"UTF-8 at byte 0 (b'\\xff') | {bad}:3: empty line\n")


# -------------------------------------------------------------------------------- the real Debian modules
@pytest.fixture(scope="module")
def real_bible(tmp_path_factory):
    if shutil.which("mod2imp") is None:
        pytest.skip(f"mod2imp is not installed (Debian libsword-utils); {INSTALL}")
    out = tmp_path_factory.mktemp("bible")
    logs = []
    try:
        counts = bible.prepare_bible(str(out), log=logs.append)
    except bible.BibleUnavailable as exc:
        pytest.skip(f"the SWORD modules are not installed: {exc}")
    return out, counts, logs


def test_real_bible_counts_and_spot_checks(real_bible):
    out, counts, logs = real_bible
    assert counts == {"train": 28777, "dev": 377, "test": 1331}  # contract §5
    lines = {}
    for split in bible.SPLITS:
        for ext in ("es", "en", "ref"):
            lines[split, ext] = (out / f"{split}.{ext}").read_text(encoding="utf-8").split("\n")[:-1]
            assert len(lines[split, ext]) == counts[split]
            assert all(line.strip() == line and line for line in lines[split, ext])
    train = dict(zip(lines["train", "ref"], zip(lines["train", "es"], lines["train", "en"])))
    assert lines["train", "ref"][0] == "Genesis 1:1"
    assert train["Genesis 1:1"] == ("EN el principio crió Dios los cielos y la tierra.",
                                    "In the beginning, God created the heavens and the earth.")
    assert train["John 3:16"][1] == ("For God so loved the world, that he gave his only born Son, that whoever "
                                     "believes in him should not perish, but have eternal life.")
    assert train["Genesis 2:12"][0].startswith("Y el oro de aquella tierra es bueno: hay allí también bdelio")
    assert "sácalo de este lugar" in train["Genesis 19:12"][0]
    assert train["Psalms 3:1"][1].startswith("A Psalm by David, when he fled from Absalom his son. Yahweh, how")
    assert train["Revelation of John 22:21"][1] == "The grace of the Lord Jesus Christ be with all the saints. Amen."
    assert "Numbers 12:1" not in train and "Numbers 13:1" not in train and "Numbers 14:1" in train
    assert lines["test", "ref"][0] == "Nehemiah 1:1" and lines["test", "ref"][-1].startswith("Acts 28:")
    assert lines["test", "en"][0].startswith("The words of Nehemiah the son of Hacaliah.")
    assert lines["dev", "ref"][0] == "Ruth 1:1" and lines["dev", "ref"][-1] == "Philippians 4:23"
    books = {ref.rsplit(" ", 1)[0] for ref in lines["dev", "ref"]}
    assert books == {"Ruth", "Esther", "Jonah", "Philippians"}
    everything = [line for (split, ext), ls in lines.items() if ext != "ref" for line in ls]
    assert not [line for line in everything if "<" in line and ">" in line or "  " in line or " ," in line]
    manifest = data.read_manifest(str(out))
    # the standard-library prototype of docs/research/bible/REPORT.md, written before bible.py: 18 empty RV verses
    # of 31,102 keys, 31,077 pairs non-empty on both sides (so 7 more empty in WEB), 13 chapters whose last verse
    # differs, 592 pairs dropped for them
    assert manifest["dropped"] == {"empty_es": 18, "empty_en": 7, "versification": 592}
    assert len(manifest["versification_mismatches"]) == 13
    assert any("13 chapters end on a different verse" in m for m in logs)


def test_prepare_s_own_leftovers_and_the_user_s_files_beside_a_corpus(tmp_path, capsys):
    """A review's findings on the staged prepare: inputs kept in --out under split names are not the user's files
    in the way (refused since the check of foreign files, fine before); a run killed while it moved its corpus in
    (its manifest still in its stage, left) does not lock the folder, nor does a dtmt train refused there; a corpus of other languages removes only the earlier
    corpus's own files, not the user's test.de / test.fr beside it; an error of the file system names --out, not the
    stage."""
    from dtmt_models.data.prepare import staged_corpus

    d = tmp_path / "d"
    d.mkdir()
    src, tgt = numbered(d, 20, stem="test")
    assert prepare.main(["files", "--src", src, "--tgt", tgt, "--out", str(d), "--no-binarize"]) == 0
    assert (d / "test.es").read_text() == "".join(f"frase {i}\n" for i in range(20))
    assert data.read_manifest(str(d))["counts"] == {"train": 20} and "removed" not in capsys.readouterr().err
    killed = tmp_path / "killed"   # (text of two runs, no manifest there, the stage of a process long gone, its
    gone = subprocess.Popen(["true"])   # manifest not yet moved)
    gone.wait()   # a process id that no process has now
    stage = killed / f".prepare.tmp-{gone.pid}"
    os.makedirs(stage)
    data.write_manifest(str(stage), "es", "en", {"train": 1}, "files")
    write(killed / "train.es", "old\n"), write(killed / "train.en", "new\n")
    capsys.readouterr()
    # a dtmt train on it is refused and leaves the stage (it removed it as an interrupted run's leftover: prepare
    # then took the folder for the user's own files and refused it too, with no way out but deleting by hand)
    assert cli.main(["train", "--data", str(killed), "--out", str(tmp_path / "run")]) == 2
    assert f"dtmt train: {killed}: no corpus.json" in capsys.readouterr().err
    assert stage.is_dir()
    assert prepare.main(["files", "--src", src, "--tgt", tgt, "--out", str(killed), "--no-binarize"]) == 0, \
        capsys.readouterr().err
    assert data.read_parallel(*data.corpus_paths(str(killed), "train")) == data.read_parallel(src, tgt)
    assert not stage.exists()
    c1 = tmp_path / "c1"
    assert prepare.main(["files", "--src", src, "--tgt", tgt, "--out", str(c1), "--holdout", "2",
                         "--no-binarize"]) == 0
    write(c1 / "test.de", "mine\n"), write(c1 / "test.fr", "mine\n")
    capsys.readouterr()
    assert prepare.main(["files", "--src", src, "--tgt", tgt, "--src-lang", "de", "--tgt-lang", "fr", "--out",
                         str(c1), "--no-binarize"]) == 0
    err = capsys.readouterr().err
    assert sorted(os.listdir(c1)) == ["corpus.json", "test.de", "test.fr", "train.de", "train.fr"], err
    assert (c1 / "test.de").read_text() == "mine\n" and "removed " + str(c1 / "dev.es") in err
    with pytest.raises(OSError) as info:
        with staged_corpus(str(c1) + os.sep, (), print) as (stage, say):
            raise OSError(28, "No space left on device", os.path.join(stage, "train.en"))
    assert ".prepare.tmp" not in str(info.value) and info.value.filename == os.path.join(str(c1), "train.en")
