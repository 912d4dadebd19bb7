"""The Triton backend against the reference.

Without a GPU the kernels run in triton's CPU interpreter (TRITON_INTERPRET=1, set for this module only by
the `interpreter` fixture and restored afterwards, so the rest of the suite sees the environment it started
with). triton.jit decides between compiling and interpreting when a kernel is decorated; the backend
re-imports its kernels module whenever the setting changes (dtmt_kernels/ops/transition/triton.py:_kernels), so it does
not matter what imported triton or the kernels earlier in the process. The interpreter is slow: sizes here
are tiny (T <= 4, B <= 3, H <= 17).

Tests marked `gpu` run the compiled kernels on a CUDA device and skip without one.
"""
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import dtmt_kernels as dk
from dtmt_kernels import functional as Fn

from conftest import HAS_TRITON, make_layer, padding_mask, prepare_triton_interpreter

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
needs_gpu = [pytest.mark.gpu, needs_triton,
             pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CASES = [(cell, depth) for cell in ("gru", "lgru", "lau") for depth in (0, 2)] + [("atr", 0)]
CASE_IDS = [f"{c}-d{d}" for c, d in CASES]


def _triton_library_compiled() -> bool:
    """Whether triton's own @jit library functions were decorated for compilation (they are decorated once,
    when triton is first imported, by whatever TRITON_INTERPRET said then)."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    return isinstance(getattr(tl.standard, "_sum_combine", None), JITFunction)


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    old = os.environ.get("TRITON_INTERPRET")
    prepare_triton_interpreter()
    os.environ["TRITON_INTERPRET"] = "1"
    yield
    if old is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = old


@pytest.fixture
def compiled(monkeypatch):
    """For the tests of compiled kernels: compile them instead of interpreting them."""
    if not _triton_library_compiled():
        if torch.cuda.is_available():  # on a GPU machine a skip here would hide that nothing was compiled
            pytest.fail("triton was first imported with TRITON_INTERPRET=1: unset it to run the GPU tests")
        pytest.skip("triton was first imported with TRITON_INTERPRET=1 in this process: its library functions "
                    "are interpreted, so nothing can be compiled here (run this test without the variable)")
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _run(layer, x, h0, mask, drop, reverse, backend, g_out=None, g_h=None):
    """Output, final state and the gradients of x, h0 and every parameter of one direction of `layer` for
    the loss <out, g_out> + <h_n, g_h>."""
    names = [n for n, _ in layer.named_parameters()]
    xi = x.detach().clone().requires_grad_()
    hi = h0.detach().clone().requires_grad_()
    params = [p.detach().clone().requires_grad_() for p in layer.parameters()]
    w = layer.direction_weights(0, dict(zip(names, params)))
    out, h_n = Fn.transition_sequence(xi, hi, w, mask, drop, reverse, backend)
    if g_out is None:
        gen = torch.Generator().manual_seed(11)
        g_out = torch.randn(out.shape, generator=gen).to(out)
        g_h = torch.randn(h_n.shape, generator=gen).to(h_n)
    ((out.float() * g_out.float()).sum() + (h_n.float() * g_h.float()).sum()).backward()
    names = ["out", "h_n", "dx", "dh0"] + [f"d{n}" for n in names]
    return dict(zip(names, [out, h_n, xi.grad, hi.grad] + [p.grad for p in params])), (g_out, g_h)


def _assert_matches(got, ref, atol, rtol):
    assert got.keys() == ref.keys()
    for name in ref:
        g, r = got[name], ref[name]
        assert g is not None and torch.isfinite(g).all(), name
        scale = max(1.0, r.abs().max().item())
        torch.testing.assert_close(g.to(r.dtype), r, atol=atol * scale, rtol=rtol, msg=lambda m: f"{name}: {m}")


@needs_triton
@pytest.mark.parametrize("cell,depth", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("layer_norm", [False, True], ids=["noln", "ln"])
@pytest.mark.parametrize("masked", [False, True], ids=["full", "masked"])
@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
def test_matches_reference_float64(cell, depth, layer_norm, masked, reverse):
    """Outputs, h_n and all gradients (x, h0, every parameter) in float64 (the interpreter computes in
    float64 for float64 inputs, so agreement is to rounding)."""
    T, B, I, H = 3, 3, 3, 5
    layer = make_layer(cell, I, H, depth=depth, layer_norm=layer_norm)
    torch.manual_seed(1)
    x = torch.randn(T, B, I, dtype=torch.double)
    h0 = torch.randn(B, H, dtype=torch.double)
    mask = padding_mask([3, 2, 1], T) if masked else None
    ref, g = _run(layer, x, h0, mask, None, reverse, "reference")
    got, _ = _run(layer, x, h0, mask, None, reverse, "triton", *g)
    _assert_matches(got, ref, atol=1e-12, rtol=1e-10)


@needs_triton
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cell_depth=st.sampled_from(CASES), layer_norm=st.booleans(), T=st.integers(1, 4), B=st.integers(1, 3),
       I=st.integers(1, 5), H=st.integers(1, 12), reverse=st.booleans(), data=st.data())
def test_random_configurations(cell_depth, layer_norm, T, B, I, H, reverse, data):
    cell, depth = cell_depth
    lengths = data.draw(st.one_of(st.none(), st.lists(st.integers(1, T), min_size=B, max_size=B)))
    layer = make_layer(cell, I, H, depth=depth, layer_norm=layer_norm)
    x = torch.randn(T, B, I, dtype=torch.double)
    h0 = torch.randn(B, H, dtype=torch.double)
    mask = None if lengths is None else padding_mask(lengths, T)
    ref, g = _run(layer, x, h0, mask, None, reverse, "reference")
    got, _ = _run(layer, x, h0, mask, None, reverse, "triton", *g)
    _assert_matches(got, ref, atol=1e-12, rtol=1e-10)


@needs_triton
@pytest.mark.parametrize("cell,depth", [("gru", 1), ("lgru", 2), ("lau", 1)])
@pytest.mark.parametrize("layer_norm", [False, True], ids=["noln", "ln"])
def test_candidate_dropout(cell, depth, layer_norm):
    T, B, I, H = 3, 2, 3, 4
    layer = make_layer(cell, I, H, depth=depth, layer_norm=layer_norm)
    torch.manual_seed(2)
    drop = (torch.rand(depth + 1, B, H, dtype=torch.double) > 0.3).double() / 0.7
    x = torch.randn(T, B, I, dtype=torch.double)
    h0 = torch.randn(B, H, dtype=torch.double)
    mask = padding_mask([3, 2], T)
    ref, g = _run(layer, x, h0, mask, drop, True, "reference")
    got, _ = _run(layer, x, h0, mask, drop, True, "triton", *g)
    _assert_matches(got, ref, atol=1e-12, rtol=1e-10)


def _short(t, dim=0):
    return t.narrow(dim, 0, t.shape[dim] - 1)


# (what is wrong, argument index in the forward op's arguments (x, h0, mask, drop, kind, ten parameters, reverse,
# eps) -> its new value, the message)
BAD_TRITON_ARGUMENTS = [
    ("mask-batch", lambda a: {2: _short(a[2], 1)}, "mask must be [3, 3], got [3, 2]"),
    ("drop-depth", lambda a: {3: _short(a[3])}, "drop must be [2, 3, 5], got [1, 3, 5]"),
    ("drop-batch", lambda a: {3: _short(a[3], 1)}, "drop must be [2, 3, 5], got [2, 2, 5]"),
    ("h0-batch", lambda a: {1: a[1][:1]}, "h0 must be [3, 5], got [1, 5]"),
    ("h0-width", lambda a: {1: _short(a[1], 1)}, "h0 must be [3, 5], got [3, 4]"),
    ("b_hh", lambda a: {8: _short(a[8])}, "b_hh must be [20], got [19]"),
    ("b_hh-empty", lambda a: {8: a[8][:0]}, "b_hh must be [20], got [0]"),
    ("ln_w", lambda a: {9: _short(a[9])}, "ln_w must be [15], got [14]"),
    ("t_b", lambda a: {12: _short(a[12], 1)}, "t_b must be [1, 15], got [1, 14]"),
    ("t_ln_b", lambda a: {14: _short(a[14], 1)}, "t_ln_b must be [1, 10], got [1, 9]"),
    ("w_ih-width", lambda a: {5: _short(a[5], 1)}, "w_ih must be [25, 3] (H = 5), got [25, 2]"),
    ("w_hh", lambda a: {7: _short(a[7])}, "w_hh must be [4 * H, H] for this cell, got [19, 5]"),
    ("int-drop", lambda a: {3: a[3].long()}, "drop must be a floating-point tensor, got torch.int64"),
    ("w_ih-dtype", lambda a: {5: a[5].float()}, "w_ih must have x's dtype torch.float64, got torch.float32"),
    ("b_hh-dtype", lambda a: {8: a[8].float()}, "b_hh must have x's dtype torch.float64, got torch.float32"),
    ("t_w-dtype", lambda a: {11: a[11].half()}, "t_w must have x's dtype torch.float64, got torch.float16"),
    # (the layer norms, the dropout mask and h0 too, as the C++ op: converted there, refused by the reference)
    ("ln_w-dtype", lambda a: {9: a[9].half()}, "ln_w must have x's dtype torch.float64, got torch.float16"),
    ("t_ln_b-dtype", lambda a: {14: a[14].float()}, "t_ln_b must have x's dtype torch.float64, got torch.float32"),
    ("drop-dtype", lambda a: {3: a[3].float()}, "drop must have x's dtype torch.float64, got torch.float32"),
    ("h0-dtype", lambda a: {1: a[1].float()}, "h0 must have x's dtype torch.float64, got torch.float32"),
    ("kind", lambda a: {4: 4}, "kind 4 (tgru) is not a base cell"),
    ("x-rank", lambda a: {0: a[0][0]}, "x must be [T, B, I], got [3, 3]"),
    ("eps-nan", lambda a: {16: float("nan")}, "eps must be a finite number >= 0, got nan"),
    ("eps-negative", lambda a: {16: -1e-5}, "eps must be a finite number >= 0, got -1e-05"),
    ("complex-mask", lambda a: {2: a[2].to(torch.complex128)},   # (Triton's KeyError; the C++ op read its real part)
     "mask must be bool or floating point (1 a real step, 0 padding), got torch.complex128"),
]


@needs_triton
@pytest.mark.parametrize("what,change,message", BAD_TRITON_ARGUMENTS, ids=[c[0] for c in BAD_TRITON_ARGUMENTS])
def test_triton_ops_refuse_bad_arguments(what, change, message):
    """The Triton ops (public, as torch.ops.dtmt.transition_forward_triton / _backward_triton) check what the C++
    op checks before a launch: a short mask, dropout mask, bias or layer-norm gain was read past its end and a short h0
    broadcast, without a word. Now a RuntimeError naming the op and the argument, forward and backward."""
    import re
    from dtmt_kernels.ops.transition import KINDS, flat_params

    T, B, H = 3, 3, 5
    layer = make_layer("lgru", 3, H, depth=1, layer_norm=True)
    x, h0 = torch.randn(T, B, 3, dtype=torch.double), torch.randn(B, H, dtype=torch.double)
    drop = torch.ones(2, B, H, dtype=torch.double)
    args = [x, h0, padding_mask([3, 2, 1], T), drop, KINDS["lgru"], *flat_params(layer.direction_weights(0)),
            False, 1e-5]
    out, h_n, *saved = torch.ops.dtmt.transition_forward_triton(*args)
    for i, v in change(args).items():
        args[i] = v
    with pytest.raises(RuntimeError, match=re.escape(f"dtmt::transition_forward_triton: {message}")):
        torch.ops.dtmt.transition_forward_triton(*args)
    message = message.replace("h0 ", "grad_hn ")   # (the backward's grad_hn has h0's shape)
    with pytest.raises(RuntimeError, match=re.escape(f"dtmt::transition_backward_triton: {message}")):
        torch.ops.dtmt.transition_backward_triton(out, args[1], *args[:1], *args[2:-2], *saved, *args[-2:])


@needs_triton
@pytest.mark.parametrize("what,change,message", BAD_TRITON_ARGUMENTS, ids=[c[0] for c in BAD_TRITON_ARGUMENTS])
def test_the_forward_fakes_refuse_what_the_kernels_refuse(what, change, message):
    """A meta call (or a torch.compile / export trace) runs only the op's fake: the forward ops' fakes had checked
    the shapes of the outputs alone, and took a short mask or dropout mask, a float32 weight beside a float64 x, an
    int64 x or a NaN eps that the kernels refuse (found only when the traced program ran). Both fakes now refuse each
    bad argument as their kernels do: the Triton op's with its own message, the C++ op's as its CPU kernel."""
    import re
    from dtmt_kernels.ops.transition import KINDS, flat_params

    T, B, H = 3, 3, 5
    layer = make_layer("lgru", 3, H, depth=1, layer_norm=True)
    x, h0 = torch.randn(T, B, 3, dtype=torch.double), torch.randn(B, H, dtype=torch.double)
    args = [x, h0, padding_mask([3, 2, 1], T), torch.ones(2, B, H, dtype=torch.double), KINDS["lgru"],
            *[p.detach() for p in flat_params(layer.direction_weights(0))], False, 1e-5]
    for i, v in change(args).items():
        args[i] = v
    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
    with pytest.raises(RuntimeError, match=re.escape(f"dtmt::transition_forward_triton: {message}")):
        torch.ops.dtmt.transition_forward_triton(*meta)
    for call in (args, meta):   # (the C++ op: its CPU kernel, and its fake)
        if what == "b_hh-empty":   # (the C++ op's form of no bias: taken by both)
            assert list(torch.ops.dtmt.transition_forward(*call)[0].shape) == [T, B, H]
            continue
        with pytest.raises(RuntimeError, match=r"^dtmt::transition_forward: "):
            torch.ops.dtmt.transition_forward(*call)


@needs_triton
def test_triton_ops_refuse_tensors_on_two_devices():
    """The Triton ops' own bodies check that every tensor is on one device, as their fakes and the C++ op do (a call
    with a meta tensor among CPU ones reaches the fake; a CUDA x with a CPU mask reaches the body, which had gone on to
    the launch): a mask on another device than x is a one-line RuntimeError naming the op, forward and backward."""
    import re
    from dtmt_kernels.ops.transition import KINDS, flat_params
    from dtmt_kernels.ops.transition.triton import transition_backward_triton, transition_forward_triton

    T, B, H = 3, 3, 5
    layer = make_layer("lgru", 3, H, depth=1, layer_norm=True)
    x, h0 = torch.randn(T, B, 3, dtype=torch.double), torch.randn(B, H, dtype=torch.double)
    params = [None if p is None else p.detach() for p in flat_params(layer.direction_weights(0))]
    args = [x, h0, padding_mask([3, 2, 1], T), None, KINDS["lgru"], *params, False, 1e-5]
    out, h_n, *saved = torch.ops.dtmt.transition_forward_triton(*args)
    args[2] = args[2].to("meta")   # (the op's body, as the dispatcher runs it for a CUDA x beside a CPU mask)
    for op, call in (("forward", lambda: transition_forward_triton._init_fn(*args)),
                     ("backward", lambda: transition_backward_triton._init_fn(out, h_n, *args[:1], *args[2:-2],
                                                                              *saved, *args[-2:]))):
        with pytest.raises(RuntimeError, match=re.escape(f"dtmt::transition_{op}_triton: every tensor must be on "
                                                         f"one device, got ['cpu', 'meta']")):
            call()


@needs_triton
def test_a_mask_that_needs_a_gradient_is_refused_by_the_raw_ops():
    """The ops' backwards form no gradient for the mask or the dropout mask: a raw op's call with one that requires
    grad left its .grad None without a word (the layers refused it; the reference backend gives one). Both forward
    ops refuse it where a graph is recorded, and run it without one."""
    import re
    from dtmt_kernels.ops.transition import KINDS, flat_params

    T, B, H = 3, 2, 4
    layer = make_layer("lgru", 3, H, depth=1, layer_norm=True)
    params = [p.detach() for p in flat_params(layer.direction_weights(0))]
    x, h0 = torch.randn(T, B, 3, dtype=torch.double, requires_grad=True), torch.randn(B, H, dtype=torch.double)
    mask, drop = padding_mask([3, 2], T), torch.ones(2, B, H, dtype=torch.double)
    for op in ("transition_forward", "transition_forward_triton"):
        f = getattr(torch.ops.dtmt, op)
        for name, m, d in (("mask", mask.clone().requires_grad_(), drop),
                           ("drop", mask, drop.clone().requires_grad_())):
            with pytest.raises(RuntimeError, match=re.escape(f"dtmt::{op}: {name} requires grad, but the fused "
                                                             f"kernels form no gradient for the")):
                f(x, h0, m, d, KINDS["lgru"], *params, False, 1e-5)
            with torch.no_grad():
                out = f(x, h0, m, d, KINDS["lgru"], *params, False, 1e-5)[0]
            torch.testing.assert_close(out, f(x, h0, mask, drop, KINDS["lgru"], *params, False, 1e-5)[0])


@needs_triton
@pytest.mark.parametrize("which", [0, 1, 4], ids=["xp", "hs", "hpt"])
def test_triton_backward_refuses_saved_tensors_of_other_sizes(which):
    """The backward op's saved tensors (xp, hs, hs_lp, hp, hpt) against x and the weights, as the C++ op's."""
    from dtmt_kernels.ops.transition import KINDS, flat_params

    T, B, H = 3, 2, 4
    layer = make_layer("gru", 3, H, depth=1)
    x, h0 = torch.randn(T, B, 3, dtype=torch.double), torch.randn(B, H, dtype=torch.double)
    params = flat_params(layer.direction_weights(0))
    out, h_n, *saved = torch.ops.dtmt.transition_forward_triton(x, h0, None, None, KINDS["gru"], *params, False, 1e-5)
    saved[which] = _short(saved[which], saved[which].dim() - 1)
    name = ("xp", "hs", "hs_lp", "hp", "hpt")[which]
    with pytest.raises(RuntimeError, match=f"dtmt::transition_backward_triton: {name} must be "):
        torch.ops.dtmt.transition_backward_triton(out, h_n, x, None, None, KINDS["gru"], *params, *saved, False,
                                                  1e-5)


@needs_triton
@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
def test_triton_ops_of_no_steps(reverse):
    """x of T = 0 steps (the C++ op returns h_n = h0 and dh0 = grad_hn): the forward indexed the first of no steps
    (IndexError) and the backward added an unfilled product to dh0. Now the C++ op's results."""
    from dtmt_kernels.ops.transition import KINDS, flat_params

    B, H = 3, 5
    layer = make_layer("lgru", 3, H, depth=1, layer_norm=True)
    x, h0, g_h = torch.randn(0, B, 3, dtype=torch.double), torch.randn(B, H, dtype=torch.double), torch.randn(B, H)
    params = flat_params(layer.direction_weights(0))
    out, h_n, *saved = torch.ops.dtmt.transition_forward_triton(x, h0, None, None, KINDS["lgru"], *params, reverse,
                                                                1e-5)
    assert out.shape == (0, B, H)
    torch.testing.assert_close(h_n, h0, rtol=0, atol=0)
    g_h = g_h.double()
    grads = torch.ops.dtmt.transition_backward_triton(out, g_h, x, None, None, KINDS["lgru"], *params, *saved,
                                                      reverse, 1e-5)
    assert grads[0].shape == (0, B, 3)
    torch.testing.assert_close(grads[1], g_h, rtol=0, atol=0)
    for g, p in zip(grads[2:], params):
        if p is not None:
            torch.testing.assert_close(g, torch.zeros_like(p), rtol=0, atol=0)


@needs_triton
def test_strided_mask_and_dropout():
    """A mask [T, B] and a dropout mask [D+1, B, H] that are transposed views (not contiguous): the backward op got
    them from autograd as the caller gave them and its kernels read them as contiguous, wrong gradients without a
    word; now the reference's gradients."""
    T, B, I, H = 4, 3, 3, 5
    layer = make_layer("gru", I, H, depth=1, layer_norm=True)
    torch.manual_seed(5)
    x, h0 = torch.randn(T, B, I, dtype=torch.double), torch.randn(B, H, dtype=torch.double)
    mask = padding_mask([4, 2, 1], T).t().contiguous().t()
    drop = ((torch.rand(B, 2, H, dtype=torch.double) > 0.3).double() / 0.7).transpose(0, 1)
    assert not mask.is_contiguous() and not drop.is_contiguous()
    ref, g = _run(layer, x, h0, mask, drop, False, "reference")
    got, _ = _run(layer, x, h0, mask, drop, False, "triton", *g)
    _assert_matches(got, ref, atol=1e-12, rtol=1e-10)


@needs_triton
@pytest.mark.parametrize("cell,depth,layer_norm", [("lgru", 1, True), ("gru", 0, False), ("atr", 0, True)])
@pytest.mark.parametrize("H", [1, 17])
def test_float32_odd_hidden_sizes(cell, depth, layer_norm, H):
    """H that is not a power of two (masked lanes in the row reductions) and H=1."""
    T, B, I = 4, 3, 5
    layer = make_layer(cell, I, H, depth=depth, layer_norm=layer_norm, dtype=torch.float32)
    torch.manual_seed(3)
    x, h0 = torch.randn(T, B, I), torch.randn(B, H)
    mask = padding_mask([4, 1, 3], T, torch.float32)
    ref, g = _run(layer, x, h0, mask, None, False, "reference")
    got, _ = _run(layer, x, h0, mask, None, False, "triton", *g)
    _assert_matches(got, ref, atol=2e-5, rtol=1e-4)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cell,depth,layer_norm", [("lgru", 2, True), ("gru", 0, False), ("atr", 0, True)],
                         ids=["lgru-d2-ln", "gru-d0", "atr-ln"])
def test_low_precision_inputs(dtype, cell, depth, layer_norm):
    """16-bit inputs and parameters against the float32 reference: the error (relative to each tensor's
    largest entry) is within the format's precision and no worse than the eager reference run in the same
    16-bit dtype (float32 state and statistics should make the kernels at least as accurate)."""
    T, B, I, H = 4, 3, 4, 8
    layer = make_layer(cell, I, H, depth=depth, layer_norm=layer_norm, dtype=torch.float32)
    torch.manual_seed(4)
    x, h0 = torch.randn(T, B, I), torch.randn(B, H)
    mask = padding_mask([4, 2, 3], T, torch.float32)
    ref, g = _run(layer, x, h0, mask, None, True, "reference")
    low = layer.to(dtype)
    got, _ = _run(low, x.to(dtype), h0.to(dtype), mask.to(dtype), None, True, "triton", *g)
    eager, _ = _run(low, x.to(dtype), h0.to(dtype), mask.to(dtype), None, True, "reference", *g)
    tol = 4e-2 if dtype == torch.bfloat16 else 5e-3
    for name in ref:
        assert got[name].dtype == dtype, name
        scale = ref[name].abs().max().item() + 1e-3
        err = (got[name].float() - ref[name]).abs().max().item() / scale
        err_eager = (eager[name].float() - ref[name]).abs().max().item() / scale
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol}"
        assert err <= 2 * err_eager + tol / 4, f"{name}: {err:.2e} vs eager {dtype} reference {err_eager:.2e}"


@needs_triton
@pytest.mark.parametrize("cell,depth", [("lgru", 2), ("lau", 0), ("atr", 0)])
def test_single_step_cell(cell, depth):
    """The single-step op (decoder use, T=1) through the public cell, with its gradients."""
    torch.manual_seed(5)
    if cell == "atr":
        step = dk.nn.ATRCell(4, 6, layer_norm=True, backend="triton").double()
    else:
        step = dk.nn.DeepTransitionGRUCell(4, 6, depth=depth, cell=cell, layer_norm=True, backend="triton").double()
    with torch.no_grad():
        for p in step.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(3, 4, dtype=torch.double, requires_grad=True)
    h = torch.randn(3, 6, dtype=torch.double, requires_grad=True)
    results = {}
    for backend in ("reference", "triton"):
        step.backend = backend
        h1 = step(x, h)
        results[backend] = [h1, *torch.autograd.grad(h1.pow(2).sum(), [x, h, *step.parameters()])]
    for a, b in zip(results["reference"], results["triton"]):
        torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-10)


@needs_triton
def test_gradients_are_deterministic():
    """Bias and layer-norm gradients are column sums of per-row values (no atomics): two runs agree bitwise."""
    layer = make_layer("lgru", 3, 8, depth=1, layer_norm=True, dtype=torch.float32)
    torch.manual_seed(6)
    x, h0 = torch.randn(3, 3, 3), torch.randn(3, 8)
    mask = padding_mask([3, 1, 2], 3, torch.float32)
    first, g = _run(layer, x, h0, mask, None, False, "triton")
    second, _ = _run(layer, x, h0, mask, None, False, "triton", *g)
    for name in first:
        assert torch.equal(first[name], second[name]), name


@needs_triton
def test_triton_op_passes_opcheck():
    """dtmt::transition_forward_triton (torch.library.custom_op) in the interpreter: schema, fake implementation
    against the kernels, the autograd it shares with the C++ op, AOT dispatch. (Its gradients against the
    reference: the tests above.)"""
    from dtmt_kernels.ops.transition import KINDS, flat_params

    layer = make_layer("lgru", 3, 5, depth=1, layer_norm=True, dtype=torch.float64)
    torch.manual_seed(2)
    params = [None if p is None else p.detach().clone().requires_grad_()
              for p in flat_params(layer.direction_weights(0))]
    x = torch.randn(2, 2, 3, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    args = (x, h0, padding_mask([2, 1], 2, torch.float64), None, KINDS["lgru"], *params, True, 1e-5)
    torch.library.opcheck(torch.ops.dtmt.transition_forward_triton.default, args)


@needs_triton
def test_layers_end_to_end():
    """The public layers with backend="triton" on CPU tensors (interpreter): bidirectional, batch_first,
    lengths; same outputs and gradients as the reference backend; and the registry tells the truth."""
    assert "triton" in dk.available_backends()
    assert dk.resolve_backend("triton", torch.device("cpu")).name == "triton"
    assert dk.resolve_backend("auto", torch.device("cpu")).name == "cpp"  # never the slow interpreter
    torch.manual_seed(7)
    lengths = [3, 1]
    for layer in (dk.nn.DeepTransitionGRU(3, 4, depth=1, cell="lau", layer_norm=True, bidirectional=True,
                                          batch_first=True, backend="triton"),
                  dk.nn.ATR(3, 4, bidirectional=True, backend="triton")):
        x = torch.randn(2, 3, 3) if layer.batch_first else torch.randn(3, 2, 3)
        results = {}
        for backend in ("triton", "reference"):
            layer.backend = backend
            layer.zero_grad()
            out, h_n = layer(x, lengths=lengths)
            (out.pow(2).sum() + h_n.sum()).backward()
            results[backend] = [out, h_n] + [p.grad.clone() for p in layer.parameters()]
        for a, b in zip(results["reference"], results["triton"]):
            torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)


@needs_triton
def test_unavailable_without_gpu_or_interpreter(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device makes the backend available")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "triton" not in dk.available_backends()
    layer = dk.nn.ATR(3, 4, backend="triton")
    with pytest.raises(ValueError, match="backend 'triton' is not available: it needs a CUDA device"):
        layer(torch.randn(2, 1, 3))


def test_package_imports_without_triton():
    """`import dtmt_kernels` never needs triton; without it the backend is reported unavailable, with why."""
    code = (
        "import sys, os\n"
        "sys.modules['triton'] = None  # as if not installed: import fails, find_spec gives None\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "import dtmt_kernels as dk\n"
        "from dtmt_kernels import backends\n"
        "assert 'triton' not in dk.available_backends(), dk.available_backends()\n"
        "print(backends._REGISTRY['triton'].unavailable())\n"
    )
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "triton" in res.stdout and ("not installed" in res.stdout or "did not import" in res.stdout)


# ---------------------------------------------------------- compiled for a GPU (no GPU needed to compile)
def _compile_for_gpu(kernel, dtype, acc, arch, num_warps, **constexprs):
    """Ahead-of-time compilation of one kernel specialisation to a cubin (triton's own front end, LLVM and
    ptxas; no device needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    acc_args = {"HIN", "HBLK", "HOUT", "DIN", "CD", "DH", "DLNW", "DLNB"}
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name == "eps":
            sig[name] = "fp32"
        elif name in ("t", "hp_slab", "in_slab", "out_slab", "k", "dln_slab", "B", "H"):
            sig[name] = "i32"
        else:
            sig[name] = "*" + (acc if name in acc_args else dtype)
    try:
        src = ASTSource(kernel, sig, constexprs)
    except TypeError as exc:  # pragma: no cover - other triton versions
        pytest.skip(f"this triton's ASTSource API differs ({exc})")
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})


GPU_COMPILE_CASES = [  # (kind, storage, accumulation, layer norm, other flags on)
    (0, "fp32", "fp32", False, True), (0, "fp64", "fp64", True, True), (1, "fp32", "fp32", True, True),
    (1, "bf16", "fp32", True, True), (2, "fp16", "fp32", True, False), (3, "fp32", "fp32", True, True),
    (3, "bf16", "fp32", False, False), (4, "fp32", "fp32", True, True), (4, "bf16", "fp32", False, False),
]


@needs_triton
@pytest.mark.parametrize("case", GPU_COMPILE_CASES, ids=lambda c: f"k{c[0]}-{c[1]}-{'ln' if c[3] else 'noln'}-"
                                                                    f"{'flags' if c[4] else 'plain'}")
def test_kernels_compile_for_gpu(compiled, case):
    """The compiled (not interpreted) kernels go through triton's whole GPU pipeline for sm_90 (and sm_80
    for 16-bit storage), forward and backward: what the interpreter cannot check (constexpr branches, types
    of the lowered IR, register allocation) is checked here without a GPU."""
    from dtmt_kernels.ops.transition import triton as ops

    kind, dtype, acc, ln, flags = case
    K = ops._kernels()
    n_in, n_h, n_g = ops.ROWS[kind]
    rows = dict(KIND=kind, NIN=max(n_in, 1), NH=n_h, NG=n_g, LN=ln, HAS_DROP=flags and kind != 3,
                HAS_MASK=flags, BLOCK=512)
    archs = (90, 80) if dtype in ("bf16", "fp16") else (90,)
    for arch in archs:
        fwd = _compile_for_gpu(K.step_forward_kernel, dtype, acc, arch, ops._num_warps(512), LAST=flags,
                               WRITE_LP=dtype != acc, **rows)
        bwd = _compile_for_gpu(K.step_backward_kernel, dtype, acc, arch, ops._num_warps(512), TOP=flags,
                               BASE=flags or kind != 4, HAS_CG=flags, **rows)
        for k in (fwd, bwd):
            assert len(k.asm["cubin"]) > 0 and ".entry step_" in k.asm["ptx"]


# ---------------------------------------------------------------------------------------------- GPU only
def _assert_relative_errors(ref, got, tol, what=""):
    """Every output and gradient of `got` within `tol` of the float64 reference `ref`, relative to each tensor's
    largest entry (+1e-3); `what` prefixes the message."""
    for name in ref:
        scale = ref[name].abs().max().item() + 1e-3
        err = (got[name].double() - ref[name]).abs().max().item() / scale
        assert err <= tol, f"{what}{name}: relative error {err:.2e} > {tol}"


def _ragged_case(cell, depth, I, H, B, T, seed):
    """A layer-normed `cell` layer of depth `depth` (float32, on the CPU, its parameters scaled by 0.3), inputs
    x [T, B, I] and h0 [B, H] and a padding mask [T, B] of random lengths, drawn from `seed`, and the float64
    reference's outputs and gradients of the reverse direction on the GPU (_run's ref, g)."""
    import copy

    layer = make_layer(cell, I, H, depth=depth, layer_norm=True, dtype=torch.float32)
    with torch.no_grad():
        for p in layer.parameters():
            p.mul_(0.3)
    gen = torch.Generator().manual_seed(seed)
    x, h0 = torch.randn(T, B, I, generator=gen), torch.randn(B, H, generator=gen)
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    mask = (torch.arange(T).unsqueeze(1) < lengths.unsqueeze(0)).float()
    ref, g = _run(copy.deepcopy(layer).double().cuda(), x.double().cuda(), h0.double().cuda(), mask.double().cuda(),
                  None, True, "reference")
    return layer, x, h0, mask, ref, g


def _gpu_check(cell, depth, dtype, T, B, I, H, drop_p=0.0, device="cuda"):
    """triton (and cuda, when built) on the GPU against the float64 reference on the GPU: outputs and all
    gradients, relative to each tensor's largest entry; also forward under no_grad."""
    import copy

    layer = make_layer(cell, I, H, depth=depth, layer_norm=True, dtype=torch.float32).to(device)
    with torch.no_grad():
        for p in layer.parameters():
            p.mul_(0.3)
    gen = torch.Generator().manual_seed(8)
    x, h0 = torch.randn(T, B, I, generator=gen), torch.randn(B, H, generator=gen)
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    mask = (torch.arange(T).unsqueeze(1) < lengths.unsqueeze(0)).double()
    drop = None
    if drop_p and cell != "atr":
        drop = (torch.rand(depth + 1, B, H, generator=gen) > drop_p).double() / (1 - drop_p)
    cuda = dict(device=device)
    ref, g = _run(copy.deepcopy(layer).double(), x.double().to(device), h0.double().to(device), mask.to(device),
                  None if drop is None else drop.to(device), True, "reference")
    low = layer.to(dtype)
    tol = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}[dtype]
    # the float32 tolerance assumes IEEE float32 GEMMs: TF32 off, whatever the environment asked for
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for backend in ["triton"] + (["cuda"] if "cuda" in dk.available_backends() else []):
            args = (x.to(dtype=dtype, **cuda), h0.to(dtype=dtype, **cuda), mask.to(dtype=dtype, **cuda),
                    None if drop is None else drop.to(dtype=dtype, **cuda))
            got, _ = _run(low, *args, True, backend, g[0].to(dtype), g[1].to(dtype))
            _assert_relative_errors(ref, got, tol, f"{backend} ")
            with torch.no_grad():
                w = low.direction_weights(0)
                out, h_n = Fn.transition_sequence(*args[:2], w, args[2], args[3], True, backend)
            torch.testing.assert_close(out, got["out"].detach(), atol=0, rtol=0)
            torch.testing.assert_close(h_n, got["h_n"].detach(), atol=0, rtol=0)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("cell,depth", CASES, ids=CASE_IDS)
def test_gpu_compiled_matches_reference(compiled, cell, depth, dtype):
    _gpu_check(cell, depth, dtype, T=12, B=16, I=40, H=200, drop_p=0.2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cell,depth", [("lgru", 2), ("atr", 0)], ids=["lgru-d2", "atr"])
def test_gpu_backward_in_chunks_matches_reference(compiled, cell, depth, dtype):
    """B x T = 2,560 rows: the cuda backward forms its gradients in 4 chunks of 10 steps (transition_cuda.cu's
    GradientChunks; one persistent launch a chunk under DTMT_CUDA_RECURRENCE=persistent), against the float64
    reference, with ragged lengths and dropout."""
    _gpu_check(cell, depth, dtype, T=40, B=64, I=24, H=96, drop_p=0.2)


@pytest.mark.parametrize("H", [1, 1000, 2500])
def test_gpu_compiled_hidden_sizes(compiled, H):
    """One row per program at BLOCK 1..4096 (several warps; 16 warps at 4096)."""
    _gpu_check("lgru", 1, torch.float32, T=5, B=3, I=8, H=H)


@pytest.mark.parametrize("cell,depth", [("lgru", 2), ("atr", 0)], ids=["lgru-d2", "atr"])
def test_gpu_cuda_backend_follows_torchs_tf32_flag(compiled, cell, depth):
    """torch.backends.cuda.matmul.allow_tf32 on, float32 storage: the cuda backend may take its products on TF32
    tensor cores, as cuBLAS does (the persistent launches do: csrc/block_mma.cuh; the per-step path's own GEMMs stay
    FMA): outputs and every gradient within TF32's precision of the float64 reference. With the persistent launches
    (DTMT_CUDA_RECURRENCE=persistent, gpu_session.sh's persistent stage) the products are TF32: the outputs differ
    from the strict-fp32 run's."""
    if "cuda" not in dk.available_backends():
        pytest.skip("the cuda backend is not built")
    layer, x, h0, mask, ref, g = _ragged_case(cell, depth, 40, 200, B=16, T=12, seed=9)
    layer, x, h0, mask = layer.cuda(), x.cuda(), h0.cuda(), mask.cuda()
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        runs = {}
        for tf32 in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            runs[tf32], _ = _run(layer, x, h0, mask, None, True, "cuda", g[0].float(), g[1].float())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    _assert_relative_errors(ref, runs[True], 2e-2, "TF32 allowed: ")
    if os.environ.get("DTMT_CUDA_RECURRENCE") == "persistent":
        assert not torch.equal(runs[True]["out"], runs[False]["out"]), "TF32 allowed, yet the products were fp32"


def test_gpu_captured_products_are_cublas(compiled):
    """While a CUDA graph is captured the cuda backend's per-step products are ATen's mm (cuBLAS) at every B
    (transition_cuda.cu's step_gemm; docs/design/gpu.md, "Step GEMMs"): at B = 16 an eager forward runs the tiled
    GEMM, its replayed graph runs none of the own GEMM kernels, and the replay's outputs are the eager ones to
    float32 rounding, not bit for bit (cuBLAS sums in another order)."""
    if "cuda" not in dk.available_backends():
        pytest.skip("the cuda backend is not built")
    if os.environ.get("DTMT_CUDA_STEP_GEMM") or os.environ.get("DTMT_CUDA_RECURRENCE") == "persistent":
        pytest.skip("a product or a recurrence forced for every call")
    layer, x, h0, mask, _, _ = _ragged_case("lgru", 1, 40, 200, B=16, T=6, seed=5)
    layer, x, h0, mask = layer.cuda(), x.cuda(), h0.cuda(), mask.cuda()
    w = layer.direction_weights(0)

    def forward():
        with torch.no_grad():
            return Fn.transition_sequence(x, h0, w, mask, None, True, "cuda")

    def kernels(run):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            result = run()
            torch.cuda.synchronize()
        return result, {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}

    (out, h_n), eager = kernels(forward)
    assert any("tiled_gemm_kernel" in k for k in eager), sorted(eager)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # (torch's warm-up before a capture)
        forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_hn = forward()
    _, replayed = kernels(graph.replay)
    # (where the profiler lists a graph's kernels: none of the own GEMMs; in any case other sums than the tiled GEMM's)
    assert not any("tiled_gemm_kernel" in k or "rows_gemm_kernel" in k for k in replayed), sorted(replayed)
    assert not torch.equal(g_out, out), "the replay's products were summed as the tiled GEMM sums them"
    torch.testing.assert_close(g_out, out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(g_hn, h_n, atol=1e-5, rtol=1e-4)


def test_gpu_persistent_reads_matrices_from_l2(compiled):
    """The deep transition at H = 1024 in bfloat16 (L-GRU + 4 T-GRUs, layer norm): its matrices outgrow an H100's
    shared memory, and with DTMT_CUDA_RECURRENCE=persistent (gpu_session.sh's persistent stage) the plan reads the top
    T-GRUs' from L2 (docs/design/persistent_recurrence.md, "Past shared memory: the L2"). The persistent launches run
    (no fall-back warning) and give the float64 reference's outputs and gradients to bfloat16's precision."""
    import warnings

    if "cuda" not in dk.available_backends():
        pytest.skip("the cuda backend is not built")
    if os.environ.get("DTMT_CUDA_RECURRENCE") != "persistent":
        pytest.skip("the persistent launches are not asked for (DTMT_CUDA_RECURRENCE=persistent)")
    T, B, H = 6, 16, 1024
    plan = dk.persistent_plan("lgru", 4, B, H, torch.bfloat16)
    if not plan.fits or not plan.forward_spill:
        pytest.skip(f"on this device: {plan}")
    layer, x, h0, mask, ref, g = _ragged_case("lgru", 4, 64, H, B, T, seed=12)
    low = layer.to(torch.bfloat16).cuda()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, _ = _run(low, x.bfloat16().cuda(), h0.bfloat16().cuda(), mask.bfloat16().cuda(), None, True, "cuda",
                      g[0].bfloat16(), g[1].bfloat16())
    assert not [w for w in caught if "does not fit" in str(w.message)], [str(w.message) for w in caught]
    _assert_relative_errors(ref, got, 5e-2)


def _strict_fp32_launches(cell, depth, H, B, T, seed):
    """A ragged layer (_ragged_case) forward and backward on the cuda backend in strict fp32 (TF32 off, restored
    after): the float64 reference's outputs and gradients, the layer's, and the persistent launches of each form it
    made (dk persistent_launches, the difference over the run)."""
    from dtmt_kernels.ops.transition.persistent import persistent_launches

    layer, x, h0, mask, ref, g = _ragged_case(cell, depth, 32, H, B, T, seed=seed)
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    launched = persistent_launches()
    try:
        got, _ = _run(layer.cuda(), x.cuda(), h0.cuda(), mask.cuda(), None, True, "cuda", g[0].float(), g[1].float())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    now = persistent_launches()
    return ref, got, {k: now[k] - launched[k] for k in now}


@pytest.mark.parametrize("cell,depth,H,B,T", [("gru", 0, 512, 8, 256), ("lgru", 2, 256, 4, 7), ("lgru", 1, 37, 5, 64),
                                              ("gru", 0, 512, 64, 32), ("gru", 0, 512, 1, 16)],
                         ids=["gru-512-T256", "lgru-d2-256", "lgru-d1-37-13-blocks", "gru-512-B64", "gru-512-B1"])
def test_gpu_persistent_cluster_form(compiled, cell, depth, H, B, T):
    """With DTMT_CUDA_RECURRENCE=persistent-cluster (gpu_session.sh's persistent-cluster stage) a layer that fits one
    thread-block cluster runs in such clusters, each the whole layer for its own batch rows, as many as the SMs hold
    up to one a row (docs/design/persistent_recurrence.md, "One cluster" and "Clusters of batch rows"): the plan says
    so, the driver's launch counts (dk persistent_launches) show a cluster launch for the forward and one for the
    backward and no other persistent launch, and forward and backward give the float64 reference's outputs and
    gradients in strict fp32 (ragged lengths, layer norm; 256 steps of a GRU at H = 512: 16 blocks of 32 units, 8
    clusters of a row, the states and layer-norm partials passed between a cluster's blocks through global memory
    across 256 x 2 cluster barriers each way; 13 blocks of 3 units at H = 37; B = 64 in 8 clusters of 8 rows, the
    stage in two buffers backward; B = 1, one cluster)."""
    if "cuda" not in dk.available_backends():
        pytest.skip("the cuda backend is not built")
    if os.environ.get("DTMT_CUDA_RECURRENCE") != "persistent-cluster":
        pytest.skip("the cluster form is not asked for (DTMT_CUDA_RECURRENCE=persistent-cluster)")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread-block clusters need compute capability 9.0")
    plan = dk.persistent_plan(cell, depth, B, H, torch.float32, tensor_cores=False, cluster=16)
    blocks = -(-H // -(-H // 16))   # ceil(H / ceil(H / 16))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert plan.fits and plan.cluster and plan.grid == blocks, str(plan)
    assert plan.groups == -(-B // -(-B // max(1, min(B, sms // blocks)))), str(plan)
    ref, got, ran = _strict_fp32_launches(cell, depth, H, B, T, seed=13)
    assert ran == {"grid": 0, "cluster": 2, "refused": 0, "multicast": 0, "tensor_cores": 0, "steps": 0}, ran
    _assert_relative_errors(ref, got, 1e-4)


@pytest.mark.parametrize("cell,depth,H,B,T", [("gru", 0, 512, 8, 64), ("gru", 0, 512, 64, 32),
                                              ("lgru", 2, 256, 128, 7)],
                         ids=["gru-512-B8-whole-rows", "gru-512-B64-chunks", "lgru-d2-256-B128"])
def test_gpu_persistent_stage_read_once_a_cluster(compiled, cell, depth, H, B, T):
    """With DTMT_CUDA_RECURRENCE=persistent-multicast (gpu_session.sh's persistent-multicast stage, which builds for
    sm_90a) the persistent launches run as the grid form in thread-block clusters of 2 whose blocks read the products'
    stage from L2 once a cluster (docs/design/persistent_recurrence.md, "The stage read once a cluster"): the plan
    says so, the launch counts show the forward and the backward in that form and no other, and forward and backward
    give the float64 reference's outputs and gradients in strict fp32 (ragged lengths, layer norm where the cell has
    it): whole rows staged at B = 8, chunks in two buffers at B = 64, and buffers refilled at B = 128."""
    if "cuda" not in dk.available_backends():
        pytest.skip("the cuda backend is not built")
    if os.environ.get("DTMT_CUDA_RECURRENCE") != "persistent-multicast":
        pytest.skip("the stage read once a cluster is not asked for (DTMT_CUDA_RECURRENCE=persistent-multicast)")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the bulk copies' multicast is code for sm_90a")
    plan = dk.persistent_plan(cell, depth, B, H, torch.float32, tensor_cores=False, multicast=2)
    assert plan.fits and plan.multicast == 2 and plan.grid % 2 == 0, str(plan)
    ref, got, ran = _strict_fp32_launches(cell, depth, H, B, T, seed=17)
    assert ran == {"grid": 0, "cluster": 0, "refused": 0, "multicast": 2, "tensor_cores": 0, "steps": 0}, ran
    _assert_relative_errors(ref, got, 1e-4)


_UNFIT_LAYER = """
import warnings, torch
from conftest import make_layer
from dtmt_kernels.ops.transition.persistent import persistent_launches
caught = []
# too wide for shared memory; deeper than the plan's bound
for layer in (make_layer("lgru", 8, 2500, depth=1, layer_norm=True, dtype=torch.float32),
              make_layer("gru", 8, 4, depth=65, dtype=torch.float32)):
    layer = layer.cuda()
    layer.backend = "cuda"
    x = torch.randn(3, 2, 8, device="cuda", requires_grad=True)
    with warnings.catch_warnings(record=True) as these:
        warnings.simplefilter("always")
        out, h_n = layer(x)
        out.sum().backward()
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    caught += these
print(persistent_launches())
for w in caught:
    print("WARNING", w.message)
"""


@pytest.mark.parametrize("recurrence", ["persistent", "persistent-cluster"])
def test_gpu_persistent_says_where_a_layer_does_not_fit(compiled, recurrence):
    """A layer the persistent launches cannot hold (L-GRU at H = 2500 with layer norm, fp32: more than one cluster
    and more than the device's shared memory; a GRU with 65 T-GRUs: deeper than the plan takes) runs on the
    per-step path with a warning that names its sizes, in a
    child process (the switch is read once a process; and a crash there fails this test instead of ending the run).
    The warnings hold numbers: on the H200 image of 2026-11-30 that warning ended the process inside libstdc++
    (docs/design/gpu.md, "Messages from the CUDA unit")."""
    if "cuda" not in dk.available_backends():
        pytest.skip("the cuda backend is not built")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # (the package need not be installed)
    env = {**os.environ, "DTMT_CUDA_RECURRENCE": recurrence,
           "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, "-c", _UNFIT_LAYER], cwd=os.path.dirname(os.path.abspath(__file__)),
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "'grid': 0, 'cluster': 0" in run.stdout and "'steps': 4}" in run.stdout, run.stdout   # (2 layers, 2 ways)
    assert "a layer of H=2500, depth 1, B=2 needs " in run.stdout, run.stdout
    assert "a layer of H=4, depth 65, B=2 is past the persistent plan's sizes (depth <= 64" in run.stdout, run.stdout
    if recurrence == "persistent-cluster" and torch.cuda.get_device_capability()[0] >= 9:
        assert "a layer of H=2500, depth 1, B=2 does not fit one thread-block cluster" in run.stdout, run.stdout


@needs_triton
@pytest.mark.parametrize("cell,depth,dtype", [("lgru", 1, torch.float32), ("atr", 0, torch.bfloat16)],
                         ids=["lgru-fp32", "atr-bf16"])
def test_the_gpu_check_itself_under_interpreter(cell, depth, dtype):
    """The GPU tests' check, run here on CPU tensors through the interpreter, so that its own code has run
    before the first session with a GPU relies on it."""
    _gpu_check(cell, depth, dtype, T=3, B=2, I=5, H=7, drop_p=0.3, device="cpu")


for _mark in needs_gpu:
    test_gpu_compiled_matches_reference = _mark(test_gpu_compiled_matches_reference)
    test_gpu_compiled_hidden_sizes = _mark(test_gpu_compiled_hidden_sizes)
    test_gpu_backward_in_chunks_matches_reference = _mark(test_gpu_backward_in_chunks_matches_reference)
    test_gpu_cuda_backend_follows_torchs_tf32_flag = _mark(test_gpu_cuda_backend_follows_torchs_tf32_flag)
    test_gpu_persistent_cluster_form = _mark(test_gpu_persistent_cluster_form)
    test_gpu_persistent_says_where_a_layer_does_not_fit = _mark(test_gpu_persistent_says_where_a_layer_does_not_fit)
    test_gpu_persistent_reads_matrices_from_l2 = _mark(test_gpu_persistent_reads_matrices_from_l2)
    test_gpu_captured_products_are_cublas = _mark(test_gpu_captured_products_are_cublas)
    test_gpu_persistent_stage_read_once_a_cluster = _mark(test_gpu_persistent_stage_read_once_a_cluster)
