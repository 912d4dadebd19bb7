"""The fused C++ CPU kernels against the reference: float64 gradcheck over every cell x layer norm x mask
x direction (and T-GRU depth, candidate dropout), float32 agreement on awkward shapes, determinism."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import dtmt_kernels as dk
from dtmt_kernels import functional as Fn

from conftest import make_layer, padding_mask

pytestmark = pytest.mark.skipif("cpp" not in dk.available_backends(), reason="C++ extension not built")

CASES = [(cell, depth) for cell in ("gru", "lgru", "lau") for depth in (0, 2)] + [("atr", 0)]


def _sequence_fn(layer, mask, drop, reverse, backend):
    names = [n for n, _ in layer.named_parameters()]

    def f(x, h0, *params):
        w = layer.direction_weights(0, dict(zip(names, params)))
        return Fn.transition_sequence(x, h0, w, mask, drop, reverse, backend)
    return f


@pytest.mark.parametrize("cell,depth", CASES, ids=[f"{c}-d{d}" for c, d in CASES])
@pytest.mark.parametrize("layer_norm", [False, True], ids=["noln", "ln"])
@pytest.mark.parametrize("masked", [False, True], ids=["full", "masked"])
@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
def test_gradcheck_float64(cell, depth, layer_norm, masked, reverse):
    T, B, I, H = 4, 3, 3, 5
    layer = make_layer(cell, I, H, depth=depth, layer_norm=layer_norm)
    torch.manual_seed(1)
    x = torch.randn(T, B, I, dtype=torch.double, requires_grad=True)
    h0 = torch.randn(B, H, dtype=torch.double, requires_grad=True)
    mask = padding_mask([4, 2, 1], T) if masked else None
    params = [p.detach().clone().requires_grad_() for p in layer.parameters()]
    f = _sequence_fn(layer, mask, None, reverse, "cpp")
    assert torch.autograd.gradcheck(f, (x, h0, *params), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("cell,depth", [("gru", 1), ("lgru", 2), ("lau", 1)])
@pytest.mark.parametrize("layer_norm", [False, True], ids=["noln", "ln"])
@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
def test_gradcheck_candidate_dropout(cell, depth, layer_norm, reverse):
    """Candidate dropout (a mask a sub-cell, fixed over time): gradcheck of the cpp backward against its forward,
    and outputs and every gradient against the reference backend with the same mask (1e-12), so that a mask applied
    to the wrong sub-cell fails here too."""
    T, B, I, H = 3, 2, 3, 4
    layer = make_layer(cell, I, H, depth=depth, layer_norm=layer_norm)
    torch.manual_seed(2)
    drop = (torch.rand(depth + 1, B, H, dtype=torch.double) > 0.3).double() / 0.7
    x = torch.randn(T, B, I, dtype=torch.double, requires_grad=True)
    h0 = torch.randn(B, H, dtype=torch.double, requires_grad=True)
    params = [p.detach().clone().requires_grad_() for p in layer.parameters()]
    f = _sequence_fn(layer, padding_mask([3, 2], T), drop, reverse, "cpp")
    assert torch.autograd.gradcheck(f, (x, h0, *params), eps=1e-6, atol=1e-7, rtol=1e-5)
    g = torch.Generator().manual_seed(3)
    g_out, g_hn = torch.randn(T, B, H, generator=g, dtype=torch.double), torch.randn(B, H, generator=g,
                                                                                      dtype=torch.double)
    results = []
    for backend in ("cpp", "reference"):
        inputs = [t.detach().clone().requires_grad_() for t in (x, h0, *params)]
        out, h_n = _sequence_fn(layer, padding_mask([3, 2], T), drop, reverse, backend)(*inputs)
        ((out * g_out).sum() + (h_n * g_hn).sum()).backward()
        results.append([out.detach(), h_n.detach()] + [t.grad for t in inputs])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert not torch.equal(results[1][0], _sequence_fn(layer, padding_mask([3, 2], T), None, reverse, "reference")(
        x, h0, *params)[0].detach())   # (the mask changes the result)


@pytest.mark.parametrize("keep", [0, 1], ids=["out-only", "h_n-only"])
def test_gradcheck_one_output_used(keep):
    """A layer whose out (or h_n) alone reaches the loss: the op's backward gets no gradient for the other output
    (autograd does not fill it with zeros) and must still be exact."""
    T, B, I, H = 4, 3, 3, 5
    layer = make_layer("lgru", I, H, depth=1, layer_norm=True)
    torch.manual_seed(4)
    x = torch.randn(T, B, I, dtype=torch.double, requires_grad=True)
    h0 = torch.randn(B, H, dtype=torch.double, requires_grad=True)
    params = [p.detach().clone().requires_grad_() for p in layer.parameters()]
    f = _sequence_fn(layer, padding_mask([4, 2, 1], T), None, False, "cpp")
    assert torch.autograd.gradcheck(lambda *a: f(*a)[keep], (x, h0, *params), eps=1e-6, atol=1e-7, rtol=1e-5)


def _compare_backends(layer, x, h0, lengths, atol, rtol):
    """Outputs and all gradients of `layer` on the cpp and reference backends."""
    results = {}
    torch.manual_seed(7)
    g_out = None
    for backend in ("reference", "cpp"):
        layer.backend = backend
        layer.zero_grad()
        xi = x.detach().clone().requires_grad_()
        hi = h0.detach().clone().requires_grad_()
        out, h_n = layer(xi, hi, lengths=lengths)
        if g_out is None:
            g_out, g_h = torch.randn_like(out), torch.randn_like(h_n)
        ((out * g_out).sum() + (h_n * g_h).sum()).backward()
        results[backend] = [out, h_n, xi.grad, hi.grad] + [p.grad.clone() for p in layer.parameters()]
    names = ["out", "h_n", "dx", "dh0"] + [n for n, _ in layer.named_parameters()]
    for name, ref, got in zip(names, results["reference"], results["cpp"]):
        assert torch.isfinite(got).all(), name
        # gradients are sums over T*B terms: scale the absolute tolerance by the tensor's magnitude
        scale = max(1.0, ref.abs().max().item())
        torch.testing.assert_close(got, ref, atol=atol * scale, rtol=rtol, msg=lambda m: f"{name}: {m}")


SHAPES = [  # (T, B, I, H, lengths)
    (1, 1, 3, 5, None),
    (7, 1, 4, 13, [7]),
    (5, 4, 6, 9, [5, 1, 1, 1]),       # all but one sequence padded down to a single token
    (6, 3, 8, 16, [2, 6, 4]),
    (9, 5, 7, 31, None),
]


@pytest.mark.parametrize("cell,depth", CASES, ids=[f"{c}-d{d}" for c, d in CASES])
@pytest.mark.parametrize("layer_norm", [False, True], ids=["noln", "ln"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}B{}I{}H{}".format(*s[:4]))
def test_float32_matches_reference(cell, depth, layer_norm, shape):
    T, B, I, H, lengths = shape
    layer = make_layer(cell, I, H, depth=depth, layer_norm=layer_norm, bidirectional=True, dtype=torch.float32)
    torch.manual_seed(3)
    x = torch.randn(T, B, I)
    h0 = torch.randn(2, B, H)
    _compare_backends(layer, x, h0, lengths, atol=2e-5, rtol=1e-4)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cell_depth=st.sampled_from(CASES), layer_norm=st.booleans(), T=st.integers(1, 8),
       B=st.integers(1, 6), I=st.integers(1, 9), H=st.integers(1, 21), bidirectional=st.booleans(),
       batch_first=st.booleans(), data=st.data())
def test_random_configurations(cell_depth, layer_norm, T, B, I, H, bidirectional, batch_first, data):
    cell, depth = cell_depth
    lengths = data.draw(st.one_of(st.none(), st.lists(st.integers(1, T), min_size=B, max_size=B)))
    layer = make_layer(cell, I, H, depth=depth, layer_norm=layer_norm, bidirectional=bidirectional,
                       batch_first=batch_first)
    x = torch.randn((B, T, I) if batch_first else (T, B, I), dtype=torch.double)
    h0 = torch.randn(2 if bidirectional else 1, B, H, dtype=torch.double)
    _compare_backends(layer, x, h0, lengths, atol=1e-10, rtol=1e-8)


def test_large_hidden_float32():
    """H=500 (not a multiple of 8 or of a vector width), with padding."""
    layer = make_layer("lgru", 24, 500, depth=1, layer_norm=True, dtype=torch.float32)
    with torch.no_grad():
        for p in layer.parameters():
            p.mul_(0.2)
    torch.manual_seed(4)
    _compare_backends(layer, torch.randn(5, 3, 24), torch.randn(1, 3, 500), [5, 3, 1], atol=5e-5, rtol=1e-4)


def test_gradients_are_deterministic():
    layer = make_layer("lgru", 16, 64, depth=3, layer_norm=True, bidirectional=True, dtype=torch.float32,
                       backend="cpp")
    x = torch.randn(12, 32, 16)
    grads = []
    for _ in range(2):
        layer.zero_grad()
        out, _ = layer(x, lengths=torch.randint(1, 13, (32,), generator=torch.Generator().manual_seed(0)))
        out.pow(2).sum().backward()
        grads.append([p.grad.clone() for p in layer.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cell,depth", CASES, ids=[f"{c}-d{d}" for c, d in CASES])
def test_single_step_cell(cell, depth):
    """The cell (single-step op) equals one step of the layer, and its gradients match the reference."""
    torch.manual_seed(5)
    layer = make_layer(cell, 4, 6, depth=depth, layer_norm=True)
    if cell == "atr":
        step = dk.nn.ATRCell(4, 6, layer_norm=True).double()
    else:
        step = dk.nn.DeepTransitionGRUCell(4, 6, depth=depth, cell=cell, layer_norm=True).double()
    step.load_state_dict(layer.state_dict())
    x = torch.randn(3, 4, dtype=torch.double, requires_grad=True)
    h = torch.randn(3, 6, dtype=torch.double, requires_grad=True)
    out, _ = layer(x.unsqueeze(0), h.unsqueeze(0))
    h1 = step(x, h)
    torch.testing.assert_close(h1, out[0])
    grads = {}
    for backend in ("reference", "cpp"):
        step.backend = backend
        h1 = step(x, h)
        torch.testing.assert_close(h1, out[0], rtol=1e-12, atol=1e-12)   # (the reference's step: the cpp layer's)
        grads[backend] = torch.autograd.grad(h1.pow(2).sum(), [x, h, *step.parameters()])
    for a, b in zip(grads["reference"], grads["cpp"]):
        torch.testing.assert_close(a, b)
    params = [p.detach().clone().requires_grad_() for p in step.parameters()]
    names = [n for n, _ in step.named_parameters()]
    step.backend = "cpp"

    def f(x, h, *ps):
        return Fn.transition_step(x, h, step.direction_weights(0, dict(zip(names, ps))), backend="cpp")
    assert torch.autograd.gradcheck(f, (x, h, *params))
