"""Row-wise int8 weights (dtmt_kernels.ops.linear.quantize), the reference of int8 decoding, and the BLEU
simulation benchmarks/bench_int8.py runs on it."""
from __future__ import annotations

import pytest
import torch

from dtmt_kernels.ops.linear.quantize import dequantize_rows, linear_int8_weights, quantize_rows


def test_quantize_rows_bounds_and_exact_cases():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(37, 53, generator=gen, dtype=torch.float64) * torch.logspace(-3, 1, 37, dtype=torch.float64)[:, None]
    w[5] = 0.0
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and q.shape == w.shape
    nonzero = torch.arange(37) != 5
    assert (q[nonzero].abs().amax(1) == 127).all()                 # every row uses the full range
    assert (q[5] == 0).all() and scale[5] == 1.0                    # an all-zero row
    err = (dequantize_rows(q, scale, torch.float64) - w).abs()
    assert (err <= scale.double()[:, None] / 2 * (1 + 1e-12)).all()  # half a step at most
    # values on the grid come back exactly
    grid = torch.randint(-127, 128, (4, 9), generator=gen).double() * 0.25
    grid[:, 0] = 127 * 0.25
    q2, s2 = quantize_rows(grid)
    assert torch.equal(dequantize_rows(q2, s2, torch.float64), grid) and torch.equal(q2.double() * 0.25, grid)
    with pytest.raises(ValueError, match="non-finite"):
        quantize_rows(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        quantize_rows(torch.ones(3))


def test_linear_with_int8_weights():
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(64, 32, generator=gen), torch.randn(64, generator=gen)
    x = torch.randn(4, 32, generator=gen)
    q, scale = quantize_rows(w)
    y = linear_int8_weights(x, q, scale, b)
    torch.testing.assert_close(y, x @ dequantize_rows(q, scale).T + b)
    # against the float32 layer: the error is that of the rounded weights, |x| . scale / 2 per output at most
    bound = x.abs().sum(1, keepdim=True) * scale[None, :] / 2
    assert ((y - torch.nn.functional.linear(x, w, b)).abs() <= bound + 1e-5).all()


def test_bench_int8_quantizes_what_a_step_reads(tmp_path):
    from conftest import TOY_SRC as SRC, TOY_TGT as TGT, save_model
    from test_train import make_toy_corpus

    from benchmarks import bench_int8
    from dtmt_models.data.vocabulary import Vocabulary
    from dtmt_models.models.registry import build_model

    sv, tv = Vocabulary.train(SRC, vocab_size=50), Vocabulary.train(TGT, vocab_size=50)
    options = dict(embed_dim=16, hidden_size=16, depth=1, heads=2, dropout=0.0, candidate_dropout=0.0)
    torch.manual_seed(0)
    model = build_model("dtmt", len(sv), len(tv), **options)
    names = [n for n, _ in bench_int8.step_matrices(model)]
    assert "readout.output.proj.weight" in names and "query_cell.weight_hh" in names
    assert not any(n.startswith(("encoder", "src_embed", "tgt_embed", "attention.key")) for n in names)
    embedding = model.tgt_embed.weight.detach().clone()
    projection = model.readout.output.proj.weight.detach().clone()
    f32, i8 = bench_int8.quantize_step_weights(model)
    assert torch.equal(model.tgt_embed.weight, embedding)                        # float32, even if tied
    q, scale = quantize_rows(projection)
    assert torch.equal(model.readout.output.proj.weight, dequantize_rows(q, scale))
    assert i8 < f32 / 3
    # a projection tied to the target embedding (rnnsearch-atr's default) is quantized, the embedding is not
    tied = build_model("rnnsearch-atr", len(sv), len(tv), embed_dim=16, hidden_size=16)
    assert tied.readout.output.proj.weight is tied.tgt_embed.weight
    assert "readout.output.proj.weight" in [n for n, _ in bench_int8.step_matrices(tied)]
    embedding = tied.tgt_embed.weight.detach().clone()
    bench_int8.quantize_step_weights(tied)
    assert torch.equal(tied.tgt_embed.weight, embedding)
    assert torch.equal(tied.readout.output.proj.weight, dequantize_rows(*quantize_rows(embedding)))
    torch.manual_seed(0)
    path = save_model(tmp_path / "tiny.pt", "dtmt", options, sv, tv, build_model("dtmt", len(sv), len(tv), **options))
    data = make_toy_corpus(tmp_path / "toy", n_train=20, n_dev=5, n_test=12)
    row = bench_int8.main(["--checkpoint", path, "--data", data, "--threads", "1", "--beam", "2",
                           "--out", str(tmp_path / "out")])
    assert row["sentences"] == 12 and 0 <= row["changed"] <= 12
    assert row["delta"] == pytest.approx(row["bleu_int8"] - row["bleu_float32"])
