"""The fused ops as torch.library custom ops (dtmt_kernels/ops/, csrc/registration.cpp): every op passes
torch.library.opcheck (schema, fake implementation against the kernel, autograd registration, AOT dispatch with
dynamic shapes), the differentiable ops pass gradcheck in float64 through the op itself, and the layers and a whole
system compile with torch.compile(fullgraph=True) (no graph break) and export with torch.export, giving the eager
outputs and gradients. CPU only (the CUDA kernels are registered under the same ops; tests/test_triton.py holds
the Triton op to the same checks in triton's interpreter)."""
import os
import re

import pytest
import torch

import dtmt_kernels as dk
from conftest import RecordOps, padding_mask
from dtmt_kernels.ops.transition import KINDS, flat_params
import dtmt_models.engine.ops  # noqa: F401  (the engine's ops: their fakes and autocast rules)
from dtmt_models import build_model
from dtmt_models.decoding.beam_search import beam_search

pytestmark = pytest.mark.skipif("cpp" not in dk.available_backends(), reason="the C++ extension is not built")

OPS = ("transition_forward", "transition_backward", "additive_scores", "additive_scores_backward",
       "attention_context", "attention_context_backward", "small_rows_linear", "attention_step", "readout_features",
       "rnmt_step", "rnmt_beam_search", "memory_encoder", "transition_encode", "transition_encode_tokens")


def test_every_op_is_registered_in_the_dtmt_namespace():
    for name in OPS + ("transition_forward_triton", "transition_backward_triton"):
        op = getattr(torch.ops.dtmt, name).default
        assert op.namespace == "dtmt"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta") or \
            torch._library.simple_registry.singleton.find(op.name()).fake_impl.kernel is not None


def test_the_row_layout_table_is_the_kernels_one():
    """dtmt_kernels/ops/transition/layout.py's CELLS (read by nn.py, the Triton launchers and the fakes) against the
    extension's compiled values (csrc/cell_layout.inc, read by the C++ and CUDA kernels), exported as _C.CELL_ROWS;
    and the layers' parameter shapes follow it."""
    from dtmt_kernels import _C
    from dtmt_kernels.ops.transition import CELL_ROWS, DEEP_TRANSITION_CELLS, ROWS

    assert {k: tuple(v) for k, v in _C.CELL_ROWS.items()} == ROWS
    for cell in DEEP_TRANSITION_CELLS:
        layer = dk.nn.DeepTransitionGRU(3, 5, depth=1, cell=cell, layer_norm=True)
        n_in, n_h, n_g = CELL_ROWS[cell]
        assert layer.weight_ih.shape == (n_in * 5, 3) and layer.weight_hh.shape == (n_h * 5, 5)
        assert layer.ln_weight.shape == (n_g * 5,) and layer.tgru1_ln_weight.shape == (CELL_ROWS["tgru"][2] * 5,)


def test_the_kernels_layout_header_is_generated_from_the_table():
    """csrc/cell_layout.inc, the table as the C++ and CUDA kernels read it, is what setup.py writes from
    layout.py's CELLS (it writes it before every build; committed, it must be current for the CUDA sources' own
    compiles and a reader). Regenerate: python setup.py build_ext --inplace."""
    from dtmt_kernels.ops.transition.layout import cell_layout_header

    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "cell_layout.inc"),
              encoding="utf-8") as f:
        assert f.read() == cell_layout_header()


def _layer(cell, depth, ln, dtype=torch.float64, I=4, H=6):
    layer = dk.nn.ATR(I, H, layer_norm=ln) if cell == "atr" else \
        dk.nn.DeepTransitionGRU(I, H, depth=depth, cell=cell, layer_norm=ln)
    layer = layer.to(dtype)
    with torch.no_grad():   # layer-norm gains and offsets away from 1 and 0
        for name, p in layer.named_parameters():
            if "ln_" in name:
                p.add_(0.3 * torch.randn_like(p))
    return layer


TRANSITION_CASES = [("gru", 0, False), ("gru", 1, True), ("lgru", 2, True), ("lau", 1, False), ("atr", 0, True),
                    ("atr", 0, False)]


def _transition_args(cell, depth, ln, masked, seed=0, dtype=torch.float64, T=3, B=2):
    torch.manual_seed(seed)
    layer = _layer(cell, depth, ln, dtype)
    params = [None if p is None else p.detach().clone().requires_grad_()
              for p in flat_params(layer.direction_weights())]
    x = torch.randn(T, B, 4, dtype=dtype, requires_grad=True)
    h0 = torch.randn(B, 6, dtype=dtype, requires_grad=True)
    mask = drop = None
    if masked:
        mask = torch.ones(T, B, dtype=dtype)
        mask[T - 1:, 1] = 0
        if cell != "atr":
            drop = (torch.rand(depth + 1, B, 6) > 0.3).to(dtype) / 0.7
    return (x, h0, mask, drop, KINDS[cell], *params, masked, 1e-5)


@pytest.mark.parametrize("case", TRANSITION_CASES, ids=lambda c: f"{c[0]}-d{c[1]}-{'ln' if c[2] else 'noln'}")
@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked-reversed-dropout"])
def test_transition_op_passes_opcheck_and_gradcheck(case, masked):
    args = _transition_args(*case, masked)
    torch.library.opcheck(torch.ops.dtmt.transition_forward.default, args)
    inputs = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]

    def outputs(*tensors):
        full = list(args)
        for i, t in zip(inputs, tensors):
            full[i] = t
        out, h_n, *_ = torch.ops.dtmt.transition_forward(*full)
        return out, h_n

    assert torch.autograd.gradcheck(outputs, [args[i] for i in inputs])


def _detached(tree):
    return tuple(torch.utils._pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t,
                                              list(tree)))


def _record_system_calls(system, dtype=torch.float64):
    """The dtmt ops a system calls in one training step (forward and backward), in inference decoding steps at
    beam 4 (the small-row linear's rows) and in a beam search (its decoder's encode, and the modules' encode
    beside it), with the arguments they were called with."""
    torch.manual_seed(0)
    model = build_model(system, 40, 50, embed_dim=8, hidden_size=12).to(dtype)
    src, lengths = torch.randint(4, 40, (4, 6)), torch.tensor([6, 5, 3, 2])
    prev, target = torch.randint(4, 50, (4, 5)), torch.randint(4, 50, (4, 5))
    recorder = RecordOps()
    with recorder:
        loss, _, n = model(src, lengths, prev, target=target)
        (loss / n).backward()
        model.eval()
        with torch.no_grad():
            decoder = model.inference_decoder()
            state = decoder.encode(src, lengths)
            getattr(decoder, "model", decoder).encode(src, lengths)   # the modules' encode (no source tables)
            for t in range(2):
                _, state = decoder.step(state, prev[:, t])
            beam_search(decoder, src, lengths, beam=2, max_len_a=0.0, max_len_b=3)
    return recorder.calls


def test_the_transition_fakes_check_what_the_output_shapes_rest_on():
    """The fake implementations (what torch.compile and torch.export trace through, and all that a call on meta
    tensors runs) check the cell kind and the sizes the outputs' shapes come from, as the kernels do: a wrong kind
    was a KeyError from inside the fake, an h0 [7, 9] beside weights of H = 6 gave outputs of H = 6 without a word,
    and meta and CPU tensors mixed gave a meta result. The right arguments give the kernel's shapes."""
    from conftest import make_layer
    from dtmt_kernels.ops.transition import KINDS, flat_params

    layer = make_layer("lgru", 4, 6, depth=1, layer_norm=True, dtype=torch.float32)
    params = [p.detach() if p is not None else None for p in flat_params(layer.direction_weights(0))]
    meta = [p.to("meta") if p is not None else None for p in params]
    x, h0 = torch.zeros(3, 2, 4, device="meta"), torch.zeros(2, 6, device="meta")
    forward = torch.ops.dtmt.transition_forward
    out, h_n, xp, hs, hs_lp, hp, hpt = forward(x, h0, None, None, KINDS["lgru"], *meta, False, 1e-5)
    assert [list(t.shape) for t in (out, h_n, hs, hpt)] == [[3, 2, 6], [2, 6], [2, 3, 2, 6], [1, 3, 2, 18]]
    bad = {"unknown cell kind 99": (x, h0, 99, meta),
           "h0 must be [2, 6], got [7, 9]": (x, torch.zeros(7, 9, device="meta"), KINDS["lgru"], meta),
           "w_ih must be [30, 5] (H = 6), got [30, 4]": (torch.zeros(3, 2, 5, device="meta"), h0, KINDS["lgru"], meta),
           "w_hh must be [3 * H, H] for this cell": (x, h0, KINDS["gru"], meta),
           "every tensor must be on one device": (x, h0, KINDS["lgru"], [meta[0], *params[1:]])}
    for message, (xx, hh, kind, ps) in bad.items():
        with pytest.raises(RuntimeError, match=re.escape(f"dtmt::transition_forward: {message}")):
            forward(xx, hh, None, None, kind, *ps, False, 1e-5)
    encode = torch.ops.dtmt.transition_encode
    flat = [p if p is not None else torch.empty(0, device="meta") for p in meta]
    out, h_n = encode(x, h0.unsqueeze(0), None, KINDS["lgru"], flat, False, 1e-5)
    assert list(out.shape) == [3, 2, 6] and list(h_n.shape) == [1, 2, 6]
    with pytest.raises(RuntimeError, match=re.escape("dtmt::transition_encode: params must be ten a direction")):
        encode(x, h0.unsqueeze(0).expand(2, 2, 6), None, KINDS["lgru"], flat, False, 1e-5)
    with pytest.raises(RuntimeError, match=re.escape("dtmt::transition_encode: h0 must be [1, 2, 6], got [1, 2, 5]")):
        encode(x, torch.zeros(1, 2, 5, device="meta"), None, KINDS["lgru"], flat, False, 1e-5)


def test_the_encode_ops_refuse_a_mask_that_is_not_bool_or_real():
    """transition_encode (the C++ kernel and its fake) read a complex mask as its real part: 1j made every step
    padding, without a word; an integer one was converted. Refused, naming the op; bool and floating masks run."""
    from conftest import make_layer
    from dtmt_kernels.ops.transition import KINDS, flat_params

    layer = make_layer("lgru", 4, 6, depth=1, layer_norm=True, dtype=torch.float32)
    flat = [p.detach() if p is not None else torch.empty(0) for p in flat_params(layer.direction_weights(0))]
    x, h0 = torch.randn(3, 2, 4), torch.randn(1, 2, 6)
    encode = torch.ops.dtmt.transition_encode
    ones = torch.ones(3, 2)
    for device in ("cpu", "meta"):
        on = [t.to(device) for t in flat]
        for bad in (ones.to(torch.complex64) * 1j, ones.long()):
            with pytest.raises(RuntimeError, match=re.escape("dtmt::transition_encode: mask must be bool or "
                                                             "floating point (1 a real step, 0 padding), got")):
                encode(x.to(device), h0.to(device), bad.to(device), KINDS["lgru"], on, False, 1e-5)
    out = encode(x, h0, ones.bool(), KINDS["lgru"], flat, False, 1e-5)[0]
    torch.testing.assert_close(out, encode(x, h0, ones, KINDS["lgru"], flat, False, 1e-5)[0])


def test_the_transition_ops_refuse_a_dropout_mask_for_atr():
    """An ATR step has no candidate (contract §2): the raw ops took a dropout mask and ignored it, where the layers
    refuse candidate_dropout for ATR. Refused by the C++ ops (forward and backward) and by their fakes (the Triton
    ops' check, csrc's check_sequence on the meta device), naming the op; without the mask they run."""
    from dtmt_kernels.ops.transition import KINDS, flat_params

    layer = _layer("atr", 0, True)
    p = [t.detach() if t is not None else None for t in flat_params(layer.direction_weights())]
    x, h0 = torch.randn(3, 2, 4, dtype=torch.float64), torch.randn(2, 6, dtype=torch.float64)
    drop = torch.full((1, 2, 6), 2.0, dtype=torch.float64)
    out, h_n, *saved = torch.ops.dtmt.transition_forward(x, h0, None, None, KINDS["atr"], *p, False, 1e-5)
    message = "drop must be None for ATR, which has no candidate to drop (contract §2)"
    for device in ("cpu", "meta"):
        on = [t.to(device) if isinstance(t, torch.Tensor) else t for t in p]
        with pytest.raises(RuntimeError, match=re.escape(f"dtmt::transition_forward: {message}")):
            torch.ops.dtmt.transition_forward(x.to(device), h0.to(device), None, drop.to(device), KINDS["atr"],
                                              *on, False, 1e-5)
    with pytest.raises(RuntimeError, match=re.escape(f"dtmt::transition_backward: {message}")):
        torch.ops.dtmt.transition_backward(torch.ones_like(out), torch.ones_like(h_n), x, None, drop, KINDS["atr"],
                                           *p, *saved[:5], False, 1e-5, True)


def test_encode_tokens_takes_the_masks_encode_takes():
    """transition_encode_tokens refused a bool mask ("the mask of the table's dtype expected") where transition_encode,
    its fake and every other op take bool or floating masks: it takes both, and gives transition_encode's outputs on
    the embedded tokens (float64, ragged lengths), bool mask or float."""
    from dtmt_kernels.ops.transition import KINDS, flat_params

    layer = _layer("lgru", 1, True)
    p = [t.detach() if t is not None else torch.empty(0, dtype=torch.float64)
         for t in flat_params(layer.direction_weights())]
    g = torch.Generator().manual_seed(3)
    E, tokens = torch.randn(10, 4, dtype=torch.float64, generator=g), torch.randint(0, 10, (3, 2), generator=g)
    mask, h0 = padding_mask([3, 1], 3).bool(), torch.randn(1, 2, 6, dtype=torch.float64, generator=g)
    want = torch.ops.dtmt.transition_encode(E[tokens], h0, mask, KINDS["lgru"], p, False, 1e-5)
    for m in (mask, mask.double()):
        got = torch.ops.dtmt.transition_encode_tokens(tokens, E @ p[0].t(), None, h0, m, KINDS["lgru"], p, False,
                                                      1e-5)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("reverse", [False, True])
def test_the_reference_of_no_steps_answers_as_the_op(reverse):
    """T = 0 (a raw call; the layers refuse it as torch.nn.GRU does): the C++ op answers an empty output and h0
    as h_n; the reference, the spec it is tested against, failed in torch.stack's "expects a non-empty TensorList"."""
    from dtmt_kernels.ops.transition import KINDS, flat_params

    layer = _layer("lgru", 2, True, torch.float64)
    w = layer.direction_weights()
    x, h0 = torch.randn(0, 3, 4, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)
    out, h_n = dk.reference.transition_sequence(x, h0, w, torch.ones(0, 3, dtype=torch.float64), reverse=reverse)
    op_out, op_hn, *_ = torch.ops.dtmt.transition_forward(x, h0, None, None, KINDS["lgru"], *flat_params(w),
                                                          reverse, 1e-5)
    assert out.shape == op_out.shape == (0, 3, 6) and torch.equal(h_n, h0) and torch.equal(op_hn, h0)


def test_the_engine_fakes_check_kinds_and_batches():
    """The inference ops' fakes (dtmt_models/engine/ops.py) check the cell kinds and that their tensors share the
    batch and source length, as the kernels do: a meta call with a wrong kind returned outputs without a word, and
    a state of another batch gave outputs of src_mask's. The calls a system makes (recorded) pass on meta tensors;
    attention_step (which the systems' fused steps do not call) on meta tensors made here."""
    calls = {op.__name__.split(".")[0]: c for op, c in _record_system_calls("dtmt", torch.float32).items()}
    calls.update({op.__name__.split(".")[0]: c for op, c in _record_system_calls("mce", torch.float32).items()})

    def meta(tree):
        return list(torch.utils._pytree.tree_map(lambda t: t.detach().to("meta") if isinstance(t, torch.Tensor) else t,
                                                 list(tree)))

    step = meta(calls["rnmt_step"][0])
    log_probs, state, alpha = torch.ops.dtmt.rnmt_step(*step)
    assert log_probs.is_meta and state.shape == step[1].shape and alpha.shape == step[4].shape
    for index, name in ((5, "q_kind"), (7, "d_kind")):
        bad = list(step)
        bad[index] = 99
        with pytest.raises(RuntimeError, match=f"dtmt::rnmt_step: unknown cell kind 99 for {name}"):
            torch.ops.dtmt.rnmt_step(*bad)
    bad = list(step)
    bad[1] = torch.empty(step[1].shape[0] + 1, step[1].shape[1], device="meta")
    with pytest.raises(RuntimeError, match=re.escape(f"dtmt::rnmt_step: s must be [{step[4].shape[0]}, ?], got")):
        torch.ops.dtmt.rnmt_step(*bad)
    encoder = meta(calls["memory_encoder"][0])
    torch.ops.dtmt.memory_encoder(*encoder)
    encoder[4] = -1
    with pytest.raises(RuntimeError, match="dtmt::memory_encoder: unknown cell kind -1 for cell_kind"):
        torch.ops.dtmt.memory_encoder(*encoder)
    def m(*shape):
        return torch.empty(*shape, device="meta")

    keys, annotations, src_mask = m(2, 5, 2, 4), m(2, 5, 6), torch.empty(2, 5, dtype=torch.bool, device="meta")
    context, alpha = torch.ops.dtmt.attention_step(m(2, 8), keys, annotations, src_mask, [m(0)] * 3, 1e-5)
    assert list(context.shape) == [2, 6] and list(alpha.shape) == [2, 2, 5]
    with pytest.raises(RuntimeError, match=re.escape("dtmt::attention_step: query must be [2, ?], got [1, 8]")):
        torch.ops.dtmt.attention_step(m(1, 8), keys, annotations, src_mask, [m(0)] * 3, 1e-5)


def test_the_attention_linear_and_loss_fakes_check_the_sizes_their_outputs_rest_on():
    """The fakes of the attention ops, the small-row linear and the loss check the sizes the kernels check: a meta call
    with a query, v, gradient, weight or target of other sizes gave outputs without a word (shaped by one of the
    arguments), where the kernel refuses it."""
    def m(*shape, dtype=torch.float32):
        return torch.empty(*shape, device="meta", dtype=dtype)

    ops = torch.ops.dtmt
    assert ops.additive_scores(m(2, 5, 3, 4), m(2, 3, 4), m(3, 4)).shape == (2, 3, 5)
    assert ops.attention_context(m(2, 3, 5), m(2, 5, 6)).shape == (2, 6)
    assert ops.small_rows_linear(m(2, 8), m(4, 12, dtype=torch.int8), None).shape == (2, 4)
    bad = [("additive_scores: query must be [2, 3, 4], got [7, 3, 4]", ops.additive_scores,
            (m(2, 5, 3, 4), m(7, 3, 4), m(3, 4))),
           ("additive_scores: keys must be [?, ?, ?, ?], got [2, 5, 3]", ops.additive_scores,
            (m(2, 5, 3), m(2, 3, 4), m(3, 4))),
           ("additive_scores_backward: grad must be [2, 3, 5], got [2, 5, 3]", ops.additive_scores_backward,
            (m(2, 5, 3), m(2, 5, 3, 4), m(2, 3, 4), m(3, 4))),
           ("attention_context: values must be [2, 7, ?], got [2, 5, 6]", ops.attention_context,
            (m(2, 3, 7), m(2, 5, 6))),
           ("attention_context: values' C = 6 must be a multiple of alpha's NH = 4", ops.attention_context,
            (m(2, 4, 5), m(2, 5, 6))),
           ("attention_context_backward: grad must be [2, 6], got [6, 2]", ops.attention_context_backward,
            (m(6, 2), m(2, 3, 5), m(2, 5, 6), True)),
           ("small_rows_linear: x must be [?, 9], got [2, 8]", ops.small_rows_linear, (m(2, 8), m(4, 9), None)),
           ("small_rows_linear: bias must be [4], got [5]", ops.small_rows_linear, (m(2, 8), m(4, 8), m(5))),
           ("smoothed_cross_entropy: target must be [5], got [4]", ops.smoothed_cross_entropy,
            (m(5, 7), m(4, dtype=torch.long), 0.1, -100))]
    for message, op, args in bad:
        with pytest.raises(RuntimeError, match=re.escape(f"dtmt::{message}")):
            op(*args)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_attention_linear_and_loss_ops_refuse_dtypes_by_name_and_their_fakes_alike(device):
    """What the kernels refuse for its dtype, the fakes refuse too (a meta call or a trace took float16 logits, an
    int32 target, a smoothing of 5 or mixed dtypes, which failed only when run), and both name the argument: the
    kernels' messages were ATen's ("mat1 and mat2 must have the same dtype", "not implemented for 'Half'") or named
    x for a float64 bias."""
    def t(*shape, dtype=torch.float32):
        return torch.zeros(*shape, device=device, dtype=dtype)

    ops, f64, i8 = torch.ops.dtmt, torch.float64, torch.int8
    packed = t(4, 12, dtype=i8)
    if device == "cpu":
        packed = dk.ops.linear.quantize.pack_int8_rows(torch.randn(4, 8))
    cases = [(r"additive.scores: q is (torch\.float64|Double) but keys is (torch\.float32|Float); give them one dtype",
              ops.additive_scores, (t(2, 5, 3, 4), t(2, 3, 4, dtype=f64), t(3, 4))),
             (r"additive.scores: float32 or float64 tensors expected, got (torch\.float16|Half)|additive_scores: takes "
              r"float32 or float64 tensors, got torch\.float16", ops.additive_scores,
              (t(2, 5, 3, 4, dtype=torch.half), t(2, 3, 4, dtype=torch.half), t(3, 4, dtype=torch.half))),
             (r"attention.context: values is (torch\.float32|Float) but alpha is (torch\.float64|Double)",
              ops.attention_context, (t(2, 3, 5, dtype=f64), t(2, 5, 6))),
             (r"attention.context(: float32 or float64 tensors expected|: takes float32 or float64 tensors), got "
              r"(torch\.int64|Long)", ops.attention_context,
              (t(2, 3, 5, dtype=torch.long), t(2, 5, 6, dtype=torch.long))),
             (r"small_rows_linear: (w|weight) is (torch\.float32|Float) but x is (torch\.float64|Double)",
              ops.small_rows_linear, (t(2, 8, dtype=f64), t(4, 8), None)),
             (r"small_rows_linear: bias is (torch\.float64|Double) but x is (torch\.float32|Float)",
              ops.small_rows_linear, (t(2, 8), t(4, 8), t(4, dtype=f64))),
             (r"the bias of an int8 weight is float32, got Double|small_rows_linear: bias is torch\.float64 but x is",
              ops.small_rows_linear, (t(2, 8), packed, t(4, dtype=f64))),
             ("smoothed_cross_entropy takes float32 or float64 logits|smoothed_cross_entropy: takes float32 or float64",
              ops.smoothed_cross_entropy, (t(3, 5, dtype=torch.half), t(3, dtype=torch.long), 0.1, -100)),
             ("the target int64|smoothed_cross_entropy: takes int64 tensors, got torch.int32",
              ops.smoothed_cross_entropy, (t(3, 5), t(3, dtype=torch.int32), 0.1, -100)),
             ("takes 0 <= smoothing < 1, got 5", ops.smoothed_cross_entropy,
              (t(3, 5), t(3, dtype=torch.long), 5.0, -100))]
    for message, op, args in cases:
        with pytest.raises(RuntimeError, match=message):
            op(*args)


def test_an_op_with_one_argument_on_the_meta_device_refuses_it():
    """A call with one argument on the meta device and the others on the CPU dispatches to the op's fake, which gave
    uninitialised CPU tensors as the result (a layer whose bias was loaded onto the meta device: values of 1e37,
    different at every call). Every fake now checks that its tensors share one device first: each op a system
    calls, with each of its tensor arguments in turn on the meta device, is refused, naming the op: the empty ones
    too (an absent bias given as an empty meta tensor passed the check, which skipped empty tensors, and the result
    was uninitialised CPU memory). And no fake is registered past that check."""
    calls = {}
    for system in ("dtmt", "mce", "gnmt-atr"):
        calls.update(_record_system_calls(system, torch.float32))
    assert len(calls) >= 12
    refused = refused_empty = 0
    for op, (args, kwargs) in calls.items():
        args = _detached(args)
        name = op.__name__.split(".")[0]
        for i, a in enumerate(args):
            for j, t in ([(None, a)] if isinstance(a, torch.Tensor) else
                         enumerate(a) if isinstance(a, (list, tuple)) else ()):
                if not isinstance(t, torch.Tensor):
                    continue
                bad = list(args)
                if j is None:
                    bad[i] = t.to("meta")
                else:
                    bad[i] = [u.to("meta") if k == j else u for k, u in enumerate(a)]
                with pytest.raises(RuntimeError, match=re.escape(f"dtmt::{name}: every tensor must be on one device, "
                                                                 "got ['cpu', 'meta']")):
                    op(*bad, **kwargs)
                refused += 1
                refused_empty += t.numel() == 0
    assert refused >= 100 and refused_empty >= 5
    # an op whose CPU tensors are all empty, with an empty meta one: its output (not empty) was CPU heap bytes
    with pytest.raises(RuntimeError, match=re.escape("dtmt::additive_scores: every tensor must be on one device")):
        torch.ops.dtmt.additive_scores(torch.randn(2, 3, 2, 0), torch.randn(2, 2, 0), torch.empty(2, 0, device="meta"))
    # the case found: a layer's state dict loaded with one tensor on the meta device
    layer = dk.nn.DeepTransitionGRU(5, 6, depth=1, cell="gru", layer_norm=False)
    state = layer.state_dict()
    state["bias_ih"] = torch.empty(18, device="meta")
    layer.load_state_dict(state, assign=True)   # (the layer names it: test_nn's parameter-apart test)
    with pytest.raises(ValueError, match="parameter bias_ih is torch.float32 on meta but the others"):
        layer(torch.randn(4, 3, 5))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for package in ("dtmt_kernels", "dtmt_models"):
        for folder, _, files in os.walk(os.path.join(root, package)):
            for f in files:
                if f.endswith(".py") and f != "_register.py":
                    with open(os.path.join(folder, f), encoding="utf-8") as source:
                        assert "library.register_fake" not in source.read(), os.path.join(folder, f)


def test_a_gradient_of_a_gradient_through_the_fused_ops_is_refused():
    """Differentiating a fused op's gradient (double backward) gave no second-order gradients (None) with only
    torch's warning that the backward op had no autograd kernel. Now it is refused in one line naming the op; a
    backward with create_graph=True alone still gives the first-order gradients; the reference backend, which has
    second-order gradients, is what the message points to (its gradient penalty's gradient is finite and nonzero)."""
    torch.manual_seed(0)
    layer = dk.nn.DeepTransitionGRU(6, 7, depth=2).double()
    x = torch.randn(5, 3, 6, dtype=torch.float64, requires_grad=True)
    plain, = torch.autograd.grad(layer(x)[0].sum(), x)
    graphed, = torch.autograd.grad(layer(x)[0].sum(), x, create_graph=True)
    assert torch.equal(plain, graphed)
    with pytest.raises(RuntimeError, match=re.escape("dtmt::transition_backward: a gradient of a gradient (double "
                                                     "backward) is not supported")):
        graphed.square().sum().backward()
    layer.backend = "reference"
    penalty, = torch.autograd.grad(layer(x)[0].sum(), x, create_graph=True)
    penalty.square().sum().backward()
    assert torch.isfinite(layer.weight_hh.grad).all() and layer.weight_hh.grad.abs().sum() > 0
    keys, query = torch.randn(2, 5, 2, 4, requires_grad=True), torch.randn(2, 2, 4, requires_grad=True)
    v, values = torch.randn(2, 4, requires_grad=True), torch.randn(2, 5, 6, requires_grad=True)
    for name, out in (("additive_scores_backward", lambda: torch.ops.dtmt.additive_scores(keys, query, v)),
                      ("attention_context_backward",
                       lambda: torch.ops.dtmt.attention_context(torch.softmax(query @ keys[:, :, 0].mT, -1), values))):
        grads = torch.autograd.grad(out().sum(), (keys, query), create_graph=True, allow_unused=True)
        with pytest.raises(RuntimeError, match=re.escape(f"dtmt::{name}: a gradient of a gradient")):
            sum(g.square().sum() for g in grads if g is not None).backward()


def test_the_inference_only_ops_refuse_a_gradient_instead_of_giving_none():
    """The ops without a backward (the small-row linear, the encode and decoding ops), called on tensors that require
    grad, ran their backward with only torch's warning that they had no autograd kernel, and the inputs' gradients
    were None. Now they have torch's not-implemented autograd kernel: a gradient through their outputs is refused in
    one line naming the op; without one needed, and under no_grad, they run as before."""
    x, w = torch.randn(2, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    out = torch.ops.dtmt.small_rows_linear(x, w, None)
    torch.testing.assert_close(out, x.detach() @ w.detach().t())
    with pytest.raises(RuntimeError, match="derivative for dtmt::small_rows_linear is not implemented"):
        out.sum().backward()
    with torch.no_grad():
        assert not torch.ops.dtmt.small_rows_linear(x, w, None).requires_grad
    seen = set()
    for func, (args, kwargs) in _record_system_calls("dtmt").items():
        name = func.__name__.split(".")[0]
        if name not in ("transition_encode", "transition_encode_tokens", "attention_step", "readout_features",
                        "rnmt_step", "rnmt_beam_search", "memory_encoder"):
            continue
        args = list(args)
        i = next(i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point() and a.numel())
        args[i] = args[i].detach().clone().requires_grad_()
        outputs = [t for t in func(*args, **kwargs) if t.is_floating_point() and t.numel()]
        with pytest.raises(RuntimeError, match=f"derivative for dtmt::{name} is not implemented"):
            sum(t.sum() for t in outputs).backward()
        seen.add(name)
    assert seen >= {"transition_encode", "transition_encode_tokens", "rnmt_step", "rnmt_beam_search"}, seen


def test_the_ops_autograd_kernels_fill_no_defaults_per_call(monkeypatch):
    """The C++ ops' autograd kernels (_register.register_autograd) call setup_context with the call's own arguments:
    torch's called fill_defaults on every recording forward, quadratic in the arguments (transition_forward has 17):
    the largest piece of a small layer's host time a call. Counted here: no call on the ops of a layer, attention
    and the loss, and their gradients still reach every input that asks for one (only those: a frozen weight gets
    none). An op with defaults is refused at registration."""
    from torch._library import utils
    from dtmt_kernels.ops._register import register_autograd
    calls = []
    fill = utils.fill_defaults
    monkeypatch.setattr(utils, "fill_defaults", lambda *a: calls.append(1) or fill(*a))
    torch.manual_seed(0)
    layer = dk.nn.DeepTransitionGRU(6, 7, depth=1).double()
    layer.weight_hh.requires_grad_(False)
    x = torch.randn(5, 3, 6, dtype=torch.float64, requires_grad=True)
    keys, query = torch.randn(2, 5, 2, 4, requires_grad=True), torch.randn(2, 2, 4, requires_grad=True)
    v, values = torch.randn(2, 4), torch.randn(2, 5, 6, requires_grad=True)
    logits = torch.randn(4, 9, requires_grad=True)
    alpha = torch.softmax(torch.ops.dtmt.additive_scores(keys, query, v), -1)   # [B, heads, S]
    total = (layer(x)[0].sum() + torch.ops.dtmt.attention_context(alpha, values).sum()
             + torch.ops.dtmt.smoothed_cross_entropy(logits, torch.tensor([1, 2, 3, 0]), 0.1, -100)[0])
    total.backward()
    assert calls == []
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (x, layer.weight_ih, keys, query, values, logits))
    assert layer.weight_hh.grad is None and v.grad is None
    with pytest.raises(AssertionError, match="positional without defaults"):
        register_autograd("dtmt::transition_backward", lambda ctx, *g: g, lambda ctx, inputs, output: None)


def test_a_gradient_of_a_gradient_through_unrolled_steps_is_refused():
    """In an `unrolled` block (the decoder cells' and contexts' steps, autograd.Functions), a gradient taken with
    create_graph=True and then differentiated gave a silently wrong second-order gradient where the gradient reaching
    the steps was a constant (a loss linear in the states): torch's once_differentiable returned the steps' gradients
    as constants (a probe: the embedding's gradient 1.05 against the reference's 3.31, the cell's none). Now refused
    as outside the block; a backward with create_graph=True alone still runs."""
    torch.manual_seed(0)
    cell, embed = dk.nn.DeepTransitionGRUCell(3, 4, depth=1).double(), torch.nn.Linear(3, 3).double()
    attention = dk.nn.DeepTransitionGRUCell(3, 4)   # (an Unrollable owner for the contexts' steps)
    x = torch.randn(4, 2, 3, dtype=torch.float64, requires_grad=True)
    values = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    with dk.nn.unrolled(cell, attention):
        h = torch.zeros(2, 4, dtype=torch.float64)
        for t in range(4):
            h = cell(embed(x[t]), h)
        first, = torch.autograd.grad(h.sum(), x, create_graph=True)
        scores = torch.randn(2, 1, 5, dtype=torch.float64, requires_grad=True)
        context = dk.nn.step_context(attention, torch.softmax(scores, -1), values)
        first_values, = torch.autograd.grad(context.sum(), values, create_graph=True)
    assert torch.isfinite(first).all() and first.abs().sum() > 0 and torch.isfinite(first_values).all()
    with pytest.raises(RuntimeError, match=re.escape("dtmt::transition_backward: a gradient of a gradient (double "
                                                     "backward) is not supported by the fused kernels; run the layer "
                                                     "with backend='reference'")):
        first.square().sum().backward()
    with pytest.raises(RuntimeError, match=re.escape("dtmt::attention_context_backward: a gradient of a gradient")):
        first_values.square().sum().backward()


def test_a_gradient_of_a_gradient_taken_with_autograd_grad_is_refused_not_none():
    """torch.autograd.grad of an unrolled block's gradient with respect to the weights or the inputs (not .backward()
    to every leaf) never reached the refusal, which hung on detached aliases only: the second-order gradient came back
    None with allow_unused=True (the reference backend's abs sum 0.51), else torch's "appears to not have been used".
    The refusal hangs on what the gradients depend on: the incoming gradients, the saved tensors, the session's
    weights or values."""
    torch.manual_seed(0)
    cell = dk.nn.DeepTransitionGRUCell(5, 4, depth=1).double()
    attention = dk.nn.DeepTransitionGRUCell(3, 4)
    x = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    values = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    refused = re.escape("a gradient of a gradient (double backward) is not supported by the fused kernels")
    with dk.nn.unrolled(cell, attention):
        h = cell(x, cell(x))
        first_x, = torch.autograd.grad(h.pow(2).sum(), x, create_graph=True)
        first_w, = torch.autograd.grad(cell(x, cell(x)).sum(), cell.weight_hh, create_graph=True)
        scores = torch.randn(2, 1, 5, dtype=torch.float64, requires_grad=True)
        context = dk.nn.step_context(attention, torch.softmax(scores, -1), values)
        first_scores, = torch.autograd.grad(context.pow(2).sum(), scores, create_graph=True)
    for first, wrt in ((first_x, cell.weight_hh), (first_x, x), (first_w, x), (first_scores, values)):
        with pytest.raises(RuntimeError, match=refused):
            torch.autograd.grad(first.pow(2).sum(), wrt, allow_unused=True)


def test_a_first_order_gradient_with_create_graph_runs_inside_a_non_reentrant_checkpoint():
    """The refusal's node read the Function's saved tensors a second time, which a non-reentrant checkpoint refuses
    ("Unpack is being triggered for a tensor that was already unpacked once"): the portable loss (CUDA, 16-bit)
    under torch.utils.checkpoint with create_graph=True failed where it had run. Its gradients are the plain ones,
    and differentiating them is still refused."""
    from torch.utils.checkpoint import checkpoint

    from dtmt_kernels.ops.loss.op import PortableSmoothedCrossEntropy

    torch.manual_seed(0)
    target = torch.tensor([1, 4, 0])
    logits = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    plain, = torch.autograd.grad(PortableSmoothedCrossEntropy.apply(logits * 2, target, 0.1, -100)[0], logits)
    loss = checkpoint(lambda z: PortableSmoothedCrossEntropy.apply(z * 2, target, 0.1, -100)[0], logits,
                      use_reentrant=False)
    first, = torch.autograd.grad(loss, logits, create_graph=True)
    torch.testing.assert_close(first, plain)
    with pytest.raises(RuntimeError, match="a gradient of a gradient"):
        first.square().sum().backward()


def test_forward_mode_and_torch_func_gradients_are_refused_not_zero():
    """A forward-mode tangent (torch.func.jvp / jacfwd, torch.autograd.forward_ad) passed through the fused ops as
    through a constant's: a silent zero or None where torch.nn.GRU gives the tangent (a probe's finding). The layers,
    cells and attention ops now refuse it in one line naming the op, as torch.func.grad (torch's message about
    autograd.Function before); the loss and the small-row linear, which have no backend to choose, compute it by
    PyTorch's own ops: the tangents of torch.nn.Linear and of the loss's reference."""
    import torch.autograd.forward_ad as forward_ad
    from dtmt_kernels.ops.loss import reference as loss_reference

    torch.manual_seed(0)
    gru = torch.nn.GRU(3, 4).double()
    layer = dk.nn.DeepTransitionGRU.from_torch(gru)
    x, t = torch.randn(5, 2, 3, dtype=torch.float64), torch.randn(5, 2, 3, dtype=torch.float64)
    forward = re.escape("dtmt::transition_forward: forward-mode AD (torch.func.jvp, jacfwd, torch.autograd.forward_ad) "
                        "is not supported by the fused kernels; run the layer with backend='reference'")
    with pytest.raises(RuntimeError, match=forward):
        torch.func.jvp(lambda x: layer(x)[0], (x,), (t,))
    with pytest.raises(RuntimeError, match=re.escape("dtmt::transition_forward: torch.func's gradient transforms")):
        torch.func.grad(lambda x: layer(x)[0].sum())(x)
    # a layer the transform does not differentiate through runs (a frozen encoder beside the head that torch.func.grad
    # trains; the review found the first check refused it, the tensors made inside a transform being wrapped too),
    # its lengths made inside the transform with it
    head = torch.randn(3, dtype=torch.float64)
    frozen = dk.nn.DeepTransitionGRU.from_torch(gru).requires_grad_(False)
    torch.testing.assert_close(torch.func.grad(lambda w: (w * w).sum() + frozen(
        x, lengths=torch.tensor([5, 3]))[0].sum())(head), 2 * head)
    layer.requires_grad_(False)   # (frozen: a tangent of None before)
    with forward_ad.dual_level(), pytest.raises(RuntimeError, match=forward):
        layer(forward_ad.make_dual(x, t))
    cell = dk.nn.DeepTransitionGRUCell.from_torch(torch.nn.GRUCell(3, 4).double())
    with pytest.raises(RuntimeError, match=forward):
        torch.func.jvp(lambda x: cell(x), (x[0],), (t[0],))
    keys, query, v = torch.randn(2, 5, 1, 4), torch.randn(2, 1, 4), torch.randn(1, 4)
    with pytest.raises(RuntimeError, match=re.escape("dtmt::additive_scores: forward-mode AD")):
        torch.func.jvp(lambda q: dk.functional.additive_scores(keys, q, v), (query,), (query,))
    # what vmap, the reference backend and torch.nn.GRU give is untouched: the reference's tangent is torch's
    layer.backend = "reference"
    torch.testing.assert_close(torch.func.jvp(lambda x: layer(x)[0], (x,), (t,))[1],
                               torch.func.jvp(lambda x: gru(x)[0], (x,), (t,))[1])
    layer.backend = "cpp"
    torch.testing.assert_close(torch.func.vmap(lambda x: layer(x)[0], in_dims=1, out_dims=1)(x), layer(x)[0])
    lengths = torch.tensor([5, 3])   # (the batch's lengths from outside: read on the host; vmapped over, refused
    #                                   in one line, where torch said "Cannot access data pointer of Tensor ...")
    torch.testing.assert_close(torch.func.vmap(lambda x: layer(x, lengths=lengths)[0])(x[None])[0],
                               layer(x, lengths=lengths)[0])
    with pytest.raises(ValueError, match="DeepTransitionGRU: lengths are read on the host, which a torch.func "
                                         "transform"):
        torch.func.vmap(lambda x, n: layer(x, lengths=n)[0])(x[None], lengths[None])
    linear = dk.nn.Linear(3, 5).double().requires_grad_(False)
    reference = torch.nn.Linear(3, 5).double()
    reference.load_state_dict(linear.state_dict())
    rows, tangent = torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)
    assert torch.func.jvp(linear, (rows,), (tangent,))[1].abs().sum() > 0
    torch.testing.assert_close(torch.func.jvp(linear, (rows,), (tangent,))[1],
                               torch.func.jvp(reference, (rows,), (tangent,))[1])
    logits, target = torch.randn(4, 7, dtype=torch.float64), torch.tensor([1, 0, 6, 2])
    for transform in (lambda f: torch.func.grad(f)(logits), lambda f: torch.func.jvp(f, (logits,), (logits,))[1]):
        torch.testing.assert_close(
            transform(lambda z: dk.functional.smoothed_cross_entropy(z, target, 0.1, 0)[0]),
            transform(lambda z: loss_reference.smoothed_cross_entropy(z, target, 0.1, 0)[0]))
    # the ops called directly, not through the functional wrappers' checks: their tangent was a silent zero (jvp) or
    # None (make_dual); the ops' autograd kernel now refuses it too
    a, values = torch.randn(2, 2, 3, dtype=torch.float64), torch.randn(2, 3, 4, dtype=torch.float64)
    direct = {"attention_context": lambda a: torch.ops.dtmt.attention_context(a, values),
              "smoothed_cross_entropy": lambda z: torch.ops.dtmt.smoothed_cross_entropy(z, target, 0.1, 0)[0],
              "additive_scores": lambda q: torch.ops.dtmt.additive_scores(keys, q, v)}
    for (name, f), primal in zip(direct.items(), (a, logits, query)):
        with pytest.raises(RuntimeError, match=re.escape(f"dtmt::{name}: forward-mode AD")):
            torch.func.jvp(f, (primal,), (torch.ones_like(primal),))
        with forward_ad.dual_level(), pytest.raises(RuntimeError, match=re.escape(f"dtmt::{name}: forward-mode AD")):
            f(forward_ad.make_dual(primal, torch.ones_like(primal)))
    torch.testing.assert_close(torch.func.vmap(direct["attention_context"])(a[None]),
                               direct["attention_context"](a)[None])   # (vmap runs)


def test_a_dropout_mask_that_needs_a_gradient_is_refused():
    """A caller's candidate-dropout mask with requires_grad got no gradient from the fused kernels (None) where the
    reference backend gives one: a silent difference between backends (learned dropout). Now refused in one line;
    a mask without a gradient runs as before."""
    torch.manual_seed(0)
    cell = dk.nn.DeepTransitionGRUCell(3, 4, depth=1).double()
    x = torch.randn(2, 3, dtype=torch.float64)
    drop = torch.ones(2, 2, 4, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match=re.escape("dtmt::transition_forward: drop requires grad, but the fused "
                                                     "kernels form no gradient for the dropout mask")):
        cell(x, None, drop)
    with dk.nn.unrolled(cell), pytest.raises(RuntimeError, match="drop requires grad"):
        cell(x.requires_grad_(), None, drop)
    torch.testing.assert_close(cell(x, None, drop.detach()), cell(x))
    cell.backend = "reference"
    cell(x, None, drop).sum().backward()
    assert drop.grad.abs().sum() > 0


@pytest.mark.parametrize("system", ["dtmt", "nematus", "mce", "gnmt-atr"])
def test_every_op_a_system_calls_passes_opcheck(system):
    """Each op as a system calls it (training step and decoding: the attention, backward and inference ops),
    its arguments detached: schema, fake implementation (shapes, dtypes, strides) and AOT dispatch."""
    calls = _record_system_calls(system, torch.float32 if system == "gnmt-atr" else torch.float64)
    assert calls, f"{system} called no dtmt op"
    for op, (args, kwargs) in calls.items():
        torch.library.opcheck(op, _detached(args), dict(kwargs))
    names = {op.__name__.split(".")[0] for op in calls}
    expected = {"dtmt": {"transition_forward", "transition_backward", "additive_scores", "additive_scores_backward",
                         "attention_context_backward", "rnmt_step", "rnmt_beam_search", "transition_encode",
                         "transition_encode_tokens"},
                "mce": {"memory_encoder", "rnmt_step", "rnmt_beam_search"},
                "nematus": {"transition_forward", "rnmt_step", "rnmt_beam_search"},
                "gnmt-atr": {"transition_forward", "small_rows_linear"}}[system] | {"smoothed_cross_entropy"}
    assert expected <= names, f"{system}: {sorted(names)}"


def test_loss_op_passes_opcheck_and_gradcheck():
    torch.manual_seed(2)
    logits = (3 * torch.randn(7, 11, dtype=torch.float64)).requires_grad_()
    target = torch.tensor([3, 0, 10, 5, 0, 1, 0])
    torch.library.opcheck(torch.ops.dtmt.smoothed_cross_entropy.default, (logits, target, 0.1, 0))
    assert torch.autograd.gradcheck(lambda z: torch.ops.dtmt.smoothed_cross_entropy(z, target, 0.1, 0)[0], (logits,))
    loss, _, _ = torch.ops.dtmt.smoothed_cross_entropy(logits, target, 0.1, 0)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss, logits, create_graph=True)
    loss, nll, _ = torch.ops.dtmt.smoothed_cross_entropy(logits, target, 0.1, 0)   # backward twice (retain_graph)
    first, = torch.autograd.grad(loss * 2.0, logits, retain_graph=True)
    second, = torch.autograd.grad(loss * 3.0, logits)
    torch.testing.assert_close(second, first * 1.5, rtol=1e-12, atol=0)
    assert not nll.requires_grad   # (a statistic: nothing flows back through it, as through torch.max's indices)
    # logits a transposed view: the fake's gradient is contiguous, as the kernel's (it had the logits' strides, and
    # inductor failed on the op's output)
    torch.library.opcheck(torch.ops.dtmt.smoothed_cross_entropy.default, (logits.detach().t().contiguous().t(),
                                                                         target, 0.1, 0))


def _attention_ops_pass_opcheck_with_gradients(device):
    """torch.library.opcheck and gradcheck of the scores and context ops on `device`'s kernels (float64)."""
    torch.manual_seed(1)
    keys = torch.randn(2, 5, 3, 4, dtype=torch.float64, device=device, requires_grad=True)
    query = torch.randn(2, 3, 4, dtype=torch.float64, device=device, requires_grad=True)
    v = torch.randn(3, 4, dtype=torch.float64, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.dtmt.additive_scores.default, (keys, query, v))
    assert torch.autograd.gradcheck(torch.ops.dtmt.additive_scores, (keys, query, v))
    alpha = torch.softmax(torch.randn(2, 3, 5, dtype=torch.float64, device=device), -1).requires_grad_()
    for transposed in (False, True):   # values read in place when only the last dimension is contiguous
        values = torch.randn(5, 2, 6, dtype=torch.float64, device=device).transpose(0, 1) if transposed else \
            torch.randn(2, 5, 6, dtype=torch.float64, device=device)
        values.requires_grad_()
        torch.library.opcheck(torch.ops.dtmt.attention_context.default, (alpha, values))
        assert torch.autograd.gradcheck(torch.ops.dtmt.attention_context, (alpha, values))


def test_attention_ops_pass_opcheck_with_gradients():
    _attention_ops_pass_opcheck_with_gradients("cpu")


def test_an_export_leaves_no_fake_table_behind():
    """The inference decoder's encode exported before any eager call (dtmt: positional source embeddings) kept the
    tables it made while traced, fake tensors, in the decoder (its source positions' products) and in the model's
    embedding (its positions): every later encode returned a FakeTensor and beam search failed. Caches are not kept
    while torch traces: after the export the decoder decodes as a fresh one, and the program gives its encode."""
    def built():
        torch.manual_seed(0)
        return build_model("dtmt", 60, 60, embed_dim=32, hidden_size=48, heads=4).eval()

    src, lengths = torch.randint(4, 60, (2, 5)), torch.tensor([5, 3])
    fresh = beam_search(built().inference_decoder(), src, lengths)
    model = built()
    decoder = model.inference_decoder()
    program = torch.export.export(_Call(decoder, "encode"), (src, lengths))
    tables = [decoder._source_position_table, model.src_embed._table, model.tgt_embed._table]
    assert not any(isinstance(t, torch._subclasses.fake_tensor.FakeTensor) for t in tables)
    assert type(decoder.encode(src, lengths)["s"]) is torch.Tensor
    assert beam_search(decoder, src, lengths) == fresh
    torch.testing.assert_close(program.module()(src, lengths)["s"], decoder.encode(src, lengths)["s"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_attention_ops_pass_opcheck_with_gradients():
    """The attention ops' CUDA kernels (csrc/attention_cuda.cu, registered under the CUDA key): schema, fake,
    autograd, AOT dispatch and gradcheck on the device."""
    if not dk.ops._C.has_cuda:
        pytest.skip("the extension was built without CUDA kernels")
    _attention_ops_pass_opcheck_with_gradients("cuda")


def _compare_compiled(module, args, grads_of, backend="aot_eager", **kwargs):
    """module(*args) eager against torch.compile(fullgraph=True): outputs and the gradients of sum(outputs)."""
    results = []
    for fn in (module, torch.compile(module, fullgraph=True, backend=backend)):
        for t in grads_of:
            t.grad = None
        out = fn(*args, **kwargs)
        outs = out if isinstance(out, tuple) else (out,)
        sum(o.float().sin().sum() for o in outs if o.is_floating_point()).backward()
        results.append([o.detach() for o in outs] + [t.grad.clone() for t in grads_of])
    for ref, got in zip(*results):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["dt-gru-bidirectional", "atr-reverse", "dt-cell", "atr-cell"])
def test_layers_compile_without_graph_breaks(kind):
    torch._dynamo.reset()
    torch.manual_seed(0)
    x = torch.randn(5, 3, 8, requires_grad=True)
    lengths = torch.tensor([5, 3, 2])
    if kind == "dt-gru-bidirectional":
        layer = dk.nn.DeepTransitionGRU(8, 16, depth=2, bidirectional=True, candidate_dropout=0.0)
        args, kwargs = (x,), dict(lengths=lengths)
    elif kind == "atr-reverse":
        layer = dk.nn.ATR(8, 16, layer_norm=True, reverse=True)
        args, kwargs = (x,), dict(lengths=lengths)
    elif kind == "dt-cell":
        layer = dk.nn.DeepTransitionGRUCell(8, 16, depth=3, cell="lau")
        args, kwargs = (x[0], torch.randn(3, 16)), {}
    else:
        layer = dk.nn.ATRCell(8, 16)
        args, kwargs = (x[0], torch.randn(3, 16)), {}
    _compare_compiled(layer, args, [x, *layer.parameters()], **kwargs)


def test_layer_compiles_with_inductor():
    """The whole stack (dynamo, AOT autograd, inductor's C++ code around the op) on one bidirectional layer."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = dk.nn.DeepTransitionGRU(8, 16, depth=1, bidirectional=True)
    x = torch.randn(5, 3, 8, requires_grad=True)
    _compare_compiled(layer, (x,), [x, *layer.parameters()], backend="inductor", lengths=torch.tensor([5, 3, 2]))


def test_compiled_lengths_check_still_fails_on_bad_lengths():
    torch._dynamo.reset()
    layer = torch.compile(dk.nn.DeepTransitionGRU(4, 6, depth=1), fullgraph=True, backend="aot_eager")
    x = torch.randn(3, 2, 4)
    layer(x, lengths=torch.tensor([3, 1]))
    with pytest.raises(RuntimeError, match=r"every length must be in \[1, T=3\]"):
        layer(x, lengths=torch.tensor([3, 4]))


@pytest.mark.parametrize("system", ["dtmt", "rnnsearch-atr"])
def test_system_training_forward_compiles_without_graph_breaks(system):
    """A whole system's teacher-forced training loss (dropout off, so that the two runs draw nothing) compiled with
    fullgraph=True: the loss, token count and every parameter's gradient equal eager's."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    no_dropout = dict(dropout=0.0, **({"candidate_dropout": 0.0} if system == "dtmt" else {}))
    model = build_model(system, 40, 50, embed_dim=16, hidden_size=16, **no_dropout)
    src, lengths = torch.randint(4, 40, (4, 7)), torch.tensor([7, 6, 4, 3])
    prev, target = torch.randint(4, 50, (4, 5)), torch.randint(4, 50, (4, 5))
    results = []
    for fn in (model, torch.compile(model, fullgraph=True, backend="aot_eager")):
        model.zero_grad()
        loss, nll, n = fn(src, lengths, prev, target)
        (loss / n).backward()
        results.append([loss.detach(), nll.detach(), torch.as_tensor(n)] +
                       [p.grad.clone() for p in model.parameters()])
    for ref, got in zip(*results):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6, check_dtype=False)


def test_layer_exports_and_runs():
    torch.manual_seed(0)
    layer = dk.nn.DeepTransitionGRU(8, 16, depth=2, bidirectional=True).eval()
    x, lengths = torch.randn(5, 3, 8), torch.tensor([5, 3, 2])
    program = torch.export.export(layer, (x,), dict(lengths=lengths))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "dtmt.transition_forward.default" in targets
    x2, lengths2 = torch.randn(5, 3, 8), torch.tensor([4, 5, 1])
    for got, ref in zip(program.module()(x2, lengths=lengths2), layer(x2, lengths=lengths2)):
        torch.testing.assert_close(got, ref)
    # the steps dynamic: a bad length's message names T, not the symbol the trace gave it ("T=s27")
    steps = torch.export.Dim("steps", min=2, max=64)
    program = torch.export.export(layer, (x,), dict(lengths=lengths), dynamic_shapes={"x": {0: steps}, "lengths": None})
    x3 = torch.randn(7, 3, 8)
    torch.testing.assert_close(program.module()(x3, lengths=torch.tensor([7, 3, 2]))[0],
                               layer(x3, lengths=torch.tensor([7, 3, 2]))[0])
    with pytest.raises(RuntimeError, match=re.escape("every length must be in [1, T], T the steps of x")):
        program.module()(x3, lengths=torch.tensor([8, 3, 2]))


@pytest.mark.parametrize("system", ["dtmt", "rnnsearch-atr"])
def test_a_system_traces_with_autograd_recording(system):
    """torch.jit.trace of a recurrent system's forward with gradients on failed with the bare "unordered_map::at":
    its teacher-forced decoder runs its steps in an `unrolled` block, whose autograd.Functions take Python objects a
    trace cannot hold. A trace now runs each step as the plain op: the traced forward gives the model's logits, and
    its backward the model's gradients."""
    torch.manual_seed(0)
    model = build_model(system, 40, 50, embed_dim=16, hidden_size=16).eval()
    src, lengths, prev = torch.randint(4, 40, (2, 5)), torch.tensor([5, 3]), torch.randint(4, 50, (2, 4))
    traced = torch.jit.trace(model, (src, lengths, prev), check_trace=False)
    traced(src, lengths, prev).square().sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model(src, lengths, prev).square().sum().backward()
    assert got.keys() == {n for n, p in model.named_parameters() if p.grad is not None} and got
    for n, p in model.named_parameters():
        if n in got:
            torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cell,depth,ln", [("lgru", 1, True), ("atr", 0, False)])
@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_a_traced_layer_takes_each_call_s_lengths(cell, depth, ln, backend):
    """torch.jit.trace of a layer with lengths: the trace reads the lengths it is given, not the example's. Before,
    the lengths were read on the host while tracing and became constants of the trace (no mask at all for full
    example lengths): a padded step came out 0.567 where it is 0, and trace's own check did not see it."""
    torch.manual_seed(0)
    layer = _layer(cell, depth, ln).eval()
    layer.backend = backend
    x, h0 = torch.randn(5, 3, 4, dtype=torch.float64), torch.zeros(1, 3, 6, dtype=torch.float64)
    for example in ([5, 5, 5], [5, 3, 2]):
        traced = torch.jit.trace(layer, (x, h0, torch.tensor(example)), check_trace=False)
        for lengths in ([2, 5, 4], [5, 5, 5], [1, 1, 3]):
            lengths = torch.tensor(lengths)
            with torch.no_grad():
                for got, want in zip(traced(x, h0, lengths), layer(x, h0, lengths)):
                    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        # lengths outside [1, T] are refused by the trace as by the layer (a trace dropped the assert, whose result
        # nothing read: a length 0 gave zeros, 7 ran as 5, without a word; a review found it)
        for bad, shown in (([0, 5, 3], "min 0, max 5"), ([7, 5, 3], "min 3, max 7")):
            with pytest.raises(RuntimeError, match=rf"{type(layer).__name__}: every length must be in \[1, T=5\], "
                                                   rf"got {shown}"):
                traced(x, h0, torch.tensor(bad))


def test_torchscript_is_refused_in_one_line_naming_the_module():
    """torch.jit.script of a layer, a cell, the small-row linear or a system: a RuntimeError naming the module and
    what to use instead. Before: errors from inside torch (a JoinedStr, `hx`, torch.cuda's module), and a second
    try failed otherwise ("Can't redefine method")."""
    for module in (dk.nn.DeepTransitionGRU(4, 6), dk.nn.ATRCell(4, 6), dk.nn.Linear(4, 6),
                   build_model("dtmt", 20, 20, embed_dim=8, hidden_size=8)):
        for _ in range(2):
            with pytest.raises(RuntimeError, match=rf"^{type(module).__name__}: TorchScript \(torch.jit.script\) is "
                                                   r"not supported; use torch.compile or torch.export$"):
                torch.jit.script(module)


class _Call(torch.nn.Module):
    """A model's method as a module's forward (what torch.export takes)."""

    def __init__(self, model, method):
        super().__init__()
        self.model, self.method = model, method

    def forward(self, *args):
        return getattr(self.model, self.method)(*args)


@pytest.mark.parametrize("system", ["dtmt", "rnnsearch-atr"])
def test_system_encode_and_step_export_and_run(system):
    """A system's `encode` and `step` (the inference interface) exported with torch.export: the graphs hold the
    dtmt ops, and on new inputs they give the eager results."""
    torch.manual_seed(0)
    model = build_model(system, 40, 50, embed_dim=16, hidden_size=16).eval()
    src, lengths = torch.randint(4, 40, (3, 6)), torch.tensor([6, 4, 2])
    encode = torch.export.export(_Call(model, "encode"), (src, lengths))
    state = model.encode(src, lengths)
    step = torch.export.export(_Call(model, "step"), (state, torch.randint(4, 50, (3,))))
    ops = {str(n.target) for g in (encode, step) for n in g.graph.nodes if "dtmt." in str(n.target)}
    assert "dtmt.transition_forward.default" in ops
    src2, lengths2, prev2 = torch.randint(4, 40, (3, 6)), torch.tensor([3, 6, 5]), torch.randint(4, 50, (3,))
    state2 = encode.module()(src2, lengths2)
    ref_state = model.encode(src2, lengths2)
    for k in ref_state:
        torch.testing.assert_close(state2[k], ref_state[k])
    for got, ref in zip(step.module()(state2, prev2), model.step(ref_state, prev2)):
        for k in (ref if isinstance(ref, dict) else {0: ref}):
            torch.testing.assert_close((got if isinstance(got, dict) else {0: got})[k],
                                       (ref if isinstance(ref, dict) else {0: ref})[k], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("op_name", ["transition_forward", "transition_forward_triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_transition_ops_pass_opcheck(op_name, dtype):
    """The CUDA kernels (registered under the CUDA key of dtmt::transition_forward) and the Triton op on the GPU:
    schema, fake (the 16-bit inputs' float32 states and their low-precision copy), autograd, AOT dispatch."""
    if op_name == "transition_forward" and not dk.ops._C.has_cuda:
        pytest.skip("the extension was built without CUDA kernels")
    args = _transition_args("lgru", 2, True, True, dtype=torch.float64)
    args = tuple(a.detach().to("cuda", dtype).requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                 for a in args)
    tol = 1e-2 if dtype == torch.bfloat16 else None
    torch.library.opcheck(getattr(torch.ops.dtmt, op_name).default, args, atol=tol, rtol=tol)
