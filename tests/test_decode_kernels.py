"""The decoding kernels: the small-row linear (csrc/small_gemm_cpu.cpp) against a float64 product, and the
inference-only fused attention step, readout features and memory encoder (csrc/engine/decode_step_cpu.cpp), the
modules' inference forms, against the modules themselves, and the systems' inference decoders
(`Seq2Seq.inference_decoder`, the fused whole step among them) against the models on the reference backend."""
import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from conftest import assert_decoders_step_alike, at_thread_counts
import dtmt_kernels as dk
from dtmt_kernels import _C
from dtmt_models.engine import EngineOptions
from dtmt_models.engine import ops as engine_ops
from dtmt_models.engine.forms import (AttentionStep, FrozenMemoryEncoder, FrozenReadout, FrozenTransitionLayer,
                                     inference_form)
from dtmt_models.models.attention import AdditiveAttention, MultiHeadAdditiveAttention
from dtmt_models.models.registry import build_model
from dtmt_models.engine.rnmt import FusedRNMTDecoder
from dtmt_models.models.seq2seq import Readout
from dtmt_models.models.modes import any_training

pytestmark = pytest.mark.skipif("cpp" not in dk.available_backends(), reason="C++ extension not built")


def _f64_linear(x, w, b):
    out = x.double() @ w.double().t()
    return out if b is None else out + b.double()


@settings(max_examples=40, deadline=None)
@given(M=st.integers(1, _C.SMALL_ROWS_MAX), K=st.integers(1, 300), N=st.integers(1, 700), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_small_rows_linear_matches_float64(M, K, N, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    out = torch.ops.dtmt.small_rows_linear(x, w, b if bias else x.new_empty(0))
    assert out.shape == (M, N) and not out.isnan().any()
    torch.testing.assert_close(out.double(), _f64_linear(x, w, b), rtol=1e-5, atol=1e-5 * K ** 0.5)


def test_small_rows_linear_refuses_a_bias_of_another_shape():
    """A bias of shape [1], [] or [M, 1] went through ATen's addmm broadcasting (a per-row bias with [M, 1]): the op
    takes a bias [N] or none (empty). dk.functional.linear, F.linear's stand-in, leaves such a bias to F.linear."""
    x, w = torch.randn(2, 5), torch.randn(3, 5)
    for bias in (torch.zeros(1), torch.zeros(()), torch.zeros(2, 1), torch.zeros(4)):
        with pytest.raises(RuntimeError, match=r"bias \[N = 3\] or none expected"):
            torch.ops.dtmt.small_rows_linear(x, w, bias)
    torch.testing.assert_close(torch.ops.dtmt.small_rows_linear(x, w, torch.ones(3)), x @ w.T + 1)
    torch.testing.assert_close(torch.ops.dtmt.small_rows_linear(x, w, x.new_empty(0)), x @ w.T)
    for bias in (torch.zeros(1), torch.zeros(()), torch.ones(2, 1)):   # F.linear broadcasts them: so does linear
        torch.testing.assert_close(dk.functional.linear(x, w, bias), F.linear(x, w, bias))
    # an empty bias is the op's "none", but F.linear refuses it: so does linear at every number of rows (at 8 rows
    # or fewer it was dropped silently)
    for rows in (1, 8, 9):
        with pytest.raises(RuntimeError, match="expanded size"):
            dk.functional.linear(torch.randn(rows, 5), w, x.new_empty(0))


def test_small_rows_linear_strided_rows_threads_and_fallback():
    g = torch.Generator().manual_seed(1)
    big, w, b = torch.randn(8, 700, generator=g), torch.randn(3000, 300, generator=g), torch.randn(3000, generator=g)
    x = big[:5, 100:400]                      # row stride 700: taken as it lies
    assert x.stride() == (700, 1)
    expected = _f64_linear(x, w, b)
    one, two = at_thread_counts(lambda: torch.ops.dtmt.small_rows_linear(x, w, b), 1, 2)
    assert torch.equal(one, two)              # each output summed by one thread in a fixed order
    torch.testing.assert_close(one.double(), expected, rtol=1e-5, atol=1e-4)
    # more rows than the kernel takes, float64, a non-contiguous last dim: ATen's GEMM, same result
    for xx, ww in ((torch.randn(9, 300, generator=g), w), (x.double(), w.double()), (big[:4, ::2][:, :300], w)):
        torch.testing.assert_close(torch.ops.dtmt.small_rows_linear(xx, ww, b.to(ww.dtype)).double(), _f64_linear(xx, ww, b),
                                   rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("M", range(1, _C.SMALL_ROWS_MAX + 1))
def test_small_rows_linear_column_sums_do_not_depend_on_their_neighbours(M):
    """Each output column is summed in one fixed order wherever it falls among the weight rows the loop takes
    together (the avx512 copy takes 4 or 2 at a time, leftovers one by one): any slice of the weight rows gives the
    full product's columns to the bit, K with and without a tail past the vector width."""
    g = torch.Generator().manual_seed(M)
    for K in (48, 61):
        x, w, b = torch.randn(M, K, generator=g), torch.randn(23, K, generator=g), torch.randn(23, generator=g)
        full = torch.ops.dtmt.small_rows_linear(x, w, b)
        torch.testing.assert_close(full.double(), _f64_linear(x, w, b), rtol=1e-5, atol=1e-5 * K ** 0.5)
        for lo, hi in ((0, 1), (1, 4), (2, 9), (3, 23), (21, 23), (5, 6)):
            assert torch.equal(torch.ops.dtmt.small_rows_linear(x, w[lo:hi], b[lo:hi]), full[:, lo:hi]), (K, lo, hi)


def test_functional_linear_paths(monkeypatch):
    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(2, 3, 64, generator=g), torch.randn(40, 64, generator=g), torch.randn(40, generator=g)
    calls = []
    kernel = dk.functional.small_rows_linear
    monkeypatch.setattr(dk.functional, "small_rows_linear", lambda *a: calls.append(1) or kernel(*a))
    with torch.no_grad():
        fast = dk.functional.linear(x, w, b)                      # 6 rows: the small-row kernel
        assert calls == [1]
        assert fast.shape == (2, 3, 40)
        torch.testing.assert_close(fast, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        assert torch.equal(dk.functional.linear(x, w, b, backend="reference"), F.linear(x, w, b))
    # with gradients: F.linear, so autograd works
    wg = w.clone().requires_grad_()
    dk.functional.linear(x, wg, b).sum().backward()
    torch.testing.assert_close(wg.grad, x.reshape(-1, 64).sum(0).expand(40, 64))
    with pytest.raises(ValueError, match="backend"):
        dk.functional.linear(x, w, b, backend="nope")
    # a backend named that cannot run these tensors says why, as the recurrent ops do (it ran F.linear silently)
    for name in ("cuda", "triton"):
        try:
            dk.backends.resolve_backend(name, x.device)
        except ValueError as exc:
            with pytest.raises(ValueError, match=f"backend '{name}' .*") as caught:
                dk.functional.linear(x, w, b, backend=name)
            assert str(caught.value) == str(exc)
        else:
            torch.testing.assert_close(dk.functional.linear(x, w, b, backend=name), F.linear(x, w, b))


def test_nn_linear_is_a_drop_in_for_torch_linear():
    torch.manual_seed(0)
    ref = torch.nn.Linear(32, 24)
    lin = dk.nn.Linear(32, 24)
    lin.load_state_dict(ref.state_dict())
    assert set(lin.state_dict()) == {"weight", "bias"}
    x = torch.randn(3, 32)
    with torch.no_grad():
        torch.testing.assert_close(lin(x), ref(x), rtol=1e-5, atol=1e-6)
    lin(x).sum().backward()
    assert lin.weight.grad is not None and "backend='auto'" in repr(lin)
    # under autocast the dtype torch.nn.Linear gives, whatever the rows and the grad mode (the small-row kernel's
    # float32 result came out as it was: float32 for 8 rows without a gradient, bfloat16 for 9, a probe's finding)
    for rows in (1, 8, 9):
        x = torch.randn(rows, 32)
        for grad in (False, True):
            with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16):
                ours, theirs = lin(x), ref(x)
            assert ours.dtype == theirs.dtype == torch.bfloat16, (rows, grad)
            torch.testing.assert_close(ours.float(), theirs.float(), rtol=2e-2, atol=2e-2)


def _attention_inputs(B, S, Q, C, A, heads, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    annotations = torch.randn(B, S, C, generator=g, dtype=dtype)
    lengths = torch.randint(1, S + 1, (B,), generator=g)
    lengths[0] = S
    mask = torch.arange(S).unsqueeze(0) < lengths.unsqueeze(1)
    annotations = annotations * mask.unsqueeze(-1)
    return torch.randn(B, Q, generator=g, dtype=dtype), annotations, mask


def _randomise(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return module


def _sequence_layer(layer_kind: str, H: int):
    """A sequence layer for the FrozenTransitionLayer tests, its parameters randomised, in eval mode: input size 6,
    hidden size H, layer_kind "cell-rest" with rest "bi" (bidirectional, two T-GRUs), "reverse" (one direction read
    right to left) or "shallow" (bidirectional, no T-GRU); ATR layers bidirectional."""
    cell, rest = layer_kind.split("-")
    torch.manual_seed(0)
    if cell == "atr":
        layer = dk.nn.ATR(6, H, layer_norm=True, bidirectional=True)
    else:
        layer = dk.nn.DeepTransitionGRU(6, H, depth=0 if rest == "shallow" else 2, cell=cell, layer_norm=True,
                                        bidirectional=rest in ("bi", "shallow"), reverse=rest == "reverse")
    return _randomise(layer, 7).eval()


def test_weight_structures_mirror_the_extension():
    """The Python weight structures and csrc/engine/decode_step.h's structs list the same fields in the same order."""
    E = engine_ops
    for cls, fields in ((E.AttentionWeights, _C.ATTENTION_WEIGHT_FIELDS), (E.ReadoutWeights, _C.READOUT_WEIGHT_FIELDS),
                        (E.MemoryWeights, _C.MEMORY_WEIGHT_FIELDS)):
        assert cls.tensor_fields() == tuple(fields.split())


@pytest.mark.parametrize("kind", ["multi-head", "plain", "layer-norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@settings(max_examples=10, deadline=None)
@given(B=st.integers(1, 9), S=st.integers(1, 20), heads=st.sampled_from([1, 2, 4]), seed=st.integers(0, 999))
def test_attention_step_matches_the_module(kind, dtype, B, S, heads, seed):
    """The attention's inference form (one fused call) against the module's own ops; "layer-norm" is Nematus'
    attention (layer norm on the projected query and on the keys, random gains and offsets)."""
    Q, C, A = 12, 8 * heads, 4 * heads
    if kind == "multi-head":
        att = MultiHeadAdditiveAttention(Q, C, A, heads)
    else:
        heads = 1
        att = AdditiveAttention(Q, C, A, layer_norm=kind == "layer-norm")
    att = _randomise(att.to(dtype), seed).eval()
    query, annotations, mask = _attention_inputs(B, S, Q, C, A, heads, seed, dtype)
    step = inference_form(att)
    assert type(step) is AttentionStep
    att.backend = "reference"   # (the module on its own ops would share the step's C++ scores)
    keys = att.precompute(annotations)
    ctx_ref, alpha_ref = att(query, keys, annotations, mask)      # the module's pure-PyTorch reference
    with torch.no_grad():
        ctx, alpha = step(query, step.precompute(annotations), annotations, mask)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(alpha, alpha_ref.detach(), **tol)
    torch.testing.assert_close(ctx, ctx_ref.detach(), **tol)
    assert (alpha.reshape(B, -1, S)[~mask.unsqueeze(1).expand(B, alpha.reshape(B, -1, S).shape[1], S)] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@settings(max_examples=12, deadline=None)
@given(B=st.integers(1, 5), S=st.sampled_from([1, 7, 16, 17, 64, 65, 150]), heads=st.sampled_from([1, 2, 4]),
       D=st.sampled_from([1, 5, 16, 33]), seed=st.integers(0, 999))
def test_attention_scores_from_the_keys_exponentials(dtype, B, S, heads, D, seed):
    """dtmt::key_exps (exp(2 keys), positions last, padded to 16 with ones) and the attention step's scores from
    them (tanh(k + q) = 1 - 2 / (exp(2k) exp(2q) + 1); in the AVX-512 copy 1 / x by a reciprocal and a Newton step)
    against the plain step: the same attention weights and context within float32 / float64 rounding, for padded
    batches and position counts on both sides of the loops' 16 and 64 lanes. Keys beyond +-20 give no
    exponentials, and a query beyond +-20 takes the plain loop: the plain step to the bit."""
    g = torch.Generator().manual_seed(seed)
    Q, C = 12, 8 * heads
    keys = (3 * torch.randn(B, S, heads, D, generator=g)).to(dtype)
    annotations = torch.randn(B, S, C, generator=g, dtype=dtype)
    lengths = torch.randint(1, S + 1, (B,), generator=g)
    mask = torch.arange(S).unsqueeze(0) < lengths.unsqueeze(1)
    query = torch.randn(B, Q, generator=g, dtype=dtype)
    weights = engine_ops.AttentionWeights(torch.randn(heads * D, Q, generator=g, dtype=dtype) * 0.5,
                                             torch.randn(heads, D, generator=g, dtype=dtype))
    exps = torch.ops.dtmt.key_exps(keys)
    Sp = (S + 15) // 16 * 16
    assert exps.shape == (B, heads, D, Sp)
    torch.testing.assert_close(exps[..., :S], (2 * keys.double()).exp().permute(0, 2, 3, 1).to(dtype),
                               rtol=1e-6 if dtype == torch.float32 else 1e-15, atol=0)
    assert (exps[..., S:] == 1).all()

    def step(q, e):
        return torch.ops.dtmt.attention_step(q, keys, annotations, mask, weights.tensors, 1e-5, e)

    ctx, alpha = step(query, exps)
    ctx_ref, alpha_ref = step(query, None)
    # (float32: each tanh within ~1e-7 of the plain loop's, summed over D features and S positions)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(alpha, alpha_ref, **tol)
    torch.testing.assert_close(ctx, ctx_ref, **tol)
    assert (alpha[~mask.unsqueeze(1).expand_as(alpha)] == 0).all()
    # a query beyond the bound (its projection's largest value 100): the plain loop. (query * 100 was not always
    # beyond it: with D = 1 a projection of ~0.07 happens, as Hypothesis found)
    far = query * (100 / (query @ weights.tensors[0].t()).abs().max())
    assert all(torch.equal(a, b) for a, b in zip(step(far, exps), step(far, None)))
    far_keys = keys.clone()
    far_keys.view(-1)[-1] = 20.5
    assert torch.ops.dtmt.key_exps(far_keys).numel() == 0


def test_attention_with_a_query_norm_the_step_cannot_take_has_no_inference_form():
    """A query layer norm without gain and offset is not what the fused step takes: the module is its own
    inference form; with the usual affine norm it gets an AttentionStep, which gives the module's result. The
    reference backend has none either."""
    query, annotations, mask = _attention_inputs(2, 5, 6, 8, 4, 1, 0, torch.float32)
    for affine in (False, True):
        att = _randomise(AdditiveAttention(6, 8, 4, layer_norm=True), 1)
        att.ln_q = torch.nn.LayerNorm(4, elementwise_affine=affine)
        form = inference_form(att)
        assert (type(form) is AttentionStep) == affine and (form is att) != affine
        keys = att.precompute(annotations)
        with torch.no_grad():
            torch.testing.assert_close(form(query, keys, annotations, mask), att(query, keys, annotations, mask),
                                       rtol=1e-5, atol=1e-6)
        att.backend = "reference"
        assert inference_form(att) is att


@pytest.mark.parametrize("layer_norm", [True, False])
@pytest.mark.parametrize("lead", [(5,), (3, 7)])
def test_readout_features_match_the_module(layer_norm, lead):
    readout = _randomise(Readout(10, 12, 16, 9, 30, layer_norm=layer_norm), 3)
    g = torch.Generator().manual_seed(4)
    y, s, c = (torch.randn(*lead, d, generator=g) for d in (10, 12, 16))
    expected = readout.features(y, s, c)                         # the module's ops
    form = inference_form(readout)
    assert type(form) is FrozenReadout
    with torch.no_grad():
        out = form.features(y, s, c)
        torch.testing.assert_close(form(out), readout(out))     # the projection is the readout's own
    assert out.shape == (*lead, 9)
    torch.testing.assert_close(out, expected.detach(), rtol=1e-5, atol=1e-6)
    readout.from_y.backend = "reference"                         # the switch turns the fused op off
    assert inference_form(readout) is readout


FUSED_STEP_SYSTEMS = ("dtmt", "shallow-rnmt", "rnnsearch-atr", "mce", "nematus")   # engine.rnmt.FusedRNMTDecoder


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("system", ["dtmt", "shallow-rnmt", "rnnsearch-atr", "nematus", "gnmt-atr", "deeplau",
                                    "mce", "transformer"])
def test_inference_decoder_steps_match_the_modules(system, dtype):
    """A system's inference decoder at batch 1, beam 4 (the rows the small-row kernel and the fused ops take)
    gives the same log-probabilities and states as the same model on the reference backend with gradients on,
    which runs none of them (the transformer has no backend switch; with gradients on its linears are
    F.linear)."""
    torch.manual_seed(0)
    model = build_model(system, 50, 60, embed_dim=16, hidden_size=24).eval().to(dtype)
    src, lengths = torch.randint(4, 50, (4, 6)), torch.tensor([6, 6, 4, 2])
    prev = torch.randint(4, 60, (4,))
    with torch.no_grad():
        decoder = model.inference_decoder()
        assert isinstance(decoder, FusedRNMTDecoder) == (system in FUSED_STEP_SYSTEMS)
        assert decoder.inference_decoder() is decoder
        state = decoder.encode(src, lengths)
        fast, state_fast = decoder.step(state, prev)
        fast2, _ = decoder.step(decoder.reorder(state_fast, torch.tensor([1, 0, 3, 2])), prev)
    own = {id(p) for p in model.parameters()}
    assert all(id(p) in own for p in decoder_parameters(decoder))   # shared, not copied
    model.set_backend("reference")
    state = model.encode(src, lengths)
    slow, state_slow = model.step(state, prev)
    slow2, _ = model.step(model.reorder(state_slow, torch.tensor([1, 0, 3, 2])), prev)
    assert slow.requires_grad
    # (float32: the fused step's log-probabilities within 1e-7 of float64's here, every system; 1e-5 leaves room for
    # the other instruction-set copies' orders of the same sums)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(fast, slow.detach(), **tol)
    torch.testing.assert_close(fast2, slow2.detach(), **tol)
    if system != "transformer":   # the new state: s and the head-averaged attention
        torch.testing.assert_close(state_fast["s"], state_slow["s"].detach(), **tol)
        torch.testing.assert_close(state_fast["attn"], state_slow["attn"].detach(), **tol)


def decoder_parameters(decoder):
    return (decoder.model if isinstance(decoder, FusedRNMTDecoder) else decoder).parameters()


def _count_fused_steps(monkeypatch):
    calls = []
    fused = engine_ops.rnmt_step
    monkeypatch.setattr(engine_ops, "rnmt_step", lambda *a, **k: calls.append(1) or fused(*a, **k))
    return calls


def _fused_against_reference(model, calls, fused, src, lengths, prev):
    """Two steps of `model`'s inference decoder against the same model on the reference backend: the fused op
    ran (`calls`) exactly where `fused` says, and log-probabilities, states and attention agree."""
    with torch.no_grad():
        decoder = model.inference_decoder()
        assert isinstance(decoder, FusedRNMTDecoder) == fused
        state = decoder.encode(src, lengths)
        calls.clear()
        fast, fast_state = decoder.step(state, prev)
        fast2, _ = decoder.step(fast_state, prev)
        assert calls == ([1, 1] if fused else [])
        model.set_backend("reference")
        slow, slow_state = model.step(model.encode(src, lengths), prev)
        slow2, _ = model.step(slow_state, prev)
        model.set_backend("auto")
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast2, slow2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast_state["s"], slow_state["s"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast_state["attn"], slow_state["attn"], rtol=1e-5, atol=1e-6)


_SRC, _LENGTHS = torch.randint(4, 50, (3, 6), generator=torch.Generator().manual_seed(9)), torch.tensor([6, 4, 1])
_PREV = torch.randint(4, 60, (3,), generator=torch.Generator().manual_seed(10))


@pytest.mark.parametrize("decoder, options, fused", [
    ("deep-transition", {}, True), ("shallow", {"layer_norm": False}, True),
    ("shallow", {"tie_embeddings": False}, True), ("cgru", {}, False), ("bideep", {}, False)])
def test_nematus_decoders_fused_where_one_level(monkeypatch, decoder, options, fused):
    """Nematus' one-level cGRU decoders (deep-transition: a T-GRU in the decoder cell; with and without layer
    norm, tied or not) get the fused decoder; decoders with higher levels keep the modules' step (with their
    inference forms). Both give the reference backend's log-probabilities and states."""
    torch.manual_seed(1)
    depth = {"dec_base_transition_depth": 3} if decoder in ("deep-transition", "bideep") else {}   # (read there)
    model = _randomise(build_model("nematus", 50, 60, embed_dim=16, hidden_size=24, decoder=decoder, **depth,
                                   **options), 2).eval()
    _fused_against_reference(model, _count_fused_steps(monkeypatch), fused, _SRC, _LENGTHS, _PREV)


@pytest.mark.parametrize("system", ["nematus", "dtmt"])
def test_fused_step_uses_each_norms_own_eps(monkeypatch, system):
    """Non-default eps everywhere (the cells', the attention query norm's, the readout norms'): each reaches its
    own norm in the fused op (a swap of any two would show at these values)."""
    torch.manual_seed(2)
    model = _randomise(build_model(system, 50, 60, embed_dim=16, hidden_size=24), 3).eval()
    model.query_cell.eps = model.decoder_cell.eps = 0.05
    for n in model.readout.norms:
        n.eps = 0.7
    if system == "nematus":
        model.attention.ln_q.eps = 0.3
    _fused_against_reference(model, _count_fused_steps(monkeypatch), True, _SRC, _LENGTHS, _PREV)


def _mix_norms(model):
    model.readout.norms[1] = torch.nn.Identity()


def _unequal_eps(model):
    model.readout.norms[2].eps = 0.5


def _reference_linear(model):
    model.readout.from_y.backend = "reference"


def _query_norm_subclass(model):
    class Norm(torch.nn.LayerNorm):
        def forward(self, x):
            return super().forward(x) * 2.0
    model.attention.ln_q = Norm(model.attention.ln_q.normalized_shape)


def _linear_subclass(model):
    class Scaled(dk.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 0.5
    lin = Scaled(model.readout.from_s.in_features, model.readout.from_s.out_features)
    lin.load_state_dict(model.readout.from_s.state_dict())
    model.readout.from_s = lin


@pytest.mark.parametrize("change", [_mix_norms, _unequal_eps, _reference_linear, _query_norm_subclass,
                                    _linear_subclass])
def test_parts_the_fused_step_cannot_take_keep_the_modules_step(monkeypatch, change):
    """A model changed after a fused decoder was built from it: mixed readout norms, norms with different eps,
    one readout linear on the reference backend, a query-norm subclass or a linear subclass with its own forward:
    the decoder built after the change runs the modules' step and still matches."""
    torch.manual_seed(3)
    model = _randomise(build_model("nematus", 50, 60, embed_dim=16, hidden_size=24), 4).eval()
    calls = _count_fused_steps(monkeypatch)
    _fused_against_reference(model, calls, True, _SRC, _LENGTHS, _PREV)
    change(model)
    _fused_against_reference(model, calls, False, _SRC, _LENGTHS, _PREV)


def test_a_parametrized_linear_is_read_once_into_the_fused_step(monkeypatch):
    """A weight-normalised (parametrized) readout linear computes x W^T + b with W made from its parametrization:
    the decoder takes W as it is when built, and matches the modules."""
    torch.manual_seed(3)
    model = _randomise(build_model("nematus", 50, 60, embed_dim=16, hidden_size=24), 4).eval()
    torch.nn.utils.parametrizations.weight_norm(model.readout.from_s)
    _fused_against_reference(model, _count_fused_steps(monkeypatch), True, _SRC, _LENGTHS, _PREV)


def test_a_decoder_step_override_is_honoured(monkeypatch):
    """A subclass that overrides decoder_step (only) gets its override in the inference decoder too, not the
    fused op, and in teacher forcing."""
    torch.manual_seed(4)
    base = build_model("dtmt", 50, 60, embed_dim=16, hidden_size=24)

    class Halved(type(base)):
        def decoder_step(self, state, prev_tokens):
            features, state = super().decoder_step(state, prev_tokens)
            return features * 0.5, state

    model = Halved(50, 60, embed_dim=16, hidden_size=24).eval()
    model.load_state_dict(base.state_dict())
    calls = _count_fused_steps(monkeypatch)
    with torch.no_grad():
        decoder = model.inference_decoder()
        state = decoder.encode(_SRC, _LENGTHS)
        log_probs, _ = decoder.step(state, _PREV)
        features, _ = model.decoder_step(model.encode(_SRC, _LENGTHS), _PREV)
        expected = model.readout(features)
    assert calls == [] and isinstance(decoder, Halved)
    torch.testing.assert_close(log_probs, expected)
    # teacher forcing runs the override too (Seq2Seq.forward's loop over decoder_step), so that a model's
    # training and decoding compute the same function
    prev = torch.stack([_PREV, _PREV.flip(0)], 1)
    with torch.no_grad():
        forced = model(_SRC, _LENGTHS, prev)
        state = model.encode(_SRC, _LENGTHS)
        steps = []
        for t in range(2):
            out, state = model.step(state, prev[:, t])
            steps.append(out)
    torch.testing.assert_close(forced, torch.stack(steps, 1))


def test_inference_decoder_where_it_does_not_apply():
    """Training mode: the decoder of an eval copy (it was the model itself, dropout on); the reference backend: an
    eval copy sharing the parameters (no part has an inference form; a copy, so that it keeps eval mode when the
    model trains again)."""
    torch.manual_seed(0)
    model = build_model("dtmt", 50, 60, embed_dim=16, hidden_size=24)
    assert isinstance(model.inference_decoder(), FusedRNMTDecoder) and model.training   # training mode
    model.eval()
    assert isinstance(model.inference_decoder(), FusedRNMTDecoder)
    model.set_backend("reference")
    copied = model.inference_decoder()                           # nothing to stand in: the modules' step
    assert type(copied) is type(model) and copied is not model and not any_training(copied)
    assert all(a is b for a, b in zip(copied.parameters(), model.parameters()))
    model.set_backend("auto")
    assert isinstance(model.inference_decoder(), FusedRNMTDecoder)   # asked afresh each time


@pytest.mark.parametrize("name", ["deeplau", "gnmt-atr", "transformer"])
def test_converting_a_decoder_is_refused_before_anything_converts(name):
    """.double() / .to() on an inference decoder: a TypeError saying to convert the model and build the decoder again,
    raised before any parameter (the model's own, shared) is converted. Before, the decoder's parameters became
    float64 while its gathered weights did not, and encoding failed with a message telling to convert the layer."""
    torch.manual_seed(0)
    model = build_model(name, 50, 60, embed_dim=16, hidden_size=24).eval()
    decoder = model.inference_decoder()
    assert decoder is not model
    for convert in (lambda d: d.double(), lambda d: d.to(torch.float64), lambda d: d.half()):
        with pytest.raises(TypeError, match="convert the model, then build its decoder again"):
            convert(decoder)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    model.double()   # (the model itself converts, and its new decoder runs in float64)
    state = model.inference_decoder().encode(_SRC, _LENGTHS)
    assert all(v.dtype in (torch.float64, torch.long, torch.bool) for v in state.values() if torch.is_tensor(v))


@pytest.mark.parametrize("name", ["dtmt", "deeplau", "transformer"])
def test_a_part_of_a_decoder_is_not_converted_saved_or_loaded(name):
    """A part of an inference copy converted (decoder.model.src_embed.double()) converted the model's own parameters,
    which the copy shares (the model then refused its own batches), and the copy's state_dict held 4 of dtmt's 62
    entries (saved without a word) while load_state_dict(strict=False) wrote into the model: each is a TypeError,
    the model left as it was."""
    torch.manual_seed(0)
    model = build_model(name, 50, 60, embed_dim=16, hidden_size=24).eval()
    copy = getattr(model.inference_decoder(), "model", model.inference_decoder())
    assert copy is not model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TypeError, match="convert the model, then build its decoder again"):
        copy.src_embed.double()
    for call in (lambda: copy.state_dict(), lambda: copy.load_state_dict(before, strict=False)):
        with pytest.raises(TypeError, match=r"\.(load_)?state_dict: a decoder \(inference_decoder\(\)\) is a copy for "
                                            r"decoding that shares the model's parameters .* save or load the model"):
            call()
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # a copy pickled and loaded keeps the refusal (a method bound to the part did not pickle: an AttributeError)
    loaded = pickle.loads(pickle.dumps(copy))
    with pytest.raises(TypeError, match="convert the model, then build its decoder again"):
        loaded.src_embed.double()
    model.src_embed.double()   # (the model's own parts still convert)
    assert model.src_embed.weight.dtype == torch.float64


@pytest.mark.parametrize("name", ["mce", "dtmt", "nematus"])
def test_a_fused_decoder_of_a_model_converted_since_is_refused(name):
    """The model converted (.double()) after its FusedRNMTDecoder was built: the decoder's parameters shared with the
    model convert in place, its gathered weights do not. Encoding (and a variant of the decoder) is a TypeError
    saying to build the decoder again; before, the search failed deep inside an op (mce: 'dtmt::
    cell_step_from_products: xp [B, 24] contiguous, of h's dtype', the others 'mat1 and mat2 must have the same
    dtype'). A decoder built after the conversion decodes in float64."""
    from dtmt_models.decoding.beam_search import beam_search

    torch.manual_seed(0)
    model = build_model(name, 50, 60, embed_dim=16, hidden_size=24).eval()
    decoder = model.inference_decoder()
    assert isinstance(decoder, FusedRNMTDecoder)
    model.double()
    for use in (lambda: beam_search(decoder, _SRC, _LENGTHS, beam=2, max_len_b=3),
                lambda: decoder.encode(_SRC, _LENGTHS), lambda: decoder.variant(int8=True)):
        with pytest.raises(TypeError, match=r"FusedRNMTDecoder: its model was converted to torch.float64 on cpu after "
                                            r"the decoder gathered its weights in torch.float32 on cpu, .*build its "
                                            r"decoder again") as info:
            use()
        assert "\n" not in str(info.value)
    fresh = model.inference_decoder()
    assert fresh.encode(_SRC, _LENGTHS)["annotations"].dtype == torch.float64
    assert len(beam_search(fresh, _SRC, _LENGTHS, beam=2, max_len_b=3)) == 3


@pytest.mark.parametrize("name", ["gnmt-atr", "deeplau", "transformer"])
def test_a_prepared_decoder_of_a_model_converted_since_is_refused(name):
    """The same for the systems without the fused step, whose decoder is a prepared copy of the model with its
    layers' frozen forms: a search with it after the model's .double() is a TypeError saying to build it again
    (gnmt-atr failed inside transition_encode: 'self and mat2 must have the same dtype'). The transformer's copy
    gathers no weights: it decodes in float64, as a new one does."""
    torch.manual_seed(0)
    model = build_model(name, 50, 60, embed_dim=16, hidden_size=24).eval()
    decoder = model.inference_decoder()
    assert decoder is not model and not isinstance(decoder, FusedRNMTDecoder)
    model.double()
    fresh = _stale_decoder_refused(name, model, decoder, TypeError,
                                   rf"{type(model).__name__}: its model was converted to torch.float64 on cpu after "
                                   r"the decoder gathered its weights in torch.float32 on cpu, .*build its decoder "
                                   r"again")
    assert len(fresh) == 3


def _stale_decoder_refused(name, model, decoder, error, message):
    """A search with `decoder`, built before `model` changed: `error` matching `message`, in one line, except for the
    transformer, whose decoder reads its weights live and decodes as a new one does. Returns a new decoder's
    hypotheses."""
    from dtmt_models.decoding.beam_search import beam_search

    fresh = beam_search(model.inference_decoder(), _SRC, _LENGTHS, beam=2, max_len_b=3)
    if name == "transformer":
        assert beam_search(decoder, _SRC, _LENGTHS, beam=2, max_len_b=3) == fresh
        return fresh
    with pytest.raises(error, match=message) as info:
        beam_search(decoder, _SRC, _LENGTHS, beam=2, max_len_b=3)
    assert "\n" not in str(info.value)
    # (a caller's own loop: the encode of a decoder that is a prepared copy of the model, not a fused one, had
    # decoded with its old weights, or failed inside a kernel after a conversion; a review's)
    with pytest.raises(error, match=message):
        decoder.encode(_SRC, _LENGTHS)
    return fresh


def test_a_decoder_built_after_an_optimizer_step_sees_it():
    """Weights are read when a decoder is built: one built after an in-place change (an optimizer step on the
    readout norms, which the decoder stacks, and on a cell) computes with the new weights."""
    torch.manual_seed(0)
    model = build_model("dtmt", 50, 60, embed_dim=16, hidden_size=24).eval()
    with torch.no_grad():
        model.inference_decoder()
        model.readout.norms[1].weight.mul_(1.5)
        model.readout.norms[2].bias.add_(0.3)
        model.decoder_cell.weight_hh.mul_(0.5)
        decoder = model.inference_decoder()
        fast, _ = decoder.step(decoder.encode(_SRC, _LENGTHS), _PREV)
    model.set_backend("reference")
    slow, _ = model.step(model.encode(_SRC, _LENGTHS), _PREV)
    torch.testing.assert_close(fast, slow.detach(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["dtmt", "mce", "nematus", "rnnsearch-atr", "shallow-rnmt", "gnmt-atr", "deeplau",
                                  "transformer"])
def test_a_decoder_of_weights_changed_since_is_refused(name):
    """A decoder built before an in-place change of its model's weights (an optimizer step, load_state_dict) read the
    parameters it shares as they are now and its gathered copies as they were: a model of neither, scored without a
    word (dtmt: -32.72 against -47.52 new and -32.77 old; a hostile-input review, 2026-12-06). Now a RuntimeError
    saying to build it again, for every system whose decoder gathers weights; the transformer's reads them all live
    and decodes the new model, as a new decoder does."""
    from dtmt_models.decoding.beam_search import beam_search

    torch.manual_seed(0)
    model = build_model(name, 50, 60, embed_dim=16, hidden_size=24).eval()
    decoder = model.inference_decoder()
    beam_search(decoder, _SRC, _LENGTHS, beam=2, max_len_b=3)
    other = build_model(name, 50, 60, embed_dim=16, hidden_size=24)
    model.load_state_dict(other.state_dict())
    fresh = _stale_decoder_refused(name, model, decoder, RuntimeError,
                                   r"its model's weights changed in place \(an optimizer step, load_state_dict\) "
                                   r"or were replaced after the decoder gathered them, .*build its decoder again")
    assert fresh == beam_search(other.eval().inference_decoder(), _SRC, _LENGTHS, beam=2, max_len_b=3)


@pytest.mark.parametrize("name", ["dtmt", "mce"])
def test_a_state_kept_while_the_weights_changed_is_not_searched(name):
    """A state encoded before an in-place change of the model's weights (a service's hot reload) and searched after:
    the fused search read the new embedding and the old gathered weights without a word (only encode checked)."""
    torch.manual_seed(0)
    model = build_model(name, 50, 60, embed_dim=16, hidden_size=24).eval()
    decoder = model.inference_decoder()
    assert isinstance(decoder, FusedRNMTDecoder)
    state = decoder.encode(_SRC, _LENGTHS)
    assert len(decoder._search(state, 2, 0.6, torch.tensor([4, 4, 4]))) == 3
    with torch.no_grad():
        model.tgt_embed.weight.add_(0.5)
    with pytest.raises(RuntimeError, match=r"its model's weights changed in place .*build its decoder again"):
        decoder._search(state, 2, 0.6, torch.tensor([4, 4, 4]))


def test_engine_options_take_booleans_only():
    """EngineOptions(fold="no") folded (a truthy string), and variant(options={...}) was an AttributeError."""
    from dtmt_models.engine import EngineOptions

    with pytest.raises(TypeError, match="EngineOptions.fold must be True or False, got 'no'"):
        EngineOptions(fold="no")
    with pytest.raises(TypeError, match="EngineOptions.huge_pages must be True or False, got 1"):
        EngineOptions(huge_pages=1)
    decoder = build_model("dtmt", 50, 60, embed_dim=16, hidden_size=24).eval().inference_decoder()
    with pytest.raises(TypeError, match="options must be an EngineOptions, got dict"):
        decoder.variant(options={"fold": False})
    assert decoder.variant(options=EngineOptions(fold=False)).options.fold is False


@pytest.mark.parametrize("name", ["dtmt", "mce", "gnmt-atr", "deeplau"])
def test_a_decoder_of_weights_replaced_or_partly_converted_since_is_refused(name):
    """Found by a review: the check compared the parameters' version counters and the first parameter's dtype, so
    parameters replaced by new tensors (vector_to_parameters, load_state_dict with assign=True: counters of the
    same values) decoded with a mix of old and new weights without a word (log-probabilities 0.14-0.82 from the
    old model's), and a part converted alone (the target embedding .double()) failed inside an op ('x [B, I] and
    h [B, H] of one dtype expected, got [1, 16] and [1, 16]'). Both are now refused in one line."""
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    from dtmt_models.decoding.beam_search import beam_search

    torch.manual_seed(0)
    other = build_model(name, 50, 60, embed_dim=16, hidden_size=24)
    for change in ("vector", "assign"):
        model = build_model(name, 50, 60, embed_dim=16, hidden_size=24).eval()
        decoder = model.inference_decoder()
        if change == "vector":
            vector_to_parameters(parameters_to_vector(other.parameters()).detach().clone(), model.parameters())
        else:
            model.load_state_dict({k: v.clone() for k, v in other.state_dict().items()}, assign=True)
        fresh = _stale_decoder_refused(name, model, decoder, RuntimeError,
                                       r"its model's weights changed in place \(an optimizer step, load_state_dict\) "
                                       r"or were replaced after the decoder gathered them, .*build its decoder again")
        assert fresh == beam_search(other.eval().inference_decoder(), _SRC, _LENGTHS, beam=2, max_len_b=3)
    model = build_model(name, 50, 60, embed_dim=16, hidden_size=24).eval()
    decoder = model.inference_decoder()
    model.tgt_embed.double()
    with pytest.raises(TypeError, match=r"its model was converted to torch.float64 on cpu after the decoder "
                                        r"gathered its weights in torch.float32 on cpu, .* \(tgt_embed\.\S+\); build "
                                        r"its decoder again") as info:
        beam_search(decoder, _SRC, _LENGTHS, beam=2, max_len_b=3)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["dtmt", "nematus", "deeplau"])
@pytest.mark.parametrize("int8", [False, True])
def test_a_decoder_of_weights_pruned_again_or_changed_under_inference_mode_is_refused(name, int8):
    """Found by a review: the check read the parameters' version counters only, so a pruning step after the decoder
    was built (torch.nn.utils.prune: the weight is its unchanged `_orig` parameter times a mask buffer, replaced)
    and weights changed under torch.inference_mode (inference tensors keep no version counter: a server reloading
    weights) decoded with the old weights, or with old int8 matrices beside new embeddings, without a word. Buffers
    are now recorded as parameters are, and inference tensors by a sample of their values."""
    import torch.nn.utils.prune as prune

    from dtmt_models.decoding.beam_search import beam_search

    if int8 and name == "deeplau":
        pytest.skip("deeplau has no int8 decoder")
    torch.manual_seed(0)
    model = build_model(name, 50, 60, embed_dim=16, hidden_size=24).eval()
    projection = model.readout.output.proj if name != "deeplau" else model.readout.proj
    prune.l1_unstructured(projection, "weight", amount=0.3)
    decoder = model.inference_decoder(int8=int8)
    prune.l1_unstructured(projection, "weight", amount=0.9)   # (iterative pruning: a new mask, the same _orig)
    _stale_decoder_refused(name, model, decoder, RuntimeError, r"its model's weights changed in place")
    other = build_model(name, 50, 60, embed_dim=16, hidden_size=24).state_dict()
    with torch.inference_mode():
        model = build_model(name, 50, 60, embed_dim=16, hidden_size=24).eval()
        decoder = model.inference_decoder(int8=int8)
        unchanged = beam_search(decoder, _SRC, _LENGTHS, beam=2, max_len_b=3)   # (no change: decodes, as before)
        assert unchanged == beam_search(model.inference_decoder(int8=int8), _SRC, _LENGTHS, beam=2, max_len_b=3)
        model.load_state_dict(other)
        fresh = _stale_decoder_refused(name, model, decoder, RuntimeError, r"its model's weights changed in place")
    assert fresh != unchanged


def test_an_inference_tensor_is_told_by_at_most_64_of_its_values():
    """weights_kind's sample of a tensor without a version counter: up to 64 values, evenly spread (a stride of
    numel // 64 had taken up to 127); tensors with one add nothing."""
    from dtmt_models.engine.forms import inference_sample

    with torch.inference_mode():
        tensors = [torch.arange(n, dtype=torch.float32) for n in (1, 63, 64, 65, 127, 10_000)]
    assert [len(inference_sample([t])) // 4 for t in tensors] == [1, 63, 64, 33, 64, 64]
    assert inference_sample([torch.ones(5)]) == b""


def test_a_swapped_in_single_head_attention_is_fused(monkeypatch):
    """dtmt with an AdditiveAttention (one head, with a query norm) swapped in: the fused decoder takes it."""
    torch.manual_seed(0)
    model = build_model("dtmt", 50, 60, embed_dim=16, hidden_size=24).eval()
    model.attention = _randomise(AdditiveAttention(24, 48, 24, layer_norm=True), 5)
    _fused_against_reference(model, _count_fused_steps(monkeypatch), True, _SRC, _LENGTHS, _PREV)
    model.attention.ln_q = torch.nn.LayerNorm(24, elementwise_affine=False)   # not a norm the step takes
    _fused_against_reference(model, _count_fused_steps(monkeypatch), False, _SRC, _LENGTHS, _PREV)


@pytest.mark.parametrize("reverse", [False, True])
def test_memory_encoder_matches_the_module(reverse):
    from dtmt_models.models.systems.mce import MemoryGRUEncoderDirection
    enc = _randomise(MemoryGRUEncoderDirection(6, 10, "auto"), 5)
    g = torch.Generator().manual_seed(6)
    x, memory = torch.randn(3, 7, 6, generator=g), torch.randn(3, 7, 10, generator=g)
    mask = torch.arange(7).unsqueeze(0) < torch.tensor([7, 4, 1]).unsqueeze(1)
    form = inference_form(enc)
    assert type(form) is FrozenMemoryEncoder
    with torch.no_grad():
        states, final = form(x, memory, mask, reverse)
    enc.cell.backend = "reference"
    assert inference_form(enc) is enc
    states_ref, memory_ref = enc(x, memory, mask, reverse)       # the module's pure-PyTorch reference
    torch.testing.assert_close(states, states_ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(final, memory_ref.detach(), rtol=1e-5, atol=1e-6)
    assert (states[~mask] == 0).all()


@pytest.mark.parametrize("system, options", [("dtmt", dict(heads=2)), ("dtmt", dict(heads=4, depth=2)),
                                             ("rnnsearch-atr", {})])
def test_fold_context_projection(system, options):
    """FusedRNMTDecoder folds multi-head attention's output projection into the decoder cell's input matrix and the
    readout's context matrix (engine_ops.fold_context_projection): in float64 its steps give the unfolded
    decoder's log-probabilities, states and attention to 1e-12 over steps and a reorder, and a step reads one
    matrix fewer of the same shapes. Single-head attention has no projection: nothing changes."""
    torch.manual_seed(6)
    model = build_model(system, 50, 60, embed_dim=16, hidden_size=24, **options).eval().double()
    with torch.no_grad():
        base = model.inference_decoder()   # both with the weights where they are (huge_pages=False)
        folded = base.variant(options=EngineOptions(huge_pages=False))
        plain = base.variant(options=EngineOptions(fold=False, huge_pages=False))
        has_projection = plain.attention.w_o is not None
        assert has_projection == (system == "dtmt") and folded.attention.w_o is None
        assert folded.decoder_cell.params[0].shape == plain.decoder_cell.params[0].shape
        assert folded.readout.w_c.shape == plain.readout.w_c.shape
        if not has_projection:
            assert folded.readout is plain.readout and folded.decoder_cell.params[0] is plain.decoder_cell.params[0]
        src, lengths = torch.randint(4, 50, (4, 6)), torch.tensor([6, 6, 4, 2])
        prevs = [torch.randint(4, 60, (4,)) for _ in range(3)]
        assert_decoders_step_alike(folded, plain, src, lengths, prevs, torch.tensor([2, 0, 3, 1]), 1e-12, 1e-12,
                                   1e-12)


@pytest.mark.parametrize("layer_kind", ["lgru-bi", "gru-reverse", "atr-bi"])
def test_sequence_layer_form_is_the_layer(layer_kind, monkeypatch):
    """A DeepTransitionGRU / ATR layer's inference form (FrozenTransitionLayer: the kernel parameters gathered
    once, every direction in one call of dtmt::transition_encode) gives the layer's outputs to the bit, in float32
    and float64, for padded batches (time-major and batch_first) and an unbatched sequence, on one thread and on
    two (where the two directions run on a thread each). Past 8 rows (the 11-row batch; the input products of
    every batch) the products are ATen's GEMM, whose operands lie elsewhere in the two (the layer's in its saved
    tensors) and which runs on one thread in the form's direction threads, on two in the layer's: so to the bit
    where that GEMM gives the same bits wherever its operands lie and on any thread count, else to rounding
    (conftest.aten_gemm_reproducible; docs/design/reproducibility.md). Its int8() form computes the layer with the
    recurrent matrices as int8 products (the reference: the layer on the reference backend with quantize.linear_int8
    in their place), a PackedSequence's too, refuses float64 weights and is its own int8 form. Under CPU autocast it
    computes as the layer does (bf16 products, float32 state)."""
    from conftest import aten_gemm_reproducible, at_thread_counts, int8_linear_for

    rest = layer_kind.split("-")[1]
    layer = _sequence_layer(layer_kind, 10)
    g = torch.Generator().manual_seed(8)
    x, lengths = torch.randn(7, 3, 6, generator=g), torch.tensor([7, 4, 1])
    h0 = torch.randn(2 if rest == "bi" else 1, 3, 10, generator=g)

    wide_x, wide_lengths = torch.randn(5, 11, 6, generator=g), torch.randint(1, 6, (11,), generator=g)

    def alike(got, want):
        if aten_gemm_reproducible(torch.get_num_threads()):
            assert torch.equal(got, want)
        else:
            tol = 1e-12 if got.dtype == torch.float64 else 2e-6
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)

    def same_outputs():
        # (11 rows: the GEMMs past the small-row kernel's rows)
        for args in ((xs, None, lengths), (xs, h0.to(dtype), lengths), (xs[:, :1], None, None),
                     (xs[:5, 0], None, None), (wide_x.to(dtype), None, wide_lengths)):
            for got, want in zip(form(*args), layer(*args)):
                alike(got, want)
        layer.batch_first = True
        for got, want in zip(form(xs.transpose(0, 1), lengths=lengths), layer(xs.transpose(0, 1), lengths=lengths)):
            alike(got, want)
        layer.batch_first = False
        return True

    for dtype in (torch.float32, torch.float64):
        layer = layer.to(dtype)
        xs = x.to(dtype)
        form = inference_form(layer)
        assert type(form) is FrozenTransitionLayer
        with torch.no_grad():
            assert all(at_thread_counts(same_outputs, 1, 2))
    with pytest.raises(ValueError, match="float32"):
        form.int8()
    layer = layer.float()
    int8 = inference_form(layer).int8()
    assert int8.int8() is int8 and int8.directions[0][1][2].dtype == torch.int8
    int8_linear = int8_linear_for([p.detach().clone() for n, p in layer.named_parameters() if "weight_hh" in n])
    with torch.no_grad():
        got = int8(x, lengths=lengths)
        # a PackedSequence through the form's own ops too (a method the form lacks is the layer's, on its weights)
        packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False)
        got_packed, h_packed = int8(packed)
        assert torch.equal(torch.nn.utils.rnn.pad_packed_sequence(got_packed, total_length=7)[0], got[0])
        assert torch.equal(h_packed, got[1])
        layer.backend = "reference"
        far = layer(x, lengths=lengths)   # float32 products: a real difference, so the reference is not the float one
        monkeypatch.setattr(F, "linear", int8_linear)
        want = layer(x, lengths=lengths)
    for a, b, c in zip(got, want, far):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert (a - c).abs().max() > 1e-4
    assert inference_form(layer) is layer   # the reference backend keeps the module
    layer.backend = "cpp"
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):   # the layer's autocast rule: bf16 products
        got, want = inference_form(layer)(x, None, lengths), layer(x, None, lengths)
    assert got[0].dtype == torch.bfloat16 and all(torch.equal(a, b) for a, b in zip(got, want))


def test_row_panels_layout():
    """ops.linear.row_panels: W [N, K] as panels [ceil(N / 128), K, 128] with panels[p, k, j] = W[128 p + j, k] and
    zeros past N, for one matrix and for a stack of them (the T-GRUs' t_w [D, 3H, H]); a vector is refused."""
    from dtmt_kernels.ops.linear import PANEL_WIDTH, row_panels

    assert PANEL_WIDTH == _C.PANEL_WIDTH == 128   # the Python layout is the kernel's
    g = torch.Generator().manual_seed(0)
    for shape in ((300, 7), (128, 3), (5, 9), (2, 150, 5)):
        w = torch.randn(*shape, generator=g)
        panels = row_panels(w)
        *lead, N, K = shape
        P = -(-N // 128)
        assert panels.shape == (*lead, P, K, 128) and panels.is_contiguous() and panels.dtype == w.dtype
        for n in (0, 1, N - 1) + ((128, 129) if N > 129 else ()):
            assert torch.equal(panels[..., n // 128, :, n % 128], w[..., n, :])
        flat = panels.transpose(-1, -2).reshape(*lead, P * 128, K)
        assert torch.equal(flat[..., :N, :], w) and not flat[..., N:, :].any()
    with pytest.raises(ValueError, match="row_panels"):
        row_panels(torch.randn(5))


@pytest.mark.parametrize("layer_kind", ["lgru-bi", "gru-reverse", "atr-bi", "lgru-shallow"])
def test_sequence_layer_row_panels(layer_kind):
    """FrozenTransitionLayer.with_row_panels (EngineOptions.encoder_panels, the default): at batch 1 the
    float32 products of the states with w_hh and the T-GRUs' t_w come from the row-panel layout (CpuKernels::
    row_panels: each output one multiply-add chain in k order): the layer's outputs, in float64, within float32
    rounding, as close to them as the row-major form's (with padding masks, time-major and unbatched, H = 40 so that
    4H = 160 and 3H = 120 end in a part-filled panel), on one thread and on two; at batch > 1 the row-major form's
    outputs to the bit (the panels unused). Its on_huge_pages copy keeps the panels (the same values, the same
    outputs to the bit); float64 and int8 forms are their own panel forms."""
    layer = _sequence_layer(layer_kind, 40)
    g = torch.Generator().manual_seed(8)
    x, lengths = torch.randn(9, 3, 6, generator=g), torch.tensor([9, 5, 1])
    D = 2 if layer.bidirectional else 1
    h0 = torch.randn(D, 1, 40, generator=g)
    plain = inference_form(layer)
    panels = plain.with_row_panels()
    assert plain.panels is None and panels.panels is not None and panels.with_row_panels() is panels
    w_hh = plain.directions[0][1][2]
    assert torch.equal(panels.panels[0][0], dk.ops.linear.row_panels(w_hh))
    reference = copy.deepcopy(layer).double()

    def outputs():
        with torch.no_grad():
            for args in ((x[:, :1], None, lengths[:1]), (x[:, :1], h0, None), (x[:4, 0], None, None),
                         (x[:, 1:2], None, lengths[1:2])):
                want = reference(*[a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                                   for a in args])
                got, rows = panels(*args), plain(*args)
                for a, b, c in zip(got, rows, want):
                    assert (a - c).abs().max() <= 1e-5 and (a - c).abs().max() <= 4 * (b - c).abs().max() + 1e-6
            assert all(torch.equal(a, b) for a, b in zip(panels(x, lengths=lengths), plain(x, lengths=lengths)))
        return True

    assert all(at_thread_counts(outputs, 1, 2))
    # the op with twelve tensors a direction (the ten parameters, then the two panel tensors): schema, fake, AOT
    assert len(panels._flat) == 12 * D
    torch.library.opcheck(torch.ops.dtmt.transition_encode.default,
                          (x[:, :1], torch.zeros(D, 1, 40), None, panels.directions[0][0],
                           [t.detach() for t in panels._flat],
                           getattr(layer, "reverse", False), layer.eps))
    # the panels are what batch 1 reads, and only batch 1: panels of zeros leave the base cell's recurrent products
    # to the biases there, and change nothing for a batch of three
    zeros = FrozenTransitionLayer(layer, plain.directions, [tuple(torch.zeros_like(t) for t in pair)
                                                                  for pair in panels.panels])
    with torch.no_grad():
        assert (zeros(x[:, :1])[0] - plain(x[:, :1])[0]).abs().max() > 1e-2
        assert all(torch.equal(a, b) for a, b in zip(zeros(x, lengths=lengths), plain(x, lengths=lengths)))
    bad = [t.detach() for t in panels._flat]
    bad[10] = bad[10][:, :-1]
    with torch.no_grad(), pytest.raises(RuntimeError, match="row panels of float32 weights expected"):
        torch.ops.dtmt.transition_encode(x[:, :1], torch.zeros(D, 1, 40), None, panels.directions[0][0], bad,
                                         getattr(layer, "reverse", False), layer.eps)
    huge = panels.on_huge_pages()
    if huge is not panels:
        assert all(torch.equal(a, b) for pa, pb in zip(huge.panels, panels.panels) for a, b in zip(pa, pb))
        with torch.no_grad():
            assert all(torch.equal(a, b) for a, b in zip(huge(x[:, :1]), panels(x[:, :1])))
    assert plain.int8().with_row_panels().panels is None
    double = inference_form(copy.deepcopy(layer).double())
    assert double.with_row_panels() is double


@pytest.mark.parametrize("system", ["dtmt", "rnnsearch-atr"])
def test_encoder_panels_search(system):
    """EngineOptions(encoder_panels=True), the default, against encoder_panels=False: the same hypotheses and
    scores within float32 rounding at batch 1 (the encoder's products from the row panels), the same results to the
    bit for a batch of several sentences (the panels unused); an int8 decoder has none."""
    from dtmt_models.decoding.beam_search import beam_search

    torch.manual_seed(3)
    model = build_model(system, 50, 60, embed_dim=16, hidden_size=40).eval()
    with torch.no_grad():
        on = model.inference_decoder()
        off = on.variant(options=EngineOptions(encoder_panels=False))
        encoders = lambda d: [m for m in d.model.modules() if isinstance(m, FrozenTransitionLayer)]  # noqa: E731
        assert encoders(on) and all(m.panels is not None for m in encoders(on))
        assert all(m.panels is None for m in encoders(off))
        assert all(m.panels is None for m in encoders(on.inference_decoder(int8=True)))
        g = torch.Generator().manual_seed(4)
        for length in (1, 5, 13):
            src = torch.randint(4, 50, (1, length), generator=g)
            lengths = torch.tensor([length])
            a, b = beam_search(on, src, lengths, beam=3, nbest=3), beam_search(off, src, lengths, beam=3, nbest=3)
            assert [h.tokens for h in a[0]] == [h.tokens for h in b[0]]
            assert all(abs(x.score - y.score) < 1e-5 for x, y in zip(a[0], b[0]))
        src, lengths = torch.randint(4, 50, (3, 7), generator=g), torch.tensor([7, 4, 2])
        assert beam_search(on, src, lengths, beam=3) == beam_search(off, src, lengths, beam=3)


@pytest.mark.parametrize("layer_kind", ["lgru-bi", "gru-reverse", "atr-bi", "lgru-shallow"])
def test_sequence_layer_encode_tokens(layer_kind):
    """FrozenTransitionLayer.input_products and encode_tokens (dtmt::transition_encode_tokens): the table is the
    rows' products with every direction's w_ih, in float64 rounded once, direction d in columns d*n_in*H..; encoding
    token ids from the tables of an embedding and of its position rows gives the layer's outputs on x = embedding
    [tokens] + positions: in float64 within 1e-12, in float32 within float32 rounding of the float64 layer and as
    close to it as the layer's own float32 outputs (padded batches time-major and batch_first, batch 1 through the
    row panels, no positions, an initial state of zeros; on one thread and on two). A token outside the table, ids
    that are not int64 and a table of the wrong width are refused; a table past INPUT_TABLE_BYTES or of rows of
    another dtype is not made."""
    layer = _sequence_layer(layer_kind, 40)
    g = torch.Generator().manual_seed(8)
    embedding, positions = torch.randn(30, 6, generator=g), 0.3 * torch.randn(12, 6, generator=g)
    tokens, lengths = torch.randint(0, 30, (9, 3), generator=g), torch.tensor([9, 5, 1])
    reference = copy.deepcopy(layer).double()
    with torch.no_grad():
        want = reference(embedding.double()[tokens] + positions.double()[:9, None], lengths=lengths)
        want_plain = reference(embedding.double()[tokens], lengths=lengths)
    w_ih = torch.cat([p for n, p in layer.named_parameters() if n.startswith("weight_ih")])
    for dtype in (torch.float64, torch.float32):
        form = inference_form(copy.deepcopy(layer).to(dtype))
        if dtype == torch.float32:
            form = form.with_row_panels()
        E, P = embedding.to(dtype), positions.to(dtype)
        table, position_table = form.input_products(E), form.input_products(P)
        assert table.dtype == dtype and table.shape == (30, w_ih.shape[0])
        assert torch.equal(table, (embedding.double() @ w_ih.double().t()).to(dtype))
        x = E[tokens] + P[:9, None]
        tol = 1e-12 if dtype == torch.float64 else 1e-5

        def outputs():
            with torch.no_grad():
                for (got, layer_out, ref) in (
                        (form.encode_tokens(tokens, table, position_table, lengths=lengths),
                         form(x, lengths=lengths), want),
                        (form.encode_tokens(tokens, table, lengths=lengths), form(E[tokens], lengths=lengths),
                         want_plain),
                        (form.encode_tokens(tokens[:, 1:2], table, position_table, lengths=lengths[1:2]),
                         form(x[:, 1:2], lengths=lengths[1:2]), [t[:, 1:2] if t.dim() == 3 and t.shape[1] == 3
                                                                 else t for t in want])):
                    for a, b, c in zip(got, layer_out, ref):
                        if a.shape != c.shape:   # h_n of the one-sentence batch
                            c = c[:, 1:2]
                        err, own = (a.double() - c).abs().max(), (b.double() - c).abs().max()
                        assert err <= tol and err <= 4 * own + 1e-6, (err, own)
                form.batch_first = True
                try:
                    got = form.encode_tokens(tokens.t(), table, position_table, lengths=lengths)
                    layer_out = form(x.transpose(0, 1), lengths=lengths)
                finally:
                    form.batch_first = False
                assert (got[0] - layer_out[0]).abs().max() <= tol and (got[1] - layer_out[1]).abs().max() <= tol
            return True

        assert all(at_thread_counts(outputs, 1, 2))
    D = 2 if layer.bidirectional else 1
    torch.library.opcheck(torch.ops.dtmt.transition_encode_tokens.default,
                          (tokens, table, position_table, torch.zeros(D, 3, 40), None, form.directions[0][0],
                           [t.detach() for t in form._flat], getattr(layer, "reverse", False), layer.eps))
    with torch.no_grad():
        with pytest.raises(IndexError, match="token 30 is not in the table"):   # as the embedding's lookup
            form.encode_tokens(torch.full((2, 1), 30), table)
        with pytest.raises(ValueError, match="int64"):
            form.encode_tokens(tokens.int(), table)
        with pytest.raises(RuntimeError, match="table"):
            form.encode_tokens(tokens, table[:, :-1])
    assert form.input_products(embedding.double()) is None   # rows of another dtype
    small = copy.deepcopy(form)
    small.INPUT_TABLE_BYTES = table.numel() * 4 - 1
    assert small.input_products(embedding) is None and small.input_products(positions) is not None


@pytest.mark.parametrize("system", ["dtmt", "rnnsearch-atr", "mce"])
def test_source_tables(system):
    """EngineOptions(source_tables=True), the default, against False: encode reads the source tokens' and positions'
    input products from tables (the embedding's and its position rows' products with the encoder's input matrices)
    instead of embedding and multiplying: the same state (the same entries in the same order; the annotations, keys
    and first state within rounding, the mask and positions equal) for one sentence and for a padded batch, in
    float64 (within 1e-10) and float32 (within 1e-5), and in float64 the same best hypotheses with scores within
    1e-9. A source longer than the position table makes it anew, at least twice as long. A source id past the
    vocabulary is an IndexError with the tables as without them. mce (its own encoder) has no tables; the int8
    decoder has none (it quantizes the encoder's states: test_int8 holds it to the modules' products), nor has
    nematus (an encode of its own)."""
    from conftest import spread_weights

    from dtmt_models.decoding.beam_search import beam_search

    torch.manual_seed(3)
    model = spread_weights(build_model(system, 50, 60, embed_dim=16, hidden_size=40)).eval()
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        model = model.to(dtype)
        with torch.no_grad():
            on = model.inference_decoder()
            off = on.variant(options=EngineOptions(source_tables=False))
            assert (on.source_table is not None) == (system != "mce") and off.source_table is None

            def same(src, lengths):
                sa, sb = on.encode(src, lengths), off.encode(src, lengths)
                assert list(sa) == list(sb)
                for k, b in sb.items():
                    if b.is_floating_point():
                        torch.testing.assert_close(sa[k], b, rtol=tol, atol=tol)
                    else:
                        assert torch.equal(sa[k], b) and sa[k].dtype == b.dtype
                if dtype == torch.float64:
                    # the best, over 12 steps: a random model's hypotheses run to max length, where a difference of
                    # an ulp in the first state can tip a near-tie dozens of steps on
                    kw = dict(beam=3, max_len_a=0, max_len_b=12)
                    a, b = beam_search(on, src, lengths, **kw), beam_search(off, src, lengths, **kw)
                    assert [s[0].tokens for s in a] == [s[0].tokens for s in b]
                    assert all(abs(s[0].score - t[0].score) < 1e-9 for s, t in zip(a, b))
                return sb

            g = torch.Generator().manual_seed(4)
            for length in (1, 5, 13):
                same(torch.randint(4, 50, (1, length), generator=g), torch.tensor([length]))
            state = same(torch.randint(4, 50, (3, 7), generator=g), torch.tensor([7, 4, 2]))
            assert not state["src_mask"].all()   # a padded batch
            if on.source_table is not None and model.src_embed.positional:
                on._source_position_table = on._source_position_table[:3]
                same(torch.randint(4, 50, (1, 5), generator=g), torch.tensor([5]))
                assert on._source_position_table.shape[0] >= 6
            for decoder in (on, off, model):   # a source id past the vocabulary: the embedding's IndexError
                with pytest.raises(IndexError):
                    decoder.encode(torch.tensor([[4, 50]]), torch.tensor([2]))
    with torch.no_grad():
        assert model.inference_decoder(int8=True).source_table is None
        nematus = build_model("nematus", 50, 60, embed_dim=16, hidden_size=40).eval().inference_decoder()
        assert nematus.source_table is None


def test_longer_table():
    """engine.rnmt.longer_table: the table itself while it is long enough; else one of max(length, 256, twice its rows)
    rows, or of `length` rows where that is refused, or None where both are."""
    from dtmt_models.engine.rnmt import longer_table

    asked = []

    def make(rows, bound=None):
        asked.append(rows)
        return None if bound is not None and rows > bound else torch.zeros(rows, 2)

    t = torch.zeros(300, 2)
    assert longer_table(t, 300, make) is t and asked == []
    assert longer_table(None, 10, make).shape[0] == 256
    assert longer_table(t, 301, make).shape[0] == 600
    assert longer_table(t, 301, lambda r: make(r, bound=400)).shape[0] == 301
    assert longer_table(t, 500, lambda r: make(r, bound=400)) is None and asked[-2:] == [600, 500]


def _mapping_flags(ptr: int) -> str:
    """The VmFlags line of this process's mapping that holds address `ptr` (/proc/self/smaps)."""
    import re

    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                inside = int(m.group(1), 16) <= ptr < int(m.group(2), 16)
            elif inside and line.startswith("VmFlags:"):
                return line
    raise AssertionError(f"no mapping holds {ptr:#x}")


@pytest.mark.skipif(not dk.ops.linear.huge_pages_offered(), reason="no transparent huge page advice here")
def test_huge_page_copies():
    """huge_page_copies: the same values, dtypes and shapes (contiguous), in new memory that outlives the originals,
    the first copy at a 2 MiB boundary and each one at a 4 KiB one, in a mapping advised for huge pages (the `hg`
    flag of /proc/self/smaps); empty tensors come back as they are, and so does a list with a tensor off the CPU
    (here: on the meta device)."""
    import gc

    from dtmt_kernels.ops.linear.placement import HUGE_PAGE, huge_page_copies

    g = torch.Generator().manual_seed(0)
    originals = [torch.randn(1280, 512, generator=g), torch.randn(5, generator=g), torch.empty(0),
                 torch.randint(-127, 128, (300, 260), dtype=torch.int8, generator=g),
                 torch.randn(3, 768, 256, generator=g).transpose(1, 2), torch.randn(2, 3, dtype=torch.float64)]
    kept = [t.clone() for t in originals]
    copies = huge_page_copies(originals)
    assert copies[2] is originals[2]
    for t, c in zip(kept, copies):
        assert c.dtype == t.dtype and c.shape == t.shape and c.is_contiguous() and torch.equal(c, t)
    starts = [c.data_ptr() for i, c in enumerate(copies) if i != 2]
    assert starts[0] % HUGE_PAGE == 0 and all(p % 4096 == 0 for p in starts)
    assert len({c.untyped_storage().data_ptr() for i, c in enumerate(copies) if i != 2}) == 1
    assert not any(c.data_ptr() == t.data_ptr() for c, t in zip(copies, originals) if t.numel())
    assert " hg" in _mapping_flags(starts[0])
    del originals
    gc.collect()
    assert all(torch.equal(c, t) for c, t in zip(copies, kept))
    meta = [torch.randn(4), torch.empty(3, device="meta")]
    assert all(c is t for c, t in zip(huge_page_copies(meta), meta))


def test_the_int8_form_of_a_fused_decoder_keeps_its_settings():
    """FusedRNMTDecoder.inference_decoder(int8=True) is the int8 form with the decoder's own options (it used to take
    the defaults): the output projection folded or kept, and the same search as an int8 decoder built with those
    options; an int8 decoder, or int8=False, gives the decoder itself."""
    from dtmt_models.decoding.beam_search import beam_search

    torch.manual_seed(3)
    model = build_model("dtmt", 50, 60, embed_dim=16, hidden_size=24, heads=2).eval()
    src, lengths = torch.randint(4, 50, (3, 5)), torch.tensor([5, 3, 2])
    with torch.no_grad():
        base = model.inference_decoder()
        for fold, huge, products in ((False, False, False), (True, False, True), (False, True, True)):
            options = EngineOptions(fold=fold, huge_pages=huge, step_tables=products)
            d = base.variant(options=options)
            q = d.inference_decoder(int8=True)
            assert q.int8 and q.options == options
            assert (q.attention.w_o is None) == fold   # folded, or kept for the step to apply
            assert q.inference_decoder(int8=True) is q and d.inference_decoder() is d
            built = base.variant(int8=True, options=options)
            assert beam_search(q, src, lengths, beam=3) == beam_search(built, src, lengths, beam=3)


@pytest.mark.parametrize("system, options", [("dtmt", dict(heads=2)), ("rnnsearch-atr", {})])
def test_decoder_weights_on_huge_pages_give_the_same_results(system, options):
    """EngineOptions(huge_pages=True), the default: the step's weights (engine_ops.step_weights_on_huge_pages)
    and the encoder's sequence layers (FrozenTransitionLayer.on_huge_pages) are copies, in one 2 MiB-aligned buffer
    each where huge pages are offered (the previous token's tables too, each in its own), and the decoder's steps,
    its reorder and its whole C++ beam search give the 4 KiB-page decoder's results to the bit, in float32, also as
    an int8 decoder."""
    from dtmt_models.decoding.beam_search import beam_search

    torch.manual_seed(7)
    model = build_model(system, 50, 60, embed_dim=16, hidden_size=24, **options).eval()
    with torch.no_grad():
        huge = model.inference_decoder()
        plain = huge.variant(options=EngineOptions(huge_pages=False))
        layers = lambda d: [m for m in d.model.modules() if isinstance(m, FrozenTransitionLayer)]  # noqa: E731
        assert layers(huge) and layers(plain)
        if dk.ops.linear.huge_pages_offered():
            from dtmt_kernels.ops.linear.placement import HUGE_PAGE

            assert huge.query_cell.params[0].data_ptr() % HUGE_PAGE == 0
            assert huge.query_cell.params[0].data_ptr() != plain.query_cell.params[0].data_ptr()
            assert len({t.untyped_storage().data_ptr() for t in huge.readout.tensors + huge.attention.tensors
                        if t.numel()}) == 1
            for a, b in zip(layers(huge), layers(plain)):
                assert a.directions[0][1][0].data_ptr() % HUGE_PAGE == 0
                assert all(x.data_ptr() != y.data_ptr() and torch.equal(x, y)
                           for (_, pa), (_, pb) in zip(a.directions, b.directions) for x, y in zip(pa, pb) if x.numel())
            # the previous token's tables (rows read anywhere in them a step) too, each in a mapping of its own in
            # 2 MiB pages (huge_page_copies: a 2 MiB-aligned start, the mapping whole 2 MiB pages), the same values;
            # the 4 KiB-page decoder's are ordinary tensors (storage of their own size)
            tables = [(huge.token_table, plain.token_table), (huge.position_table(9), plain.position_table(9))]
            for a, b in tables[:1] + (tables[1:] if model.tgt_embed.positional else []):
                assert a.data_ptr() % HUGE_PAGE == 0 and a.untyped_storage().nbytes() % HUGE_PAGE == 0
                assert b.untyped_storage().nbytes() == b.nbytes and torch.equal(a, b)
        src, lengths = torch.randint(4, 50, (4, 6)), torch.tensor([6, 6, 4, 2])
        prevs = [torch.randint(4, 60, (4,)) for _ in range(3)]
        assert_decoders_step_alike(huge, plain, src, lengths, prevs, torch.tensor([2, 0, 3, 1]), 0, 0, 0)
        for a, b in ((huge, plain), (huge.inference_decoder(int8=True),
                                     huge.variant(int8=True, options=EngineOptions(huge_pages=False)))):
            assert a.search is not None
            assert beam_search(a, src, lengths, beam=3) == beam_search(b, src, lengths, beam=3)
