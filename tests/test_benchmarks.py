"""The benchmark scripts run (tiny grids) and write what they promise."""
import csv
import json
import os
import platform
import shutil
import subprocess
import sys

import pytest
import torch

import dtmt_kernels as dk
import dtmt_models as dm

from conftest import HAS_TRITON, prepare_triton_interpreter


def tiny_checkpoint(tmp_path, system: str, n_test: int = 8, **options):
    """(checkpoint, data) for a benchmark's quick run: a freshly initialised `system` with `options` (seed 0) and
    50-piece toy vocabularies, saved as tmp_path/tiny.pt, and a toy corpus of 20 training, 5 dev and `n_test` test
    pairs in tmp_path/toy."""
    from test_train import make_toy_corpus

    from conftest import TOY_SRC, TOY_TGT, save_model
    from dtmt_models.data.vocabulary import Vocabulary
    from dtmt_models.models.registry import build_model

    sv, tv = Vocabulary.train(TOY_SRC, vocab_size=50), Vocabulary.train(TOY_TGT, vocab_size=50)
    torch.manual_seed(0)
    ckpt = save_model(tmp_path / "tiny.pt", system, options, sv, tv, build_model(system, len(sv), len(tv), **options))
    return ckpt, make_toy_corpus(tmp_path / "toy", n_train=20, n_dev=5, n_test=n_test)


def csv_rows(path) -> list:
    """The rows of a benchmark's CSV file, its "# run: ..." comment line (common.provenance_line) above the header
    checked and skipped."""
    with open(path, newline="") as f:
        first = f.readline()
        assert first.startswith("# run: ") and "; commit " in first and " UTC; torch " in first, first
        return list(csv.DictReader(f))


@pytest.mark.skipif("cpp" not in dk.available_backends(), reason="C++ extension not built")
def test_bench_cells_quick(tmp_path):
    from benchmarks import bench_cells
    rows = bench_cells.main(["--quick", "--out", str(tmp_path)])
    impls = {(r["kind"], r["impl"]) for r in rows}
    assert ("deep-transition", "cpp") in impls and ("gru", "torch.nn.GRU") in impls and ("atr", "reference") in impls
    table = csv_rows(os.path.join(tmp_path, "bench_cells.csv"))
    assert len(table) == len(rows)
    assert all(float(r["ms"]) > 0 and float(r["saved_B"]) > 0 for r in table)


@pytest.mark.skipif("cpp" not in dk.available_backends(), reason="C++ extension not built")
def test_bench_portable_quick(tmp_path):
    """The three builds' processes, with this checkout's extension standing in for the native one."""
    from benchmarks import bench_portable
    from dtmt_kernels import _C
    rows = bench_portable.main(["--quick", "--native-so", _C.__file__, "--out", str(tmp_path)])
    assert {r["build"] for r in rows} == {"portable", "baseline", "native"}
    # (the native build's process runs the best copy this CPU has, whatever DTMT_CPU_ISA asks of this one)
    assert {(r["build"], r["isa"]) for r in rows if r["build"] != "portable"} == {
        ("baseline", "baseline"), ("native", _C.supported_cpu_isas()[0])}
    assert all(r["ms"] > 0 and r["vs_native"] > 0 for r in rows)
    assert all(r["vs_native"] == 1.0 for r in rows if r["build"] == "native")
    with open(os.path.join(tmp_path, "bench_portable.csv")) as f:
        assert len(list(csv.DictReader(f))) == len(rows)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_bench_cells_gpu_grid_under_interpreter(monkeypatch):
    """The --device cuda grid (triton, the eager reference and torch.nn.GRU, fwd+bwd and fwd only) on CPU
    tensors through triton's interpreter: the code the first session with a GPU runs has run here."""
    from benchmarks import bench_cells
    prepare_triton_interpreter()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rows = bench_cells.add_ratios(bench_cells.run_grid_cuda([(2, 2, 8)], [1], 1, device="cpu", peak_n=64), "cuda")
    got = {(r["kind"], r["impl"], r["mode"]) for r in rows}
    for kind in ("deep-transition", "gru", "atr"):
        for impl in ("reference", "triton"):
            assert {(kind, impl, "fwd+bwd"), (kind, impl, "fwd")} <= got
    assert {("gru", "torch.nn.GRU", "fwd+bwd"), ("gru", "torch.nn.GRU", "fwd")} <= got
    assert len(rows) == len(got)
    for r in rows:
        assert r["ms"] > 0 and r["dtype"] == "float32" and r["peak_MB"] != r["peak_MB"]   # no CUDA: NaN
        assert (r["saved_B"] > 0) == (r["mode"] == "fwd+bwd")
        assert r["speedup_vs_ref"] > 0 and r["vs_cudnn_gru"] > 0
    bench_cells.print_table(rows, "interpreter", "cuda")


def test_bench_train_quick(tmp_path):
    from benchmarks import bench_train
    rows = bench_train.main(["--quick", "--systems", "dtmt", "transformer", "--out", str(tmp_path)])
    assert [(r["system"], r["backend"]) for r in rows] == [("dtmt", "auto"), ("dtmt", "reference"),
                                                            ("transformer", "-")]
    assert all(r["tok_s"] > 0 and r["saved_MB"] > 0 and r["peak_rss_MB"] > 0 for r in rows)
    assert rows[0]["speedup"] == rows[0]["tok_s"] / rows[1]["tok_s"]
    assert os.path.isfile(os.path.join(tmp_path, "bench_train.csv"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a pair that cannot run here: the cuda backend without a GPU")
def test_bench_train_keeps_the_table_of_the_pairs_that_ran(tmp_path, capsys):
    """A pair that fails (on a GPU: a capture that has never run there) raised at once, and every other pair's
    measurements were lost, the table never written. It is now left out, named, and the run exits 1 after the table of
    the others."""
    from benchmarks import bench_train
    with pytest.raises(SystemExit, match=r"^bench_train: dtmt/cuda \(graphs off, math strict\) failed"):
        bench_train.main(["--quick", "--systems", "dtmt", "--fused", "cpp", "cuda", "--steps", "1", "--warmup", "0",
                          "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "dtmt/cuda (graphs off, math strict) failed (left out):" in out and "| dtmt | cpp |" in out
    assert {row["backend"] for row in csv_rows(tmp_path / "bench_train.csv")} == {"cpp", "reference"}


def test_bench_train_names_the_failures_when_no_pair_ran(tmp_path, monkeypatch, capsys):
    """Every pair failed (a broken build): the figure of no pairs divided by zero, a traceback that hid the
    failures' message."""
    from benchmarks import bench_train

    monkeypatch.setattr(bench_train.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "",
                                                                                                     "boom"))
    with pytest.raises(SystemExit, match=r"^bench_train: dtmt/cpp \(graphs off, math strict\) failed; dtmt/reference"):
        bench_train.main(["--quick", "--systems", "dtmt", "--fused", "cpp", "--out", str(tmp_path)])
    assert "boom" in capsys.readouterr().out


def test_bench_amp_quality_plumbing(tmp_path):
    """bench_amp.py --quality (gpu_session.sh's amp stage) on the CPU at toy sizes: both modes per seed, the dev loss
    at each validation read back from `dtmt train`'s log, the table and the verdict."""
    from test_train import make_toy_corpus

    from benchmarks import bench_amp
    data = make_toy_corpus(tmp_path / "toy", n_train=60, n_dev=8, n_test=0)
    out = bench_amp.main(["--quality", "--device", "cpu", "--steps", "3", "--seeds", "1", "2", "--data", data,
                          "--out", str(tmp_path / "amp"), "--train-args",
                          "--vocab-size 60 --opt embed_dim=16 --opt hidden_size=16 --max-tokens 200 --threads 1"])
    assert sorted(out["runs"]) == [("bf16", 1), ("bf16", 2), ("off", 1), ("off", 2)]
    assert all(sorted(r["dev_loss"]) == [1, 2, 3] and r["tok_s"] > 0 for r in out["runs"].values())
    assert out["runs"][("off", 1)]["dev_loss"] != out["runs"][("off", 2)]["dev_loss"]   # the seeds differ
    assert isinstance(out["within_noise"], bool) and out["speed"] > 0
    assert os.path.isfile(tmp_path / "amp" / "quality-dtmt-cpu.json")


def test_bench_train_math_modes(tmp_path):
    """--math (gpu_session.sh's train-profile stage: the paper presets' throughput in strict fp32, TF32 and bf16, the
    ratios in one run): every pair in each mode, "× strict" the mode's tok/s over strict's of the same pair; bf16 runs
    the forward under autocast as `dtmt train --amp bf16` (its loss is not strict fp32's on the same batch), and tf32,
    a GPU mode, is refused on the CPU with a one-line error."""
    from benchmarks import bench_train
    from dtmt_models.data.batching import collate
    from dtmt_models.models.registry import build_model

    rows = bench_train.main(["--quick", "--systems", "rnnsearch-atr", "--fused", "cpp", "--math", "strict", "bf16",
                             "--out", str(tmp_path)])
    assert [(r["backend"], r["math"]) for r in rows] == [("cpp", "strict"), ("cpp", "bf16"), ("reference", "strict"),
                                                         ("reference", "bf16")]
    assert rows[0]["vs_strict"] is None and rows[1]["vs_strict"] == pytest.approx(rows[1]["tok_s"] / rows[0]["tok_s"])
    assert rows[1]["speedup"] == pytest.approx(rows[1]["tok_s"] / rows[3]["tok_s"])   # fused/ref within a mode
    assert [r["math"] for r in csv_rows(tmp_path / "bench_train.csv")] == ["strict", "bf16", "strict", "bf16"]
    batch = [tuple(t for t in collate(b)) for b in bench_train.synthetic_batches(1, 200, 50)][0]
    losses = {}
    for mode, autocast in (("strict", None), ("bf16", lambda: torch.autocast("cpu", dtype=torch.bfloat16))):
        torch.manual_seed(0)
        model = build_model("rnnsearch-atr", 50, 50, embed_dim=16, hidden_size=32)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        losses[mode] = float(bench_train.training_update(model, opt, *batch, autocast)[0])
    assert losses["strict"] != losses["bf16"] and losses["bf16"] == pytest.approx(losses["strict"], rel=0.05)
    with pytest.raises(SystemExit):
        bench_train.main(["--quick", "--systems", "rnnsearch-atr", "--math", "tf32", "--out", str(tmp_path)])


def test_bench_train_bucket_table(tmp_path):
    """--buckets: with steps of 1 every batch is its own shape unpadded (ratio exactly 1, buckets = the distinct
    (B, S, T)); coarser steps never make more buckets, and pad more."""
    from test_train import make_toy_corpus

    from benchmarks import bench_train
    from dtmt_models.data import binarized

    data = make_toy_corpus(tmp_path / "toy", n_train=300, n_dev=0, n_test=0)
    binarized.binarize(data, 60)
    exact, fine, coarse = bench_train.bucket_table(data, 60, 100, (200,), ((1, 1), (8, 8), (16, 16)))
    assert exact["padded_over_real"] == 1.0 and 1 < exact["buckets"] <= exact["batches"]
    assert exact["buckets"] >= fine["buckets"] >= coarse["buckets"] >= 1
    assert 1.0 < fine["padded_over_real"] <= coarse["padded_over_real"]


def test_bench_train_device_time_table():
    """bench_train's --profile on a GPU (gpu_session.sh's train-profile stage): the device kernels a profiler run
    recorded, graph replays' included, grouped by name with their calls, ms and share, the most device time first;
    CPU ops, copies and memsets left out. Events made by hand stand in for a CUDA run."""
    import types

    import torch

    from benchmarks import bench_train

    def event(name, kind, us, annotation=False):
        span = types.SimpleNamespace(elapsed_us=lambda: us)
        return types.SimpleNamespace(name=name, device_type=kind, time_range=span, is_user_annotation=annotation)

    cpu, gpu = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    prof = types.SimpleNamespace(events=lambda: [event("aten::mm", cpu, 500.0), event("gemm_kernel", gpu, 300.0),
                                                 event("step_kernel", gpu, 100.0), event("gemm_kernel", gpu, 300.0),
                                                 event("Memcpy HtoD (Pageable -> Device)", gpu, 50.0),
                                                 event("Optimizer.step#Adam.step", gpu, 400.0, annotation=True),
                                                 event("k" * 100 + "a", gpu, 1.0), event("k" * 100 + "b", gpu, 2.0)])
    assert bench_train.kernel_microseconds(prof) == 703.0   # (the annotation's range is no kernel)
    table = bench_train.device_time_table(prof, 5).splitlines()
    assert table[0].startswith("| kernel (4 names, 5 launches, 0.7 ms) |")
    assert table[2:4] == ["| `gemm_kernel` | 2 | 0.60 | 85.3% |", "| `step_kernel` | 1 | 0.10 | 14.2% |"]
    # two long names sharing their first 90 characters stay two rows
    assert table[4:] == [f"| `{'k' * 87}...` | 1 | 0.00 | 0.3% |", f"| `{'k' * 87}...` | 1 | 0.00 | 0.1% |"]


def test_bench_train_graphs_plumbing(tmp_path):
    """--graphs off on: each pair eager and graphed (the capture stood in for on the CPU), the ratio from one run."""
    from benchmarks import bench_train
    rows = bench_train.main(["--quick", "--systems", "rnnsearch-atr", "--fused", "cpp", "--graphs", "off", "on",
                             "--rounds", "2", "--out", str(tmp_path)])
    assert [(r["backend"], r["graphs"]) for r in rows] == [("cpp", "off"), ("cpp", "stand-in"), ("reference", "off"),
                                                            ("reference", "stand-in")]
    assert rows[1]["captured"] >= 1 and rows[0]["graphs_vs_eager"] is None and rows[0]["captured"] is None
    # --rounds 2: every round's row in the CSV (the second round in the reverse order); the medians of the rounds
    runs = csv_rows(tmp_path / "bench_train.csv")
    assert [(r["round"], r["backend"], r["graphs"]) for r in runs] == [
        ("1", "cpp", "off"), ("1", "cpp", "stand-in"), ("1", "reference", "off"), ("1", "reference", "stand-in"),
        ("2", "reference", "stand-in"), ("2", "reference", "off"), ("2", "cpp", "stand-in"), ("2", "cpp", "off")]
    tok = {(r["round"], r["backend"], r["graphs"]): float(r["tok_s"]) for r in runs}
    ratios = [tok[(n, "cpp", "off")] / tok[(n, "reference", "off")] for n in ("1", "2")]
    assert rows[0]["speedup"] == pytest.approx(sum(ratios) / 2) and rows[0]["speedup_range"] == (min(ratios),
                                                                                                  max(ratios))
    assert rows[0]["tok_s"] == pytest.approx((tok[("1", "cpp", "off")] + tok[("2", "cpp", "off")]) / 2)
    assert rows[1]["graphs_vs_eager"] == pytest.approx(sum(tok[(n, "cpp", "stand-in")] / tok[(n, "cpp", "off")]
                                                           for n in ("1", "2")) / 2)


def test_the_gpu_profile_runs_on_the_cpu(capsys):
    """gpu_profile.py's own code (layers, timing, the profiler's event sums, the table), on CPU tensors: on a GPU
    machine only the CUDA graph column and the kernel counts are new."""
    from benchmarks import gpu_profile
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    gpu_profile.main(["--device", "cpu", "--B", "2", "--H", "8", "--T", "3", "--repeat", "1"])
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert [(r[0].strip(), r[2].strip()) for r in rows] == [("GRU", "cpp"), ("GRU", "cuDNN"), ("DT", "cpp"),
                                                            ("ATR", "cpp")]
    assert all(float(r[3]) > 0 and r[5].strip() == "0" for r in rows)   # eager ms; no kernels on the CPU
    # the header names every side's math mode and the recurrence (issue 72 item 1: like for like, or said)
    gpu_profile.main(["--device", "cpu", "--B", "2", "--H", "8", "--T", "3", "--repeat", "1", "--kinds", "ATR",
                      "--math", "tf32"])
    head = capsys.readouterr().out.splitlines()[0]
    assert "TF32 allowed" in head and "DTMT_CUDA_RECURRENCE=" in head, head
    assert torch.backends.cudnn.allow_tf32 and torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags   # (as before, for the tests after)


def test_the_gpu_profile_fails_where_a_row_fails(capsys, monkeypatch):
    """A row that fails is said in the table, and the run's status is a failure (a review's: every row failing, as
    after a poisoned CUDA context, exited 0, and the session's stage stayed green)."""
    from benchmarks import gpu_profile

    def broken(kind, H, backend):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")
    monkeypatch.setattr(gpu_profile, "layer_for", broken)
    with pytest.raises(SystemExit, match=r"^gpu_profile: 2 row\(s\) failed \(said in the table\)$"):
        gpu_profile.main(["--device", "cpu", "--B", "2", "--H", "8", "--T", "3", "--repeat", "1", "--kinds", "GRU"])
    out = capsys.readouterr().out
    assert out.count("failed: RuntimeError: CUDA error: an illegal memory access was encountered |") == 2, out


def test_bench_decode_quick(tmp_path):
    from benchmarks import bench_decode
    rows = bench_decode.main(["--quick", "--systems", "rnnsearch-atr", "transformer", "--out", str(tmp_path)])
    assert len(rows) == 3 * 2 * 2                   # (systems + a size-matched transformer) x beams x batches
    # EOS is suppressed: every sentence decodes exactly tgt_len tokens
    assert all(r["words"] == 4 * 2 for r in rows)
    assert all(r["vs_transformer"] == 1.0 for r in rows if r["model"] == "transformer")
    atr = [r for r in rows if r["model"] == "rnnsearch-atr"]
    matched = [r for r in rows if r["model"] == atr[0]["matched"]]
    assert len(matched) == 4 and all(r["vs_matched"] == pytest.approx(r["words_per_s"] / m["words_per_s"])
                                     for r, m in zip(atr, matched))
    # the matched transformer is the one nearest in size: the widths 8 apart on either side are farther
    width = int(atr[0]["matched"].split("d")[-1])
    from dtmt_models.models.presets import get_preset
    base = get_preset("transformer", "small")["model"]

    def size(w):
        return bench_decode.count_params(dm.build_model("transformer", 100, 100, **dict(
            base, embed_dim=w, hidden_size=4 * w)))
    target = atr[0]["params"]
    assert abs(size(width) - target) <= min(abs(size(max(8, width - 8)) - target), abs(size(width + 8) - target))


def test_bench_decode_quick_keeps_the_options_given_with_it(tmp_path):
    """--quick sets the sizes not given: --sentences 3 and --tgt-len 6 with it were replaced by 2 and 4. And the
    "× transformer" column is the small preset's ratio only."""
    from benchmarks import bench_decode
    rows = bench_decode.main(["--quick", "--systems", "rnnsearch-atr", "--sentences", "3", "--tgt-len", "6",
                              "--beams", "1", "--out", str(tmp_path)])
    assert rows and all(r["words"] == 6 * 3 for r in rows)
    # without the transformer in --systems, no "× transformer" (it had been the size-matched one's ratio)
    assert any(r["matched"] for r in rows) and all(r["vs_transformer"] is None for r in rows)


def test_bench_decode_times_both_loops_in_one_run(tmp_path):
    """--loops host device: every model decoded by both beam-search loops in the same run (the GPU session's
    decode stage), the same words from both, the device loop's speed as a ratio to the host loop's."""
    from benchmarks import bench_decode
    rows = bench_decode.main(["--quick", "--systems", "rnnsearch-atr", "--no-match", "--loops", "host", "device",
                              "--out", str(tmp_path)])
    assert [(r["beam"], r["batch"], r["loop"]) for r in rows] == [
        (b, n, loop) for b in (1, 4) for n in ("1", "2") for loop in ("device", "host")]
    by = {(r["beam"], r["batch"], r["loop"]): r for r in rows}
    for r in rows:
        host = by[(r["beam"], r["batch"], "host")]
        assert r["words"] == host["words"] == 4 * 2
        if r["loop"] == "device":
            assert r["vs_host_loop"] == pytest.approx(r["words_per_s"] / host["words_per_s"])
        else:
            assert r["vs_host_loop"] is None
    table = bench_decode.main(["--quick", "--bookkeeping", "--loops", "host", "device"])
    assert [(r["beam"], r["batch"], r["loop"]) for r in table] == [
        (b, n, loop) for b in (1, 4) for n in (1, 2) for loop in ("host", "device")]


def test_bench_decode_bookkeeping_quick():
    from benchmarks import bench_decode
    rows = bench_decode.main(["--quick", "--bookkeeping"])
    assert [(r["beam"], r["batch"]) for r in rows] == [(1, 1), (1, 2), (4, 1), (4, 2)]
    assert all(r["ms_per_step"] > 0 for r in rows)


def test_bench_quality_quick(tmp_path, capsys):
    from test_train import make_toy_corpus

    from benchmarks import bench_quality
    data = make_toy_corpus(tmp_path / "toy", n_train=200, n_dev=10, n_test=10)
    rows = bench_quality.main(["--quick", "--systems", "dtmt", "rnnsearch-atr", "--data", data, "--budget", "3s",
                               "--valid-every", "20", "--out", str(tmp_path / "q"), "--parallel"])
    assert len(rows) == 2 and all(r["steps"] > 0 and 0 <= r["test_bleu"] <= 100 for r in rows)
    with open(os.path.join(tmp_path, "q", "bench_quality.md")) as f:
        table = f.read()
    assert "small presets with --vocab-size 60 --opt embed_dim=16" in table   # (said "small presets" alone)
    assert "| dtmt |" in table and "| rnnsearch-atr |" in table and \
        f"all trained at once on {max(1, (os.cpu_count() or 1) // 2)} thread(s) each" in table
    assert all(os.path.getsize(tmp_path / "q" / f"train_{s}.log") > 0 for s in ("dtmt", "rnnsearch-atr"))
    # parameters: each tensor once, however many state-dict entries share it (rnnsearch-atr ties its output
    # layer to the target embedding)
    for row in rows:
        state = torch.load(os.path.join(tmp_path, "q", row["system"], "best.pt"), weights_only=True)["model"]
        unique = {v.untyped_storage().data_ptr(): v.numel() for v in state.values() if v.is_floating_point()}
        assert row["params"] == sum(unique.values())
    assert rows[1]["params"] < sum(v.numel() for v in state.values())
    # --no-train evaluates the runs already there: same updates, same test BLEU (beam search is deterministic)
    again = bench_quality.main(["--quick", "--systems", "rnnsearch-atr", "--data", data, "--budget", "3s",
                                "--out", str(tmp_path / "q"), "--no-train"])
    assert again[0]["steps"] == rows[1]["steps"] and again[0]["test_bleu"] == pytest.approx(rows[1]["test_bleu"])
    with pytest.raises(SystemExit):
        bench_quality.main(["--quick", "--systems", "deeplau", "--data", data, "--out", str(tmp_path / "q"),
                            "--no-train"])
    # LABEL=SYSTEM ARGS: a preset variant with its own training arguments, in its own folder and row
    variant = bench_quality.main(["--quick", "--systems", "nodrop=rnnsearch-atr --opt dropout=0.0", "--data", data,
                                  "--budget", "2s", "--valid-every", "20", "--out", str(tmp_path / "v")])
    assert [r["system"] for r in variant] == ["nodrop"]
    with open(tmp_path / "v" / "nodrop" / "config.yaml") as f:
        assert "dropout: 0.0" in f.read()
    for bad in ("x=nosuchsystem", "dtmt --opt dropout=0.1"):
        with pytest.raises(SystemExit):
            bench_quality.main(["--quick", "--systems", bad, "--data", data, "--out", str(tmp_path / "v")])
    # refused in one line before anything is trained or written: a run already in --out (replaced without a word
    # by `dtmt train --overwrite`), a --data that is no corpus (a Bible was built there), options `dtmt evaluate`
    # refused once the whole budget was spent
    best = (tmp_path / "v" / "nodrop" / "best.pt").read_bytes()
    for flags, message in ((["--systems", "nodrop=rnnsearch-atr"], "already holds the run of nodrop; add --overwrite"),
                           (["--data", str(tmp_path / "typo")], "no corpus.json; make the corpus with `dtmt prepare`"),
                           (["--beam", "0"], "--beam 0: must be >= 1 and <= "), (["--budget", "0s"], "--budget 0: must"),
                           (["--valid-every", "0"], "--valid-every 0: must be >= 1"),
                           (["--budget", "soon"], "--budget: cannot read 'soon'")):
        args = ["--quick", "--systems", "other=rnnsearch-atr", "--data", data, "--budget", "2s", "--out",
                str(tmp_path / "v")]
        for i in range(0, len(flags), 2):
            at = args.index(flags[i]) if flags[i] in args else None
            if at is None:
                args += flags[i:i + 2]
            else:
                args[at + 1] = flags[i + 1]
        with pytest.raises(SystemExit):
            bench_quality.main(args)
        assert message in capsys.readouterr().err, flags
        assert not (tmp_path / "v" / "other").exists() and not (tmp_path / "typo").exists()
    assert (tmp_path / "v" / "nodrop" / "best.pt").read_bytes() == best


@pytest.mark.skipif("cpp" not in dk.available_backends(), reason="C++ extension not built")
def test_bench_attention_quick(tmp_path):
    from benchmarks import bench_attention
    rows = bench_attention.main(["--quick", "--out", str(tmp_path)])
    assert [r["backend"] for r in rows] == ["reference", "cpp"]
    assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["saved_KB"] > 0 for r in rows)
    # the fused scores keep nothing beyond their inputs: the reference keeps the tanh output [B, S, A] too
    assert rows[1]["saved_KB"] < rows[0]["saved_KB"]
    assert os.path.isfile(os.path.join(tmp_path, "bench_attention.csv"))


def test_bench_gemm_runs():
    from benchmarks import bench_gemm
    rows = bench_gemm.main(["--shapes", "4x8x16", "--threads", "1", "--inner", "2", "--repeat", "1"])
    assert [r["shape"] for r in rows] == ["4x8x16"] and rows[0]["gflops"] > 0 and rows[0]["wgrad_gflops"] > 0
    # the weight read rate is the GEMM's time over the weight's bytes
    assert rows[0]["weight_gbs"] == pytest.approx(rows[0]["gflops"] * 4 * 8 * 16 / (2 * 4 * 8 * 16))
    cold = bench_gemm.main(["--shapes", "4x8x16", "--threads", "1", "--inner", "2", "--repeat", "1", "--cold"])
    assert cold[0]["read_gbs"] > 0


def test_bench_amp_gemm_attention_refuse_bad_counts_before_running(tmp_path, capsys):
    """bench_amp's, bench_gemm's and bench_attention's counts (and bench_amp's system), each refused in one line
    before anything runs: bench_amp --rounds 0 / --batches 0 were IndexErrors after the GEMMs had been timed,
    --src-len 1 drew empty sentences, --model nope a traceback; bench_gemm and bench_attention --repeat 0 an empty
    median, --threads 0 torch's error."""
    from benchmarks import bench_amp, bench_attention, bench_gemm

    for main, flags, message in (
            (bench_amp.main, ["--rounds", "0"], "--rounds 0: must be >= 1"),
            (bench_amp.main, ["--batches", "0"], "--batches 0: must be >= 1"),
            (bench_amp.main, ["--src-len", "1"], "--src-len 1: must be >= 2"),
            (bench_amp.main, ["--model", "nope"], "--model nope: unknown model 'nope'"),
            (bench_gemm.main, ["--repeat", "0"], "--repeat 0: must be >= 1"),
            (bench_gemm.main, ["--threads", "1", "0"], "--threads 0: must be >= 1"),
            (bench_gemm.main, ["--shapes", "4x8x16", "foo"], "--shapes: expected MxKxN of positive integers, e.g. "
                                                              "50x512x1024, got 'foo'"),   # (a traceback, mid-run)
            (bench_gemm.main, ["--shapes", "4x0x16"], "got '4x0x16'"),
            (bench_attention.main, ["--repeat", "0"], "--repeat 0: must be >= 1")):
        extra = ["--out", str(tmp_path / "o")] if main is not bench_gemm.main else []
        with pytest.raises(SystemExit) as info:
            main([*flags, *extra])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, flags
    assert not (tmp_path / "o").exists()


def test_the_other_benchmarks_refuse_bad_counts_before_running(tmp_path, capsys):
    """The counts of bench_serve, bench_peers, bench_persistent, bench_portable, bench_small_rows, bench_data,
    bench_op_checks, bench_step_phases and bench_pages, each refused in one line (exit 2) before anything runs or is
    written: they were tracebacks (bench_data --sizes 1x, --processes a), empty medians (--rounds 0), a zero-client
    load (bench_serve --clients 0), a search's own error (--beam 0) or nothing at all (bench_op_checks --calls 0)."""
    from benchmarks import (bench_data, bench_op_checks, bench_pages, bench_peers, bench_persistent, bench_portable,
                            bench_serve, bench_small_rows, bench_step_phases)

    out = str(tmp_path / "o")
    for main, flags, message in (
            (bench_serve.main, ["--clients", "0"], "--clients 0: must be >= 1"),
            (bench_serve.main, ["--beam", "0"], "--beam 0: must be >= 1 and <= 1024"),
            (bench_serve.main, ["--timeout", "-1"], "--timeout -1.0: must be >= 0"),
            (bench_peers.main, ["--beam", "0", "--out", out], "--beam 0: must be >= 1 and <= 1024"),
            (bench_peers.main, ["--valid-every", "0", "--out", out], "--valid-every 0: must be >= 1"),
            (bench_persistent.main, ["--B", "8", "0"], "--B 0: must be >= 1"),
            (bench_persistent.main, ["--repeat", "0"], "--repeat 0: must be >= 1"),
            (bench_portable.main, ["--rounds", "0", "--out", out], "--rounds 0: must be >= 1"),
            (bench_small_rows.main, ["--passes", "0", "--out", out], "--passes 0: must be >= 1"),
            (bench_data.main, ["--sizes", "1x", "--out", out], "--sizes: bad size '1x'"),
            (bench_data.main, ["--sizes", "0", "--out", out], "--sizes 0: every size must be at least 1 pair"),
            (bench_data.main, ["--processes", "a", "--out", out], "--processes takes whole numbers"),
            (bench_data.main, ["--steps", "0", "--out", out], "--steps 0: must be >= 1"),
            (bench_op_checks.main, ["--calls", "0", "--out", out], "--calls 0: must be >= 1"),
            (bench_step_phases.main, ["--beam", "0", "--out", out], "--beam 0: must be >= 1 and <= 1024"),
            (bench_pages.main, ["--threads", "0"], "--threads 0: must be >= 1")):
        with pytest.raises(SystemExit) as info:
            main(flags)
        assert info.value.code == 2, flags
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (flags, err)
    assert not (tmp_path / "o").exists()


def test_bench_peers_parts_that_need_no_peer(tmp_path):
    """The peer's subwords are dtmt train's (same SentencePiece model, same filtered pairs), and the runner's
    learning-rate multiplier is dtmt's RNMT+ schedule. (The peer itself is never installed in CI.)"""
    from test_train import make_toy_corpus

    from benchmarks import bench_peers
    from benchmarks.peers.onmt_train import rnmt_multiplier
    from dtmt_models.data.corpus import corpus_paths, filter_by_length, read_parallel
    from dtmt_models.training.schedules import RNMTPlusSchedule
    from dtmt_models.data.vocabulary import Vocabulary

    ours = RNMTPlusSchedule(200, 1500, 6000, n=1, floor=0.05)
    theirs = rnmt_multiplier(200, 1500, 6000, 0.05)
    for step in (0, 1, 199, 1500, 1501, 3000, 6000, 20000):
        assert theirs(step + 1) == pytest.approx(ours(step))   # OpenNMT-py counts from 1, LambdaLR from 0
    data = make_toy_corpus(tmp_path / "toy", n_train=300, n_dev=10, n_test=12)
    pieces = bench_peers.write_pieces(data, str(tmp_path / "pieces"), 60, 6, str(tmp_path / "log"))
    pairs = read_parallel(*corpus_paths(data, "train"))
    vocab = [Vocabulary.train([p[i] for p in pairs], 60, "bpe") for i in (0, 1)]
    assert [v.proto for v in vocab] == [v.proto for v in pieces["vocabs"]]
    kept, dropped = filter_by_length([(vocab[0].encode(s), vocab[1].encode(t)) for s, t in pairs], 6)
    assert dropped > 0 and pieces["paths"][("train", "n")] == len(kept)
    with open(pieces["paths"][("train", "en")], encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert [vocab[1].sp.piece_to_id(line.split()) for line in lines] == [t for _, t in kept]
    assert pieces["paths"][("test", "n")] == 12
    cfg = bench_peers.onmt_config(str(tmp_path / "onmt"), pieces, dict(seed=1, smoothing=0.1, lr=2e-3, clip=1.0,
                                                                       max_tokens=2000),
                                  dict(embed_dim=128, hidden_size=256, dropout=0.2, valid_every=250))
    with open(cfg) as f:
        text = f.read()
    for line in ("encoder_type: brnn", "rnn_type: LSTM", "input_feed: 1", "batch_size: 2000", "learning_rate: 0.002",
                 "label_smoothing: 0.1", "max_grad_norm: 1.0"):
        assert line in text, line
    cfg = bench_peers.onmt_config(str(tmp_path / "onmt-t"), pieces, dict(seed=1, smoothing=0.1, lr=2e-3, clip=1.0,
                                                                         max_tokens=2000),
                                  dict(hidden_size=256, ff=1024, layers=2, heads=4, warmup=4000, valid_every=250),
                                  "transformer")
    with open(cfg) as f:
        text = f.read().splitlines()
    for line in ("encoder_type: transformer", "decoder_type: transformer", "hidden_size: 256", "word_vec_size: 256",
                 "transformer_ff: 1024", "enc_layers: 2", "dec_layers: 2", "heads: 4", "decay_method: noam",
                 "learning_rate: 2", "warmup_steps: 4000", "max_grad_norm: 0", "param_init_glorot: true",
                 "share_decoder_embeddings: true", "batch_size: 2000", "label_smoothing: 0.1", "adam_beta2: 0.998"):
        assert line in text, line
    assert not any(line.startswith(("rnn_type", "input_feed", "global_attention")) for line in text)


def test_bench_peers_sizes_rates_and_batches(tmp_path):
    """The LSTM's parameter count is OpenNMT-py 3.5.1's own report for its run of 2026-11-29 (4,035,368 at 128/256
    with build_vocab files of 3,913 and 3,872 pieces), so `--onmt-size match` sizes it by the count OpenNMT-py will
    print; dtmt's count comes from the model built on the meta device, equal to the one built for real; the rate in
    the budget's second half is the tokens between its first and last log point over the time between them;
    CTranslate2's two CPU backends are its default and the one CT2_USE_MKL forces, by the CPU's vendor."""
    from benchmarks import bench_peers
    from dtmt_models.models.presets import get_preset
    from dtmt_models.models.registry import build_model

    assert bench_peers.onmt_lstm_params(128, 256, 3920, 3880) == 4_035_368
    # build_vocab's files: the specials not among the pieces are added, then the size rounded up to 8
    for pieces, specials, size in ((3913, [], 3920), (3872, [], 3880), (3916, [], 3920), (3917, [], 3928),
                                   (3917, ["<unk>"], 3920), (3917, ["<unk>", "</s>"], 3920)):
        vocab = tmp_path / f"vocab.{pieces}.{len(specials)}"
        vocab.write_text("".join(f"{p}\t{9}\n" for p in specials + [f"p{i}" for i in range(pieces - len(specials))]))
        assert bench_peers.onmt_vocab_size(str(vocab)) == size
    assert bench_peers.matched_lstm_size(4_035_368, 128, 3920, 3880) == 256
    small = bench_peers.dtmt_params_for("dtmt", "small", 4000, 3990)
    torch.manual_seed(0)
    assert small == sum(p.numel() for p in build_model("dtmt", 4000, 3990, **get_preset("dtmt", "small")["model"])
                        .parameters())
    hid = bench_peers.matched_lstm_size(small, 128, 3920, 3880)
    assert hid == 316 and abs(bench_peers.onmt_lstm_params(128, hid, 3920, 3880) - small) < 0.01 * small
    for h in (hid - 2, hid + 2):   # the nearest even size
        assert (abs(bench_peers.onmt_lstm_params(128, h, 3920, 3880) - small)
                >= abs(bench_peers.onmt_lstm_params(128, hid, 3920, 3880) - small))
    points = [(10.0, 100), (40.0, 1000), (60.0, 1600), (90.0, 2500), (118.0, 3340)]
    assert bench_peers.steady_rate(points, 120.0) == pytest.approx((3340 - 1600) / (118.0 - 60.0))
    assert bench_peers.steady_rate(points[:3], 120.0) is None          # one point in the second half
    assert bench_peers.decode_batch("2000") == (2000, "tokens") and bench_peers.decode_batch("64s") == (64, "sents")
    # CTranslate2's two CPU backends: its default (MKL on an Intel CPU only) and the other, forced by CT2_USE_MKL
    assert bench_peers.ct2_backends("GenuineIntel") == [("default backend (MKL)", {}),
                                                        ("CT2_USE_MKL=0", {"CT2_USE_MKL": "0"})]
    assert bench_peers.ct2_backends("AuthenticAMD") == [("default backend (not MKL)", {}),
                                                        ("CT2_USE_MKL=1", {"CT2_USE_MKL": "1"})]
    assert bench_peers.cpu_vendor() in ("GenuineIntel", "AuthenticAMD", "")
    for bad in ("0", "64x", "s", "-3"):
        with pytest.raises(ValueError, match="--decode-batch"):
            bench_peers.decode_batch(bad)
    # strict_fp32.py runs a module or a script as `python -m` / `python SCRIPT` would (imports from the working
    # directory, or from the script's folder), with TF32 off for cuBLAS and cuDNN
    (tmp_path / "here_only.py").write_text("import sys, torch\nprint(__name__, sys.argv[1:], "
                                           "torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)\n")
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "beside.py").write_text("VALUE = 7\n")
    (tmp_path / "s" / "script.py").write_text("import beside\nprint(beside.VALUE)\nraise SystemExit(3)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runner = os.path.join(root, "benchmarks", "peers", "strict_fp32.py")
    r = subprocess.run([sys.executable, runner, "-m", "here_only", "a", "b"], cwd=tmp_path, capture_output=True,
                       text=True)
    assert r.returncode == 0 and r.stdout.split() == ["__main__", "['a',", "'b']", "False", "False"], r.stderr
    r = subprocess.run([sys.executable, runner, str(tmp_path / "s" / "script.py")], cwd=root, capture_output=True,
                       text=True)
    assert r.returncode == 3 and r.stdout.strip() == "7", r.stderr


def test_bench_peers_carry_decodes_elsewhere(tmp_path):
    """--carry gathers what decoding runs on another machine needs: dtmt's checkpoint as it is with its trained
    tokens and updates, OpenNMT-py's checkpoint without its optimizer state, the SentencePiece models and test
    pieces, which a later run reuses instead of training them again; `--no-train` on the carried folder then
    tabulates the run as trained (its record, tokens/s and updates) and decodes it, in batches of sentences, to the
    translations `dtmt translate` gives with its default batches."""
    import argparse

    from test_train import TINY, make_toy_corpus, run_train

    from benchmarks import bench_peers
    from benchmarks.bench_quality import read_log
    from dtmt_models.models.presets import get_preset

    data = make_toy_corpus(tmp_path / "toy", n_train=300, n_dev=10, n_test=12)
    runs = tmp_path / "runs"
    r = run_train(["--data", data, "--out", str(runs / "dtmt"), "--max-steps", "30", "--log-every", "10",
                   "--valid-every", "15", *TINY])
    assert r.returncode == 0, r.stderr
    setting = dict(threads=1, budget_s=60.0, sequential=False, valid_every=15, clock=bench_peers.CLOCK)
    bench_peers.write_record(str(runs / "dtmt"), dict(setting, train_args="", preset="small", device="cpu"))
    log = str(tmp_path / "log")
    cfg = dict(get_preset("dtmt", "small")["train"])
    pieces = bench_peers.write_pieces(data, str(runs / "pieces"), cfg["vocab_size"], cfg["max_len"], log)
    onmt = runs / "onmt-lstm"
    onmt.mkdir()
    with open(onmt / "train.jsonl", "w") as f:
        for row in ({"kind": "valid", "step": 10, "wall_s": 5.0, "dev_loss": 3.0},
                    {"kind": "valid", "step": 20, "wall_s": 9.0, "dev_loss": 2.5},
                    {"kind": "end", "step": 24, "wall_s": 60.0, "tokens": 5000}):
            f.write(json.dumps(row) + "\n")
    for step in (10, 20, 24):
        torch.save({"model": {"w": torch.full((3,), float(step))}, "vocab": {"src": ["a"]}, "opt": argparse.Namespace(
            layers=2), "optim": {"state": torch.zeros(1000)}}, onmt / f"model_step_{step}.pt")
    a = argparse.Namespace(out=str(runs), carry=str(tmp_path / "carry"), systems=["dtmt", "onmt-lstm"],
                           checkpoints=["best"], data=data, preset="small")
    # pieces written before pieces.json was are described from their files as write_pieces describes them
    with open(runs / "pieces" / "pieces.json") as f:
        written = json.load(f)
    os.rename(runs / "pieces" / "pieces.json", tmp_path / "pieces.json")
    bench_peers.write_carry(a, log, wheels=False)
    os.rename(tmp_path / "pieces.json", runs / "pieces" / "pieces.json")
    carried = tmp_path / "carry" / "peers"
    with open(carried / "pieces" / "pieces.json") as f:
        described = json.load(f)
    assert described == dict(written, paths=[p for p in written["paths"] if p[0] == "test" or p[1] == "n"])
    sizes = bench_peers.write_carry(a, log, wheels=False)
    assert sorted(os.listdir(carried / "onmt-lstm")) == ["model_step_20.pt", "train.jsonl"]   # the lowest dev loss
    ck = torch.load(carried / "onmt-lstm" / "model_step_20.pt", weights_only=False)
    assert "optim" not in ck and ck["opt"].layers == 2 and torch.equal(ck["model"]["w"], torch.full((3,), 20.0))
    assert sorted(os.listdir(carried / "dtmt")) == ["bench_peers_machine.json", "best.pt", "config.yaml",
                                                    "train_log.csv", "trained.json"]
    with open(runs / "dtmt" / "best.pt", "rb") as f, open(carried / "dtmt" / "best.pt", "rb") as g:
        assert f.read() == g.read()
    rows = [r for r in read_log(str(runs / "dtmt" / "train_log.csv")) if r["kind"] == "train"]
    tokens, updates = bench_peers.dtmt_trained(str(runs / "dtmt"), rows)
    assert updates == 30 and bench_peers.dtmt_trained(str(carried / "dtmt"), rows) == (tokens, updates)
    again = bench_peers.read_pieces(str(carried / "pieces"), cfg["vocab_size"], cfg["max_len"], data)
    assert [v.proto for v in again["vocabs"]] == [v.proto for v in pieces["vocabs"]]
    assert again["paths"][("train", "n")] == pieces["paths"][("train", "n")] and ("train", "en") not in again["paths"]
    with open(again["paths"][("test", "es")]) as f, open(pieces["paths"][("test", "es")]) as g:
        assert f.read() == g.read()
    assert sum(sizes.values()) == sum(os.path.getsize(p) for p in sizes) and len(sizes) == 12
    assert bench_peers.read_pieces(str(carried / "pieces"), 8000, cfg["max_len"], data) is None   # other settings
    other = make_toy_corpus(tmp_path / "other", n_train=200, n_dev=10, n_test=12, seed=1)
    assert bench_peers.read_pieces(str(carried / "pieces"), cfg["vocab_size"], cfg["max_len"], other) is None
    table = bench_peers.main(["--no-train", "--systems", "dtmt", "--checkpoints", "best", "--decode-batch", "5s",
                              "--data", data, "--out", str(carried), "--budget", "60s", "--threads", "1",
                              "--valid-every", "15"])
    best, trained = table
    assert best["checkpoint"] == bench_peers.CHECKPOINT_RULES["best"] and 0 <= best["bleu"] <= 100
    assert trained["checkpoint"] == "trained, not decoded" and trained.get("bleu") is None
    assert trained["tok_s"] == pytest.approx(tokens / 60.0) and trained["updates"] == 30
    ref = str(tmp_path / "ref.hyp")
    bench_peers.dtmt_translate(str(runs / "dtmt" / "best.pt"), os.path.join(data, "test.es"), ref, 4, 1, log)
    with open(ref) as f, open(carried / "dtmt" / "test_best.hyp") as g:
        assert f.read() == g.read()
    with open(carried / "bench_peers.md") as f:
        text = f.read()
    assert "batches of 5 sentences" in text and "| trained, not decoded, update 30 |" in text


def test_bench_peers_stops_each_run_by_one_wall_clock(tmp_path):
    """stop_at_budget sends SIGTERM once a run's budget of wall time since its launch is spent (start-up, data
    reading and validation inside it); `dtmt train` then finishes its update, writes last.pt and exits with 143, and
    dtmt_trained counts every target token it trained, the window after its last log row included: the tokens of a
    run of as many updates that logs every update. A run that ends before its budget is an error."""
    import time

    from test_train import TINY, make_toy_corpus, run_train

    from benchmarks import bench_peers, bench_quality

    data = make_toy_corpus(tmp_path / "toy")
    out = str(tmp_path / "run")
    cmd = ["train", "--data", data, "--out", out, "--max-steps", str(10 ** 9), "--log-every", "7",
           "--valid-every", "40", *TINY]
    job = (*bench_quality.start(cmd, str(tmp_path / "train.log")), time.perf_counter())
    bench_peers.stop_at_budget([job], 15.0)
    assert job[0].returncode == 143 and time.perf_counter() - job[3] >= 15.0
    with open(os.path.join(out, "train_log.csv"), newline="") as f:
        rows = [row for row in csv.DictReader(f) if row["kind"] == "train"]
    tokens, updates = bench_peers.dtmt_trained(out, rows)
    assert updates >= 8
    ref = str(tmp_path / "ref")
    r = run_train(["--data", data, "--out", ref, "--max-steps", str(updates), "--log-every", "1", "--valid-every",
                   "40", *TINY])
    assert r.returncode == 0, r.stderr
    with open(os.path.join(ref, "train_log.csv"), newline="") as f:
        assert tokens == sum(int(row["tokens"]) for row in csv.DictReader(f) if row["kind"] == "train")
    early = (subprocess.Popen([sys.executable, "-c", "pass"]), ["python", "-c", "pass"], "its log", time.perf_counter())
    with pytest.raises(RuntimeError, match="ended before its budget"):
        bench_peers.stop_at_budget([early], 60.0)


def test_bench_peers_tabulates_only_runs_of_one_machine_and_setting(tmp_path):
    """Runs trained in separate invocations (a 2-hour budget per system) are tabulated together only when their
    records name the same machine and setting; the record is the machine's real /proc/cpuinfo identity."""
    from benchmarks import bench_peers
    from benchmarks.common import ISA_FLAGS, machine_record

    rec = machine_record()
    assert rec["cores"] == os.cpu_count() and set(rec["isa"]) <= set(ISA_FLAGS)
    if os.path.isfile("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            text = f.read()
        assert rec["model name"] in text and rec["vendor_id"] in text
    setting = dict(threads=2, budget_s=7200.0, sequential=True, valid_every=250, clock=bench_peers.CLOCK)
    runs = {}
    for name in ("dtmt", "onmt-lstm"):
        runs[name] = tmp_path / name
        runs[name].mkdir()
        bench_peers.write_record(str(runs[name]), setting)
    records = {n: bench_peers.read_record(str(d)) for n, d in runs.items()}
    assert records["dtmt"]["machine"] == rec and records["dtmt"]["threads"] == 2
    assert bench_peers.check_records(records) == records["dtmt"]["machine_name"]
    assert bench_peers.apart_line(records) == []       # same day, same commit: trained together
    other = dict(records["onmt-lstm"], date="2026-12-01 09:00", commit="abc1234")
    assert bench_peers.apart_line({"dtmt": records["dtmt"], "onmt-lstm": other})[0].startswith(
        "Trained separately: dtmt ")
    cpu = dict(records["onmt-lstm"], machine=dict(rec, model="143", isa=["avx2", "fma"]))
    with pytest.raises(SystemExit, match="different machines"):
        bench_peers.check_records({"dtmt": records["dtmt"], "onmt-lstm": cpu})
    threads = dict(records["onmt-lstm"], threads=1)
    with pytest.raises(SystemExit, match=r"settings \(threads\)"):
        bench_peers.check_records({"dtmt": records["dtmt"], "onmt-lstm": threads})
    older = {k: v for k, v in records["onmt-lstm"].items() if k != "clock"}   # a run timed by the earlier clock
    with pytest.raises(SystemExit, match=r"settings \(clock\)"):
        bench_peers.check_records({"dtmt": records["dtmt"], "onmt-lstm": older})
    with pytest.raises(SystemExit, match="onmt-lstm has no bench_peers_machine.json"):
        bench_peers.check_records({"dtmt": records["dtmt"], "onmt-lstm": None})
    assert bench_peers.check_records({"dtmt": None, "onmt-lstm": None}) is None   # runs older than records
    # a record made before `device` and `preset` were recorded trained on the CPU with the small preset
    assert bench_peers.check_records({"dtmt": records["dtmt"], "onmt-lstm": dict(records["dtmt"], device="cpu",
                                                                                 preset="small")})
    with pytest.raises(SystemExit, match=r"different settings \(device\)"):
        bench_peers.check_records({"dtmt": records["dtmt"], "onmt-lstm": dict(records["dtmt"], device="cuda")})
    # the speed probes: a real one, then records whose probes say the machine ran at different speeds
    assert 0 < bench_peers.speed_probe(1, seconds=0.5) < 1e5
    assert bench_peers.probe_lines(records) == []                                  # no probes recorded
    slow, fast = dict(records["dtmt"], probe=[100.0, 96.0]), dict(other, probe=[120.0, 121.0])
    lines = bench_peers.probe_lines({"dtmt": slow, "onmt-lstm": fast})
    assert "dtmt 100.0 → 96.0; onmt-lstm 120.0 → 121.0" in lines[0]
    assert "1.23× as fast during onmt-lstm's training as during dtmt's" in lines[1]
    near = dict(other, probe=[101.0, 100.0])
    assert len(bench_peers.probe_lines({"dtmt": slow, "onmt-lstm": near})) == 2     # within 5%: no warning
    # one run whose own probes drifted apart (a 2-hour run's, 230.5 → 109.3: docs/design/training.md, "Speed probes
    # for runs trained apart"), beside a steady run of the same mean speed
    drift, steady = dict(records["dtmt"], probe=[230.5, 109.3]), dict(other, probe=[171.5, 168.0])
    lines = bench_peers.probe_lines({"dtmt": drift, "onmt-lstm": steady})
    assert "changed speed during dtmt's training (230.5 → 109.3 GFLOP/s, 0.47×)" in lines[1]
    assert len(lines) == 3 and "as fast during" not in " ".join(lines)           # equal means: no pair warning
    assert "Not probed (trained before the probe): onmt-lstm" in bench_peers.probe_lines(
        {"dtmt": slow, "onmt-lstm": records["onmt-lstm"]})[1]
    with pytest.raises(SystemExit):
        bench_peers.main(["--no-train", "--no-eval", "--systems", "dtmt", "--out", str(tmp_path)])


def test_dtmt_bench_finds_the_scripts_of_a_checkout_or_says_where_they_are(tmp_path, monkeypatch, capsys):
    """An editable install finds benchmarks/ next to the package; a regular install (no checkout next to the
    package) finds the current directory's; elsewhere the command says what it needs."""
    from dtmt_models.cli import bench

    assert "cells" in bench.available()                       # editable: next to the package
    monkeypatch.setattr(bench, "ROOT", str(tmp_path / "site-packages"))
    monkeypatch.chdir(tmp_path)
    assert bench.available() == []
    assert bench.main(["--help"]) == 0 and "source checkout" in capsys.readouterr().out
    assert bench.main([]) == 2 and "source checkout" in capsys.readouterr().err   # no NAME: a usage error
    assert bench.main(["cells"]) == 2 and "source checkout" in capsys.readouterr().err
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the checkout
    assert "cells" in bench.available()
    # a script's refusal (SystemExit with a message) reaches the user, as when the script runs by itself
    assert bench.main(["pages", "--checkpoint", str(tmp_path / "none.pt"), "--chunk", "0"]) == 2
    assert "--chunk 0: must be >= 1" in capsys.readouterr().err
    main_module = sys.modules.get("__main__")
    assert bench.main(["pages", "--no-such-option"]) == 2   # its usage names the command typed, not the script
    assert "dtmt bench pages: error: unrecognized arguments: --no-such-option" in capsys.readouterr().err
    assert sys.argv[0] != "dtmt bench pages" and sys.modules.get("__main__") is main_module   # both restored
    # a script's --help says what a run without options does (its docstring whole: it gave the first line, and
    # `dtmt bench quality` trains every system for 10 minutes each)
    assert bench.main(["quality", "--help"]) == 0
    assert "# all systems, 10 min each, Bible" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["x"])
    script = tmp_path / "benchmarks" / "bench_refuses.py"
    script.parent.mkdir()
    (script.parent / "bench_cells.py").write_text("")
    script.write_text("raise SystemExit('bench_refuses: no such thing here')\n")
    monkeypatch.chdir(tmp_path)
    assert bench.main(["refuses"]) == 1 and "bench_refuses: no such thing here" in capsys.readouterr().err


def test_dtmt_bench_list_says_what_each_measures(tmp_path, monkeypatch, capsys):
    """`dtmt bench --list`: every benchmark of the checkout, one a line, with the first paragraph of its docstring
    (read, not run: a script with side effects at import runs nothing); none found: one line, exit 2."""
    from dtmt_models.cli import bench

    assert bench.main(["--list", "extra"]) == 2   # (it was ignored)
    assert capsys.readouterr().err == "dtmt bench: --list takes nothing more (got extra)\n"
    assert bench.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == bench.available() and len(lines) >= 15
    listed = dict(line.split(None, 1) for line in lines)
    assert listed["decode"] == "Decoding speed: words/s and ms per sentence, beam 1 and beam 4, batch 1 and batched, every system."
    assert listed["persistent"].startswith("The persistent launches (issue 72;") and listed["persistent"].endswith(" ...")
    folder = tmp_path / "benchmarks"
    folder.mkdir()
    (folder / "bench_cells.py").write_text('"""Cells."""\n')
    (folder / "bench_boom.py").write_text('raise SystemExit("ran")\n')   # no docstring, and must not run
    monkeypatch.setattr(bench, "ROOT", str(tmp_path / "site-packages"))
    monkeypatch.chdir(tmp_path)
    assert bench.main(["--list"]) == 0
    assert capsys.readouterr().out.splitlines() == ["boom   (no description)", "cells  Cells."]
    monkeypatch.chdir(tmp_path / "site-packages" if (tmp_path / "site-packages").exists() else "/")
    assert bench.main(["--list"]) == 2 and "source checkout" in capsys.readouterr().err


def test_bench_serve_quick(tmp_path):
    """The load test end to end at toy size: a real server, 6 concurrent clients, every request answered with
    `translate`'s translation (the benchmark counts any other answer as lost)."""
    pytest.importorskip("aiohttp")
    from benchmarks import bench_serve

    assert bench_serve.percentile([3, 1, 2, 4], 50) == pytest.approx(2.5)
    assert bench_serve.percentile([1, 2, 3, 4, 5], 100) == 5 and bench_serve.percentile([7], 99) == 7
    ckpt, data = tiny_checkpoint(tmp_path, "rnnsearch-atr", n_test=24, embed_dim=8, hidden_size=8, dropout=0.0)
    row = bench_serve.main(["--checkpoint", ckpt, "--data", data, "--clients", "6", "--threads", "1",
                            "--beam", "2", "--out", str(tmp_path / "out")])
    assert row["sent"] == row["answered"] == 24 and row["lost"] == 0 and row["server_exit"] == 0
    assert row["sentences_per_s"] > 0 and 0 < row["p50_ms"] <= row["p99_ms"] <= row["max_ms"]
    assert 1 <= row["batches"] <= 24
    with open(tmp_path / "out" / "bench_serve.md") as f:
        assert "| 6 | 24 | 24 | 0 |" in f.read()


def test_bench_pages_quick(tmp_path):
    """The decoder-option timer: with the weights in 2 MiB pages or not, both decoders translate the toy test set
    alike, one sentence a call and in chunks; --option step_tables times that option's two decoders, --option
    table_pages the previous token's tables in either kind of page, --option nbest_stop one decoder's search with
    either stopping rule; context_table, encoder_panels, source_tables and fold each time a decoder with it
    against one without."""
    from benchmarks import bench_pages

    ckpt, data = tiny_checkpoint(tmp_path, "dtmt", embed_dim=8, hidden_size=8, heads=2, dropout=0.0)
    for chunk in ("1", "3"):
        seconds, differ = bench_pages.main(["--checkpoint", ckpt, "--data", data, "--chunk", chunk])
        assert differ == 0 and all(s > 0 for s in seconds.values()) and len(seconds) == 2
    seconds, differ = bench_pages.main(["--checkpoint", ckpt, "--data", data, "--option", "step_tables"])
    assert list(seconds) == ["step_tables=True", "step_tables=False"] and all(s > 0 for s in seconds.values())
    # the previous token's tables in 2 MiB pages or 4 KiB ones: the same values, so the same translations
    seconds, differ = bench_pages.main(["--checkpoint", ckpt, "--data", data, "--option", "table_pages"])
    assert list(seconds) == ["2 MiB pages", "4 KiB pages"] and differ == 0
    # the stopping rule against the one translation written or the beam's worst: the same best translations
    seconds, differ = bench_pages.main(["--checkpoint", ckpt, "--data", data, "--option", "nbest_stop"])
    assert list(seconds) == ["nbest 1", "nbest 4"] and differ == 0
    # the constructor options and the context table: two decoders, on and off (their sums may round otherwise)
    for option in ("context_table", "encoder_panels", "source_tables", "fold"):
        seconds, differ = bench_pages.main(["--checkpoint", ckpt, "--data", data, "--option", option])
        assert list(seconds) == [f"{option}=True", f"{option}=False"] and all(s > 0 for s in seconds.values())
    with pytest.raises(SystemExit):
        bench_pages.main(["--checkpoint", ckpt, "--data", data, "--chunk", "0"])


def test_bench_data_quick(tmp_path):
    """bench_data on a toy corpus: the synthetic corpus is what it says, prepare and a 2-update run are measured."""
    from test_train import make_toy_corpus

    from benchmarks import bench_data
    from dtmt_models.data.corpus import read_parallel

    data = make_toy_corpus(tmp_path / "toy", n_train=50, n_dev=25, n_test=0)
    out = str(tmp_path / "out")
    src, tgt, dev_src, _ = bench_data.generate(data, 300, os.path.join(out, "gen"))
    pairs = read_parallel(src, tgt)
    train = set(read_parallel(os.path.join(data, "train.es"), os.path.join(data, "train.en")))
    assert len(pairs) == 300 and len(read_parallel(dev_src, dev_src)) == 20
    for s, t in pairs[:20]:   # two training pairs glued, side by side
        assert any(s.startswith(a + " ") and t.startswith(b + " ") and (s[len(a) + 1:], t[len(b) + 1:]) in train
                   for a, b in train)
    assert bench_data.main(["--data", data, "--sizes", "300", "--processes", "1", "--steps", "2", "--out", out]) == 0
    with open(os.path.join(out, "bench_data.json")) as f:
        row = json.load(f)["rows"][0]
    assert row["pairs"] == 300 and row["prepare_s"] > 0 and row["prepare_rss_main_mib"] > 10
    run = row["train"]["1"]
    assert len(run["rss_per_process_mib"]) == 1 and run["rss_per_process_mib"][0] > 100
    assert 0 < run["first_update_s"] < run["wall_s"]
    with open(os.path.join(out, "bench_data.md")) as f:
        assert "| 300 |" in f.read()


@pytest.mark.skipif(not (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")
                         and shutil.which("g++")), reason="the probe is x86-64 Linux code compiled with g++")
def test_bench_core_limits(tmp_path):
    """The core probe compiles and runs here: positive FMA and read rates, the FMA bounds from the 512-bit FMA's
    time (or the 256-bit one's without AVX-512), and both output files."""
    import math

    from benchmarks import bench_core_limits

    r = bench_core_limits.main(["--out", str(tmp_path)])
    rates = [r[k] for k in ("read_l2_gbs", "read_1_75mib_gbs", "read_7mib_gbs", "rows1_7mib_gbs", "rows4_7mib_gbs",
                            "weigh_hot_gbs", "weigh_after_stream_gbs", "read_7mib_nta_gbs", "weigh_after_nta_stream_gbs")]
    assert all(math.isfinite(x) and x > 0 for x in rates) and r["ns_per_fma256"] > 0
    ns = r["ns_per_fma512"] if r["vector_floats"] == 16 else r["ns_per_fma256"]
    assert ns > 0 and r["fma_bound_rows1_gbs"] == pytest.approx(4 * r["vector_floats"] / ns)
    assert r["fma_bound_rows4_gbs"] == pytest.approx(r["fma_bound_rows1_gbs"] / 4)
    assert json.loads((tmp_path / "bench_core_limits.json").read_text()) == r
    text = (tmp_path / "bench_core_limits.md").read_text()
    assert "4 rows x 7 MiB" in text and "non-temporal" in text


def _revision_present(rev: str) -> bool:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return shutil.which("git") is not None and subprocess.run(
        ["git", "-C", root, "cat-file", "-e", f"{rev}:csrc/isa/small_gemm_rows.cpp"], capture_output=True).returncode == 0


# the small-row loops before 8f6ee33 kept their sums in memory (docs/design/cpu_kernels.md, "Sums kept in
# registers"); the arithmetic was to stay the same to the bit
LOOPS_IN_MEMORY = "8f6ee33ba2109d27c301445673bdf39e2db862ec~1"


@pytest.mark.skipif(not (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")
                         and shutil.which("g++") and "cpp" in dk.available_backends()),
                    reason="the probe is x86-64 Linux code compiled with g++ (its default copy: the extension's)")
def test_bench_small_rows(tmp_path):
    """The small-row loops compiled as the extension's copy (the one this CPU runs) against the same file before
    8f6ee33 (the sums kept in registers): the outputs are the same to the bit for M = 1-8 (float32 and int8; the
    step's shapes and a K with a tail, bias or none, odd column ranges), the times positive, both output files
    written; a revision without the file is refused with a one-line reason."""
    from dtmt_kernels import _C
    from benchmarks import bench_small_rows

    if _C.cpu_isa() not in bench_small_rows.MARCH:
        pytest.skip(f"the extension runs its {_C.cpu_isa()!r} loops here; the probe builds the avx2 or avx512 copy")
    if not _revision_present(LOOPS_IN_MEMORY):
        pytest.skip(f"this checkout has no revision {LOOPS_IN_MEMORY} (a shallow clone)")
    r = bench_small_rows.main(["--against", LOOPS_IN_MEMORY, "--rows", "1,4", "--passes", "3", "--out", str(tmp_path)])
    assert r["differ"] == 0 and r["checked"] == 8 * (2 * 2 * (len(bench_small_rows.STEP_SHAPES) + 1)
                                                     + 2 * len(bench_small_rows.STEP_SHAPES))
    assert [row["M"] for row in r["rows"]] == [1, 4]
    assert all(row[k] > 0 for row in r["rows"] for k in ("float_us", "int8_us", "float_ref_us", "int8_ref_us"))
    assert r["read_us"] > 0 and json.loads((tmp_path / "bench_small_rows.json").read_text()) == json.loads(
        json.dumps(r))
    assert "the same to the bit" in (tmp_path / "bench_small_rows.md").read_text()
    with pytest.raises(SystemExit, match="no csrc/isa/small_gemm_rows.cpp at"):
        bench_small_rows.main(["--against", "0000000", "--rows", "1", "--passes", "1"])


@pytest.mark.skipif("cpp" not in dk.available_backends(), reason="C++ extension not built")
def test_bench_step_phases(tmp_path):
    """The phase timers: the benchmark's table lists every phase the extension has; a build without the timers
    (the default, CI's) reports zeros and the benchmark refuses it with how to build one; a build with them
    (DTMT_PHASE_TIMERS=1) times a toy model's translations: one search and one encode a sentence, the steps'
    parts within the steps, the steps within the searches, two cell steps a decoder step."""
    from dtmt_kernels import _C
    from benchmarks import bench_step_phases

    assert sorted(n for n, _, _ in _C.phase_times()) == sorted(n for n, _, _ in bench_step_phases.LAYOUT)
    if not _C.PHASE_TIMERS:
        _C.reset_phase_times()
        assert all(s == 0 and c == 0 for _, s, c in _C.phase_times())
        with pytest.raises(SystemExit, match="DTMT_PHASE_TIMERS=1"):
            bench_step_phases.main(["--checkpoint", "unused", "--data", "unused"])
        pytest.skip("the timed half needs a build with DTMT_PHASE_TIMERS=1 (the refusal above was checked)")
    ckpt, data = tiny_checkpoint(tmp_path, "dtmt", embed_dim=8, hidden_size=8, heads=2, dropout=0.0)
    r = bench_step_phases.main(["--checkpoint", ckpt, "--data", data, "--sentences", "8", "--out", str(tmp_path)])
    phase = {row["phase"]: row for row in r["phases"]}
    assert phase["search"]["calls"] == 8 and phase["encode"]["calls"] == 8 and phase["step"]["calls"] >= 8
    assert phase["recurrent_product"]["calls"] == 2 * phase["step"]["calls"]
    assert sum(phase[p]["seconds"] for p in ("query_cell", "attention", "decoder_cell", "readout", "output_product",
                                            "log_softmax")) <= phase["step"]["seconds"]
    assert phase["step"]["seconds"] + phase["search_setup"]["seconds"] <= phase["search"]["seconds"] < r["seconds"]
    assert json.loads((tmp_path / "bench_step_phases.json").read_text())["sentences"] == 8


def test_bench_op_checks_workload_calls_both_ops():
    """The callgrind workload runs and calls both ops it counts (what --toggle-collect collects), as many times as
    it says."""
    from benchmarks import bench_op_checks
    from conftest import RecordOps

    with RecordOps() as record:
        bench_op_checks.workload(2)
    assert record.counts["rnmt_step"] == 2 and record.counts["transition_forward"] == 2
    assert set(bench_op_checks.CHECKS) == {"rnmt_step", "transition_forward"}


def test_bench_op_checks_reads_callgrind_annotate():
    from benchmarks import bench_op_checks

    counts = bench_op_checks.inclusive_counts(
        "--------\nIr\n--------\n12,345,678 (100.0%)  PROGRAM TOTALS\n--------\nIr  file:function\n"
        " 1,000,000 (10.00%)  ???:dtmt::rnmt_step_cpu(at::Tensor const&) [/x/_C.so]\n"
        "     2,000 ( 0.02%)  /w/csrc/op_checks.cpp:dtmt::check_cell(dtmt::TransitionWeights const&, long)\n")
    assert counts["PROGRAM TOTALS"] == 12_345_678
    assert [v for k, v in counts.items() if bench_op_checks.KERNELS["rnmt_step"] in k] == [1_000_000]
    assert [v for k, v in counts.items() if "dtmt::check_cell(" in k] == [2_000]


def test_bench_persistent_says_it_needs_a_gpu(capsys):
    """bench_persistent.py (the persistent forward against the per-step one and cuDNN: gpu_session.sh's persistent
    stage) runs only on a CUDA device; elsewhere one line and exit 2, not a traceback."""
    import torch

    from benchmarks import bench_persistent

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: gpu_session.sh runs this benchmark")
    assert bench_persistent.main(["--B", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bench_persistent: needs a CUDA device") and err.count("\n") == 1


def test_bench_cells_math_mode_is_named_and_gpu_only():
    """bench_cells --math (issue 72 item 1): the GPU table's header names each side's arithmetic; on the CPU the
    option is refused (exit 2) rather than ignored."""
    from benchmarks import bench_cells

    assert "strict fp32 on every side" in bench_cells.math_mode("strict", "float32")
    assert "TF32 tensor cores" in bench_cells.math_mode("tf32", "float32")
    assert "bfloat16 storage on every side" in bench_cells.math_mode("strict", "bfloat16")
    with pytest.raises(SystemExit) as exc:
        bench_cells.main(["--math", "tf32", "--quick"])
    assert exc.value.code == 2


def test_bench_persistent_floor():
    """The floor a persistent forward is printed beside: T x (grid barriers a step x the barrier's cost + a step's
    recurrent products at the dense rate), worked by hand: a GRU step is one barrier and B x H against 3H rows; the
    deep transition (L-GRU + 4 T-GRUs, layer norm) at B = 64 fifteen barriers (each layer norm's join shared out:
    one more) and 4H + 4 x 3H rows; ATR one barrier and H rows."""
    from benchmarks import bench_persistent as bp

    T, B, H, us, rate = 50, 64, 512, 3.0, 1e13
    assert bp.step_flops("gru", 0, B, H) == 2 * 64 * 512 * 1536
    assert bp.floor_ms("gru", 0, False, T, B, H, us, rate) == pytest.approx(50 * (3e-6 + 2 * 64 * 512 * 1536 / 1e13)
                                                                            * 1e3)
    assert bp.floor_ms("lgru", 4, True, T, B, H, us, rate) == pytest.approx(
        50 * (15 * 3e-6 + 2 * 64 * 512 * (4 + 12) * 512 / 1e13) * 1e3)
    assert bp.floor_ms("atr", 0, False, T, B, H, us, None) == pytest.approx(50 * 3e-6 * 1e3)   # barriers alone
    assert bp.step_flops("atr", 0, B, H) == 2 * 64 * 512 * 512


def test_bench_persistent_names_the_products_of_each_mode(capsys):
    """bench_persistent's -fma modes (the persistent products on FMA, DTMT_CUDA_PRODUCTS=fma) run their base mode on
    every side, say so in the table's header, and a row whose launches ran on other products than its mode asks for
    says which (from the driver's launch counts)."""
    from benchmarks import bench_persistent as bp

    row = dict(fwd_ms=2.0, fwd_bwd_ms=5.0, rel_err=1e-3, peak_MB=10.0, fell_back=False)
    results = {("gru", 64, "steps"): dict(row, form="steps", products=""),
               ("gru", 64, "persistent"): dict(row, form="grid", products="FMA"),
               ("atr", 64, "steps"): dict(row, form="steps", products=""),
               ("atr", 64, "persistent"): dict(row, form="grid", products="tensor cores")}
    for math, flagged in (("bf16-fma", "atr (products on tensor cores)"), ("bf16", "gru (products on FMA)")):
        bp.report(results, None, 50, 512, [64], 3, "a GPU", math)
        out = capsys.readouterr().out
        assert bp.MATH_NAMES[math] in out and f"| {flagged} | 64 |" in out, out
        assert out.count("(products on") == 1, out
    assert "DTMT_CUDA_PRODUCTS=fma" in bp.MATH_NAMES["tf32-fma"]


def test_bench_persistent_envelope_needs_no_gpu(capsys):
    """`bench_persistent.py --envelope` with a device's numbers prints the envelope table (dtmt_kernels' arithmetic,
    the driver's) without a GPU; without the numbers and without a GPU it asks for them, exit 2."""
    from benchmarks import bench_persistent
    from dtmt_kernels.ops.transition.persistent import envelope_table

    assert bench_persistent.main(["--envelope", "--multiprocessors", "132", "--shared-memory", "232448",
                                  "--l2-cache", "52428800", "--B", "64"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# the persistent launches' envelope: 132 SMs, 232448 bytes") and envelope_table(
        132, 232448, 64, 52428800) in out
    assert envelope_table(132, 232448, 64, 52428800) != envelope_table(132, 232448, 64)   # the L2 widens it
    if not torch.cuda.is_available():
        assert bench_persistent.main(["--envelope"]) == 2
        assert "give multiprocessors and shared_memory" in capsys.readouterr().err


def test_bench_persistent_table_and_floor(capsys):
    """bench_persistent's table from the children's rows (faked here: the children run on a GPU): both modes side
    by side with their ratios, and the persistent forward's floor, T x its grid barriers a step x the barrier's
    cost: the deep transition (depth 4, layer norm) waits at 10 barriers a step, a GRU at 1; the header names the
    math mode of every side."""
    from benchmarks import bench_persistent

    def row(case, B, mode, fwd, fwd_bwd, **extra):
        return dict(case=case, B=B, mode=mode, fell_back=False, rel_err=1e-6, fwd_ms=fwd, fwd_bwd_ms=fwd_bwd,
                    peak_MB=10.0, **extra)

    results = {("gru", 8, "steps"): row("gru", 8, "steps", 2.0, 6.0, cudnn_fwd_ms=1.0, cudnn_fwd_bwd_ms=3.0,
                                        reference_peak_MB=12.0),
               ("gru", 8, "persistent"): row("gru", 8, "persistent", 0.5, 2.0),
               ("deep-transition", 8, "steps"): row("deep-transition", 8, "steps", 10.0, 30.0),
               ("deep-transition", 8, "persistent"): row("deep-transition", 8, "persistent", 2.5, 9.0)}
    barrier = dict(case="barrier", units=132, steps=512, step_us=2.0)
    table = bench_persistent.report(results, barrier, 50, 512, [8], 10, "a GPU")
    out = capsys.readouterr().out
    assert bench_persistent.barriers_per_step("lgru", 4, True) == 10
    # at B = 64 every layer norm's join is shared out (192 and 128 pairs: 24 and 16 passes of 8 warps), one more
    # barrier each; at B = 8 none (3 and 2 passes); at B = 11 the L-GRU's (33 pairs: 5 passes) but not the T-GRUs'
    assert [bench_persistent.barriers_per_step("lgru", 4, True, B) for B in (8, 11, 64)] == [10, 11, 15]
    assert bench_persistent.barriers_per_step("gru", 0, False, 64) == 1
    assert "| gru | 8 | 2.00 | 0.50 | 4.00 | 0.10 (20%) | 6.00 | 2.00 | 3.00 | 1.00 / 3.00 |" in out, out
    assert "1.0e-06 / 1.0e-06 | 10 / 10 / 12 |" in out and "peak MB (steps / persistent / reference)" in out
    assert "| deep-transition | 8 | 10.00 | 2.50 | 4.00 | 1.00 (40%) | 30.00 | 9.00 | 3.33 |" in out, out
    assert "grid barrier: at most 2.00 us" in out and len(table) == 2
    assert "strict fp32 on every side" in out
    bench_persistent.report(results, barrier, 50, 512, [8], 10, "a GPU", "tf32")   # each table names its math mode
    assert "; TF32 on every side (torch's TF32 flags on" in capsys.readouterr().out
    # the cluster form: its own rows against the same per-step rows, its own barrier's probe
    results[("gru", 8, "persistent-cluster")] = row("gru", 8, "persistent-cluster", 0.25, 1.5)
    cluster = dict(case="barrier", units=16, steps=512, step_us=0.6)
    table = bench_persistent.report(results, cluster, 50, 512, [8], 10, "a GPU", form="cluster")
    out = capsys.readouterr().out
    assert "| gru | 8 | 2.00 | 0.25 | 8.00 | 0.03 (12%) | 6.00 | 1.50 | 4.00 | 1.00 / 3.00 |" in out, out
    assert "cluster barrier: at most 0.60 us" in out and "16 blocks" in out and "--forms cluster" in out
    assert len(table) == 1 and table[0]["form"] == "cluster"   # (no cluster row for the deep transition: none)
    results[("gru", 8, "persistent-cluster")].update(fell_back=True, form="grid")   # did not fit one cluster
    bench_persistent.report(results, cluster, 50, 512, [8], 10, "a GPU", form="cluster")
    assert "| gru (ran as grid: did not fit) | 8 |" in capsys.readouterr().out


def test_bench_forms_measures_its_two_parts():
    """bench_forms.py (issue 75 item 5's decision): the weight forming is timed inside the updates (dtmt: the
    encoder layer's and both decoder cells' forms, each update), and each batch-first layer call of an update is
    compared with its time-major twin."""
    from benchmarks import bench_forms

    r = bench_forms.main(["--updates", "1", "--warmup", "1", "--repeats", "1", "--max-tokens", "200",
                          "--threads", "1"])
    assert r["system"] == "dtmt" and r["layer_calls"] == 1
    assert 0 < r["forms_ms"] < r["update_ms"] and 0 < r["forms_share"] < 1
    assert abs(r["transposes_share"] * r["update_ms"] - r["transposes_ms"]) < 1e-6 * r["update_ms"]


def test_bench_int8_refuses_bad_options_before_decoding(tmp_path, capsys):
    """bench_int8.py's counts and corpus, each refused in one line before a checkpoint is loaded: --beam 0 was
    beam_search's traceback, --sentences -1 left the last sentence out without a word, --threads 0 torch's
    RuntimeError, a --data that is no corpus (the default, where no Bible was prepared) a CorpusError's traceback."""
    from benchmarks import bench_int8
    from conftest import save_model
    from dtmt_models.data.vocabulary import Vocabulary

    vocab = Vocabulary.train(["el perro come la manzana", "la casa es grande"] * 20, vocab_size=40)
    model = dm.build_model("rnnsearch-atr", len(vocab), len(vocab), embed_dim=8, hidden_size=8)
    real = save_model(tmp_path / "m.pt", "rnnsearch-atr", dict(embed_dim=8, hidden_size=8), vocab, vocab, model)
    for flags, message in ((["--beam", "0"], "--beam 0: must be >= 1 and <= 1024"),
                           (["--sentences", "-1"], "--sentences -1: must be >= 0"),
                           (["--threads", "0"], "--threads 0: must be >= 1"),
                           # (the checkpoint is checked first: a real one, for the corpus's refusal to be reached)
                           (["--data", str(tmp_path / "typo"), "--checkpoint", real],
                            "no corpus.json; make the corpus")):
        with pytest.raises(SystemExit) as info:
            bench_int8.main(["--checkpoint", str(tmp_path / "none.pt"), *flags, "--out", str(tmp_path / "o")])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, flags
    assert not (tmp_path / "o").exists()


def test_bench_forms_refuses_bad_options_before_running(capsys):
    """bench_forms.py's counts, system and preset, each refused in one line before a model is built: --updates 0 was
    a ZeroDivisionError after the whole run, --repeats 0 an empty median, --warmup 0 timed no layer call without a
    word, --max-tokens 0 an empty max(), --threads 0 torch's RuntimeError, an unknown system or preset a
    traceback."""
    from benchmarks import bench_forms

    for flags, message in ((["--updates", "0"], "--updates 0: must be >= 1"),
                           (["--repeats", "0"], "--repeats 0: must be >= 1"),
                           (["--warmup", "0"], "--warmup 0: must be >= 1"),
                           (["--max-tokens", "0"], "--max-tokens 0: must be >= 81"),
                           (["--threads", "0"], "--threads 0: must be >= 1"),
                           (["--system", "nope"], "--system nope --preset small: unknown model 'nope'"),
                           (["--system", "mce", "--preset", "002-T1-baseline"],
                            "preset '002-T1-baseline' is a nematus configuration, not mce's")):
        with pytest.raises(SystemExit) as info:
            bench_forms.main(flags)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, flags



def _gpu_session_calls():
    """Every `"$PY" benchmarks/NAME.py ARGS` of benchmarks/gpu_session.sh: (line, NAME, the arguments), its shell
    variables given sample values, its continuation lines joined, cut at the first pipe or redirection."""
    import re
    import shlex

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "gpu_session.sh")
    with open(path) as f:
        text = f.read()
    values = {"OUT": "/tmp/gpu-out", "dtype": "float32", "math": "strict", "H": "512", "gemm": "rows",
              "rec": "persistent", "carry": "/tmp/gpu-carry", "peerpath": "/tmp/peers", "PYTHONPATH": "",
              "form": "cluster", "batches": "1 8 64"}
    calls, joined, first = [], [], None
    for number, raw in enumerate(text.splitlines(), 1):   # (continuation lines joined, numbered by their first)
        first = number if not joined else first
        joined.append(raw[:-1] if raw.endswith("\\") else raw)
        if raw.endswith("\\"):
            continue
        line, number, joined = " ".join(part.strip() for part in joined), first, []
        if line.startswith("#"):
            continue
        for m in re.finditer(r'"\$PY" benchmarks/(\w+)\.py([^\n]*)', line):
            rest = re.sub(r"\$\{?(\w+)(?::[^}]*)?\}?", lambda v: values.get(v.group(1), "1"), m.group(2))
            args = []
            for token in shlex.split(rest):
                if token in ("|", "||", "&&", ">", ";") or token.startswith((">", "2>", "1>")):
                    break
                args.append(token)
            calls.append((number, m.group(1), args))
    return calls


def test_the_gpu_session_s_benchmark_calls_parse(monkeypatch):
    """Each benchmark call of gpu_session.sh is accepted by its script's argument parser (parsed only, not run:
    most are GPU runs), and each test file it names exists, so that a renamed or misspelt option or file fails here,
    not in a device call of the 15 minutes a GPU session has."""
    import argparse
    import importlib
    import re

    class Parsed(Exception):
        pass

    parse = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):
        parse(self, args, namespace)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    calls = _gpu_session_calls()
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "gpu_session.sh")) as f:
        named = set(re.findall(r"tests/\w+\.py", f.read()))   # the test files its stages run
    assert named and all(os.path.isfile(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", t))
                         for t in named), named
    assert len(calls) >= 20 and {name for _, name, _ in calls} >= {"bench_train", "bench_decode", "bench_attention",
                                                                     "bench_persistent", "gpu_profile"}
    for number, name, args in calls:
        module = importlib.import_module(f"benchmarks.{name}")
        with pytest.raises(Parsed):   # (argparse's refusal is a SystemExit, which this does not catch)
            try:
                module.main(args)
            except SystemExit as exc:
                raise AssertionError(f"gpu_session.sh:{number}: {name}.py {' '.join(args)}: refused ({exc})")


def test_the_gpu_session_s_stages_are_the_ones_it_knows():
    """gpu_session.sh refuses a stage outside its KNOWN list before it takes the GPU (a misspelt stage ran nothing and
    exited 0): KNOWN is every stage a `want` of the script tests, and its usage lines name each of them, no other."""
    import re

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "gpu_session.sh")
    with open(path) as f:
        text = f.read()
    known = set(re.search(r'^KNOWN="([^"]*)"', text, re.M).group(1).replace("\\\n", " ").split())
    wanted = set(re.findall(r"\bwant ([a-z0-9-]+)", text))
    usage = {stage for line in re.findall(r"^#   bash benchmarks/gpu_session\.sh ([a-z0-9 -]*?) *(?:#|$)", text, re.M)
             for stage in line.split()}
    assert known == wanted, (known ^ wanted)
    assert usage == known, (usage ^ known)


def test_the_gpu_session_refuses_the_stages_that_read_the_corpus_without_it(tmp_path):
    """amp, peers and peers-train read data/bible, which a device machine cannot prepare (no SWORD modules, no
    network) and which git ignores: without it they failed there, after the build, in device time. The script now
    refuses them at once, on stderr, saying to carry it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    (tmp_path / "benchmarks").mkdir()
    shutil.copy(os.path.join(root, "benchmarks", "gpu_session.sh"), tmp_path / "benchmarks")
    for stages in (["amp"], ["build", "peers"], ["peers-train"]):
        r = subprocess.run(["bash", str(tmp_path / "benchmarks" / "gpu_session.sh"), *stages], capture_output=True,
                           text=True, env=dict(os.environ, OUT=str(tmp_path / "out"), PYTHON="false"), timeout=60)
        assert r.returncode == 2 and "name data/bible in the device call's carry" in r.stderr, r.stdout + r.stderr
        assert "== device" not in r.stdout and not (tmp_path / "out").exists()   # (refused before $OUT is made)


@pytest.mark.parametrize("script, flags, message", [
    ("bench_train", ["--rounds", "0"], "--rounds 0: must be >= 1"),
    ("bench_train", ["--steps", "0"], "--steps 0: must be >= 1"),
    ("bench_train", ["--max-tokens", "5"], "--max-tokens 5: must be >= 81"),
    ("bench_train", ["--systems", "foo"], "--systems foo: not a system (one of deeplau, dtmt,"),
    ("bench_train", ["--device", "foo"], "--device foo: not a device (cpu or cuda)"),
    ("bench_cells", ["--BH", "2x"], "--BH 2x: expected BATCHxHIDDEN, both >= 1, e.g. 64x256"),
    ("bench_cells", ["--BH", "0x16"], "--BH 0x16: expected BATCHxHIDDEN"),
    ("bench_cells", ["--repeat", "0"], "--repeat 0: must be >= 1"),
    ("bench_cells", ["--T", "5", "0"], "--T 0: must be >= 1"),
    ("bench_decode", ["--systems", "dtmt", "foo"], "--systems foo: not a system"),
    ("bench_decode", ["--beams", "4", "0"], "--beams 0: must be >= 1"),
    ("bench_decode", ["--checkpoints", "none.pt", "--input", "EMPTY"], "--input EMPTY: no sentences"),
    # (NaN passed both comparisons: bench_serve sent no request and printed NaN latencies; inf trained without end)
    ("bench_serve", ["--max-seconds", "nan"], "--max-seconds nan: must be a finite number >= 0"),
    ("bench_serve", ["--max-wait-ms", "100000"], "--max-wait-ms 100000.0: must be >= 0 and <= 60000.0"),
    ("bench_quality", ["--budget", "inf"], "--budget inf: must be a finite duration >= 0.001 (seconds)"),
    ("bench_peers", ["--budget", "inf"], "--budget inf: must be a finite duration of more than 0 seconds"),
    ("bench_int8_kernel", ["--calls", "0"], "--calls 0: must be >= 1"),
    ("bench_int8_kernel", ["--repeat", "-3"], "--repeat -3: must be >= 1"),
    ("bench_int8_kernel", ["--rows", "1,"], "--rows 1,: must be integers separated by commas"),
    ("bench_int8_kernel", ["--rows", "4,0"], "--rows 0: must be >= 1"),
    ("bench_int8_kernel", ["--isa", "bogus"], "--isa bogus: this CPU runs"),   # (exit 1 before, after loading)
    ("bench_int8", ["--isa", "bogus"], "--isa bogus: not a copy this CPU runs"),
    ("bench_small_rows", ["--against=--output=OUT"], "--against --output=OUT: not a git revision"),
    ("bench_train", ["--quick", "--one", "dtmt", "foo"], "--one dtmt foo: 'foo': a backend"),   # (KeyError,
    ("bench_train", ["--quick", "--one", "foo", "cpp"], "--one foo: not a system"),              # SystemExit)
    ("bench_data", ["--model", "foo", "--sizes", "300"], "--model foo: not a system"),   # (after the corpus was made)
    ("bench_decode", ["--quick", "--loops", "graph"], "--loops graph replays CUDA graphs: with --device cuda"),
    ("bench_portable", ["--BH", "abc"], "--BH abc: expected BATCHxHIDDEN"),   # (after the native build's minutes)
    ("bench_portable", ["--native-so", "/nonexistent.so"], "--native-so /nonexistent.so: no such file"),
])
def test_bad_benchmark_options_are_one_line_before_anything_runs(tmp_path, capsys, script, flags, message):
    _refused_before_running(tmp_path, capsys, script, flags, message)


@pytest.mark.parametrize("script, flags, message", [
    ("bench_core_limits", ["--out", "/dev/null/x"], "--out /dev/null/x: cannot make this folder"),
    ("bench_small_rows", ["--out", "/dev/null/x"], "--out /dev/null/x: cannot make this folder"),
    ("bench_forms", ["--json", "/dev/null/x/f.json"], "--json /dev/null/x/f.json: no folder /dev/null/x"),
])
def test_an_output_that_cannot_be_written_is_refused_before_the_measurement(tmp_path, capsys, script, flags,
                                                                             message):
    """They measured everything (core_limits a minute), then failed writing (exit 1, the figures lost)."""
    _refused_before_running(tmp_path, capsys, script, flags, message, out=False)


def _refused_before_running(tmp_path, capsys, script, flags, message, out=True):
    """Each is refused by argparse (exit 2, one line) before anything is measured or written: they were a
    ZeroDivisionError, an empty median, a reshape's or int()'s error, a traceback of the child process, and
    `bench_train --rounds 0` first replaced the CSV of earlier results by its header."""
    import importlib

    module = importlib.import_module(f"benchmarks.{script}")
    (tmp_path / "EMPTY").write_text("\n\n")
    (tmp_path / f"{script}.csv").write_text("earlier results\n")
    flags = [str(tmp_path / "EMPTY") if f == "EMPTY" else f for f in flags]
    message = message.replace("EMPTY", str(tmp_path / "EMPTY"))
    with pytest.raises(SystemExit) as info:
        module.main(flags + (["--out", str(tmp_path)] if out else []))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err.splitlines()[-1] and "Traceback" not in err, err
    assert (tmp_path / f"{script}.csv").read_text() == "earlier results\n"


def test_a_run_names_its_machine_commit_date_torch_and_command(tmp_path, monkeypatch, capsys):
    """Each of bench_train, bench_decode, bench_cells, bench_attention, bench_data, bench_forms and bench_gemm prints
    one header first and writes it into its files (common.provenance: most had recorded neither commit nor date);
    the commit says "+dirty" where tracked files differ from it."""
    from benchmarks import bench_decode, bench_gemm, common

    record = common.provenance(os.path.join(common.HERE, "bench_x.py"), ["--a", "b c"])
    assert record["command"] == "python benchmarks/bench_x.py --a 'b c'" and record["torch"] == torch.__version__
    assert record["date"].endswith(" UTC") and record["machine"].startswith(common.machine_record()["model name"])
    line = common.provenance_line(record)
    assert line.startswith("# run: ") and "\n" not in line and f"commit {record['commit']}; " in line
    path = common.write_csv(tmp_path / "t.csv", [{"a": 1}], comment=line)
    assert csv_rows(path) == [{"a": "1"}]
    with pytest.raises(ValueError):
        common.write_csv(tmp_path / "u.csv", [{"a": 1}], comment="no hash")
    bench_gemm.main(["--shapes", "4x8x16", "--threads", "1", "--inner", "1", "--repeat", "1"])
    assert capsys.readouterr().out.startswith("# run: ")
    bench_decode.main(["--quick", "--bookkeeping", "--beams", "1"])
    assert capsys.readouterr().out.splitlines()[0].endswith(
        "command: python benchmarks/bench_decode.py --quick --bookkeeping --beams 1")
    if shutil.which("git") is None:
        return
    repo = tmp_path / "repo"   # commit(): "+dirty" for a changed tracked file, not for an untracked one
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    (repo / "f").write_text("1\n")
    for args in (["init", "-q"], ["add", "f"], ["commit", "-q", "-m", "m"]):
        subprocess.run(git + args, check=True, capture_output=True)
    monkeypatch.setattr(common, "ROOT", str(repo))
    clean = common.commit()
    assert len(clean) >= 7 and "+" not in clean
    (repo / "untracked").write_text("x\n")
    assert common.commit() == clean
    (repo / "f").write_text("2\n")
    assert common.commit() == clean + "+dirty"
    monkeypatch.setattr(common, "ROOT", str(tmp_path / "nowhere"))
    assert common.commit() == "unknown"


@pytest.mark.skipif("cpp" not in dk.available_backends(), reason="C++ extension not built")
def test_bench_cells_quick_keeps_the_grid_given_and_says_what_gemm_eff_above_100_means(tmp_path, capsys):
    """--quick had replaced a --T, --BH, --depths or --repeat given with it without a word: it now sets only the
    ones not given. gemm_eff, two timings taken apart, came out at 2079% on a busy machine (one repetition): a row
    above 100% is said to be a disturbed timing, below the table."""
    from benchmarks import bench_cells

    rows = bench_cells.main(["--quick", "--T", "3", "--depths", "0", "--out", str(tmp_path)])
    assert {r["T"] for r in rows} == {3} and {r["depth"] for r in rows} == {0}
    assert {(r["B"], r["H"]) for r in rows} == {(2, 16)}   # (--quick's, not given)
    out = capsys.readouterr().out
    assert out.startswith("# run: ") and "command: python benchmarks/bench_cells.py --quick --T 3" in out
    row = dict(rows[0], gemm_eff=20.79, gemm_ms=224.0)
    bench_cells.note_gemm_eff([row, dict(rows[0], gemm_eff=0.5)])
    note = capsys.readouterr().out
    assert "gemm_eff above 100% in 1 row(s)" in note and "disturbed" in note and "224.0" in note
    bench_cells.note_gemm_eff([dict(rows[0], gemm_eff=0.5), dict(rows[0], gemm_eff=float("nan"))])
    assert capsys.readouterr().out == ""


def test_bench_forms_says_what_a_negative_transposes_figure_is():
    """transposes_ms is a difference of two medians: a negative one (seen at --repeats 1) is reported as measured,
    with a note that it is the timings' noise, not a saving."""
    from benchmarks import bench_forms

    assert bench_forms.transposes_note(0.002, 1) is None and bench_forms.transposes_note(0.0, 3) is None
    note = bench_forms.transposes_note(-0.001, 1)
    assert note.startswith("negative") and "noise" in note and "1 repeat(s)" in note


def _one_line_refusal(capsys, main, flags, message):
    with pytest.raises(SystemExit) as info:
        main(flags)
    assert info.value.code == 2, flags
    err = capsys.readouterr().err
    assert message in err.splitlines()[-1] and "Traceback" not in err, (flags, err)


def test_missing_inputs_are_one_line_before_anything_runs(tmp_path, monkeypatch, capsys):
    """A missing corpus or checkpoint (a default one above all: they come from local runs, which a checkout lacks),
    an --out that cannot be a folder, an envelope's negative count and bench_amp --quality's options, each refused
    in one line (exit 2) before anything is measured, trained or written: they had been tracebacks, some after the
    whole run (--out) or after folders were made."""
    from benchmarks import (bench_amp, bench_attention, bench_cells, bench_data, bench_decode, bench_int8,
                            bench_int8_kernel, bench_pages, bench_persistent, bench_quality, bench_serve, bench_train,
                            interpret)

    none, out = str(tmp_path / "none.pt"), tmp_path / "o"
    (tmp_path / "a_file").write_text("")
    (tmp_path / "in.txt").write_text("una frase\n")
    for module in (bench_int8, bench_int8_kernel, bench_pages, bench_serve):   # their defaults: missing here
        monkeypatch.setattr(module, "DEFAULT_CHECKPOINT", none)
    for main, flags, message in (
            (bench_data.main, ["--data", str(tmp_path / "nowhere"), "--sizes", "1k", "--processes", "0", "--out",
                               str(out)], f"--data {tmp_path / 'nowhere'}: {tmp_path / 'nowhere'}: no corpus.json"),
            (bench_train.main, ["--buckets", str(tmp_path / "nowhere"), "--out", str(out)], "no corpus.json"),
            (bench_decode.main, ["--checkpoints", none, "--input", str(tmp_path / "in.txt"), "--out", str(out)],
             f"--checkpoints {none}: no such file"),
            (bench_decode.main, ["--checkpoints", str(tmp_path / "in.txt"), "--input", str(tmp_path / "in.txt"),
                                 "--out", str(out)], "not a dtmt checkpoint"),
            (interpret.main, ["--checkpoint", none, "--data", str(tmp_path), "--out", str(out)],
             f"--checkpoint {none}: no such file"),
            (bench_int8.main, ["--out", str(out)], "no such file (the default, a local run's, which this checkout "
                                                   "lacks: `python benchmarks/bench_peers.py --systems dtmt"),
            (bench_int8_kernel.main, ["--out", str(out)], "trains that run (best.pt, last.pt, step_NNNNNNN.pt); or "
                                                          "give --checkpoint"),
            (bench_pages.main, [], "`dtmt train --data data/bible --model dtmt --out benchmarks/out/dev_dtmt` trains "
                                   "that run"),
            (bench_serve.main, ["--out", str(out)], f"--checkpoint {none}: no such file (the default"),
            (bench_persistent.main, ["--envelope", "--multiprocessors", "-1"], "--multiprocessors -1: must be >= 1"),
            (bench_persistent.main, ["--envelope", "--multiprocessors", "132", "--shared-memory", "-5"],
             "--shared-memory -5: must be >= 0"),
            (bench_amp.main, ["--quality", "--device", "cpu", "--steps", "-1", "--out", str(out)],
             "--steps -1: must be >= 1"),
            (bench_amp.main, ["--quality", "--device", "cpu", "--seeds", "1", "1", "--out", str(out)],
             "--seeds 1 1: a seed given twice"),
            (bench_amp.main, ["--quality", "--device", "cpu", "--data", str(tmp_path / "typo"), "--out", str(out)],
             "no corpus.json; make the corpus with `dtmt prepare`"),
            (bench_quality.main, ["--systems", "nosuch", "--out", str(out)], "--systems 'nosuch': expected SYSTEM"),
            (bench_cells.main, ["--quick", "--out", str(tmp_path / "a_file")], "cannot make this folder"),
            (bench_attention.main, ["--quick", "--out", str(tmp_path / "a_file" / "x")], "cannot make this folder")):
        _one_line_refusal(capsys, main, flags, message)
    if not torch.cuda.is_available():
        _one_line_refusal(capsys, bench_amp.main, ["--quality", "--device", "cuda", "--out", str(out)],
                          "--device cuda: no CUDA device is available here")
        _one_line_refusal(capsys, interpret.main, ["--checkpoint", none, "--data", str(tmp_path), "--device", "cuda",
                                                   "--out", str(out)], "--device cuda: no CUDA device")
    assert not out.exists()


def test_bench_peers_checks_everything_before_any_work(tmp_path, monkeypatch, capsys):
    """bench_peers refuses, before a peer is installed, a corpus built or a run replaced: --device cuda without a
    GPU (it had installed OpenNMT-py and started training), a mistyped --data (a Bible was built there), and an --out
    that holds an earlier run of a system to train (its record was deleted and `dtmt train --overwrite` retrained,
    unasked) unless --overwrite is given."""
    from benchmarks import bench_peers

    def no_install(*args, **kwargs):
        raise AssertionError("the peer's environment was made")

    monkeypatch.setattr(bench_peers, "ensure_env", no_install)
    out = tmp_path / "peers"
    flags = ["--out", str(out), "--data", str(tmp_path / "typo")]
    _one_line_refusal(capsys, bench_peers.main, flags, f"--data {tmp_path / 'typo'}: no corpus.json")
    _one_line_refusal(capsys, bench_peers.main, ["--onmt-transformer", "256,1024", "--out", str(out)],
                      "--onmt-transformer '256,1024': MODEL,FF,LAYERS,HEADS,WARMUP")
    _one_line_refusal(capsys, bench_peers.main, ["--budget", "0s", "--out", str(out)],
                      "--budget 0s: must be a finite duration of more than 0 seconds")
    if not torch.cuda.is_available():
        _one_line_refusal(capsys, bench_peers.main, ["--device", "cuda", "--out", str(out)],
                          "--device cuda: no CUDA device is available here")
    assert not out.exists()
    from test_train import make_toy_corpus

    data = make_toy_corpus(tmp_path / "toy", n_train=20, n_dev=5, n_test=5)
    (out / "dtmt").mkdir(parents=True)
    (out / "dtmt" / "last.pt").write_bytes(b"")
    (out / "onmt-lstm").mkdir()
    (out / "onmt-lstm" / "model_step_250.pt").write_bytes(b"")
    assert bench_peers.earlier_run(str(out / "dtmt")) and not bench_peers.earlier_run(str(tmp_path / "none"))
    flags = ["--systems", "dtmt", "onmt-lstm", "--data", data, "--out", str(out)]
    _one_line_refusal(capsys, bench_peers.main, flags,
                      f"--out {out}: already holds the run of dtmt, onmt-lstm; add --overwrite to replace it")

    class Started(Exception):
        pass

    def started(*args, **kwargs):
        raise Started

    monkeypatch.setattr(bench_peers, "write_pieces", started)   # (the first work of a training run)
    with pytest.raises(Started):
        bench_peers.main(flags[:2] + flags[3:] + ["--overwrite", "--peer-python", sys.executable])
    assert (out / "dtmt" / "last.pt").exists()   # (nothing replaced before the work)


def _fake_python(tmp_path) -> str:
    """A stand-in for gpu_session.sh's python: exits 0, and makes each --out folder with one file in it."""
    path = tmp_path / "fake-python"
    path.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do\n'
                    '  if [ "$1" = --out ]; then mkdir -p "$2" && echo x > "$2/t.csv"; fi\n'
                    '  shift\ndone\nexit 0\n')
    path.chmod(0o755)
    return str(path)


def test_the_gpu_session_packs_only_what_it_wrote_and_says_its_usage(tmp_path):
    """gpu_session.sh had packed every file of $OUT into its archive and deleted them, those it found there too
    (OUT=/tmp/p with a folder in it: lost into the archive). It now packs and removes only the files this call wrote
    (and the folders it made), never replaces an earlier archive; --help / -h print the usage, every stage named;
    without a GPU the device check is one line, not torch's traceback."""
    import re
    import tarfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "benchmarks", "gpu_session.sh")
    for flag in ("--help", "-h"):
        r = subprocess.run(["bash", script, flag], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and r.stdout.startswith("Everything a GPU machine is wanted for"), r.stderr
        stages = set(r.stdout.rsplit("The stages: ", 1)[1].split())
        usage = {stage for line in re.findall(r"^  bash benchmarks/gpu_session\.sh ([a-z0-9 -]*?) *(?:#|$)", r.stdout,
                                              re.M) for stage in line.split()}
        assert usage == stages and "peers-train" in stages, usage ^ stages
    out = tmp_path / "p"
    (out / "keep").mkdir(parents=True)
    (out / "keep" / "a.txt").write_text("mine\n")
    (out / "old.md").write_text("mine\n")
    (out / "gpu_session_files.tgz").write_text("an earlier call's\n")
    env = dict(os.environ, OUT=str(out), PYTHON=_fake_python(tmp_path), TORCH_CUDA_ARCH_LIST="9.0")
    r = subprocess.run(["bash", script, "gemm", "persistent-profile", "decode"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "12 files written in" in r.stdout and "gpu_session_files-2.tgz" in r.stdout, r.stdout
    left = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    assert left == ["gpu_session_files-2.tgz", "gpu_session_files.tgz", "keep", "keep/a.txt", "old.md"], left
    assert (out / "keep" / "a.txt").read_text() == "mine\n" and (out / "gpu_session_files.tgz").read_text() == (
        "an earlier call's\n")
    with tarfile.open(out / "gpu_session_files-2.tgz") as tar:
        packed = sorted(tar.getnames())
    assert "decode/t.csv" in packed and "gemm_rows.md" in packed and len(packed) == 12, packed
    assert not any(name.startswith(("keep", "old.md")) for name in packed)
    # the call's deadline (GPU_CALL_S): a step with under 20 s left is skipped and said, a failure; the script ends
    # itself (a device call killed at its limit loses every file of the call, the packing never run)
    r = subprocess.run(["bash", script, "decode"], capture_output=True, text=True, timeout=120,
                       env=dict(env, OUT=str(tmp_path / "late"), GPU_CALL_S="10"))
    said = r.stdout + r.stderr   # (a step's stderr goes where its output goes: its table's file, and stdout)
    assert r.returncode == 1 and said.count("gpu_session.sh: skipped, ") == 2, said
    assert "s left of the call's 10 s (GPU_CALL_S): " in said and "Traceback" not in said, said
    if not torch.cuda.is_available():
        r = subprocess.run(["bash", script, "profile"], capture_output=True, text=True, timeout=120,
                           env=dict(env, PYTHON=sys.executable, OUT=str(tmp_path / "q")))
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert "gpu_session.sh: no CUDA device here" in r.stderr.splitlines()[-1], r.stderr


def test_bench_serve_stops_waiting_for_a_server_that_exited(tmp_path):
    """`dtmt serve` refusing an option exits at once; start_server waited for its "listening" line for 300 s."""
    import importlib
    import time

    module = importlib.import_module("benchmarks.bench_serve")
    t0 = time.time()
    with pytest.raises(RuntimeError, match=r"dtmt serve exited \(2\) before it listened"):
        module.start_server(str(tmp_path / "none.pt"), ["--beam", "0"])
    assert time.time() - t0 < 120
