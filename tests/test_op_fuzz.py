"""Every torch.ops.dtmt op called with perturbed arguments (tests/op_fuzz.py, issue 71 item 2): no crash, no hang,
only ordinary errors; and the ops' one-line errors for the cases the issue named."""
import os
import re
import subprocess
import sys

import pytest
import torch

import dtmt_kernels as dk

pytestmark = pytest.mark.skipif("cpp" not in dk.available_backends(), reason="the C++ extension is not built")

HERE = os.path.dirname(os.path.abspath(__file__))


def test_no_op_crashes_or_hangs_on_perturbed_arguments():
    """About 14,000 perturbed calls of the 17 ops, in forked children of a process of its own (a crash there is a
    finding, not the end of the suite)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    r = subprocess.run([sys.executable, os.path.join(HERE, "op_fuzz.py")], capture_output=True, text=True, env=env,
                       timeout=900)
    summary = [line for line in r.stdout.splitlines() if line.startswith("op_fuzz:")]
    assert r.returncode == 0 and summary and summary[0].endswith(" 0 failures"), r.stdout[-6000:] + r.stderr[-2000:]
    calls = int(summary[0].split()[1])
    assert calls > 10_000, summary
    # an out= product that torch had to resize: sizes that do not fit went past the checks (the cells' state width
    # against their weights did, into rnmt_step's products, until the check in step_impl)
    assert "was resized" not in r.stderr, r.stderr[-3000:]


def _gru_args(H=6, I=4, T=3, B=2, ln=True, depth=1):
    torch.manual_seed(0)
    layer = dk.nn.DeepTransitionGRU(I, H, depth=depth, cell="gru", layer_norm=ln)
    from dtmt_kernels.ops.transition import KINDS, flat_params

    params = [p.detach() if p is not None else None for p in flat_params(layer.direction_weights())]
    return torch.randn(T, B, I), torch.randn(B, H), KINDS["gru"], params


def test_the_ops_name_the_argument_that_is_wrong():
    """The crashes the issue found, each now a one-line RuntimeError naming the op and the argument."""
    x, h0, kind, p = _gru_args()
    fwd = torch.ops.dtmt.transition_forward
    out = fwd(x, h0, None, None, kind, *p, False, 1e-5)
    # ln_w given, ln_b empty (was SIGSEGV)
    q = list(p)
    q[5] = torch.empty(0)
    with pytest.raises(RuntimeError, match=r"dtmt::transition_forward: the weights: ln_w and ln_b must both be"):
        fwd(x, h0, None, None, kind, *q, False, 1e-5)
    # a cell kind the weights are not (lgru's rows: 5H / 4H)
    with pytest.raises(RuntimeError, match=r"transition_forward: the weights: w_hh must be \[4 \* H, H\]"):
        fwd(x, h0, None, None, 1, *p, False, 1e-5)
    # grad_hn of [B, H - 1] (was free(): invalid next size)
    grad_out = torch.randn_like(out[0])
    with pytest.raises(RuntimeError, match=r"transition_backward: grad_hn must be \[2, 6\], got \[2, 5\]"):
        torch.ops.dtmt.transition_backward(grad_out, torch.randn(2, 5), x, None, None, kind, *p, *out[2:], False,
                                           1e-5)
    with pytest.raises(RuntimeError, match=r"transition_backward: hpt must be \[1, 3, 2, 18\]"):
        torch.ops.dtmt.transition_backward(grad_out, torch.randn(2, 6), x, None, None, kind, *p, *out[2:6],
                                           out[6][..., :-1], False, 1e-5)
    # a T-GRU stack without its biases
    q = list(p)
    q[7] = torch.empty(0)
    with pytest.raises(RuntimeError, match=r"t_w and t_b must both be given or both be empty"):
        torch.ops.dtmt.transition_encode(x, h0[None], None, kind, [t if t is not None else torch.empty(0) for t in q],
                                         False, 1e-5)


def test_the_ops_refuse_an_eps_that_is_not_a_finite_number_at_least_0():
    """A NaN or negative eps called directly (the layers check theirs) gave NaN states without a word: the ops check it
    as the loss op checks its smoothing."""
    x, h0, kind, p = _gru_args()
    fwd = torch.ops.dtmt.transition_forward
    out = fwd(x, h0, None, None, kind, *p, False, 0.0)
    assert out[0].isfinite().all()
    empty = [t if t is not None else torch.empty(0) for t in p]
    for eps in (float("nan"), -1.0, float("inf")):
        with pytest.raises(RuntimeError, match=r"transition_forward: eps must be a finite number >= 0"):
            fwd(x, h0, None, None, kind, *p, False, eps)
        with pytest.raises(RuntimeError, match=r"transition_backward: eps must be a finite number >= 0"):
            torch.ops.dtmt.transition_backward(torch.randn_like(out[0]), torch.randn_like(h0), x, None, None, kind,
                                               *p, *out[2:], False, eps)
        with pytest.raises(RuntimeError, match=r"transition_encode: eps must be a finite number >= 0"):
            torch.ops.dtmt.transition_encode(x, h0[None], None, kind, empty, False, eps)


def test_search_refuses_ids_and_lengths_out_of_range(monkeypatch):
    """bos / eos outside the vocabulary (2^31 was SIGSEGV, -1 silently gave no hypothesis) and a max_len past the
    stated bound (2^31 ran until killed): refused before the search starts. The op's arguments are those the
    decoder's search passes, recorded."""
    from dtmt_models import build_model

    torch.manual_seed(0)
    model = build_model("rnnsearch-atr", 20, 20, embed_dim=8, hidden_size=8).eval()
    decoder = model.inference_decoder()
    real, calls = torch.ops.dtmt.rnmt_beam_search, []

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.ops.dtmt, "rnmt_beam_search", spy)
    with torch.no_grad():
        state = decoder.encode(torch.randint(4, 20, (2, 4)), torch.tensor([4, 2]))
        decoder.search(state, 2, 0.6, torch.tensor([5, 5]))
    assert calls, "the fused search did not call the op"
    args, kwargs = calls[0]
    names = [a.name for a in real.default._schema.arguments]
    bound = dict(zip(names, args), **kwargs)

    def call(**change):
        a = dict(bound, **change)
        return real(*[a[n] for n in names if n in a])

    for key, value in (("eos", 2 ** 31), ("eos", -1), ("bos", 20)):
        with pytest.raises(RuntimeError, match=r"bos \d+ and eos -?\d+ must be words of the 20"):
            call(**{key: value})
    with pytest.raises(RuntimeError, match=r"max_len must be in \[1, 16384\]"):
        call(max_len=torch.tensor([2 ** 31, 5]))
    # (a float max_len was cut to an integer, a complex one lost its imaginary part: a hostile-input probe's)
    for bad in (torch.tensor([4.7, 5.0]), torch.tensor([5 + 1j, 5 + 0j])):
        with pytest.raises(RuntimeError, match=r"max_len must be an integer tensor, got (Float|ComplexFloat)"):
            call(max_len=bad)
    with pytest.raises(ValueError, match=r"length_penalty must be gnmt or average, got wu"):
        call(length_penalty="wu")
    # a cell's layer-norm gain or bias of an integer or complex dtype (the weights' own are checked by the kernels)
    q_params = list(bound["q_params"])
    slots = ("w_ih", "b_ih", "w_hh", "b_hh", "ln_w", "ln_b", "t_w", "t_b", "t_ln_w", "t_ln_b")
    i = next(i for i, t in enumerate(q_params) if t.dim() == 1 and t.numel())   # (the first bias or gain given)
    q_params[i] = q_params[i].to(torch.int64)
    with pytest.raises(RuntimeError, match=rf"q_params: {slots[i]} must be a floating-point tensor, got Long"):
        call(q_params=q_params)
    # an alpha past the bound (NaN scored every hypothesis NaN, 1e6 scored them -0.0: ranked by nothing), a NaN eps
    for alpha in (float("nan"), float("inf"), 1e6, -51.0):
        with pytest.raises(ValueError, match=r"alpha must be within \[-50, 50\]"):
            call(alpha=alpha)
    with pytest.raises(RuntimeError, match=r"rnmt_beam_search: cell_eps must be a finite number >= 0, got nan"):
        call(cell_eps=float("nan"))


def test_secondary_tensors_of_a_dtype_a_kernel_would_convert_are_refused():
    """h0, the dropout masks, the biases and layer-norm parameters, the backward's saved tensors and gradient: an
    integer, bool or complex tensor among them was converted without a word (a complex h0 ran as its real part, with
    only C++'s warning; a hostile-input probe, 2026-12-02); now a one-line error naming the op and the argument.
    So is a floating-point one of another precision than x (a float16 layer-norm gain, a float64 h0: converted
    here, refused by the reference backend), except h0 (or grad_hn) in float32 beside a 16-bit x: autocast's
    state."""
    x, h0, kind, p = _gru_args()
    fwd, bwd = torch.ops.dtmt.transition_forward, torch.ops.dtmt.transition_backward
    out = fwd(x, h0, None, None, kind, *p, False, 1e-5)
    with pytest.raises(RuntimeError, match=r"transition_forward: h0 must be a floating-point tensor, got ComplexFloat"):
        fwd(x, torch.full_like(h0, 5j, dtype=torch.complex64), None, None, kind, *p, False, 1e-5)
    with pytest.raises(RuntimeError, match=r"transition_forward: drop must be a floating-point tensor, got Bool"):
        fwd(x, h0, None, torch.ones(2, 2, 6, dtype=torch.bool), kind, *p, False, 1e-5)
    for slot, name in ((1, "b_ih"), (4, "ln_w"), (5, "ln_b")):
        q = list(p)
        q[slot] = q[slot].to(torch.int32)
        with pytest.raises(RuntimeError, match=rf"transition_forward: the weights: {name} must be a floating-point "
                                               rf"tensor, got Int"):
            fwd(x, h0, None, None, kind, *q, False, 1e-5)
    with pytest.raises(RuntimeError, match=r"transition_forward: x must be a floating-point tensor, got Long"):
        fwd(x.long(), h0, None, None, kind, *p, False, 1e-5)
    # the products' operands of another floating dtype than x (ATen's "self and mat2 must have the same dtype" named
    # no argument; a hostile-input review, 2026-12-06)
    for slot, dtype, message in ((0, torch.float64, "w_ih must have x's dtype Float (or be int8 rows), got Double"),
                                 (1, torch.float64, "b_ih must have x's dtype Float, got Double"),
                                 (2, torch.bfloat16, "w_hh must have x's dtype Float (or be int8 rows), got BFloat16"),
                                 (3, torch.float16, "b_hh must have x's dtype Float, got Half")):
        q = list(p)
        q[slot] = q[slot].to(dtype)
        for call in (lambda: fwd(x, h0, None, None, kind, *q, False, 1e-5),
                     lambda: bwd(torch.randn_like(out[0]), torch.randn(2, 6), x, None, None, kind, *q, *out[2:],
                                 False, 1e-5)):
            with pytest.raises(RuntimeError, match=re.escape(message)):
                call()
    grad_out = torch.randn_like(out[0])
    with pytest.raises(RuntimeError, match=r"transition_backward: grad_out must be a floating-point tensor, got Long"):
        bwd(grad_out.long(), torch.randn(2, 6), x, None, None, kind, *p, *out[2:], False, 1e-5)
    saved = list(out[2:])
    saved[1] = saved[1].to(torch.complex64)   # hs
    with pytest.raises(RuntimeError, match=r"transition_backward: hs must be a floating-point tensor, got Complex"):
        bwd(grad_out, torch.randn(2, 6), x, None, None, kind, *p, *saved, False, 1e-5)
    # the saved tensors of another floating dtype than the forward gives them (a float64 xp beside a float32 x
    # failed inside the kernel with 'self is undefined', naming nothing; an audit of the ops' boundaries)
    for slot, name, dtype, message in ((0, "xp", torch.float64, "xp must have x's dtype Float"),
                                       (3, "hp", torch.bfloat16, "hp must have x's dtype Float"),
                                       (4, "hpt", torch.float64, "hpt must have x's dtype Float"),
                                       (1, "hs", torch.float64, "hs must be Float (the forward's states for x of "
                                                                "Float), got Double")):
        saved = list(out[2:])
        saved[slot] = saved[slot].to(dtype)
        with pytest.raises(RuntimeError, match=re.escape(f"transition_backward: {message}")):
            bwd(grad_out, torch.randn(2, 6), x, None, None, kind, *p, *saved, False, 1e-5)
    with pytest.raises(RuntimeError, match=r"transition_encode: h0 must be a floating-point tensor, got Int"):
        torch.ops.dtmt.transition_encode(x, h0[None].int(), None, kind,
                                         [t if t is not None else torch.empty(0) for t in p], False, 1e-5)
    for slot, name, dtype in ((4, "ln_w", torch.float16), (5, "ln_b", torch.float64), (6, "t_w", torch.float64),
                              (7, "t_b", torch.bfloat16), (8, "t_ln_w", torch.float64), (9, "t_ln_b", torch.float16)):
        q = list(p)
        q[slot] = q[slot].to(dtype)
        with pytest.raises(RuntimeError, match=re.escape(f"transition_forward: {name} must have x's dtype Float")):
            fwd(x, h0, None, None, kind, *q, False, 1e-5)
    drop = torch.ones(2, 2, 6)
    for args, message in (((x, h0.double(), None, None), "h0 must have x's dtype Float, got Double"),
                          ((x, h0, None, drop.half()), "transition_forward: drop must have x's dtype Float, got Half"),
                          ((x.half(), h0.double(), None, None),
                           "h0 must have x's dtype Half (or float32, the state under autocast), got Double")):
        with pytest.raises(RuntimeError, match=re.escape(message)):
            fwd(*args, kind, *[t.to(args[0].dtype) for t in p], False, 1e-5)
    with pytest.raises(RuntimeError, match=r"transition_backward: grad_out must have x's dtype Float, got Double"):
        bwd(grad_out.double(), torch.randn(2, 6), x, None, None, kind, *p, *out[2:], False, 1e-5)
    with pytest.raises(RuntimeError, match=r"transition_backward: grad_hn must have x's dtype Float, got Double"):
        bwd(grad_out, torch.randn(2, 6).double(), x, None, None, kind, *p, *out[2:], False, 1e-5)
    # the state in float32 beside 16-bit inputs (autocast's rule) still runs, its dtype kept
    half = fwd(x.bfloat16(), h0, None, None, kind, *[t.bfloat16() for t in p], False, 1e-5)
    assert half[1].dtype == torch.float32 and torch.allclose(half[0].float(), out[0], atol=0.05)
    empty = [t if t is not None else torch.empty(0) for t in p]
    with pytest.raises(RuntimeError, match=r"transition_encode: h0 must have x's dtype Float, got Double"):
        torch.ops.dtmt.transition_encode(x, h0[None].double(), None, kind, empty, False, 1e-5)
    with pytest.raises(RuntimeError, match=re.escape("transition_encode: params[4] must have x's dtype Float, got "
                                                     "Half")):
        torch.ops.dtmt.transition_encode(x, h0[None], None, kind, [*empty[:4], empty[4].half(), *empty[5:]], False,
                                         1e-5)


def test_int8_rows_are_named_in_the_width_error_and_refused_by_the_backward():
    """int8 weight rows hold 4 bytes more than their columns: a w_ih of the wrong width read "must be [12, 3] ...,
    got [12, 3]"; a gradient through int8 rows failed in the backward with ATen's "self and mat2 must have the same
    dtype". Both now name the op, the argument and the int8 rows."""
    from dtmt_models.engine.ops import pack_int8_rows

    x, h0, kind, p = _gru_args(H=4, I=3, ln=False, depth=0)
    q = list(p)
    q[0], q[2] = pack_int8_rows(p[0]), pack_int8_rows(p[2])
    fwd = torch.ops.dtmt.transition_forward
    wide = list(q)
    wide[0] = pack_int8_rows(torch.randn(12, 4))
    with pytest.raises(RuntimeError, match=re.escape("w_ih must be [12, 3] (H = 4; int8 rows: 4 bytes wider), got "
                                                     "[12, 8] int8 rows")):
        fwd(x, h0, None, None, kind, *wide, False, 1e-5)
    xg = x.clone().requires_grad_()
    out = fwd(xg, h0, None, None, kind, *q, False, 1e-5)
    with torch.no_grad():   # the int8 forward runs, close to the float one
        assert torch.allclose(out[0], fwd(x, h0, None, None, kind, *p, False, 1e-5)[0], atol=0.05)
    with pytest.raises(RuntimeError, match=r"transition_backward: w_ih is int8 rows, which are for inference: no "
                                           r"gradient flows through them"):
        out[0].sum().backward()


@pytest.fixture(scope="module")
def recorded_calls():
    sys.path.insert(0, HERE)
    import op_fuzz

    return op_fuzz.record_calls()


ENGINE_OPS = ("attention_step", "readout_features", "rnmt_step", "rnmt_beam_search", "memory_encoder",
              "transition_encode", "transition_encode_tokens")


def test_the_engine_ops_name_a_tensor_of_another_floating_dtype(recorded_calls):
    """Every floating tensor of a recorded engine-op call (float32 and int8 decoding of five systems), one at a time
    in float64 or float16: a one-line RuntimeError naming the op and the argument (the tensor's name, or its list
    and index), where ATen's "self and mat2 must have the same dtype" had named neither, or the tensor was
    converted. (A mask of any floating dtype stays taken: its 1s and 0s are exact in each.)"""
    checked = 0
    for name in ENGINE_OPS:
        for func, args, kwargs in recorded_calls[name]:
            for i, value in enumerate(args):
                slots = [(None, value)] if isinstance(value, torch.Tensor) else \
                    list(enumerate(value)) if isinstance(value, (list, tuple)) else []
                for j, t in slots:
                    if not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()):
                        continue
                    if func._schema.arguments[i].name == "mask":
                        continue
                    for dtype in (torch.float64, torch.float16):
                        if t.dtype == dtype:
                            continue
                        a = list(args)
                        if j is None:
                            a[i] = t.to(dtype)
                        else:
                            a[i] = [*value[:j], t.to(dtype), *value[j + 1:]]
                        with pytest.raises(RuntimeError) as e, torch.no_grad():
                            func(*a, **kwargs)
                        message = str(e.value).splitlines()[0]
                        arg = func._schema.arguments[i].name
                        assert f"dtmt::{name}: " in message and "dtype" in message, message
                        assert (arg if j is None else f"{arg}[{j}]") in message or f"{arg}'s dtype" in message, \
                            message
                        checked += 1
    assert checked > 500, checked


def test_the_persistent_plan_binding_refuses_element_sizes_it_would_divide_by():
    """_C.persistent_plan (the private binding under dk.persistent_plan) with an element size of 0 divided by it: the
    process died of SIGFPE (an audit of the boundaries). Now a one-line error; the public face never passes one."""
    from dtmt_kernels import _C

    def plan(storage, accumulation):   # (a GRU of one unit and one row, FMA products, one SM of 64 KB)
        return _C.persistent_plan(0, 0, 1, 1, storage, accumulation, 1, 1 << 16, False, 256, 0, 0, 1)

    for storage, accumulation, message in ((0, 4, "storage_bytes must be 2, 4 or 8, got 0"),
                                           (3, 4, "storage_bytes must be 2, 4 or 8, got 3"),
                                           (4, 0, "accumulation_bytes must be 4 or 8, got 0")):
        with pytest.raises(RuntimeError, match=re.escape(f"persistent_plan: {message}")):
            plan(storage, accumulation)
    assert plan(4, 4)[4]   # (fits)
