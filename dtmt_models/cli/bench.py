"""`dtmt bench NAME [options]`: runs benchmarks/bench_NAME.py (cells, train, decode, quality, ...) with its options;
`dtmt bench --list`: each benchmark with what it measures (the first line of its docstring).

The benchmark scripts live in a source checkout's benchmarks/ directory (scripts, not part of the installed
package): they are found next to the package (an editable install, as setup.sh makes) or, for a regular install,
in the current directory's benchmarks/ (run it from the checkout). Elsewhere the command says so.
"""
from __future__ import annotations

import os
import sys
import types
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # dtmt_models/cli/ -> the checkout


def bench_dir() -> Optional[str]:
    """The benchmarks/ of the checkout the package was installed from (editable), else of the current
    directory; None when neither has one."""
    for d in (os.path.join(ROOT, "benchmarks"), os.path.join(os.getcwd(), "benchmarks")):
        if os.path.isfile(os.path.join(d, "bench_cells.py")):
            return d
    return None


NOT_FOUND = ("none found: they are the scripts of a source checkout's benchmarks/; run `dtmt bench` from the "
             "checkout (or install it with `bash setup.sh`, editable)")


def available() -> List[str]:
    d = bench_dir()
    if d is None:
        return []
    return sorted(f[len("bench_"):-3] for f in os.listdir(d) if f.startswith("bench_") and f.endswith(".py"))


def summary(name: str, width: int = 100) -> str:
    """The first paragraph of benchmarks/bench_NAME.py's docstring on one line, cut at a word after about `width`
    characters; read without running the script."""
    import ast

    with open(os.path.join(bench_dir(), f"bench_{name}.py"), encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    text = " ".join(doc.strip().split("\n\n")[0].split())
    if not text:
        return "(no description)"
    return text if len(text) <= width else text[:text.rfind(" ", 0, width)] + " ..."


def run_script(path: str, argv: List[str]) -> None:
    """Runs the script at `path` as `__main__` with `sys.argv` = argv, as `python path ...` would but with argv[0]
    kept: its usage and errors then name `dtmt bench NAME` (runpy.run_path sets argv[0] to the path)."""
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec")
    module = types.ModuleType("__main__")
    module.__file__ = path
    saved_argv, saved_main = sys.argv, sys.modules.get("__main__")
    sys.argv, sys.modules["__main__"] = argv, module
    try:
        exec(code, module.__dict__)
    finally:
        sys.argv = saved_argv
        if saved_main is None:
            del sys.modules["__main__"]
        else:
            sys.modules["__main__"] = saved_main


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    names = available()
    if argv[:1] == ["--list"]:
        if argv[1:]:   # (they were ignored)
            print(f"dtmt bench: --list takes nothing more (got {' '.join(argv[1:])})", file=sys.stderr)
            return 2
        if not names:
            print(f"dtmt bench: {NOT_FOUND}", file=sys.stderr)
            return 2
        width = max(map(len, names))
        try:
            for name in names:
                print(f"{name:<{width}}  {summary(name)}", flush=True)
        except BrokenPipeError:   # `dtmt bench --list | head`: the reader has what it wanted
            sys.stdout = open(os.devnull, "w")
        return 0
    if not argv or argv[0] in ("-h", "--help"):   # without a NAME: the same text, as an error (status 2)
        print("usage: dtmt bench NAME [options]   (dtmt bench NAME --help for its options; dtmt bench --list: what "
              "each measures)\n"
              f"benchmarks: {', '.join(names) if names else NOT_FOUND}", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name = argv[0]
    if name not in names:
        print(f"dtmt bench: no benchmark {name!r}; choose one of {names} "
              f"(run from a source checkout: the scripts are in benchmarks/)", file=sys.stderr)
        return 2
    try:
        run_script(os.path.join(bench_dir(), f"bench_{name}.py"), [f"dtmt bench {name}", *argv[1:]])
    except SystemExit as exc:
        if isinstance(exc.code, str):   # a script's one-line refusal: shown, as Python shows it for a script
            print(exc.code, file=sys.stderr)
            return 1
        return int(exc.code or 0)
    return 0
