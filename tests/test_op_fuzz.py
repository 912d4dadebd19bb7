"""Every torch.ops.dtmt op called with perturbed arguments (tests/op_fuzz.py, issue 71 item 2): no crash, no hang,
only ordinary errors; and the ops' one-line errors for the cases the issue named."""
import os
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
    with pytest.raises(RuntimeError, match=r"transition_backward: h0 must be \[2, 6\], got \[2, 5\]"):
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
