"""Row-wise int8 weights (dtmt_kernels.ops.linear.quantize), the reference of int8 decoding; the C++ kernels that
multiply by them (small_rows_linear with packed int8 rows, every instruction-set copy) against it; the int8
decoder step against the float step of the same model with its matrices rounded; `--int8` on the command line;
and the BLEU benchmark benchmarks/bench_int8.py."""
from __future__ import annotations

import os

import pytest
import torch

import dtmt_kernels as dk
from dtmt_kernels.ops.linear.quantize import (dequantize_rows, linear_int8, linear_int8_weights, pack_int8_rows,
                                              quantize_activations, quantize_rows, unpack_int8_rows)

needs_cpp = pytest.mark.skipif("cpp" not in dk.available_backends(), reason="C++ extension not built")


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
    with pytest.raises(FloatingPointError, match="non-finite"):
        quantize_rows(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        quantize_rows(torch.ones(3))
    # a float64 row beyond float32's range: its scale was infinite and it dequantized to NaN, without a word
    with pytest.raises(FloatingPointError, match=r"row 1's largest entry \(5e\+40\) is beyond what a float32 scale"):
        quantize_rows(torch.tensor([[1.0, 2.0], [5e40, 1.0]], dtype=torch.float64))
    # a row of subnormal entries only: its scale was 0 (the entries w / 0); the half-step bound holds for it too
    tiny = torch.tensor([[1e-44, -3e-45, 0.0]])
    q3, s3 = quantize_rows(tiny)
    assert s3[0] > 0 and (dequantize_rows(q3, s3, torch.float64) - tiny.double()).abs().max() <= s3.double()[0] / 2


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


def test_linear_int8_reference_against_float_products():
    """linear_int8 (the reference the int8 kernels and decoders are held to) against F.linear: exact where both
    operands are on their quantization grids (scales 0.25 and 0.5 a row, not 1), and within the two roundings'
    bound elsewhere: |y - (x W^T + b)| <= sum_k |x_k| e_w + |w_k| e_x + e_x e_w, e = scale / 2."""
    gen = torch.Generator().manual_seed(4)
    xi = torch.randint(-127, 128, (3, 40), generator=gen).double()
    wi = torch.randint(-127, 128, (7, 40), generator=gen).double()
    xi[:, 0], wi[:, 0] = 127, -127                       # every row's peak is 127 steps
    x, w = xi * 0.25, wi * 0.5
    q, scale = quantize_rows(w)
    assert torch.equal(scale, torch.full((7,), 0.5))
    b = torch.randn(7, generator=gen)
    y = linear_int8(x.float(), q, scale, b)
    torch.testing.assert_close(y, (x @ w.T + b.double()).float(), rtol=0, atol=0)
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        x, w, b = torch.randn(5, 33, generator=gen), torch.randn(9, 33, generator=gen), torch.randn(9, generator=gen)
        q, scale = quantize_rows(w)
        y = linear_int8(x, q, scale, b).double()
        exact = x.double() @ w.double().T + b.double()
        e_x = x.abs().amax(1).double()[:, None] / 127 / 2
        e_w = scale.double()[None, :] / 2
        bound = x.abs().double().sum(1, keepdim=True) * e_w + e_x * w.abs().double().sum(1)[None, :] + 33 * e_x * e_w
        err = (y - exact).abs()
        assert (err <= bound + 1e-6).all() and err.max() > 0, (seed, (err / bound).max())


def test_bench_int8_quantizes_what_a_step_reads(tmp_path, capsys):
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
    # int8 decoding rounds the encoder's recurrent matrices too (both directions, the T-GRU's), not its input ones
    extra = [n for n, _ in bench_int8.int8_matrices(model)][len(names):]
    assert sorted(extra) == ["encoder.tgru1_weight_hh", "encoder.tgru1_weight_hh_reverse", "encoder.weight_hh",
                             "encoder.weight_hh_reverse"]
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
                           "--out", str(tmp_path / "out"), "--isa", "all"])
    assert row["sentences"] == 12 and 0 <= row["changed"] <= 12
    # a row for every copy this CPU runs; the loaded copy's is the main row's
    from dtmt_kernels import _C

    assert [c["isa"] for c in row["copies"]] == list(_C.supported_cpu_isas())
    loaded = next(c for c in row["copies"] if c["isa"] == _C.cpu_isa())
    assert (loaded["bleu_float32"], loaded["bleu_int8"], loaded["changed"]) == (
        row["bleu_float32"], row["bleu_int8"], row["changed"])
    assert all(c["delta"] == pytest.approx(c["bleu_int8"] - c["bleu_float32"]) for c in row["copies"])
    with open(tmp_path / "out" / "bench_int8.md") as f:
        md = f.read()
    assert all(f"\n| {isa} | " in md for isa in _C.supported_cpu_isas())
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:   # (argparse's one line, exit 2, before the checkpoint loads)
        bench_int8.main(["--checkpoint", path, "--data", data, "--isa", "mmx", "--out", str(tmp_path / "out2")])
    assert info.value.code == 2 and "--isa mmx: not a copy this CPU runs" in capsys.readouterr().err
    assert row["delta"] == pytest.approx(row["bleu_int8"] - row["bleu_float32"])
    assert 0 <= row["int8_vs_weights_only_changed"] <= 12
    # the figures against translations and scores made here: the library's translate, sacrebleu on its own
    from sacrebleu.metrics import BLEU

    from dtmt_models.data.corpus import corpus_paths, read_parallel
    from dtmt_models.decoding.translate import translate
    from dtmt_models.models.checkpoint import load_model

    pairs = read_parallel(*corpus_paths(data, "test"))
    sources, refs = [s for s, _ in pairs], [t for _, t in pairs]
    model, sv, tv, _ = load_model(path)
    model.eval()
    from benchmarks.common import torch_threads

    with torch_threads(1):   # as the benchmark ran
        f32 = [h[0][0] for h in translate(model, sv, tv, sources, beam=2)]
        q8 = [h[0][0] for h in translate(model, sv, tv, sources, beam=2, decoder=model.inference_decoder(int8=True))]
    assert row["changed"] == sum(a != b for a, b in zip(f32, q8))
    assert row["bleu_float32"] == pytest.approx(BLEU().corpus_score(f32, [refs]).score)
    assert row["bleu_int8"] == pytest.approx(BLEU().corpus_score(q8, [refs]).score)


def test_pack_int8_rows_round_trip():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(3, 10, 7, generator=gen)           # a T-GRU stack [D, 3H, H]: rows like any other
    packed = pack_int8_rows(w)
    assert packed.dtype == torch.int8 and packed.shape == (3, 10, 11) and packed.is_contiguous()
    q, scale = unpack_int8_rows(packed)
    q_ref, scale_ref = quantize_rows(w.reshape(30, 7))
    assert torch.equal(q.reshape(30, 7), q_ref) and torch.equal(scale.reshape(30), scale_ref)
    with pytest.raises(ValueError, match=r"int8 \[\.\.\., N, K \+ 4\]"):
        unpack_int8_rows(torch.zeros(3, 4, dtype=torch.int8))


def _reference(x, packed, bias):
    q, scale = unpack_int8_rows(packed)
    y = linear_int8(x, q, scale, bias).double()
    # float32 rounding of the scaling and the bias: a few ulps of |scaled sum| + |bias|
    xq, x_scale = quantize_activations(x)
    scaled = (xq.double() @ q.double().T).abs() * x_scale.double()[:, None] * scale.double()[None, :]
    return y, scaled + (0 if bias is None else bias.double().abs())


def test_quantize_activations():
    x = torch.tensor([[0.5, -1.0, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [3.0, 1.5, -0.75, 1e-9]])
    xq, x_scale = quantize_activations(x)
    assert x_scale.dtype == torch.float32 and torch.equal(x_scale, torch.tensor([1 / 127, 1.0, 3 / 127]))
    assert xq.tolist() == [[64, -127, 32, 0], [0, 0, 0, 0], [127, 64, -32, 0]]   # 63.5 -> 64, 31.75 -> 32


def _isas():
    if "cpp" not in dk.available_backends():
        return []
    from dtmt_kernels import _C
    return [isa for isa in _C.supported_cpu_isas()]


@needs_cpp
@pytest.mark.parametrize("isa", _isas())
def test_int8_kernel_matches_the_reference(isa):
    """torch.ops.dtmt.small_rows_linear with packed int8 rows = linear_int8 (activations quantized per row, exact
    integer sums, both scales), for 1-8 rows (one pass of the int8 loop of this instruction set) and more (groups
    of 8), odd K and N; exactly the integer dot products where nothing needs rounding; NaN rows give NaN."""
    from dtmt_kernels import _C

    before = _C.cpu_isa()
    _C.set_cpu_isa(isa)
    try:
        gen = torch.Generator().manual_seed(3)
        for K in (1, 7, 32, 301):
            for N in (1, 77, 700):
                w = torch.randn(N, K, generator=gen) * torch.rand(N, 1, generator=gen)
                packed, b = pack_int8_rows(w), torch.randn(N, generator=gen)
                for M in (*range(1, _C.SMALL_ROWS_MAX + 1), 9, 40):
                    x = torch.randn(M, K, generator=gen)
                    for bias in (b, None):
                        y = torch.ops.dtmt.small_rows_linear(x, packed, bias)
                        ref, size = _reference(x, packed, bias)
                        assert y.dtype == torch.float32 and y.shape == (M, N)
                        err = (y.double() - ref).abs()
                        assert (err <= 1e-6 * size + 1e-30).all(), (isa, K, N, M, err.max().item())
        # a strided x (a column slice) reads the same
        x = torch.randn(4, 2 * 301, generator=gen)[:, ::2]
        assert torch.equal(torch.ops.dtmt.small_rows_linear(x, packed, b),
                           torch.ops.dtmt.small_rows_linear(x.contiguous(), packed, b))
        # integers with a peak of 127 in every row (both scales 1): the exact integer dot products
        for M, K in ((3, 67), (11, 300)):
            xi = torch.randint(-127, 128, (M, K), generator=gen).float()
            wi = torch.randint(-127, 128, (50, K), generator=gen).float()
            xi[:, 0], wi[:, 0] = 127, -127
            y = torch.ops.dtmt.small_rows_linear(xi, pack_int8_rows(wi), None)
            assert torch.equal(y, (xi.double() @ wi.double().T).float())
        # a row of x with NaN or an infinity: NaN across it, the other rows untouched
        x = torch.randn(5, 301, generator=gen)
        x[1, 7], x[3, 0] = float("nan"), float("inf")
        y = torch.ops.dtmt.small_rows_linear(x, packed, b)
        assert y[[1, 3]].isnan().all() and torch.equal(y[[0, 2, 4]],
                                                       torch.ops.dtmt.small_rows_linear(x[[0, 2, 4]], packed, b))
        ref = linear_int8(x, *unpack_int8_rows(packed), b)   # (the reference says so too: it gave finite rows)
        assert ref[[1, 3]].isnan().all() and not ref[[0, 2, 4]].isnan().any()
    finally:
        _C.set_cpu_isa(before)


@needs_cpp
@pytest.mark.parametrize("isa", _isas())
def test_int8_sums_exact_at_the_extremes(isa):
    """The int8 sums at the ends of the quantized ranges, where a saturating instruction would show: weight rows
    of all 127, all -127 and alternating signs against activation rows of all 127 (255 in the VNNI loops' unsigned
    form), all -127 (1) and alternating, both scales 1 (a row's peak is its int8 value), so that every output is
    float32 of the exact integer sum: for K with a tail past whole vectors, K = 132,104, the most the op takes
    (sums within 2^24 of int32's limit, and with the -128 weights below within 5,120 of it; the unsigned form twice
    past it), 1-8 rows and the panel loop's 9-17, in every instruction set
    copy this machine runs (vpmaddubsw adds pairs into int16 with saturation: at most 2 * 128 * 127 = 32,512 there,
    which the AVX2 and AVX-512 loops keep by multiplying |w| by x carrying w's sign). Weights of -128, which
    pack_int8_rows never writes but a crafted packed tensor can hold, are exact too (with the sign on the weights,
    -(-128) wrapped to -128 and such rows came out negated against negative activations); one value more a row is
    refused (K = 133,144 was taken, where rows of -128 wrap int32)."""
    from dtmt_kernels import _C

    before = _C.cpu_isa()
    _C.set_cpu_isa(isa)
    try:
        for K in (64, 97, 4096 + 33, 132_104):
            signs = torch.where(torch.arange(K) % 2 == 0, 1.0, -1.0)
            rows = [torch.full((K,), 127.0), torch.full((K,), -127.0), 127.0 * signs, -127.0 * signs]
            w = torch.stack(rows * 2)                     # 8 weight rows: the loops' groups of 2 and 4, twice
            for M in (*range(1, 9), 9, 12, 17):
                x = torch.stack([rows[m % 4] for m in range(M)])
                y = torch.ops.dtmt.small_rows_linear(x, pack_int8_rows(w), None)
                exact = (x.to(torch.int64) @ w.to(torch.int64).T)
                assert exact.abs().max() < 2 ** 31
                assert torch.equal(y, exact.to(torch.float32)), (isa, K, M)
                crafted = pack_int8_rows(w)
                body = crafted[:, :K]
                body[body == -127] = -128                     # (the rows' scales stay 1)
                y = torch.ops.dtmt.small_rows_linear(x, crafted, None)
                exact = x.to(torch.int64) @ body.to(torch.int64).T
                assert exact.abs().max() < 2 ** 31
                assert (body == -128).any() and torch.equal(y, exact.to(torch.float32)), (isa, K, M, "-128")
        x, w = torch.ones(1, 132_105), torch.ones(3, 132_105)
        with pytest.raises(RuntimeError, match="int8 rows of 132105 values would overflow int32 sums"):
            torch.ops.dtmt.small_rows_linear(x, pack_int8_rows(w), None)
    finally:
        _C.set_cpu_isa(before)


@needs_cpp
def test_int8_loops_of_every_instruction_set_agree_to_the_bit():
    """The int8 sums are exact integers and the scaling two roundings in every copy (AVX512-VNNI with unsigned
    activations and a row-sum correction; AVX-512 without VNNI and AVX2 with |w| and w's sign moved onto x;
    plain C++), so every instruction set this machine runs gives the
    same bits: for 1-8 rows, K with and without a tail past whole vectors, N not a multiple of the rows a loop
    takes together, and sums whose unsigned form passes 2^31 (K = 70,000 at 127 * 127). Past 8 rows the VNNI
    copy takes its panel loop (int8_panel: 16 rows a vector, 12 weight rows at a time), the others 8 rows at a
    time: 9-100 rows, with a NaN row, hold the two equal too."""
    from dtmt_kernels import _C

    isas = _isas()
    if len(isas) < 2:
        pytest.skip("this machine runs one instruction set copy")
    gen = torch.Generator().manual_seed(5)
    cases = []
    for K in (5, 64, 100, 512, 577):
        for N in (1, 6, 37):
            w, b = torch.randn(N, K, generator=gen), torch.randn(N, generator=gen)
            for M in range(1, _C.SMALL_ROWS_MAX + 1):
                cases.append((torch.randn(M, K, generator=gen), pack_int8_rows(w), b if M % 2 else None))
    for K in (3, 128, 258):
        for N in (5, 12, 29, 1024):
            w, b = torch.randn(N, K, generator=gen), torch.randn(N, generator=gen)
            for M in (9, 16, 17, 33, 100):
                x = torch.randn(M, K, generator=gen)
                x[M // 2, K // 2] = float("nan") if M == 33 else x[M // 2, K // 2]
                cases.append((x, pack_int8_rows(w), b if M % 2 else None))
    big = torch.full((2, 70_000), 127.0)   # both scales 1: x and w are their own int8 values
    cases.append((big, pack_int8_rows(torch.cat([big, -big])), None))
    before = _C.cpu_isa()
    try:
        outs = {}
        for isa in isas:
            _C.set_cpu_isa(isa)
            outs[isa] = [torch.ops.dtmt.small_rows_linear(x, w, b) for x, w, b in cases]
    finally:
        _C.set_cpu_isa(before)
    exact = float(127 * 127 * 70_000)
    assert torch.equal(outs[isas[0]][-1], torch.tensor([[exact, exact, -exact, -exact]] * 2))
    for isa in isas[1:]:
        for i, (a, b) in enumerate(zip(outs[isas[0]], outs[isa])):
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), (isas[0], isa, i, cases[i][0].shape)
            assert a.isnan().sum() == (a.shape[1] if cases[i][0].isnan().any() else 0)


def _cpu_has_vnni() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " avx512_vnni" in f.read()
    except OSError:
        return False


@needs_cpp
@pytest.mark.skipif(not _cpu_has_vnni(), reason="without VNNI the avx512 copy takes its loop without VNNI anyway")
def test_int8_loop_without_vnni_on_a_vnni_cpu():
    """DTMT_INT8_VNNI=0 keeps the avx512 copy off its VNNI loops, so that its 64-byte loop for AVX-512 CPUs without
    VNNI (Skylake-SP) is held to the reference here too: the three kernel tests above, in a process of their own."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                        "int8_kernel_matches_the_reference or agree_to_the_bit or exact_at_the_extremes"],
                       capture_output=True, text=True, env=dict(os.environ, DTMT_INT8_VNNI="0"),
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


@needs_cpp
def test_int8_kernel_is_thread_count_independent_and_refuses_bad_input():
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(5000, 64, generator=gen)
    packed, b, x = pack_int8_rows(w), torch.randn(5000, generator=gen), torch.randn(4, 64, generator=gen)
    from conftest import at_thread_counts

    one, two = at_thread_counts(lambda: torch.ops.dtmt.small_rows_linear(x, packed, b), 1, 2)
    assert torch.equal(one, two)
    many = torch.randn(40, 64, generator=gen)   # past 8 rows: the panel loop where there is one
    one, two = at_thread_counts(lambda: torch.ops.dtmt.small_rows_linear(many, packed, b), 1, 2)
    assert torch.equal(one, two)
    with pytest.raises(RuntimeError, match="float32 activations"):
        torch.ops.dtmt.small_rows_linear(x.double(), packed, b.double())
    with pytest.raises(RuntimeError, match=r"\[N, K \+ 4\]"):
        torch.ops.dtmt.small_rows_linear(torch.randn(4, 63), packed, b)


FUSED_STEP_SYSTEMS = ("dtmt", "shallow-rnmt", "rnnsearch-atr", "mce", "nematus")   # engine.rnmt.FusedRNMTDecoder


@needs_cpp
@pytest.mark.parametrize("system", FUSED_STEP_SYSTEMS)
def test_int8_decoder_is_the_reference_with_int8_products(monkeypatch, system):
    """The int8 decoder (inference_decoder(int8=True): the fused step with int8 matrices, the encoder's recurrent
    ones too; here without the fold of the attention's output projection, test_fold_context_projection) computes
    what the model's modules compute on the reference backend when every product by those matrices
    (bench_int8.int8_matrices) is the reference int8
    product quantize.linear_int8 (activations and weights rounded per row, exact integer sums): log-probabilities,
    states and attention over steps and a reorder, at batch 1 beam 4 (one group of the int8 loop) and 3 x 4 rows
    (two groups); and the model itself is left float32. The two compute the float parts in other orders (the
    reference backend's loops against the fused step's), so an activation within a few ulps of a rounding tie may
    be quantized to neighbouring int8 values by the two: such a row differs by a quantum of the product, not by
    rounding, and is not compared from then on (conftest.RoundingTies; at least half the rows are compared)."""
    import copy

    import torch.nn.functional as F

    from conftest import RoundingTies, assert_decoders_step_alike, int8_linear_for, spread_weights

    from benchmarks import bench_int8
    from dtmt_models.models.registry import build_model
    from dtmt_models.engine import EngineOptions
    from dtmt_models.engine.rnmt import FusedRNMTDecoder

    torch.manual_seed(0)
    model = spread_weights(build_model(system, 50, 60, embed_dim=16, hidden_size=24))
    ties = RoundingTies(4)
    int8_linear = int8_linear_for([p.detach().clone() for _, p in bench_int8.int8_matrices(model)], ties)
    reference = copy.deepcopy(model)
    reference.set_backend("reference")
    monkeypatch.setattr(F, "linear", int8_linear)
    with torch.no_grad():
        # fold=False: the step reads the modules' own matrices (the fold rounds W_ih W_o as one matrix instead)
        float_decoder = model.inference_decoder()
        int8 = float_decoder.variant(int8=True, options=EngineOptions(fold=False))
        assert isinstance(int8, FusedRNMTDecoder) and int8.int8
        assert int8.readout.w_out.dtype == torch.int8 and int8.query_cell.params[2].dtype == torch.int8
        assert model.readout.output.proj.weight.dtype == torch.float32     # the model itself is untouched
        gen = torch.Generator().manual_seed(5)
        for rows, lengths in ((4, [6, 6, 6, 6]), (12, [6, 5, 5, 4, 4, 4, 3, 3, 2, 2, 1, 1])):
            src = torch.randint(4, 50, (rows, 6), generator=gen)
            # drawn in the order the steps used them: two steps' tokens, the reorder, two more
            prevs = [torch.randint(4, 60, (rows,), generator=gen) for _ in range(2)]
            order = torch.randperm(rows, generator=gen)
            prevs += [torch.randint(4, 60, (rows,), generator=gen) for _ in range(2)]
            # float32 both: the summation order and the fused step's own rounding (test_decode_kernels)
            ties.reset(rows)
            assert_decoders_step_alike(int8, reference, src, torch.tensor(lengths), prevs, order, 1e-4, 1e-4, 1e-5,
                                       ties)


@needs_cpp
def test_int8_beam_search_translates_as_its_decoder():
    """Beam search with the int8 decoder, batched and one sentence at a time, gives the same translations."""
    from conftest import spread_weights

    from dtmt_models.decoding.beam_search import beam_search
    from dtmt_models.models.registry import build_model

    torch.manual_seed(0)
    model = spread_weights(build_model("dtmt", 50, 60, embed_dim=16, hidden_size=24))
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        int8 = model.inference_decoder(int8=True)
        src, lengths = torch.randint(4, 50, (3, 6), generator=gen), torch.tensor([6, 4, 2])
        batched = beam_search(int8, src, lengths, beam=4, max_len_a=1.0, max_len_b=3)
        for b in range(3):
            alone = beam_search(int8, src[b:b + 1, :int(lengths[b])], lengths[b:b + 1], beam=4, max_len_a=1.0,
                                max_len_b=3)[0]
            assert [h.tokens for h in alone] == [h.tokens for h in batched[b]]


@needs_cpp
def test_int8_decoding_is_refused_where_the_fused_step_is_not():
    from dtmt_models.decoding.ensemble import Ensemble
    from dtmt_models.models.registry import build_model

    for system in ("transformer", "deeplau", "gnmt-atr"):
        with pytest.raises(ValueError, match="int8 decoding runs the fused decoder step"):
            build_model(system, 30, 30, embed_dim=16, hidden_size=16).eval().inference_decoder(int8=True)
    model = build_model("dtmt", 30, 30, embed_dim=16, hidden_size=16)
    # training mode: the decoder of an eval copy (it was refused; the float decoder was the model itself, dropout on)
    assert type(model.train().inference_decoder(int8=True)).__name__ == "FusedRNMTDecoder" and model.training
    with pytest.raises(ValueError, match="int8 decoding.*: its weights are float64$"):
        model.eval().double().inference_decoder(int8=True)              # float64
    with pytest.raises(ValueError, match="int8 decoding.*: its backend is reference$"):
        model.float().set_backend("reference").inference_decoder(int8=True)
    model.set_backend("auto")
    deep = build_model("nematus", 30, 30, embed_dim=16, hidden_size=16, decoder="bideep", dec_depth=2).eval()
    with pytest.raises(ValueError, match=r"int8 decoding.*: its decoder has 2 levels$"):   # (it gave no reason)
        deep.inference_decoder(int8=True)
    # the member's own reason, numbered (it was "every member must be a recurrent system with an inference
    # decoder", also for a deeplau member, which is one)
    with pytest.raises(ValueError, match=r"int8 decoding of an ensemble: member 2: int8 decoding runs the fused "
                                         r"decoder step of dtmt, shallow-rnmt"):
        Ensemble([model.float(), build_model("transformer", 30, 30, embed_dim=16, hidden_size=16)]).eval() \
            .inference_decoder(int8=True)
    with pytest.raises(ValueError, match=r"member 2: int8 decoding runs the fused decoder step of .*; this \w+ model"):
        Ensemble([model.float(), build_model("deeplau", 30, 30, embed_dim=16, hidden_size=16)]).eval() \
            .inference_decoder(int8=True)
    decoder = Ensemble([model.float(), model]).eval().inference_decoder(int8=True)
    assert all(d.int8 for d in decoder.decoders)


@needs_cpp
def test_an_int8_decoder_names_the_weights_it_cannot_quantize_and_its_search_s_bad_arguments():
    """A review's findings: a NaN weight, or a finite one whose fold with the attention's output projection overflows
    float32, was quantize_rows' 'the weight has non-finite entries', naming no part of the model (the model's own
    weights finite); the decoder's own search took an int max_len to an AttributeError and a batch of no sentences
    to torch's 'max(): Expected reduction dim'."""
    from dtmt_models.models.registry import build_model

    for weight, value, part in (("readout.output.proj.weight", float("nan"), "readout"),
                                ("decoder_cell.weight_ih", 3e38, "decoder cell")):
        model = build_model("dtmt", 30, 30, embed_dim=16, hidden_size=16).eval()
        with torch.no_grad():   # (the decoder cell's input is the context: its row times W_o's columns, 32 x 3e38)
            model.get_parameter(weight)[0] = value
            model.attention.out.weight.fill_(1.0)
        assert part == "readout" or all(p.isfinite().all() for p in model.parameters())
        with pytest.raises(FloatingPointError) as info:
            model.inference_decoder(int8=True)
        assert str(info.value) == (f"int8 decoding of DTMT: the {part}'s weight matrices (with the attention's output "
                                   f"projection folded in): quantize_rows: the weight has non-finite entries (NaN or "
                                   f"infinite)"), str(info.value)
    model = build_model("rnnsearch-atr", 30, 30, embed_dim=16, hidden_size=16).eval()   # (no output projection)
    with torch.no_grad():
        model.readout.output.proj.weight[0, 0] = float("inf")
    with pytest.raises(FloatingPointError, match=r"^int8 decoding of RNNSearchATR: the readout's weight matrices: "
                                                 r"quantize_rows: "):
        model.inference_decoder(int8=True)
    decoder = build_model("dtmt", 30, 30, embed_dim=16, hidden_size=16).eval().inference_decoder(int8=True)
    src, lengths = torch.randint(4, 30, (2, 5)), torch.tensor([5, 3])
    state = decoder.encode(src, lengths)
    for bad, got in ((5, "int"), (torch.tensor([4.0, 4.0]), "torch.float32 [2]"), (torch.tensor(4), "torch.int64 []")):
        with pytest.raises(ValueError) as info:
            decoder.search(state, 4, 0.6, bad)
        assert str(info.value) == (f"FusedRNMTDecoder.search: max_len is an integer tensor [B] (each sentence's "
                                   f"bound), got {got}")
    empty = {k: v[:0] for k, v in state.items()}   # (a state of no sentences: no search)
    assert decoder.search(empty, 4, 0.6, torch.zeros(0, dtype=torch.long)) == []
    for bounds in (torch.zeros(0, dtype=torch.long), torch.tensor([4])):   # (of another batch: named)
        with pytest.raises(ValueError, match=rf"^FusedRNMTDecoder.search: max_len holds {len(bounds)} bounds for a "
                                             rf"state of 2 sentences$"):
            decoder.search(state, 4, 0.6, bounds)
    assert len(decoder.search(state, 4, 0.6, torch.tensor([4, 4]))) == 2
    # a state of another width: the packed widths named as int8 rows (H + 4 bytes: "[64, 20]" read as H = 20)
    cut = dict(state, s=state["s"][:, :5])
    with pytest.raises(RuntimeError, match=r"the state \[B, 5\] .* do not fit the cell's weights \(w_hh \[64, 20\] "
                                           r"int8 rows, w_ih \[\d+, \d+\] int8 rows\)"):
        decoder.step(cut, torch.full((2,), 1))


@needs_cpp
def test_cli_int8(tmp_path, capsys):
    """`dtmt translate --int8` writes what translate() gives with the int8 decoder (which differs from float32
    decoding only by the rounded weights), alone and in an ensemble; `dtmt evaluate --int8` records it; a
    system without the fused step is refused in one line, with nothing written."""
    import json

    from conftest import TOY_SRC as SRC, TOY_TGT as TGT, save_model, spread_weights

    from dtmt_models import cli
    from dtmt_models.data.corpus import write_manifest
    from dtmt_models.data.vocabulary import Vocabulary
    from dtmt_models.decoding.ensemble import Ensemble
    from dtmt_models.decoding.translate import translate
    from dtmt_models.models.registry import build_model

    sv, tv = Vocabulary.train(SRC, vocab_size=50), Vocabulary.train(TGT, vocab_size=50)
    paths, models = {}, {}
    for key, name, options in (("dtmt", "dtmt", dict(embed_dim=16, hidden_size=16, depth=1, heads=2)),
                               ("atr", "rnnsearch-atr", dict(embed_dim=16, hidden_size=16)),
                               ("transformer", "transformer", dict(embed_dim=16, hidden_size=16))):
        torch.manual_seed(len(paths))
        models[key] = spread_weights(build_model(name, len(sv), len(tv), **options),
                                     torch.Generator().manual_seed(20 + len(paths)))
        paths[key] = save_model(tmp_path / f"{key}.pt", name, options, sv, tv, models[key])
    src = tmp_path / "in.es"
    src.write_text("\n".join(SRC[:6]) + "\n", encoding="utf-8")

    def run(*flags):
        out = tmp_path / "out.en"
        assert cli.main(["translate", "--quiet", "--beam", "3", "--int8", *flags, str(src), "-o", str(out)]) == 0
        return out.read_text(encoding="utf-8").split("\n")[:-1]

    def expected(model):
        model.eval()
        return [h[0][0] for h in translate(model, sv, tv, SRC[:6], beam=3, decoder=model.inference_decoder(int8=True))]
    assert run("-c", paths["dtmt"]) == expected(models["dtmt"])
    assert run("-c", paths["dtmt"], "-c", paths["atr"]) == expected(Ensemble([models["dtmt"], models["atr"]]))
    capsys.readouterr()
    out = tmp_path / "refused.en"
    assert cli.main(["translate", "--quiet", "--int8", "-c", paths["transformer"], str(src), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dtmt translate: --int8: int8 decoding runs the fused decoder step of dtmt")
    assert "TransformerNMT" in err and err.count("\n") == 1 and not out.exists()
    # dtmt serve builds its decoder before it listens: refused the same way, no server started
    assert cli.main(["serve", "--int8", "-c", paths["transformer"], "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dtmt serve: --int8: int8 decoding runs the fused decoder step") and err.count("\n") == 1
    data = tmp_path / "corpus"
    data.mkdir()
    (data / "test.es").write_text("\n".join(SRC) + "\n", encoding="utf-8")
    (data / "test.en").write_text("\n".join(TGT) + "\n", encoding="utf-8")
    write_manifest(str(data), "es", "en", {"test": len(SRC)}, origin="test")
    assert cli.main(["evaluate", "-c", paths["atr"], "--data", str(data), "--beam", "2", "--int8", "--quiet",
                     "--out-dir", str(tmp_path / "eval")]) == 0
    with open(tmp_path / "eval" / "scores.json", encoding="utf-8") as f:
        assert json.load(f)["settings"]["int8"] is True


@needs_cpp
def test_bench_int8_kernel_quick(tmp_path):
    """bench_int8_kernel times the matrices the fused step reads (the T-GRU slices included)."""
    from conftest import TOY_SRC as SRC, TOY_TGT as TGT, save_model

    from benchmarks import bench_int8_kernel
    from dtmt_models.data.vocabulary import Vocabulary
    from dtmt_models.models.registry import build_model

    sv, tv = Vocabulary.train(SRC, vocab_size=50), Vocabulary.train(TGT, vocab_size=50)
    options = dict(embed_dim=16, hidden_size=16, depth=2, heads=2)
    torch.manual_seed(0)
    model = build_model("dtmt", len(sv), len(tv), **options)
    path = save_model(tmp_path / "tiny.pt", "dtmt", options, sv, tv, model)
    from benchmarks.common import torch_threads

    with torch_threads(2):   # (not the 1 of a test worker's: the count must be one the benchmark changes)
        rows = bench_int8_kernel.main(["--checkpoint", path, "--rows", "1,9", "--calls", "2", "--repeat", "1",
                                       "--out", str(tmp_path / "out")])
        after = torch.get_num_threads()
    assert [r["rows"] for r in rows] == [1, 9] and all(r["int8_us"] > 0 and r["float32_us"] > 0 for r in rows)
    import json
    with open(tmp_path / "out" / "bench_int8_kernel.json") as f:
        names = json.load(f)["matrices"]
    assert "query_cell.t_w[1]" in names and "readout.w_out" in names and "decoder_cell.w_ih" in names
    assert "attention.w_o" not in names        # folded into decoder_cell.w_ih and readout.w_c
    assert after == 2      # it ran on one thread and gave the others back
