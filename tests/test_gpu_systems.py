"""The NMT systems on a CUDA device (marked gpu: skipped without one). Every system configuration of test_models,
moved to the GPU with its fastest GPU backend, against the same model on the CPU with the reference backend:
the teacher-forced loss and every parameter's gradient in float64, the loss in float32 (TF32 off), and beam
search's hypotheses. Then the command line end to end with --device cuda. DTMT_GPU_TEST_DEVICE=cpu runs the
same code on the CPU (the cpp backend against the reference), to try this file where no GPU is."""
import copy
import json
import os
import re

import pytest
import torch

from test_models import CONFIGS, IDS, V_TGT, build, toy_batch

from dtmt_models.decoding.beam_search import beam_search

DEVICE = os.environ.get("DTMT_GPU_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")]


def _loss_and_grads(model, batch):
    src, src_lengths, prev, tgt = batch
    model.zero_grad(set_to_none=True)
    loss, _, _ = model.loss(src, src_lengths, prev, tgt, smoothing=0.1)
    loss.backward()
    return loss.detach().cpu(), {n: p.grad.detach().cpu() for n, p in model.named_parameters()
                                 if p.grad is not None}


@pytest.fixture
def ieee_float32():
    """float32 GEMMs in IEEE precision, whatever the environment asked for (TF32 would need 1e-3 tolerances)."""
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


@pytest.mark.parametrize("name,options", CONFIGS, ids=IDS)
def test_system_on_gpu_matches_cpu_reference(name, options, ieee_float32):
    cpu = build(name, **options).double().eval()
    if hasattr(cpu, "set_backend"):
        cpu.set_backend("reference")
    gpu = copy.deepcopy(cpu).to(DEVICE)
    if hasattr(gpu, "set_backend"):
        gpu.set_backend("auto")
    batch = toy_batch(B=4)
    ref_loss, ref_grads = _loss_and_grads(cpu, batch)
    loss, grads = _loss_and_grads(gpu, tuple(t.to(DEVICE) for t in batch))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-9, atol=1e-9)
    assert grads.keys() == ref_grads.keys()
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-7, atol=1e-9, msg=lambda m: f"{n}: {m}")
    # float32 on the GPU (the fused kernels' float path) against the float64 CPU loss
    loss32, _ = _loss_and_grads(copy.deepcopy(gpu).float(), tuple(t.to(DEVICE) for t in batch))
    assert abs(loss32.item() - ref_loss.item()) <= 1e-4 * max(1.0, abs(ref_loss.item())), (loss32, ref_loss)
    # decoding: the same hypotheses (the float64 models' scores agree to far more than any tie)
    src, src_lengths = batch[0], batch[1]
    hyp_cpu = beam_search(cpu, src, src_lengths, beam=3, max_len_a=1.0, max_len_b=3)
    hyp_gpu = beam_search(gpu, src.to(DEVICE), src_lengths.to(DEVICE), beam=3, max_len_a=1.0, max_len_b=3)
    assert [[h.tokens for h in s] for s in hyp_gpu] == [[h.tokens for h in s] for s in hyp_cpu]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("name,options", CONFIGS, ids=IDS)
def test_device_search_reads_the_device_only_at_its_checks(name, options, graphs, monkeypatch):
    """The beam search whose loop stays on the device (the default off the CPU; with device_search.GRAPHS its
    steps replayed as a CUDA graph where the state keeps its shapes) against the Python loop on the same device,
    float64: the same hypotheses; with GRAPHS a graph captured for every recurrent decoder, none for the
    transformer (its cache grows), and the same hypotheses as the eager steps, their scores to float64 rounding. With
    torch's sync debug mode on, a decoder step or reorder never synchronises,
    and the search's own synchronisations are at most one before the loop (the longest max length), two a check
    (the done flags, the done sentences' hypotheses: its index copies do not wait) and three a capture, besides
    those of encoding; its checks are one every CHECK_EVERY steps of the longest sentence's, at most."""
    import warnings

    from dtmt_models.decoding import device_search

    model = build(name, **options).double().eval().to(DEVICE)
    src, src_lengths = (t.to(DEVICE) for t in toy_batch(B=4)[:2])
    kwargs = dict(beam=3, max_len_a=1.0, max_len_b=3, fused=False)
    loop = beam_search(model, src, src_lengths, on_device=False, **kwargs)
    decoder = model.inference_decoder()
    syncs = {"encode": 0, "step": 0, "all": 0}
    reads, captures = [], []
    monkeypatch.setattr(device_search, "to_host", lambda x: reads.append(1) or x.tolist())
    monkeypatch.setattr(device_search, "GRAPHS", graphs)
    capture = device_search.StepGraph.of.__func__
    monkeypatch.setattr(device_search.StepGraph, "of",
                        classmethod(lambda cls, search, c: captures.append(capture(cls, search, c)) or captures[-1]))

    def counting(part, fn):
        def call(*args):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = fn(*args)
            syncs[part] += sum("synchroniz" in str(w.message) for w in caught)
            for w in caught:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            return out
        return call

    class Counted:
        encode = staticmethod(counting("encode", decoder.encode))
        step = staticmethod(counting("step", decoder.step))
        reorder = staticmethod(counting("step", decoder.reorder))
        pad_id = getattr(decoder, "pad_id", 0)

    if DEVICE == "cuda":
        torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            device = beam_search(Counted(), src, src_lengths, on_device=True, **kwargs)
    finally:
        if DEVICE == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    syncs["all"] = sum("synchroniz" in str(w.message) for w in caught)
    assert [[h.tokens for h in s] for s in device] == [[h.tokens for h in s] for s in loop]
    assert syncs["step"] == 0, syncs
    checks = -(-int((src_lengths.float() * 1.0 + 3).long().max()) // device_search.CHECK_EVERY)
    assert len(reads) <= 1 + 2 * checks, (len(reads), checks)
    assert syncs["all"] - syncs["encode"] <= 1 + 2 * checks + 3 * len(captures), (syncs, checks, len(captures))
    if DEVICE == "cuda" and graphs:
        assert captures and all(g is None for g in captures) == (name == "transformer"), captures
        state = decoder.encode(src, src_lengths)
        max_len = (src_lengths.float() * 1.0 + 3).long()
        eager = device_search.device_loop(decoder, state, max_len, 3, 0.6, 1, False, [0, 2], graphs=False)
        assert [[h.tokens for h in s] for s in eager] == [[h.tokens for h in s] for s in device]
        # (scores to float64 rounding: captured, the per-step products are cuBLAS's, eager the own GEMMs'; another
        # order of the same sums: docs/design/gpu.md, "Step GEMMs")
        torch.testing.assert_close(torch.tensor([h.score for s in device for h in s], dtype=torch.float64),
                                   torch.tensor([h.score for s in eager for h in s], dtype=torch.float64),
                                   rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
@pytest.mark.parametrize("name", ["dtmt", "rnnsearch-atr", "nematus"])
def test_16_bit_decoding_on_the_device(name, amp, monkeypatch):
    """`dtmt translate --amp` (engine.decoder.AutocastDecoder: a 16-bit copy under torch.autocast) in the device
    search: its steps are captured as CUDA graphs as the float32 decoder's are, the graph's hypotheses and scores are
    the eager 16-bit steps', and its log-probabilities and best scores are near float32's (16-bit rounding: within
    0.1 a step here) without being float32's."""
    from dtmt_models.decoding import device_search
    from dtmt_models.engine import as_decoder

    model = build(name).eval().to(DEVICE)
    src, src_lengths = (t.to(DEVICE) for t in toy_batch(B=4)[:2])
    low, full = as_decoder(model, amp=amp), as_decoder(model)
    assert all(p.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[amp] for p in low.model.parameters())
    captures = []
    capture = device_search.StepGraph.of.__func__
    monkeypatch.setattr(device_search.StepGraph, "of",
                        classmethod(lambda cls, search, c: captures.append(capture(cls, search, c)) or captures[-1]))
    kwargs = dict(beam=3, max_len_a=1.0, max_len_b=3, on_device=True)
    with torch.no_grad():
        hyps = beam_search(low, src, src_lengths, **kwargs)
        monkeypatch.setattr(device_search, "GRAPHS", False)
        eager = beam_search(low, src, src_lengths, **kwargs)
        want = beam_search(full, src, src_lengths, **kwargs)
        step_low, _ = low.step(low.encode(src, src_lengths), torch.full((4,), 1, device=DEVICE))
        step_full, _ = full.step(full.encode(src, src_lengths), torch.full((4,), 1, device=DEVICE))
    assert DEVICE != "cuda" or (captures and all(g is not None for g in captures)), captures
    assert [[h.tokens for h in s] for s in hyps] == [[h.tokens for h in s] for s in eager]
    torch.testing.assert_close(torch.tensor([h.score for s in hyps for h in s]),
                               torch.tensor([h.score for s in eager for h in s]), rtol=1e-3, atol=1e-3)
    assert step_low.dtype == torch.float32 and not torch.equal(step_low, step_full)
    torch.testing.assert_close(step_low, step_full, rtol=0, atol=0.1)
    torch.testing.assert_close(torch.tensor([s[0].score for s in hyps]), torch.tensor([s[0].score for s in want]),
                               rtol=0, atol=0.1)


def test_an_ensemble_s_device_search_is_captured(monkeypatch):
    """An ensemble (its state a tuple of its models' states) in the device search: its steps are captured as a CUDA
    graph (before, the capture's first step ended in an AttributeError), with the Python loop's hypotheses."""
    from dtmt_models.decoding import device_search
    from dtmt_models.decoding.ensemble import Ensemble

    ensemble = Ensemble([build(name).double().eval().to(DEVICE) for name in ("dtmt", "rnnsearch-atr")])
    src, src_lengths = (t.to(DEVICE) for t in toy_batch(B=4)[:2])
    captures = []
    capture = device_search.StepGraph.of.__func__
    monkeypatch.setattr(device_search.StepGraph, "of",
                        classmethod(lambda cls, search, c: captures.append(capture(cls, search, c)) or captures[-1]))
    kwargs = dict(beam=3, max_len_a=1.0, max_len_b=3, fused=False)
    device = beam_search(ensemble, src, src_lengths, on_device=True, **kwargs)
    loop = beam_search(ensemble, src, src_lengths, on_device=False, **kwargs)
    assert DEVICE != "cuda" or (captures and all(g is not None for g in captures)), captures
    assert [[h.tokens for h in s] for s in device] == [[h.tokens for h in s] for s in loop]


def test_device_search_keeps_a_step_that_reads_the_host_eager(monkeypatch):
    """A decoder step that synchronises with the host (here a read of its tokens) is not captured as a CUDA graph:
    the warm-up step under torch's sync debug mode shows it before any capture (a failed capture can leave torch's
    random generator expecting a graph, which then fails every dropout of a training run that decodes its dev set).
    With graphs asked for, the search warns, runs the steps eagerly, gives the Python loop's hypotheses, and the
    device's random draws still work after it."""
    import warnings

    from dtmt_models.decoding import device_search

    model = build("rnnsearch-atr").double().eval().to(DEVICE)
    src, src_lengths = (t.to(DEVICE) for t in toy_batch(B=4)[:2])
    kwargs = dict(beam=3, max_len_a=1.0, max_len_b=3, fused=False)
    loop = beam_search(model, src, src_lengths, on_device=False, **kwargs)
    decoder = model.inference_decoder()

    class Reading:
        encode, reorder = staticmethod(decoder.encode), staticmethod(decoder.reorder)
        pad_id = getattr(decoder, "pad_id", 0)

        @staticmethod
        def step(state, prev):
            prev.sum().item()   # a read of the host: what a capture refuses
            return decoder.step(state, prev)

    monkeypatch.setattr(device_search, "GRAPHS", True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = beam_search(Reading(), src, src_lengths, on_device=True, **kwargs)
    assert [[h.tokens for h in s] for s in got] == [[h.tokens for h in s] for s in loop]
    if DEVICE == "cuda":   # (off a CUDA device the steps are never captured)
        assert any("synchronises with the host" in str(w.message) for w in caught), [str(w.message) for w in caught]
        assert torch.cuda.get_sync_debug_mode() == 0
        drawn = torch.nn.functional.dropout(torch.ones(64, device=DEVICE), 0.5, training=True)
        assert 0 < int((drawn == 0).sum()) < 64


@pytest.mark.parametrize("name", ["dtmt", "nematus", "rnnsearch-atr"])
def test_training_mode_on_gpu_matches_the_reference(name):
    """Dropouts on (the fused kernels' candidate-dropout path on the GPU), float64: the loss and every gradient
    are the reference backend's on the same device with the same seed (the masks are drawn in Python, in the same
    order: sample_dropout_masks), and another seed gives another loss (the dropouts ran)."""
    ref = build(name, dropout=0.2).double().to(DEVICE).train()
    fast = copy.deepcopy(ref)
    ref.set_backend("reference")
    fast.set_backend("auto")
    batch = tuple(t.to(DEVICE) for t in toy_batch(B=4))
    torch.manual_seed(5)
    ref_loss, ref_grads = _loss_and_grads(ref, batch)
    torch.manual_seed(5)
    loss, grads = _loss_and_grads(fast, batch)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-9, atol=1e-9)
    assert grads.keys() == ref_grads.keys()
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-7, atol=1e-9, msg=lambda m: f"{n}: {m}")
    torch.manual_seed(6)   # other masks, another loss
    other, _ = _loss_and_grads(fast, batch)
    assert abs(other.item() - loss.item()) > 1e-6 * abs(loss.item()), (other, loss)
    assert fast(*batch[:3]).shape == (4, batch[2].shape[1], V_TGT)


def test_command_line_on_gpu(tmp_path):
    """prepare -> train --device cuda (eager with --no-cuda-graphs, and by default, its updates replayed as CUDA
    graphs) -> translate / evaluate --device cuda, as a user with a GPU runs it."""
    from test_pipeline import dtmt
    from test_train import make_toy_corpus

    raw = make_toy_corpus(tmp_path / "raw", n_train=640, n_dev=0, n_test=0)
    data = str(tmp_path / "data")
    dtmt("prepare", "files", "--src", os.path.join(raw, "train.es"), "--tgt", os.path.join(raw, "train.en"),
         "--out", data, "--holdout", "20")
    run = str(tmp_path / "run")
    r = dtmt("train", "--data", data, "--model", "dtmt", "--out", run, "--vocab-size", "60", "--opt", "embed_dim=32",
             "--opt", "hidden_size=64", "--max-tokens", "600", "--lr", "3e-3", "--max-steps", "300",
             "--valid-every", "100", "--log-every", "50", "--progress", "lines", "--device", DEVICE, "--no-cuda-graphs")
    assert "stopped: reached --max-steps 300" in r.stdout
    assert "updates replayed" not in r.stdout
    if DEVICE == "cuda":   # the updates replayed as CUDA graphs, the command line's default on one GPU
        r = dtmt("train", "--data", data, "--model", "dtmt", "--out", str(tmp_path / "graphed"), "--vocab-size", "60",
                 "--opt", "embed_dim=32", "--opt", "hidden_size=64", "--max-tokens", "600", "--lr", "3e-3",
                 "--max-steps", "60", "--valid-every", "30", "--log-every", "10", "--progress", "lines", "--device",
                 DEVICE)
        replayed = re.search(r"(\d+) of (\d+) updates replayed", r.stdout)
        assert replayed and int(replayed[1]) >= 30, r.stdout
    src_lines = open(os.path.join(data, "test.es"), encoding="utf-8").read().splitlines()
    r = dtmt("translate", "--checkpoint", os.path.join(run, "best.pt"), "--beam", "3", "--quiet", "--device", DEVICE,
             stdin="\n".join(src_lines[:3]) + "\n")
    assert len(r.stdout.splitlines()) == 3
    out = str(tmp_path / "eval")
    dtmt("evaluate", "--checkpoint", os.path.join(run, "best.pt"), "--data", data, "--split", "test",
         "--out-dir", out, "--device", DEVICE)
    with open(os.path.join(out, "scores.json")) as f:
        bleu = json.load(f)["bleu"]
    assert bleu > 30
    for amp in ("bf16", "fp16") if DEVICE == "cuda" else ():   # 16-bit decoding: BLEU within 2 of float32's
        dtmt("evaluate", "--checkpoint", os.path.join(run, "best.pt"), "--data", data, "--split", "test",
             "--out-dir", f"{out}-{amp}", "--device", DEVICE, "--amp", amp)
        with open(os.path.join(f"{out}-{amp}", "scores.json")) as f:
            assert abs(json.load(f)["bleu"] - bleu) < 2, amp
