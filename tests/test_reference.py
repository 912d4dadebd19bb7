"""The reference cells against independent formulations: torch.nn.GRU, and contract §2 written out by hand."""

import pytest
import torch

from dtmt_kernels import reference as R

from conftest import make_layer


def test_reference_gru_reproduces_torch_gru():
    torch.manual_seed(0)
    gru = torch.nn.GRU(5, 7).double()
    # torch updates h' = (1-z) c + z h, contract §2 h' = (1-z) h + z c: z_spec = 1 - z_torch = σ(-a_z), so the
    # update-gate rows (H..2H) change sign.
    flip = torch.ones(21, 1, dtype=torch.double)
    flip[7:14] = -1
    w = R.TransitionWeights("gru", gru.weight_ih_l0 * flip, gru.bias_ih_l0 * flip[:, 0],
                            gru.weight_hh_l0 * flip, gru.bias_hh_l0 * flip[:, 0])
    x = torch.randn(6, 3, 5, dtype=torch.double)
    h0 = torch.randn(3, 7, dtype=torch.double)
    out, h_n = R.transition_sequence(x, h0, w)
    out_t, h_t = gru(x, h0.unsqueeze(0))
    torch.testing.assert_close(out, out_t)
    torch.testing.assert_close(h_n, h_t[0])


def _ln(a, g, b, eps=1e-5):
    mean = a.mean(-1, keepdim=True)
    var = ((a - mean) ** 2).mean(-1, keepdim=True)
    return (a - mean) / torch.sqrt(var + eps) * g + b


def _sig(a):
    return 1 / (1 + torch.exp(-a))


@pytest.mark.parametrize("cell", ["gru", "lgru", "lau", "atr"])
@pytest.mark.parametrize("layer_norm", [False, True])
@pytest.mark.parametrize("depth", [1, 3])
def test_reference_step_matches_spec_equations(cell, layer_norm, depth):
    """One step of base cell + `depth` T-GRUs (each its own weights, layer norm and dropout mask), written directly
    from contract §2 with per-gate slices. (ATR has no transition: depth 0 both times.)"""
    if cell == "atr" and depth > 1:
        pytest.skip("ATR has no T-GRUs")
    H, I, B = 4, 3, 2
    layer = make_layer(cell, I, H, depth=0 if cell == "atr" else depth, layer_norm=layer_norm)
    w = layer.direction_weights(0)
    torch.manual_seed(1)
    x = torch.randn(B, I, dtype=torch.double)
    h = torch.randn(B, H, dtype=torch.double)
    drop = torch.rand(w.depth + 1, B, H, dtype=torch.double) + 0.5
    got = R.transition_step(x @ w.w_ih.T + w.b_ih, h, w, drop if cell != "atr" else None)

    def rows(m, k):
        return m[k * H:(k + 1) * H]

    def pre(k, ln_w, ln_b, Wx, Uh):
        a = Wx + Uh
        if layer_norm:
            return _ln(a, rows(ln_w, k), rows(ln_b, k))
        return a

    Wk = lambda k: x @ rows(w.w_ih, k).T + rows(w.b_ih, k)
    Uk = lambda k, W, b, s: s @ rows(W, k).T + rows(b, k)
    if cell == "atr":
        p = x @ w.w_ih.T
        q = h @ w.w_hh.T + w.b_hh
        if layer_norm:
            p = _ln(p, w.ln_w[:H], w.ln_b[:H])
            q = _ln(q, w.ln_w[H:], w.ln_b[H:])
        want = _sig(p + q) * p + _sig(p - q) * h
    else:
        U = lambda k: Uk(k, w.w_hh, w.b_hh, h)
        r = _sig(pre(0, w.ln_w, w.ln_b, Wk(0), U(0)))
        z = _sig(pre(1, w.ln_w, w.ln_b, Wk(1), U(1)))
        if cell == "gru":
            c = torch.tanh(Wk(2) + r * U(2)) * drop[0]
            h1 = (1 - z) * h + z * c
        elif cell == "lgru":
            l = _sig(pre(2, w.ln_w, w.ln_b, Wk(2), U(2)))
            c = (torch.tanh(Wk(3) + r * U(3)) + l * Wk(4)) * drop[0]
            h1 = (1 - z) * h + z * c
        else:  # lau
            g = _sig(pre(2, w.ln_w, w.ln_b, Wk(2), U(2)))
            c = torch.tanh((1 - r) * Wk(3) + r * U(3)) * drop[0]
            h1 = ((1 - z) * h + z * c) * (1 - g) + g * Wk(4)
        # the T-GRUs on top, each on the last one's output
        assert w.depth == depth
        for i in range(depth):
            Ut = lambda k: Uk(k, w.t_w[i], w.t_b[i], h1)
            zero = torch.zeros_like(h1)
            rt = _sig(pre(0, w.t_ln_w[i], w.t_ln_b[i], zero, Ut(0)))
            zt = _sig(pre(1, w.t_ln_w[i], w.t_ln_b[i], zero, Ut(1)))
            ct = torch.tanh(rt * Ut(2)) * drop[i + 1]
            h1 = (1 - zt) * h1 + zt * ct
        want = h1
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_reference_masking_matches_unpadded_runs():
    """A padded batch gives, per sequence, what that sequence gives alone; reversed directions start at each
    sequence's own last token."""
    layer = make_layer("lgru", 3, 5, depth=2, layer_norm=True, bidirectional=True, backend="reference")
    torch.manual_seed(2)
    lengths = [4, 1, 3]
    x = torch.randn(4, 3, 3, dtype=torch.double)
    out, h_n = layer(x, lengths=lengths)
    for b, L in enumerate(lengths):
        out_b, h_b = layer(x[:L, b:b + 1])
        torch.testing.assert_close(out[:L, b], out_b[:, 0])
        assert torch.count_nonzero(out[L:, b]) == 0
        torch.testing.assert_close(h_n[:, b], h_b[:, 0])
