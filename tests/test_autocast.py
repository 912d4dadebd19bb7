"""16-bit computation on the CPU (contract §3; issue 22 item 4): the C++ transition op with bfloat16 / float16 inputs
(GEMMs in the input dtype, states and layer-norm statistics in float32), the ops' autocast rules
(dtmt_kernels/ops/_autocast.py), the layers and whole systems under torch.autocast("cpu", torch.bfloat16) against
their float32 results, and `dtmt train --amp bf16`."""
import os

import pytest
import torch

import dtmt_kernels as dk
from dtmt_kernels import reference
from dtmt_kernels.ops.transition import KINDS, flat_params
from dtmt_models import build_model

pytestmark = pytest.mark.skipif("cpp" not in dk.available_backends(), reason="the C++ extension is not built")

LOW = [torch.bfloat16, torch.float16]
TOL = {torch.bfloat16: 4e-2, torch.float16: 5e-3}     # relative to each tensor's largest entry


def _layer(cell, depth, ln, I=5, H=8):
    torch.manual_seed(0)
    layer = dk.nn.ATR(I, H, layer_norm=ln) if cell == "atr" else \
        dk.nn.DeepTransitionGRU(I, H, depth=depth, cell=cell, layer_norm=ln)
    with torch.no_grad():   # layer-norm gains and offsets away from 1 and 0
        for name, p in layer.named_parameters():
            if "ln_" in name:
                p.add_(0.3 * torch.randn_like(p))
    return layer


def _op_results(layer, x, h0, mask, drop, reverse, dtype, state_dtype):
    """out, h_n and the gradients of x, h0 and the ten flat parameters of the C++ op for the loss
    <out, g_out> + <h_n, g_h>, all inputs in `dtype` except h0 (state_dtype)."""
    params = [None if p is None else p.detach().to(dtype).requires_grad_()
              for p in flat_params(layer.direction_weights())]
    xi = x.to(dtype).requires_grad_()
    hi = h0.detach().to(state_dtype).clone().requires_grad_()
    m = None if mask is None else mask.to(dtype)
    d = None if drop is None else drop.to(dtype)
    out, h_n, xp, hs, hs_lp, hp, hpt = torch.ops.dtmt.transition_forward(
        xi, hi, m, d, KINDS[layer.cell], *params, reverse, 1e-5)
    gen = torch.Generator().manual_seed(11)
    g_out, g_h = torch.randn(out.shape, generator=gen), torch.randn(h_n.shape, generator=gen)
    ((out.float() * g_out).sum() + (h_n.float() * g_h).sum()).backward()
    grads = [xi.grad, hi.grad] + [p.grad for p in params if p is not None]
    return [out, h_n] + grads, (xp, hs, hs_lp, hp)


def _reference_results(layer, x, h0, mask, drop, reverse, dtype):
    """The same quantities from the pure-PyTorch reference in float64, on the inputs rounded to `dtype` (so that
    only the computation differs)."""
    def r(t):
        return None if t is None else t.detach().to(dtype).double()
    w = layer.direction_weights()
    params = [None if p is None else r(p).requires_grad_() for p in flat_params(w)]
    xi, hi = r(x).requires_grad_(), h0.detach().double().clone().requires_grad_()
    n_t = w.depth
    t_w = [params[6][k] for k in range(n_t)] if n_t else []
    t_b = [params[7][k] for k in range(n_t)] if n_t else []
    t_ln_w = [params[8][k] if params[8] is not None else None for k in range(n_t)]
    t_ln_b = [params[9][k] if params[9] is not None else None for k in range(n_t)]
    w64 = reference.TransitionWeights(w.cell, *params[:6], t_w, t_b, t_ln_w, t_ln_b)
    out, h_n = reference.transition_sequence(xi, hi, w64, r(mask), r(drop), reverse, 1e-5)
    gen = torch.Generator().manual_seed(11)
    g_out, g_h = torch.randn(out.shape, generator=gen), torch.randn(h_n.shape, generator=gen)
    ((out * g_out.double()).sum() + (h_n * g_h.double()).sum()).backward()
    return [out, h_n, xi.grad, hi.grad] + [p.grad for p in params if p is not None]


CASES = [("lgru", 2, True), ("gru", 0, False), ("lau", 1, True), ("atr", 0, True), ("atr", 0, False)]


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-d{c[1]}-{'ln' if c[2] else 'noln'}")
@pytest.mark.parametrize("state_dtype", ["input", "float32"])
def test_cpu_op_with_16_bit_inputs_matches_the_float64_reference(dtype, case, state_dtype):
    """Outputs, final state and every gradient against the float64 reference on the same rounded inputs, with
    padding, reversal and candidate dropout; h0 in the input dtype or in float32 (the autocast rule's choice),
    h_n and dh0 coming back in h0's dtype. The GEMM results and the saved pre-activations are in the input dtype
    and the states in float32 (with their 16-bit copy, the GEMMs' operand)."""
    cell, depth, ln = case
    layer = _layer(cell, depth, ln)
    T, B, H = 6, 4, layer.hidden_size
    torch.manual_seed(1)
    x, h0 = torch.randn(T, B, layer.input_size), 0.5 * torch.randn(B, H)
    mask = torch.ones(T, B)
    mask[4:, 1], mask[2:, 3] = 0, 0
    drop = None if cell == "atr" else (torch.rand(depth + 1, B, H) > 0.25).float() / 0.75
    sd = dtype if state_dtype == "input" else torch.float32
    got, (xp, hs, hs_lp, hp) = _op_results(layer, x, h0, mask, drop, True, dtype, sd)
    ref = _reference_results(layer, x, h0.to(sd), mask, drop, True, dtype)
    assert got[0].dtype == dtype and xp.dtype == dtype and hp.dtype == dtype
    assert hs.dtype == torch.float32 and hs_lp.dtype == dtype and hs_lp.shape == hs.shape
    assert got[1].dtype == sd and got[3].dtype == sd
    names = ["out", "h_n", "dx", "dh0"] + [f"dparam{i}" for i in range(len(got) - 4)]
    for name, g, r in zip(names, got, ref):
        assert torch.isfinite(g).all(), name
        scale = r.abs().max().item() + 1e-3
        err = (g.double() - r).abs().max().item() / scale
        assert err <= TOL[dtype], f"{name}: relative error {err:.2e} > {TOL[dtype]}"


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", [("lgru", 1, True), ("atr", 0, False)], ids=["lgru-d1-ln", "atr"])
def test_a_16_bit_batch_of_no_rows_has_empty_gradients(dtype, case):
    """B = 0 in 16 bits: the forward ran, the backward failed with "expected scalar type Float but found BFloat16"
    (its gradient of the outputs left unconverted, being empty), where float32 gave empty gradients. Now every
    gradient is empty, of its input's shape and dtype (dh0 zero-size too), as in float32."""
    cell, depth, ln = case
    layer = _layer(cell, depth, ln)
    x, h0 = torch.randn(3, 0, layer.input_size), torch.zeros(0, layer.hidden_size)
    got, _ = _op_results(layer, x, h0, None, None, False, dtype, dtype)
    assert got[0].shape == (3, 0, layer.hidden_size) and got[2].shape == x.shape and got[2].dtype == dtype
    assert got[3].shape == h0.shape
    params = [p for p in flat_params(layer.direction_weights()) if p is not None]
    for g, p in zip(got[4:], params):
        assert g.shape == p.shape and g.dtype == dtype and not g.any()


@pytest.mark.parametrize("case", [("lgru", 1, True), ("atr", 0, True)], ids=["lgru-d1-ln", "atr-ln"])
def test_16_bit_op_passes_opcheck(case):
    """Schema, fake (dtypes of every result, h_n in h0's dtype), autograd registration and AOT dispatch with
    bfloat16 inputs and a float32 h0."""
    cell, depth, ln = case
    layer = _layer(cell, depth, ln)
    params = [None if p is None else p.detach().bfloat16().requires_grad_()
              for p in flat_params(layer.direction_weights())]
    x = torch.randn(3, 2, 5, dtype=torch.bfloat16, requires_grad=True)
    h0 = torch.randn(2, 8, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]], dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.dtmt.transition_forward.default,
                          (x, h0, mask, None, KINDS[cell], *params, False, 1e-5))


def test_autocast_rule_of_a_direct_op_call():
    """torch.ops.dtmt.transition_forward called under autocast with float32 tensors (keyword flags too): the
    rule casts x and the weights to bfloat16 and h0 to float32, like the layers."""
    layer = _layer("gru", 1, True)
    params = [None if p is None else p.detach() for p in flat_params(layer.direction_weights())]
    x, h0 = torch.randn(3, 2, 5), torch.randn(2, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, h_n, xp, hs, hs_lp, hp, hpt = torch.ops.dtmt.transition_forward(
            x, h0, None, None, KINDS["gru"], *params, reverse=False, eps=1e-5)
    assert out.dtype == xp.dtype == hs_lp.dtype == torch.bfloat16 and h_n.dtype == hs.dtype == torch.float32
    ref, ref_h = torch.ops.dtmt.transition_forward(x, h0, None, None, KINDS["gru"], *params, False, 1e-5)[:2]
    assert (h_n - ref_h).abs().max().item() <= 3e-2 * ref_h.abs().max().item()


def _grads(module, loss):
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    return dict(zip(names, torch.autograd.grad(loss, [p for _, p in module.named_parameters() if p.requires_grad])))


@pytest.mark.parametrize("backend", ["cpp", "reference"])
@pytest.mark.parametrize("kind", ["dt-lgru-bidirectional", "atr-reversed", "dt-cell"])
def test_layers_compute_in_bfloat16_under_autocast(kind, backend):
    """A layer under torch.autocast("cpu", torch.bfloat16), float32 parameters and input: the output in bfloat16,
    the final state in float32, float32 parameter gradients; all within bfloat16 precision of the float32 layer.
    The result differs from float32 (the GEMMs did run in bfloat16). The same dtypes on either backend (contract §3:
    switching `.backend` gives the same outputs; the reference's out was float32 under autocast)."""
    torch.manual_seed(2)
    if kind == "dt-cell":
        layer = dk.nn.DeepTransitionGRUCell(6, 16, depth=1, cell="lgru", layer_norm=True)
        args = (torch.randn(5, 6), torch.randn(5, 16))
    elif kind == "atr-reversed":
        layer = dk.nn.ATR(6, 16, layer_norm=True, reverse=True)
        args = (torch.randn(7, 5, 6), None, [7, 2, 5, 7, 1])
    else:
        layer = dk.nn.DeepTransitionGRU(6, 16, depth=2, cell="lgru", layer_norm=True, bidirectional=True)
        args = (torch.randn(7, 5, 6), None, [7, 2, 5, 7, 1])
    layer.backend = backend

    def run():
        r = layer(*args)
        outs = r if isinstance(r, tuple) else (r,)
        return outs, sum((o.float() * torch.linspace(-1, 1, o.numel()).view(o.shape)).sum() for o in outs)

    ref_outs, ref_loss = run()
    ref_grads = _grads(layer, ref_loss)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs, loss = run()
    grads = _grads(layer, loss)
    if kind == "dt-cell":
        assert outs[0].dtype == torch.float32                      # a cell's output is its state
    else:
        assert outs[0].dtype == torch.bfloat16 and outs[1].dtype == torch.float32
    for o, r in zip(outs, ref_outs):
        err = (o.float() - r).abs().max().item()
        assert 0 < err <= 3e-2 * r.abs().max().item()
    for name, g in grads.items():
        assert g.dtype == torch.float32, name
        scale = ref_grads[name].abs().max().item() + 1e-6
        assert (g - ref_grads[name]).abs().max().item() <= 5e-2 * scale, name


def test_a_16_bit_input_under_autocast_gives_the_same_dtypes_on_both_backends():
    """x already in float16 under torch.autocast("cpu", torch.float16): the fused rule turns the zero state into
    float32, so h_n is float32; the reference backend returned h_n in float16 (the layer's h0 is made in x's
    dtype). Now both give out in float16 and h_n in float32, within float16 precision of each other."""
    torch.manual_seed(3)
    layer = dk.nn.DeepTransitionGRU(3, 8, depth=1, layer_norm=True)
    x = torch.randn(5, 2, 3).half()
    results = {}
    for backend in ("cpp", "reference"):
        layer.backend = backend
        with torch.autocast("cpu", dtype=torch.float16):
            results[backend] = layer(x, lengths=[5, 3])
        assert [t.dtype for t in results[backend]] == [torch.float16, torch.float32], backend
    for a, b in zip(results["cpp"], results["reference"]):
        assert (a.float() - b.float()).abs().max().item() <= 1e-2


def test_attention_ops_run_in_float32_under_autocast():
    """Mixed bfloat16 / float32 inputs (as autocast's linear layers leave them) are accepted and computed in
    float32; bfloat16 inputs outside autocast take the reference's ops."""
    torch.manual_seed(3)
    keys, query, v = torch.randn(2, 5, 2, 4), torch.randn(2, 2, 4), torch.randn(2, 4)
    ref = reference.additive_scores(keys, query, v)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = dk.functional.additive_scores(keys.bfloat16(), query.bfloat16(), v)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, reference.additive_scores(keys.bfloat16().float(), query.bfloat16().float(), v))
    outside = dk.functional.additive_scores(keys.bfloat16(), query.bfloat16(), v.bfloat16())
    assert outside.dtype == torch.bfloat16
    assert torch.equal(outside, reference.additive_scores(keys.bfloat16(), query.bfloat16(), v.bfloat16()))
    torch.testing.assert_close(outside.float(), ref, atol=0.03, rtol=0.02)     # bfloat16's rounding, no more
    alpha, values = torch.softmax(ref, -1), torch.randn(2, 5, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ctx = dk.functional.attention_context(alpha, values.bfloat16())
    torch.testing.assert_close(ctx, reference.attention_context(alpha, values.bfloat16().float()))


@pytest.mark.parametrize("system", ["dtmt", "rnnsearch-atr", "mce"])
def test_systems_train_under_autocast(system):
    """A training forward and backward under autocast (the decoders' unrolled steps included): the loss within
    0.2% of float32's, every parameter gets a float32 gradient, the gradients point the same way as float32's
    (cosine > 0.9995 over all parameters) and each of weight (norm over 1e-3 of the largest) is within 8% of
    float32's. Measured on Zen 4: loss 1.9e-4, 1 - cosine 4.8e-5, worst gradient 1.6% (dtmt)."""
    torch.manual_seed(4)
    model = build_model(system, 40, 50, embed_dim=24, hidden_size=24, dropout=0.0)
    model.train()
    src = torch.randint(4, 40, (4, 9))
    lengths = torch.tensor([9, 7, 5, 3])
    for i, n in enumerate(lengths.tolist()):
        src[i, n:] = 0
    prev, target = torch.randint(4, 50, (4, 6)), torch.randint(4, 50, (4, 6))

    def loss_and_grads():
        torch.manual_seed(5)     # the same candidate-dropout masks in both runs
        loss, _, n = model(src, lengths, prev, target=target, smoothing=0.1)
        loss = loss / n
        return loss.detach(), torch.autograd.grad(loss, list(model.parameters()))

    ref_loss, ref_grads = loss_and_grads()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grads = loss_and_grads()
    assert loss.dtype == torch.float32
    assert 0 < abs(loss.item() - ref_loss.item()) <= 2e-3 * ref_loss.item()
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
    flat, ref_flat = torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in ref_grads])
    assert torch.nn.functional.cosine_similarity(flat, ref_flat, dim=0).item() > 0.9995
    largest = max(g.norm().item() for g in ref_grads)
    for (name, _), g, want in zip(model.named_parameters(), grads, ref_grads):
        if want.norm() > 1e-3 * largest:   # each gradient of weight within a few bfloat16 roundings of float32's
            assert (g - want).norm() <= 0.08 * want.norm(), name


def test_train_amp_bf16(tmp_path, capsys):
    """`dtmt train --amp bf16`: recorded in config.yaml; the first update's loss is bfloat16's (close to, and not
    the same as, float32's) and training goes on finite; a bad value is one line, exit 2."""
    from test_train import TINY, losses, make_toy_corpus, train_here

    data = make_toy_corpus(tmp_path / "toy", n_train=200, n_dev=0, n_test=0)
    runs = {}
    for amp in ("off", "bf16"):
        out = str(tmp_path / amp)
        r = train_here(["--data", data, "--out", out, "--max-steps", "4", "--log-every", "1", "--amp", amp, *TINY],
                       capsys)
        assert r.returncode == 0, r.stderr
        runs[amp] = [float(loss) for _, loss, _ in losses(out)]
    with open(os.path.join(str(tmp_path / "bf16"), "config.yaml")) as f:
        assert "amp: bf16" in f.read()
    first_off, first_bf16 = runs["off"][0], runs["bf16"][0]
    assert first_off != first_bf16 and abs(first_off - first_bf16) <= 1e-2 * first_off
    assert len(runs["bf16"]) == 4 and all(map(lambda v: v == v and v < 1e4, runs["bf16"]))
    r = train_here(["--data", data, "--out", str(tmp_path / "bad"), "--amp", "fp8", *TINY], capsys)
    assert r.returncode == 2 and "--amp" in r.stderr and not os.path.exists(tmp_path / "bad")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_layer_under_autocast(backend):
    """The CUDA kernels and the Triton op under torch.autocast("cuda", torch.bfloat16): the output in bfloat16,
    the state in float32, within bfloat16 precision of the float32 layer, gradients included."""
    if backend not in dk.available_backends():
        pytest.skip(f"backend {backend} not available")
    torch.manual_seed(6)
    layer = dk.nn.DeepTransitionGRU(32, 64, depth=2, cell="lgru", layer_norm=True, bidirectional=True,
                                    backend=backend).cuda()
    x = torch.randn(9, 8, 32, device="cuda")
    lengths = [9, 3, 5, 9, 1, 7, 8, 2]
    ref, ref_h = layer(x, None, lengths)
    ref_grads = _grads(layer, ref.sum() + ref_h.sum())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, h_n = layer(x, None, lengths)
    grads = _grads(layer, out.float().sum() + h_n.sum())
    assert out.dtype == torch.bfloat16 and h_n.dtype == torch.float32
    assert (out.float() - ref).abs().max().item() <= 3e-2 * ref.abs().max().item()
    for name, g in grads.items():
        assert g.dtype == torch.float32, name
        assert (g - ref_grads[name]).abs().max().item() <= 5e-2 * (ref_grads[name].abs().max().item() + 1e-6), name
