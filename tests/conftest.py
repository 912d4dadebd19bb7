import functools
import importlib.util
import os

import pytest
import torch
from hypothesis import settings
from torch.utils._python_dispatch import TorchDispatchMode

import dtmt_kernels as dk

# Hypothesis draws the same examples in every run (derived from each test), so that a red suite is a change's and
# not a draw's; `pytest --hypothesis-profile=explore` draws new ones (a failure it finds is then replayed from
# .hypothesis/ until fixed).
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("repeatable")


# Under pytest-xdist (the README's `-n auto`) each worker computes on one thread, and so do the commands the tests
# start: two workers of two threads each on two cores made the tests that train 4x slower (OpenMP's threads
# waiting for a core; test_pipeline.py 267 s against 66 on a 2-core Skylake-SP). Tests of other thread counts set
# theirs.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER is not None:
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"

# A run for one copy of the CPU loops (test_isa_copies.py) checks that the library loaded that copy: DTMT_CPU_ISA
# names one the CPU cannot run or the build lacks, and the library runs another with a warning.
EXPECT_CPU_ISA = os.environ.get("DTMT_EXPECT_CPU_ISA")
if EXPECT_CPU_ISA and "cpp" in dk.available_backends():
    from dtmt_kernels import _C

    if _C.cpu_isa() != EXPECT_CPU_ISA:
        raise RuntimeError(f"DTMT_EXPECT_CPU_ISA={EXPECT_CPU_ISA}, but the library runs the {_C.cpu_isa()} copy "
                           f"(DTMT_CPU_ISA={os.environ.get('DTMT_CPU_ISA')!r}; this CPU runs "
                           f"{', '.join(_C.supported_cpu_isas())})")

# The test files that take longest, run first under pytest-xdist, so that none is left running alone at the end.
# (The nvcc checks are two files, the device kernels' and the drivers' with the emulation, so that two workers
# share their minutes of one core each.)
LONGEST_FIRST = ("test_cuda_compile.py", "test_cuda_sources.py", "test_isa_copies.py", "test_benchmarks.py",
                 "test_train.py", "test_pipeline.py", "test_models.py", "test_custom_ops.py", "test_triton.py",
                 "test_cpp_kernels.py", "test_autocast.py")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """With -n and no --dist of the caller's: a worker takes a test file at a time (module fixtures such as the
    emulated CUDA extension built once), in collection order (pytest_collection_modifyitems: the longest files
    first; xdist's own order, by the number of tests in a file, started test_cuda_sources.py's five minutes of 13
    tests last)."""
    if getattr(config.option, "numprocesses", None) and not any(
            arg == "-d" or arg.startswith("--dist") for arg in config.invocation_params.args):
        config.option.dist = "loadfile"
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    # a test named test_gpu_* runs where `pytest -m gpu` selects it (gpu_session.sh) only if it carries the mark: one
    # left without it ran nowhere (test_gpu_persistent_stage_read_once_a_cluster, until 2026-12-01)
    unmarked = [item.nodeid for item in items if item.name.startswith("test_gpu_") and not item.get_closest_marker("gpu")]
    if unmarked:
        raise pytest.UsageError(f"tests named test_gpu_* without the gpu mark (gpu_session.sh would never run them): "
                                f"{unmarked}")
    if XDIST_WORKER is None:
        return
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: within a file, and among the other
    # files, the order stays


@pytest.fixture(autouse=True)
def nan_filled_empty_tensors():
    """Deterministic mode makes torch.empty (and the kernels' at::empty) return NaN-filled memory, so any
    output or buffer a kernel forgets to write shows up as NaN in the comparisons."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(previous)


@pytest.fixture(autouse=True)
def torch_threads_restored():
    """A test that runs a command in this process which sets torch's thread count (benchmarks with --threads in
    test_benchmarks, `dtmt train --threads 1` in test_train) left torch on that count:
    every later test ran on 1 thread instead of 2, minutes longer in all. The thread count is put back after each
    test."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def make_layer(cell, input_size, hidden_size, depth=0, layer_norm=False, bidirectional=False,
               dtype=torch.float64, seed=0, **kwargs):
    """A layer with every parameter (layer-norm gains and offsets too) drawn at random, so no term of the
    equations hides behind an initial 1 or 0."""
    torch.manual_seed(seed)
    if cell == "atr":
        layer = dk.nn.ATR(input_size, hidden_size, layer_norm=layer_norm, bidirectional=bidirectional, **kwargs)
    else:
        layer = dk.nn.DeepTransitionGRU(input_size, hidden_size, depth=depth, cell=cell, layer_norm=layer_norm,
                                        bidirectional=bidirectional, **kwargs)
    layer = layer.to(dtype)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "ln_weight" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(0.5 * torch.randn_like(p))
    return layer


def padding_mask(lengths, T, dtype=torch.float64):
    return (torch.arange(T).unsqueeze(1) < torch.as_tensor(lengths).unsqueeze(0)).to(dtype)


HAS_TRITON = importlib.util.find_spec("triton") is not None


def prepare_triton_interpreter() -> None:
    """Call before setting TRITON_INTERPRET=1: imports triton and its compiler front end now, in compiled mode,
    unless the variable was already set. triton decorates its own @jit library functions once, when it is first
    imported, interpreted or compiled by what TRITON_INTERPRET said then (torch itself may import triton at any
    moment, e.g. from torch._dynamo); imported first here, that library stays usable by the compiled-kernel tests
    later in the process, and the backend's interpreted kernels do not use it (dtmt_kernels/ops/transition/triton_kernels.py)."""
    if HAS_TRITON and os.environ.get("TRITON_INTERPRET") in (None, "", "0"):
        import triton.compiler.code_generator  # noqa: F401


def pytest_collection_finish(session):
    """Starts the slow compile checks of test_cuda_sources.py in the background when they are selected (they
    overlap the tests before them; see start_background_compiles)."""
    names = {item.name for item in session.items if getattr(getattr(item, "module", None), "__name__", "").endswith(
        "test_cuda_sources")}
    # under pytest-xdist each worker collects every test but runs some: a worker compiles only when it reaches a
    # compile test (_run_or_wait), else both would compile everything
    if names and not session.config.option.collectonly and XDIST_WORKER is None:
        import tempfile

        module = next(item.module for item in session.items
                      if getattr(getattr(item, "module", None), "__name__", "").endswith("test_cuda_sources"))
        session.config._dtmt_compile_dir = tempfile.mkdtemp(prefix="dtmt-compiles-")
        module.start_background_compiles(names, session.config._dtmt_compile_dir)
        session.config._dtmt_compile_module = module


def pytest_sessionfinish(session):
    module = getattr(session.config, "_dtmt_compile_module", None)
    if module is not None:
        import shutil

        module.stop_background_compiles()
        shutil.rmtree(session.config._dtmt_compile_dir, ignore_errors=True)


# A toy parallel corpus for tests that need real SentencePiece vocabularies and sentences to translate
# (test_serve, test_int8, test_benchmarks).
TOY_SRC = ["el perro come pan", "la casa es grande", "el gato duerme en la casa", "yo tengo un libro rojo",
           "ella lee el libro", "nosotros vamos a la playa", "el sol brilla", "la luna es blanca"]
TOY_TGT = ["the dog eats bread", "the house is big", "the cat sleeps in the house", "i have a red book",
           "she reads the book", "we go to the beach", "the sun shines", "the moon is white"]


def at_thread_counts(call, *counts):
    """[call() with torch on each of `counts` threads], the process's thread count restored afterwards."""
    from benchmarks.common import torch_threads

    results = []
    for threads in counts:
        with torch_threads(threads):
            results.append(call())
    return results


class RecordOps(TorchDispatchMode):
    """Records the dtmt ops called below autograd while it is active: `calls` {op: (args, kwargs)} of each op's
    first call, tensors detached and copied when called (a later in-place write cannot change them), and `counts`
    {op name: calls} of every call (test_custom_ops' opcheck of each op a system calls, op_fuzz.py's valid calls,
    bench_op_checks' workload); and of every op, of any namespace, `dispatched` {(op as "namespace.name", the dtype
    of its first tensor argument or None)} (which path a call took, in what precision)."""

    def __init__(self):
        super().__init__()
        self.calls, self.counts, self.dispatched = {}, {}, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        self.dispatched.add((str(func.overloadpacket), None if first is None else first.dtype))
        if func.namespace == "dtmt":
            name = func.__name__.split(".")[0]
            self.counts[name] = self.counts.get(name, 0) + 1
            if func not in self.calls:
                self.calls[func] = torch.utils._pytree.tree_map(
                    lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, (list(args), dict(kwargs)))
        return func(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def aten_gemm_reproducible(threads: int) -> bool:
    """Whether torch's own GEMM (ATen's addmm: the products of more rows than the small-row kernel's 8, in the
    layers and the decoding steps alike) gives on `threads` threads the bits it gives on one, wherever its operands
    lie. dtmt's own loops sum every output in a fixed order, so their results depend on neither; the BLAS under
    ATen promises neither: MKL on AMD EPYC (Zen 4) sums a small product in another order when its rows are not
    16-byte aligned (a step's rows inside a layer's saved [T, B, N] tensors, against the inference op's fresh
    buffers) and when it splits it between threads (docs/design/reproducibility.md). Tests that compare two
    computations of the same products hold them to the bit where this is True and to rounding where it is not.
    Probed once per thread count: small products with x at 16 placements 4 or 8 bytes apart."""
    from benchmarks.common import torch_threads

    g = torch.Generator().manual_seed(0)
    same = True
    for dtype in (torch.float32, torch.float64):
        for M, K, N in ((11, 10, 10), (11, 10, 30), (10, 16, 48), (9, 6, 20), (35, 16, 48)):
            x, w = torch.randn(M, K, generator=g, dtype=dtype), torch.randn(N, K, generator=g, dtype=dtype)
            b = torch.randn(N, generator=g, dtype=dtype)
            with torch_threads(1):
                want = torch.addmm(b, x, w.t())
            with torch_threads(threads):
                for offset in range(16):
                    xs = torch.empty(M * K + offset, dtype=dtype)[offset:].view(M, K).copy_(x)
                    same = same and torch.equal(torch.addmm(b, xs, w.t()), want)
    return same


def spread_weights(model, generator=None):
    """A freshly built model's random weights spread out (+ 0.5 N(0, 1) each; torch's global generator when
    `generator` is None) and EOS made less likely, so that its translations are long and differ between
    sentences; returns it in eval mode."""
    from dtmt_models.data.vocabulary import EOS

    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=generator))
        bias = [m.bias for n, m in model.named_modules() if n.endswith("output.proj")]
        if bias:
            bias[0][EOS] -= 1.0
    return model.eval()


def save_model(path, name, options, src_vocab, tgt_vocab, model):
    """Writes `model` as a translation checkpoint of system `name` built with `options`; returns the path."""
    from dtmt_models.models.checkpoint import save_checkpoint

    save_checkpoint(str(path), dict(model_name=name, model_options=options, src_vocab=src_vocab.proto,
                                    tgt_vocab=tgt_vocab.proto, model=model.state_dict()))
    return str(path)


def int8_linear_for(matrices, ties=None):
    """A stand-in for F.linear (monkeypatch it in): a product by one of `matrices` (recognised by value: the T-GRU
    stacks are copies) is the reference int8 product quantize.linear_int8 (activations and weights rounded per row,
    exact integer sums); any other is F.linear's as it was when this was made.

    `ties` (a RoundingTies, optional) is told of every int8 product's activations: the rows with one within its
    distance of a rounding tie, which a float difference of a few ulps before the product may round either way."""
    import torch.nn.functional as F

    from dtmt_kernels.ops.linear.quantize import linear_int8, quantize_rows

    float_linear = F.linear
    rounded = [(m, quantize_rows(m)) for m in matrices]

    def int8_linear(x, weight, bias=None):
        for m, (q, scale) in rounded:
            if weight.shape == m.shape and torch.equal(weight, m):
                rows = x.reshape(-1, x.shape[-1])
                if ties is not None:
                    ties.see(rows)
                return linear_int8(rows, q, scale, bias).view(*x.shape[:-1], -1)
        return float_linear(x, weight, bias)
    return int8_linear


class RoundingTies:
    """The rows of a batch whose int8 reference products (int8_linear_for) quantized an activation within `distance`
    (in units of its row's quantum) of a rounding tie, k + 1/2. Two computations of the same step that differ by a
    few ulps before such a product (another summation order: another instruction set's vectors, the reference
    backend's loops) may round that activation to neighbouring int8 values, and then the row's output differs by a
    whole quantum of the product, not by rounding: such rows are not compared from then on. The products' rows are
    the batch's (x [B, K] or [1, B, K]: every product of the recurrent systems' encoders and decoding steps)."""

    def __init__(self, batch: int, distance: float = 1e-3):
        self.distance = distance
        self.reset(batch)

    def reset(self, batch: int):
        """No row held, for a batch of `batch` rows."""
        self.batch, self.rows = batch, torch.zeros(batch, dtype=torch.bool)

    def see(self, x):
        from dtmt_kernels.ops.linear.quantize import quantize_activations

        if x.shape[0] != self.batch:
            raise AssertionError(f"RoundingTies: a product over {x.shape[0]} rows, not the batch's {self.batch}")
        _, x_scale = quantize_activations(x)
        r = x.detach().float() / x_scale[:, None]   # as quantize_activations divides, before it rounds
        self.rows |= ((r - r.floor() - 0.5).abs() < self.distance).any(1)

    def reorder(self, order):
        self.rows = self.rows[order]


def assert_decoders_step_alike(first, second, src, lengths, prevs, order, rtol, atol, attn_atol, ties=None):
    """Two decoders (encode / step / reorder) stepped in lockstep from the same source over the previous tokens
    `prevs` (one [B] tensor a step): the same log-probabilities, states s (rtol / atol) and head-averaged attention
    (rtol / attn_atol) after every step; both reordered by `order` after the second step.

    `ties` (a RoundingTies the second decoder's int8 products report to): a row that differs must be one it holds
    (an activation near a rounding tie at this step or before), and at most a quarter of the rows may differ (a
    mis-wired product makes them all differ)."""
    def close(x, y, rtol, atol):
        return torch.isclose(x, y, rtol=rtol, atol=atol).flatten(1).all(1)

    a, b = first.encode(src, lengths), second.encode(src, lengths)
    for t, prev in enumerate(prevs):
        lp_a, a = first.step(a, prev)
        lp_b, b = second.step(b, prev)
        if ties is None:
            torch.testing.assert_close(lp_a, lp_b, rtol=rtol, atol=atol)
            torch.testing.assert_close(a["s"], b["s"], rtol=rtol, atol=atol)
            torch.testing.assert_close(a["attn"], b["attn"], rtol=rtol, atol=attn_atol)
        else:
            same = close(lp_a, lp_b, rtol, atol) & close(a["s"], b["s"], rtol, atol) & close(
                a["attn"], b["attn"], rtol, attn_atol)
            differ = (~same).nonzero().flatten().tolist()
            assert not (~same & ~ties.rows).any(), (
                f"step {t}: rows {differ} differ, of which {(~same & ~ties.rows).nonzero().flatten().tolist()} had "
                "no activation near a rounding tie")
            assert len(differ) * 4 <= same.numel(), f"step {t}: rows {differ} of {same.numel()} differ"
        if t == 1:
            a, b = first.reorder(a, order), second.reorder(b, order)
            if ties is not None:
                ties.reorder(order)
