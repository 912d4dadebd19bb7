"""What the sources cite is in the repository: every docs/ page a docstring or comment names exists (with the
section it names, for the contract), and none cites the contract by the name of a file outside it ("SPEC")."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("dtmt_kernels", "dtmt_models", "csrc", "tests", "benchmarks")
EXTENSIONS = (".py", ".cpp", ".h", ".cu", ".cuh", ".sh")


def _sources():
    for top in SOURCES:
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d not in ("__pycache__", "out", "results")]
            for name in files:
                if name.endswith(EXTENSIONS):
                    path = os.path.join(folder, name)
                    with open(path, encoding="utf-8") as f:
                        yield os.path.relpath(path, ROOT), f.read()
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        yield "README.md", f.read()


def test_cited_docs_exist_and_the_contract_has_the_sections_cited():
    with open(os.path.join(ROOT, "docs", "contract.md"), encoding="utf-8") as f:
        sections = {int(n) for n in re.findall(r"^## (\d+)\. ", f.read(), re.M)}
    assert sections == set(range(1, 8))
    cited, missing, bad_sections = set(), [], []
    for path, text in _sources():
        if path == "tests/test_docs.py":
            continue
        for doc in re.findall(r"docs/[\w/.-]+?\.md", text):
            cited.add(doc)
            if not os.path.isfile(os.path.join(ROOT, doc)):
                missing.append((path, doc))
        for first, last in re.findall(r"contract §(\d+)(?:-(\d+))?", text):
            if int(first) not in sections or (last and int(last) not in sections):
                bad_sections.append((path, first, last))
        assert "SPEC §" not in text and "SPEC's" not in text, path
    assert not missing and not bad_sections, (missing, bad_sections)
    assert {"docs/contract.md", "docs/design/persistent_recurrence.md"} <= cited


def test_cited_design_note_sections_exist():
    """A citation `docs/design/NOTE.md, "Section"` (the title may wrap over a comment's lines) names one of that
    note's `##` sections."""
    titles, cited, missing = {}, 0, []
    for path, text in _sources():
        if path == "tests/test_docs.py":
            continue
        for note, quote, title in re.findall(r"docs/design/([\w-]+\.md),\s+([\"'])(.+?)\2", text, re.S):
            title = re.sub(r"\s*\n\s*(?:#|//)?\s*", " ", title)
            if note not in titles:
                with open(os.path.join(ROOT, "docs", "design", note), encoding="utf-8") as f:
                    titles[note] = set(re.findall(r"^## (.+?)\s*$", f.read(), re.M))
            cited += 1
            if title not in titles[note]:
                missing.append((path, note, title))
    assert cited >= 20 and not missing, missing


def _slug(title: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def test_the_pages_links_lead_somewhere():
    """Every relative link of the README, benchmarks/README.md and docs/ leads to a file or folder of the
    repository, and a link to a heading (#...) to one of that page's headings."""
    pages = ["README.md", os.path.join("benchmarks", "README.md")]
    for folder, _, files in os.walk(os.path.join(ROOT, "docs")):
        pages += [os.path.relpath(os.path.join(folder, f), ROOT) for f in files if f.endswith(".md")]
    broken, links = [], 0
    for page in pages:
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            text = f.read()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            links += 1
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path else \
                os.path.join(ROOT, page)
            if not os.path.exists(full):
                broken.append((page, target))
            elif anchor and full.endswith(".md"):
                with open(full, encoding="utf-8") as f:
                    heads = {_slug(h) for h in re.findall(r"^#+ (.+)$", f.read(), re.M)}
                if anchor not in heads:
                    broken.append((page, target))
    assert links >= 15 and not broken, broken
