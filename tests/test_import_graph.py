"""The import graph of the two packages (issue 75 item 6): no cycles between modules and a layered package graph,
read from the sources (every `import` and `from ... import`, at module level or inside a function; a package is its
__init__). A module's import of its own enclosing packages is not counted: importing a submodule imports them
anyway, and a package's __init__ gathering its submodules is its facade, not a dependency back."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("dtmt_kernels", "dtmt_models")


def _modules():
    mods = {}
    for pkg in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    mods[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return mods


def _graph():
    """{module: the modules and packages it imports, but its own enclosing packages}."""
    mods = _modules()

    def known(name):
        while name and name not in mods:
            name = name.rsplit(".", 1)[0] if "." in name else ""
        return name

    edges = {}
    for m, path in mods.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = m if path.endswith("__init__.py") else m.rsplit(".", 1)[0]
                    for _ in range(node.level - 1):
                        base = base.rsplit(".", 1)[0]
                    base += "." + node.module if node.module else ""
                else:
                    base = node.module or ""
                targets |= {known(f"{base}.{a.name}") for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {known(a.name) for a in node.names}
        edges[m] = {t for t in targets if t and t != m and not m.startswith(t + ".")}
    return edges


def _cycles(edges):
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_a_cycle_is_found():
    """The check itself: a cycle through three modules is reported, a chain is not."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_packages_are_layered():
    """dtmt_kernels knows nothing of dtmt_models; within dtmt_models, the inference engine imports no model (the models
    build their forms from it), the models import neither decoding, training nor the command line, decoding does not import training or the command line, and the data layer none of them."""
    edges = _graph()
    below = {"dtmt_kernels": ("dtmt_models",),
             "dtmt_models.engine": ("dtmt_models.models", "dtmt_models.decoding", "dtmt_models.training",
                                    "dtmt_models.cli"),
             "dtmt_models.models": ("dtmt_models.decoding", "dtmt_models.training", "dtmt_models.cli"),
             "dtmt_models.decoding": ("dtmt_models.training", "dtmt_models.cli"),
             "dtmt_models.data": ("dtmt_models.models", "dtmt_models.decoding", "dtmt_models.training",
                                  "dtmt_models.cli")}
    wrong = [(m, t) for m, targets in edges.items() for t in targets for layer, banned in below.items()
             if (m == layer or m.startswith(layer + ".")) and any(t == b or t.startswith(b + ".") for b in banned)]
    assert wrong == []


# the inference engine's ops (dtmt_models/engine/ops.py, csrc/engine/registration.cpp)
ENGINE_OPS = ("attention_step", "key_exps", "readout_features", "rnmt_step", "rnmt_beam_search", "memory_encoder")


def test_the_kernels_know_nothing_of_nmt():
    """Issue 75 item 2: no module of dtmt_kernels and not the kernels' registration (csrc/registration.cpp) names an
    op of the inference engine; the engine registers them (csrc/engine/registration.cpp) and calls them."""
    named = []
    for folder, _, files in os.walk(os.path.join(ROOT, "dtmt_kernels")):
        named += [os.path.join(folder, f) for f in files if f.endswith(".py")]
    named.append(os.path.join(ROOT, "csrc", "registration.cpp"))
    found = []
    for path in named:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        found += [(os.path.relpath(path, ROOT), op) for op in ENGINE_OPS if op in text]
    assert found == []
    with open(os.path.join(ROOT, "csrc", "engine", "registration.cpp"), encoding="utf-8") as f:
        engine = f.read()
    assert all(f'm.def("{op}(' in engine and f'm.impl("{op}",' in engine for op in ENGINE_OPS)
