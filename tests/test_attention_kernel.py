"""The fused additive-attention kernels (csrc/attention_cpu.cpp): the scores against
reference.additive_scores and the context against an einsum per head (and reference.attention_context):
float64 gradcheck, float32 agreement on random shapes, strided inputs, the no-grad path, determinism, input
checks, and the attention modules switching with the model's backend."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import dtmt_kernels as dk
import dtmt_models as dm
from dtmt_kernels import reference
from dtmt_models.models.attention import AdditiveAttention, MultiHeadAdditiveAttention

pytestmark = pytest.mark.skipif("cpp" not in dk.available_backends(), reason="C++ extension not built")


def _inputs(B, S, NH, D, dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=g, dtype=dtype) * scale).requires_grad_()
            for shape in ((B, S, NH, D), (B, NH, D), (NH, D))]


@pytest.mark.parametrize("B,S,NH,D", [(3, 5, 4, 8), (1, 1, 1, 3), (2, 7, 1, 16), (4, 2, 3, 1)])
def test_gradcheck_float64(B, S, NH, D):
    inputs = _inputs(B, S, NH, D, torch.double)
    f = lambda k, q, v: dk.functional.additive_scores(k, q, v, "cpp")
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(f(*inputs), reference.additive_scores(*inputs), rtol=0, atol=1e-14)


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 9), S=st.integers(1, 40), NH=st.integers(1, 8), D=st.integers(1, 70),
       scale=st.sampled_from([0.1, 1.0, 6.0]), seed=st.integers(0, 2**16))
def test_float32_matches_reference(B, S, NH, D, scale, seed):
    """Against the reference in float64, each gradient to a bound of its own size: dk = g v (1 - tanh^2) is one
    product an element, dq sums S of them, dv sums S B terms g tanh; each bound is 4e-6 of the largest such
    term times the square root of the terms summed (the worst of 400 random cases here: 3e-7 of it, the
    saturated tanh's 1 - tanh^2 in float32)."""
    fused = _inputs(B, S, NH, D, torch.float32, seed, scale)
    ref = [t.detach().double().requires_grad_() for t in fused]
    out = dk.functional.additive_scores(*fused, backend="cpp")
    expected = reference.additive_scores(*ref)
    assert out.shape == (B, NH, S)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=2e-5 * D ** 0.5)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad.double())
    g, v = grad.abs().max().item(), fused[2].abs().max().item()
    bounds = {"k": g * v, "q": g * v * S ** 0.5, "v": g * (S * B) ** 0.5}
    for (name, bound), a, b in zip(bounds.items(), fused, ref):
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-5, atol=4e-6 * bound, msg=lambda m: f"d{name}: {m}")


def test_no_grad_path_and_non_contiguous_inputs():
    k, q, v = _inputs(3, 6, 2, 5, torch.float32)
    k_nc = k.detach().transpose(0, 1).contiguous().transpose(0, 1)   # same values, other strides
    with torch.no_grad():
        out = dk.functional.additive_scores(k_nc, q, v, "cpp")
    assert not out.requires_grad
    torch.testing.assert_close(out, reference.additive_scores(k, q, v).detach(), rtol=1e-5, atol=1e-5)


def test_gradients_through_non_contiguous_keys_and_query():
    """Keys and query as strided views (as a transposed or sliced projection gives them): the gradients
    reaching the leaves equal the reference's."""
    g = torch.Generator().manual_seed(3)
    k_base = torch.randn(6, 3, 2, 5, generator=g, requires_grad=True)   # [S, B, NH, D]: keys are its transpose
    q_base = torch.randn(3, 2, 9, generator=g, requires_grad=True)      # query: a slice of the last dim
    v = torch.randn(2, 5, generator=g, requires_grad=True)
    grad = torch.randn(3, 2, 6, generator=g)
    grads = []
    for backend in ("cpp", "reference"):
        for t in (k_base, q_base, v):
            t.grad = None
        k, q = k_base.transpose(0, 1), q_base[..., 2:7]
        assert not k.is_contiguous() and not q.is_contiguous()
        out = dk.functional.additive_scores(k, q, v, backend)
        out.backward(grad)
        grads.append((out.detach(), k_base.grad.clone(), q_base.grad.clone(), v.grad.clone()))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert grads[0][2][..., :2].abs().sum() == 0 and grads[0][2][..., 7:].abs().sum() == 0


def _grads_over_threads(f, inputs):
    grads = []
    for threads in (1, 2, 1):
        torch.set_num_threads(threads)
        for t in inputs:
            t.grad = None
        f(*inputs).sin().sum().backward()
        grads.append([t.grad.clone() for t in inputs])
    for g in grads[1:]:
        for a, b in zip(grads[0], g):
            assert torch.equal(a, b)


def test_gradients_are_deterministic():
    _grads_over_threads(lambda k, q, v: dk.functional.additive_scores(k, q, v, "cpp"),
                        _inputs(16, 30, 4, 32, torch.float32))


# ------------------------------------------------------------------------------------------------ context
def _context_inputs(B, S, NH, C, dtype, seed=0, transposed=False):
    """alpha [B, NH, S] (softmax rows) and values [B, S, C]; transposed: values a [S, B, C] tensor viewed
    batch first, as the encoder output is."""
    g = torch.Generator().manual_seed(seed)
    alpha = torch.softmax(torch.randn(B, NH, S, generator=g, dtype=dtype) * 2, -1).requires_grad_()
    if transposed:
        values = torch.randn(S, B, C, generator=g, dtype=dtype).requires_grad_()
        return alpha, values, values.transpose(0, 1)
    values = torch.randn(B, S, C, generator=g, dtype=dtype).requires_grad_()
    return alpha, values, values


def _context_per_head(alpha, values):
    """The definition, head by head: context[b, h-th slice] = sum_s alpha[b, h, s] * values[b, s, h-th slice]."""
    NH, C = alpha.shape[1], values.shape[2]
    Dc = C // NH
    return torch.cat([torch.einsum("bs,bsd->bd", alpha[:, h], values[:, :, h * Dc:(h + 1) * Dc])
                      for h in range(NH)], 1)


@pytest.mark.parametrize("B,S,NH,C,transposed", [(3, 5, 4, 8, False), (1, 1, 1, 3, False), (2, 7, 1, 16, True),
                                                 (4, 2, 3, 6, True), (2, 3, 2, 2, False)])
def test_context_gradcheck_float64(B, S, NH, C, transposed):
    alpha, leaf, values = _context_inputs(B, S, NH, C, torch.double, transposed=transposed)
    f = lambda a, v: dk.functional.attention_context(a, v.transpose(0, 1) if transposed else v, "cpp")
    assert torch.autograd.gradcheck(f, (alpha, leaf), eps=1e-6, atol=1e-7, rtol=1e-5)
    out = f(alpha, leaf)
    torch.testing.assert_close(out, _context_per_head(alpha, values), rtol=0, atol=1e-14)
    torch.testing.assert_close(out, reference.attention_context(alpha, values), rtol=0, atol=1e-14)


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 9), S=st.integers(1, 40), NH=st.integers(1, 6), Dc=st.integers(1, 40),
       transposed=st.booleans(), seed=st.integers(0, 2**16))
def test_context_float32_matches_definition(B, S, NH, Dc, transposed, seed):
    alpha, leaf, values = _context_inputs(B, S, NH, NH * Dc, torch.float32, seed, transposed)
    alpha_r, leaf_r = (t.detach().clone().requires_grad_() for t in (alpha, leaf))
    values_r = leaf_r.transpose(0, 1) if transposed else leaf_r
    out = dk.functional.attention_context(alpha, values, "cpp")
    expected = _context_per_head(alpha_r, values_r)
    assert out.shape == (B, NH * Dc)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(alpha.grad, alpha_r.grad, rtol=1e-4, atol=1e-4 * Dc ** 0.5)
    torch.testing.assert_close(leaf.grad, leaf_r.grad, rtol=1e-5, atol=1e-5)


def test_context_gradient_of_a_strided_view_is_laid_out_like_it():
    alpha, _, values = _context_inputs(3, 4, 2, 6, torch.float32, transposed=True)
    (grad_values,) = torch.autograd.grad(torch.ops.dtmt.attention_context(alpha, values).sum(), values)
    assert grad_values.stride() == values.stride()
    torch.testing.assert_close(grad_values, alpha.detach().repeat_interleave(3, 1).transpose(1, 2))


def test_context_gradients_are_deterministic():
    alpha, values, _ = _context_inputs(16, 30, 4, 64, torch.float32)
    _grads_over_threads(lambda a, v: dk.functional.attention_context(a, v, "cpp"), [alpha, values])


@pytest.mark.parametrize("bad", ["rank", "batch", "length", "heads", "dtype", "list"])
def test_context_bad_inputs_are_value_errors(bad):
    alpha, values, _ = (t.detach() for t in _context_inputs(2, 3, 2, 4, torch.float32))
    if bad == "rank":
        values = values.reshape(6, 4)
    elif bad == "batch":
        values = values[:1]
    elif bad == "length":
        values = values[:, :2]
    elif bad == "heads":
        alpha = torch.softmax(torch.randn(2, 3, 3), -1)
    elif bad == "list":   # (an AttributeError before)
        values = values.tolist()
    else:
        alpha = alpha.double()
    with pytest.raises(ValueError, match="attention_context"):
        dk.functional.attention_context(alpha, values, "cpp")


@pytest.mark.parametrize("bad", ["rank", "query", "v", "dtype", "list"])
def test_bad_inputs_are_value_errors(bad):
    k, q, v = (t.detach() for t in _inputs(2, 3, 2, 4, torch.float32))
    if bad == "rank":
        k = k.view(2, 3, 8)
    elif bad == "query":
        q = q[:, :1]
    elif bad == "v":
        v = v[:, :3]
    elif bad == "list":   # (an AttributeError before)
        k = k.tolist()
    else:
        q = q.double()
    with pytest.raises(ValueError, match="additive_scores"):
        dk.functional.additive_scores(k, q, v, "cpp")


def test_unknown_backend_is_a_value_error():
    k, q, v = (t.detach() for t in _inputs(2, 3, 2, 4, torch.float32))
    with pytest.raises(ValueError, match="backend"):
        dk.functional.additive_scores(k, q, v, "nope")


@pytest.mark.parametrize("multi_head", [False, True])
def test_attention_modules_agree_across_backends(multi_head):
    torch.manual_seed(0)
    B, S, Q, C = 3, 6, 10, 12
    att = (MultiHeadAdditiveAttention(Q, C, 8, heads=4) if multi_head else AdditiveAttention(Q, C, 8)).double()
    ann = torch.randn(B, S, C, dtype=torch.double, requires_grad=True)
    query = torch.randn(B, Q, dtype=torch.double, requires_grad=True)
    mask = torch.arange(S).unsqueeze(0) < torch.tensor([6, 3, 1]).unsqueeze(1)
    results = []
    for backend in ("reference", "cpp"):
        att.backend = backend
        att.zero_grad()
        ann.grad = query.grad = None
        ctx, alpha = att(query, att.precompute(ann), ann, mask)
        (ctx.square().sum() + alpha.sin().sum()).backward()
        results.append([ctx, alpha, ann.grad, query.grad] + [p.grad for p in att.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)
    assert torch.all(alpha[~mask.unsqueeze(1).expand_as(alpha) if multi_head else ~mask] == 0)


def test_multi_head_context_reads_each_heads_own_slice():
    """context = out-projection of [sum_s alpha_h[s] * annotations[s, slice h]] over heads (contract §4)."""
    torch.manual_seed(1)
    B, S, C, heads = 2, 5, 8, 4
    att = MultiHeadAdditiveAttention(6, C, 8, heads=heads).double()
    ann = torch.randn(B, S, C, dtype=torch.double)
    query = torch.randn(B, 6, dtype=torch.double)
    mask = torch.ones(B, S, dtype=torch.bool)
    ctx, alpha = att(query, att.precompute(ann), ann, mask)
    per_head = [torch.einsum("bs,bsc->bc", alpha[:, h], ann[:, :, h * 2:(h + 1) * 2]) for h in range(heads)]
    torch.testing.assert_close(ctx, att.out(torch.cat(per_head, 1)))


def test_set_backend_switches_attention():
    model = dm.build_model("dtmt", 11, 13, embed_dim=8, hidden_size=8, heads=2)
    assert model.attention.backend == "auto"
    model.set_backend("reference")
    assert model.attention.backend == "reference" and model.encoder.backend == "reference"
    assert "backend='reference'" in repr(model.attention) and "heads=2" in repr(model.attention)
    with pytest.raises(ValueError, match="backend"):
        model.attention.backend = "fast"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("transposed", [False, True])
def test_context_backward_without_the_values_gradient(dtype, transposed):
    """values_grad=False (the unrolled decoder steps' backward) forms the weights' gradient alone: the einsum's,
    and the full backward's bit for bit; the values' gradient comes back empty."""
    alpha, leaf, values = _context_inputs(5, 9, 4, 24, dtype, seed=3, transposed=transposed)
    grad = torch.randn(5, 24, dtype=dtype)
    dalpha, empty = torch.ops.dtmt.attention_context_backward(grad, alpha.detach().contiguous(), values.detach(), False)
    full = torch.ops.dtmt.attention_context_backward(grad, alpha.detach().contiguous(), values.detach())
    assert empty.numel() == 0 and full[1].shape == values.shape
    assert torch.equal(dalpha, full[0])
    (expected,) = torch.autograd.grad(_context_per_head(alpha, values), alpha, grad)
    torch.testing.assert_close(dalpha, expected)


def _ops_called(fn):
    """The names ("namespace.name") of the ops `fn` dispatched, forward and backward (conftest.RecordOps)."""
    from conftest import RecordOps

    with RecordOps() as record:
        fn()
    return {name for name, _ in record.dispatched}


def _attention_step(backend, dtype=torch.float32, device="cpu"):
    """One multi-head attention step, forward and backward, in an `unrolled` block open on the module; returns
    (the outputs and gradients, the context's autograd node's class name)."""
    torch.manual_seed(4)
    att = MultiHeadAdditiveAttention(6, 8, 8, heads=2, backend=backend).to(device, dtype)
    ann = torch.randn(3, 5, 8, dtype=dtype, device=device, requires_grad=True)
    query = torch.randn(3, 6, dtype=dtype, device=device, requires_grad=True)
    mask = torch.arange(5, device=device).unsqueeze(0) < torch.tensor([5, 2, 4], device=device).unsqueeze(1)
    with dk.nn.unrolled(att):
        q = att.query(query).view(3, 2, -1)
        alpha = torch.softmax(dk.functional.additive_scores(att.precompute(ann), q, att.v, backend), -1)
        alpha = alpha.masked_fill(~mask.unsqueeze(1), 0.0)
        ctx = dk.nn.step_context(att, alpha, ann, backend)
        node = type(ctx.grad_fn).__name__
        ctx.square().sum().backward()
    return [ctx.detach(), ann.grad, query.grad, att.v.grad], node


def test_attention_kernel_backends_decide_the_path(monkeypatch):
    """functional.ATTENTION_KERNEL_BACKENDS decides which backends run the attention ops' kernels (the scores, the
    context, and an `unrolled` block's contexts): with "cpp" in it (the default) the cpp backend calls
    torch.ops.dtmt's ops and the block's UnrolledContext; without it the same calls run the reference's PyTorch ops
    (tanh, bmm), with the same results."""
    k, q, v = (t.detach() for t in _inputs(2, 4, 2, 5, torch.float64))
    alpha, _, values = (t.detach() for t in _context_inputs(2, 4, 2, 6, torch.float64))
    assert "cpp" in dk.functional.ATTENTION_KERNEL_BACKENDS and "cuda" not in dk.functional.ATTENTION_KERNEL_BACKENDS
    fused = _ops_called(lambda: (dk.functional.additive_scores(k, q, v, "cpp"),
                                 dk.functional.attention_context(alpha, values, "cpp")))
    assert {"dtmt.additive_scores", "dtmt.attention_context"} <= fused and "aten.tanh" not in fused
    kernels, kernels_node = _attention_step("cpp", torch.float64)
    monkeypatch.setattr(dk.functional, "ATTENTION_KERNEL_BACKENDS", frozenset())
    plain = _ops_called(lambda: (dk.functional.additive_scores(k, q, v, "cpp"),
                                 dk.functional.attention_context(alpha, values, "cpp")))
    assert not any(name.startswith("dtmt.") for name in plain) and {"aten.tanh", "aten.bmm"} <= plain
    reference_ops, reference_node = _attention_step("cpp", torch.float64)
    assert kernels_node == "CppContextStepFunctionBackward" and reference_node != kernels_node
    for a, b in zip(kernels, reference_ops):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_unrolled_context_of_16_bit_values_outside_autocast_runs_the_reference():
    """An `unrolled` block's context on cpp with bfloat16 tensors outside autocast: the kernels take float32 and
    float64 only, so the step runs the reference's ops, as functional.attention_context does (the block's path would
    call the C++ op, which refuses bfloat16), with the reference backend's results to the bit."""
    kernels, node = _attention_step("cpp", torch.bfloat16)
    reference_ops, _ = _attention_step("reference", torch.bfloat16)
    assert node != "CppContextStepFunctionBackward"
    for a, b in zip(kernels, reference_ops):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)


needs_cuda_kernels = pytest.mark.skipif(not torch.cuda.is_available() or "cuda" not in dk.available_backends(),
                                        reason="needs a CUDA device and the extension's CUDA kernels")


@pytest.fixture
def cuda_attention_kernels(monkeypatch):
    """The cuda backend's attention on its kernels (csrc/attention_cuda.cu) for one test."""
    monkeypatch.setattr(dk.functional, "ATTENTION_KERNEL_BACKENDS", dk.functional.ATTENTION_KERNEL_BACKENDS | {"cuda"})


@pytest.mark.gpu
@needs_cuda_kernels
@pytest.mark.parametrize("B,S,NH,D", [(3, 5, 4, 8), (2, 7, 1, 37), (1, 3, 2, 70), (4, 2, 3, 1)])
def test_gpu_attention_kernels_gradcheck(cuda_attention_kernels, B, S, NH, D):
    """The CUDA scores and context (float64 on the device): gradcheck, and the reference's values to 1e-12; the ops
    really are the kernels (torch.ops.dtmt's, not the reference's tanh)."""
    k, q, v = (t.detach().cuda().requires_grad_() for t in _inputs(B, S, NH, D, torch.double))
    scores = lambda k, q, v: dk.functional.additive_scores(k, q, v, "cuda")
    assert "dtmt.additive_scores" in _ops_called(lambda: scores(k, q, v))
    assert torch.autograd.gradcheck(scores, (k, q, v), eps=1e-6, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(scores(k, q, v), reference.additive_scores(k, q, v), rtol=1e-12, atol=1e-12)
    alpha, leaf, _ = _context_inputs(B, S, NH, NH * D, torch.double, transposed=True)
    alpha, leaf = alpha.detach().cuda().requires_grad_(), leaf.detach().cuda().requires_grad_()
    context = lambda a, v: dk.functional.attention_context(a, v.transpose(0, 1), "cuda")
    assert "dtmt.attention_context" in _ops_called(lambda: context(alpha, leaf))
    assert torch.autograd.gradcheck(context, (alpha, leaf), eps=1e-6, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(context(alpha, leaf), _context_per_head(alpha, leaf.transpose(0, 1)),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
@needs_cuda_kernels
def test_gpu_attention_step_matches_the_reference(cuda_attention_kernels):
    """A multi-head attention step in an `unrolled` block on the device (the context's values gradient formed once
    over the block, as on the CPU) against the reference backend: float64 to 1e-12, float32 to its rounding."""
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        kernels, node = _attention_step("cuda", dtype, "cuda")
        reference_ops, _ = _attention_step("reference", dtype, "cuda")
        assert node == "CppContextStepFunctionBackward"
        for a, b in zip(kernels, reference_ops):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.gpu
@needs_cuda_kernels
def test_gpu_attention_kernels_in_a_cuda_graph(cuda_attention_kernels):
    """The CUDA attention ops synchronise nothing with the host: a forward and backward captured as a CUDA graph
    and replayed on new inputs gives what the eager calls give."""
    B, S, NH, D = 16, 12, 4, 64
    k, q, v = (t.detach().float().cuda().requires_grad_() for t in _inputs(B, S, NH, D, torch.double))
    values = torch.randn(B, S, NH * D, device="cuda", requires_grad=True)

    def step():
        alpha = torch.softmax(dk.functional.additive_scores(k, q, v, "cuda"), -1)
        out = dk.functional.attention_context(alpha, values, "cuda")
        return torch.autograd.grad(out.square().sum(), (k, q, v, values))

    assert {"dtmt.additive_scores", "dtmt.attention_context_backward"} <= _ops_called(step)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()   # warm-up on a side stream, as torch asks before a capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():
        for t in (k, q, v, values):
            t.copy_(torch.randn_like(t))
    graph.replay()
    for a, b in zip(captured, step()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
