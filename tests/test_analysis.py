"""dtmt_models.models.analysis: ATR gates (paper 004 eq. 9-10), gate correlation, attention matrices, and the
benchmarks/interpret.py script end to end on a tiny checkpoint."""
import json
import math
import os

import numpy as np
import pytest
import torch

from conftest import make_layer
from dtmt_models.models import analysis as an
from dtmt_models import build_model

H, I, T = 5, 4, 7
LENGTHS = [7, 4, 1]


def random_input(batch_first=False, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, len(LENGTHS), I, generator=g, dtype=torch.float64)
    return x.transpose(0, 1).contiguous() if batch_first else x


# ------------------------------------------------------------------------------------------- atr_gates
@pytest.mark.parametrize("layer_norm", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
def test_atr_gates_states_equal_layer_output_both_directions(layer_norm, batch_first):
    layer = make_layer("atr", I, H, layer_norm=layer_norm, bidirectional=True, batch_first=batch_first)
    x = random_input(batch_first)
    with torch.no_grad():
        out, h_n = layer(x, lengths=LENGTHS)
    if batch_first:
        out = out.transpose(0, 1)
    for d in (0, 1):
        g = an.atr_gates(layer, x, LENGTHS, direction=d)
        assert g["reverse"] == (d == 1)
        for k in ("i", "f", "p", "h"):
            assert g[k].shape == (T, len(LENGTHS), H) and torch.isfinite(g[k]).all()
        torch.testing.assert_close(g["h"], out[..., d * H:(d + 1) * H], rtol=1e-10, atol=1e-12)
        # final state of each sequence: the last real step forwards, the first step backwards
        last = [L - 1 for L in LENGTHS] if d == 0 else [0] * len(LENGTHS)
        torch.testing.assert_close(torch.stack([g["h"][t, b] for b, t in enumerate(last)]), h_n[d])
        # gates are contract §2's: i = σ(p+q), f = σ(p−q) ⇒ logit(i) + logit(f) = 2p at real steps
        m = g["mask"]
        logit = lambda v: torch.log(v) - torch.log1p(-v)  # noqa: E731
        torch.testing.assert_close((logit(g["i"]) + logit(g["f"]))[m], 2 * g["p"][m])


def test_atr_gates_reverse_layer_h0_and_unbatched():
    layer = make_layer("atr", I, H, reverse=True)
    x = random_input()
    h0 = torch.randn(1, len(LENGTHS), H, dtype=torch.float64)
    with torch.no_grad():
        out, _ = layer(x, h0, lengths=LENGTHS)
    g = an.atr_gates(layer, x, LENGTHS, h0=h0[0])
    assert g["reverse"]
    torch.testing.assert_close(g["h"], out)
    with torch.no_grad():
        out1, _ = layer(x[:, 0])
    torch.testing.assert_close(an.atr_gates(layer, x[:, 0])["h"][:, 0], out1)


def test_atr_gates_padding_is_zero_and_mask():
    layer = make_layer("atr", I, H, bidirectional=True)
    g = an.atr_gates(layer, random_input(), LENGTHS, direction=1)
    expected = torch.arange(T).unsqueeze(1) < torch.tensor(LENGTHS).unsqueeze(0)
    assert torch.equal(g["mask"], expected)
    for k in ("i", "f", "p", "h"):
        assert (g[k][~expected] == 0).all()


def test_atr_gates_rejects_other_layers_and_bad_direction():
    with pytest.raises(ValueError, match="ATR"):
        an.atr_gates(make_layer("gru", I, H), random_input())
    with pytest.raises(ValueError, match="direction"):
        an.atr_gates(make_layer("atr", I, H), random_input(), direction=1)
    with pytest.raises(ValueError, match="input_size"):
        an.atr_gates(make_layer("atr", I, H), torch.randn(T, 2, I + 1, dtype=torch.float64))


# --------------------------------------------------------------------------------------- eq. 10 identity
@pytest.mark.parametrize("layer_norm", [False, True])
def test_dependency_weights_roll_out_the_recurrence(layer_norm):
    layer = make_layer("atr", I, H, layer_norm=layer_norm, bidirectional=True, seed=3)
    x = random_input(seed=4)
    for d in (0, 1):
        g = an.atr_gates(layer, x, LENGTHS, direction=d)
        vec = an.dependency_weights(g["i"], g["f"], g["mask"], reduce=None, reverse=g["reverse"])
        assert vec.shape == (len(LENGTHS), T, T, H)
        # h_t = Σ_k g_{t,k} ⊙ p_k with h0 = 0, written out explicitly
        h = torch.einsum("btkh,kbh->tbh", vec, g["p"])
        torch.testing.assert_close(h, g["h"], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(an.unrolled_states(g["i"], g["f"], g["p"], g["mask"], reverse=g["reverse"]),
                                   g["h"], rtol=1e-10, atol=1e-12)
        # only k ≤ t (k ≥ t backwards) and only real positions carry weight
        t_idx, k_idx = torch.meshgrid(torch.arange(T), torch.arange(T), indexing="ij")
        future = (k_idx > t_idx) if d == 0 else (k_idx < t_idx)
        assert (vec[:, future] == 0).all()
        for b, L in enumerate(LENGTHS):
            assert (vec[b, L:] == 0).all() and (vec[b, :, L:] == 0).all()
        scalar = an.dependency_weights(g["i"], g["f"], g["mask"], reverse=g["reverse"])
        torch.testing.assert_close(scalar, vec.mean(-1))


def test_dependency_weights_match_eq10_by_hand_and_h0_term():
    torch.manual_seed(5)
    i, f = torch.rand(4, 1, 3, dtype=torch.float64), torch.rand(4, 1, 3, dtype=torch.float64)
    g = an.dependency_weights(i, f, reduce=None)[0]
    torch.testing.assert_close(g[3, 1], i[1, 0] * f[2, 0] * f[3, 0])
    torch.testing.assert_close(g[2, 2], i[2, 0])
    # with a non-zero h0 the roll-out gains (Π f) ⊙ h0
    layer = make_layer("atr", I, H, seed=6)
    x, h0 = random_input(seed=7), torch.randn(len(LENGTHS), H, dtype=torch.float64)
    gg = an.atr_gates(layer, x, LENGTHS, h0=h0)
    torch.testing.assert_close(an.unrolled_states(gg["i"], gg["f"], gg["p"], gg["mask"], h0=h0), gg["h"])


def test_strongest_previous():
    w = torch.tensor([[1.0, 0, 0, 0], [0.2, 1, 0, 0], [0.5, 0.1, 1, 0], [0.1, 0.3, 0.2, 1]])
    assert an.strongest_previous(w) == [None, 0, 0, 1]
    assert an.strongest_previous(w.T, reverse=True) == [2, 3, 3, None]


# ---------------------------------------------------------------------------------------- correlation
def test_gate_correlation_matches_numpy_and_excludes_padding():
    layer = make_layer("atr", I, H, bidirectional=True, seed=8)
    g = an.atr_gates(layer, random_input(seed=9), LENGTHS)
    m = g["mask"]
    expected = np.corrcoef(g["i"][m].reshape(-1).numpy(), g["f"][m].reshape(-1).numpy())[0, 1]
    assert an.gate_correlation(g["i"], g["f"], m) == pytest.approx(expected, abs=1e-12)
    # garbage at padded positions changes nothing
    i, f = g["i"].clone(), g["f"].clone()
    i[~m], f[~m] = float("nan"), 123.0
    assert an.gate_correlation(i, f, m) == pytest.approx(expected, abs=1e-12)
    assert an.gate_correlation(i, f, m.double()) == pytest.approx(expected, abs=1e-12)
    # the streaming statistics do not depend on the batching
    stats = an.GateStatistics()
    for b in range(len(LENGTHS)):
        stats.update(i[:, b:b + 1], f[:, b:b + 1], m[:, b:b + 1])
    assert stats.correlation() == pytest.approx(expected, abs=1e-12)
    assert stats.n == int(m.sum()) * H and stats.sentences == len(LENGTHS)
    si, sf = stats.sample()
    assert si.numel() == stats.n and torch.isfinite(si).all() and torch.isfinite(sf).all()


def test_gate_correlation_perfect_and_undefined():
    i = torch.rand(5, 2, 3, dtype=torch.float64)
    assert an.gate_correlation(i, 1 - i) == pytest.approx(-1.0)
    assert math.isnan(an.gate_correlation(i, torch.full_like(i, 0.5)))


def test_gate_position_curves_figure3():
    torch.manual_seed(10)
    i, f = torch.rand(T, 3, H, dtype=torch.float64), torch.rand(T, 3, H, dtype=torch.float64)
    lengths = [5, 2, 3]
    mask = torch.arange(T).unsqueeze(1) < torch.tensor(lengths).unsqueeze(0)
    c = an.gate_position_curves(i, f, mask)
    assert c["input"].shape == (5,) and c["count"].tolist() == [3, 3, 2, 1, 1]
    for pos in range(5):
        bs = [b for b, L in enumerate(lengths) if pos < L]
        assert float(c["input"][pos]) == pytest.approx(float(np.mean([i[pos, b].mean() for b in bs])))
        assert float(c["forget"][pos]) == pytest.approx(float(np.mean([f[pos, b].mean() for b in bs])))


# ------------------------------------------------------------------------------------------- attention
def _padded_source(S=6, length=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, 20, (1, S), generator=g)
    src[0, length:] = 0
    return src, length


@pytest.mark.parametrize("name,opts", [("rnnsearch-atr", {}), ("dtmt", {"heads": 2}),
                                       ("gnmt-atr", {"encoder_layers": 2, "decoder_layers": 2})])
def test_attention_matrix_rows_are_distributions(name, opts):
    torch.manual_seed(0)
    model = build_model(name, 20, 20, embed_dim=8, hidden_size=8, **opts)
    model.train()
    src, length = _padded_source()
    tgt = [5, 6, 7, 3]
    a = an.attention_matrix(model, src, length, tgt)
    assert a.shape == (len(tgt), src.shape[1])
    torch.testing.assert_close(a[:, :length].sum(1), torch.ones(len(tgt)))
    assert (a[:, length:] == 0).all() and (a >= 0).all()
    assert model.training                                # mode restored
    # deterministic (eval mode inside), and the same for a 1-D list source
    torch.testing.assert_close(an.attention_matrix(model, src[0].tolist(), torch.tensor([length]), tgt), a)


def test_attention_matrix_multihead_is_head_average():
    class Fake(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def encode(self, src, lengths):
            return {}

        def step(self, state, prev):
            attn = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]])   # [B=1, heads=2, S=3]
            return torch.zeros(1, 4), {"attn": attn}

    a = an.attention_matrix(Fake(), [4, 5, 6], None, [7, 3])
    torch.testing.assert_close(a, torch.tensor([[0.5, 0.5, 0.0]] * 2))


def test_attention_matrix_transformer_is_a_clear_error():
    model = build_model("transformer", 20, 20, embed_dim=8, hidden_size=16, heads=2, encoder_layers=1,
                        decoder_layers=1)
    with pytest.raises(ValueError, match="no attention"):
        an.attention_matrix(model, [4, 5, 6], 3, [7, 3])


def test_attention_matrix_refuses_an_ensemble_and_target_ids_outside_the_vocabulary():
    """An ensemble was an AttributeError ('Ensemble' object has no attribute 'encode'); the last target id, which no
    step reads, was taken whatever it was (99999)."""
    from dtmt_models.decoding.ensemble import Ensemble

    model = build_model("rnnsearch-atr", 20, 20, embed_dim=8, hidden_size=8)
    with pytest.raises(ValueError, match=r"attention_matrix: takes one model with encode and step, got Ensemble"):
        an.attention_matrix(Ensemble([model, model]), [4, 5, 6], 3, [7, 3])
    for bad in ([7, 99999], [-1, 3], [20]):
        with pytest.raises(ValueError, match=r"attention_matrix: tgt_tokens must be ids in \[0, 20\)"):
            an.attention_matrix(model, [4, 5, 6], 3, bad)
    assert an.attention_matrix(model, [4, 5, 6], 3, [7, 19]).shape == (2, 3)


def test_find_atr_layer():
    bi = build_model("rnnsearch-atr", 20, 20, embed_dim=8, hidden_size=8)
    assert an.find_atr_layer(bi)[:1] == ("encoder",)
    ca = build_model("rnnsearch-atr", 20, 20, embed_dim=8, hidden_size=8, encoder="ca")
    assert an.find_atr_layer(ca)[0] == "encoder.forward_layer"   # reads the embeddings, left to right
    gnmt = build_model("gnmt-atr", 20, 20, embed_dim=8, hidden_size=8, encoder_layers=2, decoder_layers=1)
    assert an.find_atr_layer(gnmt)[0] == "encoder.0"
    assert an.find_atr_layer(gnmt, "encoder.1")[0] == "encoder.1"
    with pytest.raises(ValueError, match="no ATR layer named 'encoder.lower'"):   # a one-step cell, not a layer
        an.find_atr_layer(ca, "encoder.lower")
    with pytest.raises(ValueError, match="no ATR layer"):
        an.find_atr_layer(build_model("dtmt", 20, 20, embed_dim=8, hidden_size=8, heads=2))


# ----------------------------------------------------------------------------------------------- plots
def test_plots_are_written(tmp_path):
    w = an.dependency_weights(torch.rand(4, 1, 3), torch.rand(4, 1, 3))[0]
    best = an.plot_dependencies(w, ["a", "bb", "ccc", "dddd"], str(tmp_path / "dep.png"))
    assert best[0] is None and all(k is not None and k < t for t, k in enumerate(best) if t)
    an.plot_attention(torch.rand(2, 3), ["x", "y", "z"], ["u", "</s>"], str(tmp_path / "a.png"))
    an.plot_gate_scatter_and_positions(torch.rand(50), torch.rand(50), torch.rand(6), torch.rand(6),
                                       str(tmp_path / "g.png"), r=-0.5)
    for name in ("dep.png", "a.png", "g.png"):
        assert (tmp_path / name).stat().st_size > 1000
    assert sorted(os.listdir(tmp_path)) == ["a.png", "dep.png", "g.png"]   # no temporary files left
    with pytest.raises(ValueError, match="shape"):
        an.plot_attention(torch.rand(2, 3), ["x", "y"], ["u", "v"], str(tmp_path / "bad.png"))


# ------------------------------------------------------------------------------------ script end to end
WORDS = {"el": "the", "perro": "dog", "gato": "cat", "come": "eats", "pan": "bread", "agua": "water",
         "bebe": "drinks", "casa": "house", "grande": "big", "rojo": "red"}


def _tiny_corpus(directory):
    from dtmt_models.data.corpus import write_manifest, write_parallel

    rng = np.random.default_rng(0)
    words = sorted(WORDS)
    pairs = []
    for _ in range(30):
        ws = [words[j] for j in rng.integers(0, len(words), rng.integers(2, 7))]
        pairs.append((" ".join(ws), " ".join(WORDS[w] for w in ws)))
    counts = {}
    for split, part in (("train", pairs[:20]), ("test", pairs[20:])):
        write_parallel(part, os.path.join(directory, f"{split}.es"), os.path.join(directory, f"{split}.en"))
        counts[split] = len(part)
    write_manifest(str(directory), "es", "en", counts, origin="toy")
    return pairs


@pytest.mark.parametrize("system,opts", [
    ("rnnsearch-atr", {"embed_dim": 8, "hidden_size": 8}),
    ("gnmt-atr", {"embed_dim": 8, "hidden_size": 8, "encoder_layers": 3, "decoder_layers": 2}),
    ("dtmt", {"embed_dim": 8, "hidden_size": 8, "heads": 2})])
def test_interpret_script_on_tiny_checkpoint(tmp_path, capsys, system, opts):
    from dtmt_models.models.checkpoint import save_checkpoint
    from dtmt_models.data.vocabulary import Vocabulary

    from benchmarks import interpret

    pairs = _tiny_corpus(tmp_path / "data")
    src_vocab = Vocabulary.train([s for s, _ in pairs], vocab_size=40)
    tgt_vocab = Vocabulary.train([t for _, t in pairs], vocab_size=40)
    torch.manual_seed(0)
    model = build_model(system, len(src_vocab), len(tgt_vocab), **opts)
    ckpt = str(tmp_path / "tiny.pt")
    save_checkpoint(ckpt, {"model_name": system, "model_options": opts, "src_vocab": src_vocab.proto,
                           "tgt_vocab": tgt_vocab.proto, "model": model.state_dict()})
    out = tmp_path / "out"
    summary = interpret.main(["--checkpoint", ckpt, "--data", str(tmp_path / "data"), "--split", "test",
                              "--quick", "--sentences", "8", "--example", "2", "--batch-size", "3",
                              "--out", str(out)])
    printed = capsys.readouterr().out
    assert (out / "attention.png").stat().st_size > 1000 and (out / "interpret.json").is_file()
    with open(out / "interpret.json") as f:
        saved = json.load(f)
    assert saved["files"] == summary["files"]
    if system != "dtmt":
        r = summary["pearson_r"]
        assert isinstance(r, float) and math.isfinite(r) and -1.0 <= r <= 1.0
        assert summary["sentences"] == 8
        assert summary["layer"] == ("encoder" if system == "rnnsearch-atr" else "encoder.0")
        assert (out / "gates.png").stat().st_size > 1000 and (out / "dependencies.png").stat().st_size > 1000
        assert "Pearson r" in printed and f"{r:.4f}" in printed
        assert len(summary["example_strongest_previous"]) == len(summary["example_tokens"])
    if system == "rnnsearch-atr":
        # one batch of the same 8 sentences gives the same r (the streaming statistics ignore the batching)
        test_src = [s for s, _ in pairs[20:28]]
        ids = [src_vocab.encode(s) for s in test_src]
        loaded = interpret.load_model(ckpt)[0]
        g = interpret.layer_gates(loaded, loaded.encoder, 0, ids, "cpu")
        expect = an.GateStatistics()
        expect.update(g["i"], g["f"], g["mask"])
        assert r == pytest.approx(expect.correlation(), abs=1e-5)   # float32 model, other batching
    if system == "dtmt":
        assert "pearson_r" not in summary and not (out / "gates.png").exists()
        assert any("gates: skipped" in n for n in summary["notes"])
