"""The embedded default corpus (contract §5): the Bible, Spanish (Reina-Valera 1909) → English (World English Bible).

Both translations are public domain and come from Debian's SWORD packages, read with `mod2imp` (libsword-utils):

    module          package            versification   language
    spaRV1909eb     sword-text-sparv   KJV             es  (source)
    engWEB2015eb    sword-text-web     NRSVA           en  (target, with the deuterocanon)

Pipeline (docs/research/bible/REPORT.md has the notes this module was made from):

1. `run_mod2imp` dumps a module: records `$$$<Book> <C>:<V>` followed by the verse in raw OSIS. The output
   is decoded strictly (invalid UTF-8 is an error, never replaced).
2. `parse_imp` keeps the verse records (chapter and verse > 0; headings and book/chapter intros are skipped).
3. `clean_osis` turns OSIS into plain text (rules in its docstring). A removed tag or note never glues two
   words together.
4. `align` pairs verses by reference (book, chapter, verse), drops pairs with an empty side and applies the
   versification rule: where a chapter's last non-empty verse number differs between the two modules, that
   chapter and the next chapter of the same book are left out (the verse numbering is shifted there).
5. `split_by_book`: test = Nehemiah and Acts, dev = Ruth, Esther, Jonah and Philippians, train = every
   other book present in both modules; canonical book order within each split.
6. `prepare_bible(out_dir)` does all of it and writes `{train,dev,test}.{es,en}`, `{split}.ref` (the verse
   reference of each line, e.g. "Genesis 1:1") and the manifest. With sword-text-sparv 2.60-1 and
   sword-text-web 426.0-1 it gives train 28,777, dev 377, test 1,331 pairs.

Book names are SWORD's English names ("I Samuel", "Song of Solomon", "Revelation of John"), as in the dumps.
"""
from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from dtmt_models.data import corpus as data
from dtmt_models.atomic import atomic_write

# ------------------------------------------------------------------------------------------------ constants
SRC_LANG, TGT_LANG = "es", "en"
MODULES = {SRC_LANG: "spaRV1909eb", TGT_LANG: "engWEB2015eb"}
PACKAGES = "sword-text-sparv sword-text-web libsword-utils"
INSTALL_HINT = (f"install it with `apt-get install {PACKAGES}` (as root), or run `bash setup.sh`, which does it")

SPLIT_BOOKS = {"test": ("Nehemiah", "Acts"), "dev": ("Ruth", "Esther", "Jonah", "Philippians")}
SPLITS = ("train", "dev", "test")
EXPECTED_COUNTS = {"train": 28777, "dev": 377, "test": 1331}  # contract §5

# The 66 books of the Protestant canon in their traditional (KJV) order, spelled as SWORD spells them.
CANONICAL_BOOKS = (
    "Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua", "Judges", "Ruth", "I Samuel",
    "II Samuel", "I Kings", "II Kings", "I Chronicles", "II Chronicles", "Ezra", "Nehemiah", "Esther", "Job",
    "Psalms", "Proverbs", "Ecclesiastes", "Song of Solomon", "Isaiah", "Jeremiah", "Lamentations", "Ezekiel",
    "Daniel", "Hosea", "Joel", "Amos", "Obadiah", "Jonah", "Micah", "Nahum", "Habakkuk", "Zephaniah", "Haggai",
    "Zechariah", "Malachi", "Matthew", "Mark", "Luke", "John", "Acts", "Romans", "I Corinthians",
    "II Corinthians", "Galatians", "Ephesians", "Philippians", "Colossians", "I Thessalonians",
    "II Thessalonians", "I Timothy", "II Timothy", "Titus", "Philemon", "Hebrews", "James", "I Peter",
    "II Peter", "I John", "II John", "III John", "Jude", "Revelation of John",
)

Ref = Tuple[str, int, int]  # (book, chapter, verse)
Pair = Tuple[Ref, str, str]  # (reference, source text, target text)


class BibleError(RuntimeError):
    """The embedded Bible corpus cannot be prepared."""


class BibleUnavailable(BibleError):
    """`mod2imp` or one of the SWORD modules is not installed."""


class BibleFormatError(BibleError):
    """A module dump is not what this reader expects (invalid UTF-8, no verses, a repeated reference)."""


def format_ref(ref: Ref) -> str:
    """("Genesis", 1, 1) -> "Genesis 1:1"."""
    book, chapter, verse = ref
    return f"{book} {chapter}:{verse}"


# ------------------------------------------------------------------------------------------- reading dumps
def run_mod2imp(module: str, mod2imp: str = "mod2imp") -> str:
    """The `mod2imp MODULE` dump as text; BibleUnavailable when the tool or the module is missing."""
    exe = shutil.which(mod2imp)
    if exe is None:
        raise BibleUnavailable(f"`{mod2imp}` was not found (it comes with Debian's libsword-utils), so the embedded "
                               f"Bible corpus cannot be read; {INSTALL_HINT}")
    try:
        proc = subprocess.run([exe, module], capture_output=True, check=False)
    except OSError as exc:
        raise BibleUnavailable(f"cannot run `{exe}`: {exc}; {INSTALL_HINT}") from exc
    message = proc.stderr.decode("utf-8", "replace").strip()  # only for the error message
    if proc.returncode != 0 or "couldn't find module" in message.lower():
        raise BibleUnavailable(f"`mod2imp {module}` failed (exit status {proc.returncode}: {message or 'no message'}); "
                               f"the SWORD module {module} is probably not installed; {INSTALL_HINT}")
    return decode_dump(proc.stdout, module)


def decode_dump(raw: bytes, module: str) -> str:
    """Strict UTF-8 decoding of a dump; an invalid byte is reported with its position and verse record."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        key_at = raw.rfind(b"\n$$$", 0, exc.start)
        key_at = key_at + 1 if key_at >= 0 else (0 if raw.startswith(b"$$$") else -1)
        key_end = raw.find(b"\n", key_at) if key_at >= 0 else -1
        key_end = len(raw) if key_end < 0 else key_end
        record = raw[key_at + 3:key_end].decode("utf-8", "replace") if key_at >= 0 else "none"
        bad = raw[max(0, exc.start - 20):exc.start + 20]
        raise BibleFormatError(f"`mod2imp {module}` output is not valid UTF-8 at byte {exc.start} (line {line}, "
                               f"record {record!r}): {bad!r}") from None


_REF_RE = re.compile(r"(.+) (\d+):(\d+)")


def parse_imp(dump: str) -> Dict[Ref, str]:
    """{(book, chapter, verse): raw OSIS} for the verse records of a mod2imp dump, in dump order.

    A record is a `$$$KEY` line followed by its text (one line in practice; several lines are joined with a
    line break). Keys that are not `Book C:V` (module and testament headings) and intros (chapter 0 or verse 0)
    are skipped. Every verse of the versification is present, empty ones with an empty text.
    """
    verses: Dict[Ref, str] = {}
    key: Optional[Ref] = None
    seen_key = False
    body: List[str] = []

    def close() -> None:
        if key is not None:
            verses[key] = "\n".join(body).strip()

    for line in dump.split("\n"):
        if line.startswith("$$$"):
            close()
            seen_key, key, body = True, None, []
            m = _REF_RE.fullmatch(line[3:].strip())
            if m:
                ref = (m.group(1), int(m.group(2)), int(m.group(3)))
                if ref[1] > 0 and ref[2] > 0:
                    if ref in verses:
                        raise BibleFormatError(f"the dump has {format_ref(ref)} twice")
                    key = ref
        elif key is not None:
            body.append(line.rstrip("\r"))
        elif not seen_key and line.strip():
            raise BibleFormatError(f"not a mod2imp dump: text before the first $$$ record: {line[:60]!r}")
    close()
    return verses


# -------------------------------------------------------------------------------------------- OSIS cleaning
_GAP = "\x00"  # stands for a removed tag or element until the spacing is decided
_NO_SPACE_BEFORE = ",.;:?!)]»”’—"  # the tag-free source text never has a space before these ...
_NO_SPACE_AFTER = "([«“‘¿¡—"  # ... nor after these
_GAP_BEFORE_RE = re.compile(_GAP + "+(?=[" + re.escape(_NO_SPACE_BEFORE) + "])")
_GAP_AFTER_RE = re.compile("(?<=[" + re.escape(_NO_SPACE_AFTER) + "])" + _GAP + "+")
_SPACE_RE = re.compile(r"[\s" + _GAP + "]+")

_BOOK_END_RE = re.compile(r"<div\b[^>]*/>")
_DROPPED_ELEMENTS_RE = re.compile(r"<(note|speaker)\b[^>]*>.*?</\1\s*>", re.S)
_TITLE_RE = re.compile(r"<title\b([^>]*)>(.*?)</title\s*>", re.S)
_TAG_RE = re.compile(r"<[^>]*>")

# RV1909 marks words added by the translators with <transChange type="added">; an enclitic pronoun added to
# a verb is glued to it in the source ("<w>sáca</w><transChange>lo</transChange> de") and is joined back into
# one word ("sácalo"). Only when the clitic is glued on the left and followed by a space, punctuation or the
# end. Names that happen to precede such a clitic are excepted ("Josué los circuncidó", Joshua 5:4).
CLITICS = ("lo", "la", "le", "los", "las", "les", "nos", "me", "te", "os", "se")
CLITIC_EXCEPTIONS = frozenset({"Josué"})
_CLITIC_RE = re.compile(r"(?<=\w)</w><transChange\b[^>]*>(" + "|".join(CLITICS) + r")</transChange>(?=[\s,.;:?!]|$)")
_WORD_END_RE = re.compile(r"\w+$")
_EID_RE, _BOOK_TYPE_RE = re.compile(r'\beID="'), re.compile(r'\btype="book"')
_CANONICAL_RE = re.compile(r'\bcanonical="true"')


def _join_clitic(m: re.Match) -> str:
    # the word the clitic is glued to: the letters just before </w> (a short look-back is enough)
    word = _WORD_END_RE.search(m.string[max(0, m.start() - 40):m.start()])
    if word is not None and word.group(0) in CLITIC_EXCEPTIONS:
        return m.group(0)
    return m.group(1) + "</w>"


def _is_book_end(tag: str) -> bool:
    return _EID_RE.search(tag) is not None and _BOOK_TYPE_RE.search(tag) is not None


def _title(m: re.Match) -> str:
    if _CANONICAL_RE.search(m.group(1)):  # a psalm superscription: part of the text (RV has it in v1)
        return _GAP + m.group(2) + _GAP
    return _GAP


def clean_osis(raw: str, join_clitics: bool = False) -> str:
    """One verse of OSIS markup -> plain text.

    1. Everything after the book's closing `<div eID=… type="book"/>` is cut (WEB appends its glossary to
       Revelation 22:21).
    2. With `join_clitics` (RV1909): enclitic pronouns in <transChange> rejoin their verb (see CLITICS).
    3. <note> (footnotes, cross-references) and <speaker> (Song of Solomon labels) go with their content;
       <title canonical="true"> (psalm superscriptions) keeps its text, other titles go.
    4. Every other tag (<w>, <q>, <l>, <lb/>, <div/>, <transChange>, milestones, ...) is removed; entities
       are decoded (&amp; -> &).
    5. Spacing: each removed piece leaves a gap. A gap touching punctuation that is never spaced on that side
       (before , . ; : ? ! ) ] » ” ’ — and after ( [ « “ ‘ ¿ ¡ —) disappears; any other gap becomes a space, so
       a note between two words never glues them. Whitespace is collapsed and the ends are stripped.
    """
    text = raw  # (the substring tests only skip work: each step is a no-op on a verse without that markup)
    if 'type="book"' in text:
        for m in _BOOK_END_RE.finditer(text):
            if _is_book_end(m.group(0)):
                text = text[:m.start()]
                break
    if join_clitics and "<transChange" in text:
        text = _CLITIC_RE.sub(_join_clitic, text)
    if "<note" in text or "<speaker" in text:
        text = _DROPPED_ELEMENTS_RE.sub(_GAP, text)
    if "<title" in text:
        text = _TITLE_RE.sub(_title, text)
    text = _TAG_RE.sub(_GAP, text)
    if "&" in text:
        text = html.unescape(text)
    text = _GAP_BEFORE_RE.sub("", text)
    text = _GAP_AFTER_RE.sub("", text)
    return _SPACE_RE.sub(" ", text).strip()


def clean_verses(raw: Dict[Ref, str], join_clitics: bool = False) -> Dict[Ref, str]:
    """clean_osis over a parsed dump; empty verses stay, as ''."""
    return {ref: clean_osis(text, join_clitics) for ref, text in raw.items()}


def load_module(module: str, join_clitics: bool = False, mod2imp: str = "mod2imp") -> Dict[Ref, str]:
    """{(book, chapter, verse): plain text} of every verse key of a SWORD module ('' for an empty verse)."""
    verses = parse_imp(run_mod2imp(module, mod2imp))
    if not verses:
        raise BibleFormatError(f"`mod2imp {module}` printed no verses; is the module complete? {INSTALL_HINT}")
    return clean_verses(verses, join_clitics)


# ------------------------------------------------------------------------------------ pairing and splitting
def book_order(*modules: Dict[Ref, str]) -> Dict[str, int]:
    """Rank of each book: CANONICAL_BOOKS first, then any other book in the order the modules list them."""
    rank = {book: i for i, book in enumerate(CANONICAL_BOOKS)}
    for verses in modules:
        for book, _c, _v in verses:
            rank.setdefault(book, len(rank))
    return rank


def last_verses(verses: Dict[Ref, str]) -> Dict[Tuple[str, int], int]:
    """{(book, chapter): number of its last non-empty verse} over the chapters with any text."""
    last: Dict[Tuple[str, int], int] = {}
    for (book, chapter, verse), text in verses.items():
        if text and verse > last.get((book, chapter), 0):
            last[(book, chapter)] = verse
    return last


@dataclass
class Alignment:
    """The outcome of `align`: the kept pairs and what was dropped, for the log and the manifest."""
    pairs: List[Pair]  # canonical order
    shared_books: List[str]  # books with text in both modules, canonical order
    only_src_books: List[str]
    only_tgt_books: List[str]
    empty_src: int  # references with target text only (source verse empty or absent)
    empty_tgt: int  # references with source text only
    mismatches: List[Tuple[str, int, int, int]]  # (book, chapter, last source verse, last target verse)
    excluded_chapters: List[Tuple[str, int]]  # chapters left out by the versification rule (existing ones)
    dropped_by_versification: int  # pairs with text on both sides in those chapters
    order: Dict[str, int] = field(default_factory=dict)

    @property
    def paired(self) -> int:
        """References with text on both sides, before the versification rule."""
        return len(self.pairs) + self.dropped_by_versification


def align(src: Dict[Ref, str], tgt: Dict[Ref, str]) -> Alignment:
    """Pairs two cleaned modules by reference (contract §5).

    A pair needs text on both sides. Then the versification rule: for every chapter of a book present in both
    modules, the number of the last non-empty verse is compared; where it differs (the two translations divide
    the chapter differently, which shifts the following verses against each other) the chapter and the next
    chapter of the same book are left out.
    """
    order = book_order(src, tgt)
    src_last, tgt_last = last_verses(src), last_verses(tgt)
    src_books, tgt_books = {b for b, _ in src_last}, {b for b, _ in tgt_last}
    shared = src_books & tgt_books

    def ranked(books: Iterable[str]) -> List[str]:
        return sorted(books, key=order.__getitem__)

    chapters = {bc for bc in set(src_last) | set(tgt_last) if bc[0] in shared}
    mismatches = sorted(((b, c, src_last.get((b, c), 0), tgt_last.get((b, c), 0)) for b, c in chapters
                         if src_last.get((b, c), 0) != tgt_last.get((b, c), 0)),
                        key=lambda m: (order[m[0]], m[1]))
    excluded = {(b, c + step) for b, c, _, _ in mismatches for step in (0, 1)}

    refs = sorted({ref for ref in (*src, *tgt) if ref[0] in shared}, key=lambda r: (order[r[0]], r[1], r[2]))
    pairs: List[Pair] = []
    empty_src = empty_tgt = dropped = 0
    existing = set()
    for ref in refs:
        existing.add(ref[:2])
        s, t = src.get(ref, ""), tgt.get(ref, "")
        if not s or not t:
            empty_src += bool(t)
            empty_tgt += bool(s)
        elif ref[:2] in excluded:
            dropped += 1
        else:
            pairs.append((ref, s, t))
    return Alignment(pairs=pairs, shared_books=ranked(shared), only_src_books=ranked(src_books - tgt_books),
                     only_tgt_books=ranked(tgt_books - src_books), empty_src=empty_src, empty_tgt=empty_tgt,
                     mismatches=mismatches,
                     excluded_chapters=sorted(excluded & existing, key=lambda bc: (order[bc[0]], bc[1])),
                     dropped_by_versification=dropped, order=order)


def split_of(book: str) -> str:
    """The split a book belongs to (contract §5)."""
    for split, books in SPLIT_BOOKS.items():
        if book in books:
            return split
    return "train"


def split_by_book(pairs: Sequence[Pair]) -> Dict[str, List[Pair]]:
    """{train, dev, test: pairs} by book (SPLIT_BOOKS), keeping the order of `pairs`."""
    out: Dict[str, List[Pair]] = {split: [] for split in SPLITS}
    for pair in pairs:
        out[split_of(pair[0][0])].append(pair)
    return out


# ------------------------------------------------------------------------------------------------ writing
def _write_lines(path: str, lines: Iterable[str]) -> None:
    with atomic_write(path) as f:
        for line in lines:
            f.write(line + "\n")


def _chapter(bc: Tuple[str, int]) -> str:
    return f"{bc[0]} {bc[1]}"


def prepare_bible(out_dir: str, log: Callable[[str], None] = print, mod2imp: str = "mod2imp") -> Dict[str, int]:
    """Writes the embedded corpus to out_dir and returns the pair count of each split (`dtmt prepare bible`: into
    data.prepare.staged_corpus's stage, which says what it wrote).

    Files: {train,dev,test}.{es,en} (aligned, one verse a line, canonical book order), {split}.ref (the
    reference of each line, "Genesis 1:1") and corpus.json (dtmt_models.data.corpus manifest, origin "bible").
    Raises BibleUnavailable (a RuntimeError) when mod2imp or a module is not installed.
    """
    modules = {}
    for lang, join in ((SRC_LANG, True), (TGT_LANG, False)):
        log(f"reading {MODULES[lang]} ({lang}) with {mod2imp}")
        modules[lang] = load_module(MODULES[lang], join_clitics=join, mod2imp=mod2imp)
    al = align(modules[SRC_LANG], modules[TGT_LANG])
    if al.only_src_books or al.only_tgt_books:
        log(f"books in one module only (not used): {SRC_LANG} {len(al.only_src_books)}, "
            f"{TGT_LANG} {len(al.only_tgt_books)} ({', '.join((al.only_src_books + al.only_tgt_books)[:4])}"
            f"{', ...' if len(al.only_src_books) + len(al.only_tgt_books) > 4 else ''})")
    log(f"{al.paired} verses of {len(al.shared_books)} shared books have text in both; dropped "
        f"{al.empty_src} with an empty {SRC_LANG} side and {al.empty_tgt} with an empty {TGT_LANG} side")
    listed = ", ".join(f"{b} {c} ({s}/{t})" for b, c, s, t in al.mismatches)
    log(f"versification: {len(al.mismatches)} chapters end on a different verse ({SRC_LANG}/{TGT_LANG}): "
        f"{listed or 'none'}; left out with the chapters after them: {len(al.excluded_chapters)} chapters, "
        f"{al.dropped_by_versification} pairs")
    missing = [b for books in SPLIT_BOOKS.values() for b in books if b not in al.shared_books]
    if missing:
        log(f"warning: books of the dev/test split missing from the modules: {', '.join(missing)}")

    splits = split_by_book(al.pairs)
    os.makedirs(out_dir, exist_ok=True)
    for split, pairs in splits.items():
        data.write_parallel([(s, t) for _, s, t in pairs], os.path.join(out_dir, f"{split}.{SRC_LANG}"),
                            os.path.join(out_dir, f"{split}.{TGT_LANG}"))
        _write_lines(os.path.join(out_dir, f"{split}.ref"), (format_ref(ref) for ref, _, _ in pairs))
    counts = {split: len(pairs) for split, pairs in splits.items()}
    data.write_manifest(
        out_dir, SRC_LANG, TGT_LANG, counts, origin="bible",
        modules=dict(MODULES), references={split: f"{split}.ref" for split in SPLITS},
        split_books={**{k: list(v) for k, v in SPLIT_BOOKS.items()}, "train": "the other books present in both"},
        pairs_with_text_on_both_sides=al.paired,
        dropped={f"empty_{SRC_LANG}": al.empty_src, f"empty_{TGT_LANG}": al.empty_tgt,
                 "versification": al.dropped_by_versification},
        versification_mismatches=[{"chapter": f"{b} {c}", f"last_{SRC_LANG}": s, f"last_{TGT_LANG}": t}
                                  for b, c, s, t in al.mismatches],
        excluded_chapters=[_chapter(bc) for bc in al.excluded_chapters])
    log("split by book: " + ", ".join(f"{split} {n:,}" for split, n in counts.items()) + " pairs")
    if counts != EXPECTED_COUNTS:
        log("note: docs/contract.md §5 expects " + ", ".join(f"{s} {n:,}" for s, n in EXPECTED_COUNTS.items())
            + " (with sword-text-sparv 2.60-1 and sword-text-web 426.0-1); the installed modules differ")
    return counts
