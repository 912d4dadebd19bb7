#!/usr/bin/env python3
"""Prototype: extract verse text from SWORD modules via `mod2imp` (libsword-utils).

Standard library only.  Usage:
    python3 extract.py                # report for spaRV1909eb and engWEB2015eb
    python3 extract.py MODULE [REF]   # dump one module (or one reference)

Modules (Debian sword-text-sparv / sword-text-web, /usr/share/sword):
    spaRV1909eb  Reina Valera 1909, OSIS, UTF-8, Versification=KJV
    engWEB2015eb World English Bible + deuterocanon, OSIS, UTF-8, Versification=NRSVA
"""
from __future__ import annotations

import html
import re
import subprocess
import sys

REF_RE = re.compile(r"^(.+) (\d+):(\d+)$")

# Elements whose whole content is dropped (not part of the verse text).
#   note     : footnotes (placement="foot") and cross references (type="crossReference")
#   speaker  : WEB Song of Solomon speaker labels ("Beloved", "Friends", ...)
#   title    : only non-canonical titles are dropped (see _drop_titles);
#              canonical psalm superscriptions are kept, as RV1909 has them in verse 1 text.
DROP_ELEMENTS = ("note", "speaker")
DROP_RE = [re.compile(rf"<{t}\b[^>]*>.*?</{t}>", re.S) for t in DROP_ELEMENTS]
TITLE_RE = re.compile(r"<title\b([^>]*)>(.*?)</title>", re.S)
TAG_RE = re.compile(r"<[^>]*>")
WS_RE = re.compile(r"\s+")
# End of a book: WEB appends the Glossary (a non-biblical division) to Rev 22:21.
BOOK_END_RE = re.compile(r'<div\b[^>]*\beID="[^"]*"[^>]*type="book"[^>]*/>')


def run_mod2imp(module: str) -> str:
    """Return the full mod2imp dump (str). Takes < 0.5 s per module."""
    res = subprocess.run(["mod2imp", module], capture_output=True, check=True)
    return res.stdout.decode("utf-8")


def parse_imp(dump: str) -> dict[tuple[str, int, int], str]:
    """Parse `$$$Key` / text records into {(book, chapter, verse): raw_osis}.

    Skips module/testament headings and book/chapter intros (verse 0 or chapter 0).
    A record's text may in principle span several lines; lines are joined with a space.
    """
    out: dict[tuple[str, int, int], str] = {}
    key = None
    buf: list[str] = []

    def flush():
        if key is not None:
            out[key] = " ".join(buf)

    for line in dump.split("\n"):
        if line.startswith("$$$"):
            flush()
            buf = []
            m = REF_RE.match(line[3:])
            key = None
            if m:
                b, c, v = m.group(1), int(m.group(2)), int(m.group(3))
                if c > 0 and v > 0:
                    key = (b, c, v)
        elif key is not None:
            buf.append(line)
    flush()
    return out


def _title_sub(m: re.Match) -> str:
    attrs = m.group(1)
    if 'canonical="true"' in attrs:  # psalm superscription: keep text
        return SEP + m.group(2) + SEP
    return SEP


# RV1909: <transChange> holding an enclitic pronoun glued to the preceding verb
# ("<w>sáca</w><transChange>lo</transChange> ") -> one word "sácalo".  Only when the
# clitic is glued on the left and followed by space/punctuation (~95 joins); the one
# proper-noun false positive found ("Josué|los circuncidó", Jos 5:4) is excluded.
CLITIC_RE = re.compile(
    r'([^\s>])(?<!Josué)</w><transChange type="added">(lo|la|le|los|las|les|nos|me|te|os|se)</transChange>'
    r'(?=[\s,.;:!?]|$)')
SEP = "\x00"  # placeholder for a removed tag/element
NO_SPACE_BEFORE = re.compile(SEP + r"+(?=[,.;:!?)\]»”’—])")
NO_SPACE_AFTER = re.compile(r"(?<=[(\[«“‘¿¡—])" + SEP + "+")


def clean(raw: str) -> str:
    """OSIS verse -> plain text.

    Every removed element/tag becomes a separator (so words never get glued when a
    note or tag sat between them); separators touching punctuation that never has a
    space on that side in the source (, . ; : ? ! ) ” ’ — / ( “ ‘ ¿ ¡ —) are dropped;
    the rest become spaces and whitespace is collapsed.
    """
    t = raw
    m = BOOK_END_RE.search(t)
    if m:
        t = t[: m.start()]
    t = CLITIC_RE.sub(r"\1\2</w>", t)
    for rx in DROP_RE:
        t = rx.sub(SEP, t)
    t = TITLE_RE.sub(_title_sub, t)
    t = TAG_RE.sub(SEP, t)  # <w>, <q>, <l>, <lb/>, <div/>, <transChange>, milestones ...
    t = html.unescape(t)  # &amp; etc.
    t = NO_SPACE_BEFORE.sub("", t)
    t = NO_SPACE_AFTER.sub("", t)
    t = t.replace(SEP, " ")
    return WS_RE.sub(" ", t).strip()


def load(module: str) -> dict[tuple[str, int, int], str]:
    """{(book, chapter, verse): clean_text} for every verse key, '' when empty."""
    raw = parse_imp(run_mod2imp(module))
    return {k: clean(v) for k, v in raw.items()}


def book_order(verses: dict) -> list[str]:
    seen: dict[str, None] = {}
    for (b, _c, _v) in verses:  # dicts keep mod2imp (canonical) order
        seen.setdefault(b)
    return list(seen)


if __name__ == "__main__":
    if len(sys.argv) >= 2:
        vs = load(sys.argv[1])
        want = sys.argv[2] if len(sys.argv) > 2 else None
        for (b, c, v), t in vs.items():
            ref = f"{b} {c}:{v}"
            if want is None or ref == want:
                print(f"{ref}\t{t}")
        sys.exit(0)
    for mod in ("spaRV1909eb", "engWEB2015eb"):
        vs = load(mod)
        ne = {k: t for k, t in vs.items() if t}
        print(f"== {mod}: {len(vs)} verse keys, {len(ne)} non-empty")
        print("books:", "; ".join(book_order(ne)))
        for ref in [("Genesis", 1, 1), ("Genesis", 1, 2), ("Genesis", 1, 3),
                    ("John", 3, 16), ("Acts", 1, 1)]:
            print(f"  {ref[0]} {ref[1]}:{ref[2]}: {vs.get(ref)}")
