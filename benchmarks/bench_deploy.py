"""Decoding as people deploy it: dtmt's recurrent decoders against CTranslate2 (issue 25, item 1).

    python benchmarks/bench_deploy.py --transformer runs/transformer/best.pt \\
        --system dtmt=benchmarks/out/peers_30m_b/dtmt/best.pt --system rnnsearch-atr=runs/rnnsearch-atr/best.pt
    python benchmarks/bench_deploy.py --train 30m            # trains what is missing first (dtmt train, 1 thread)
    python benchmarks/bench_deploy.py --setup-only           # only make the CTranslate2 environment

CTranslate2 is never a dependency of dtmt: on first use the script makes a virtual environment of its own
(--peer-env, default benchmarks/out/peers/env-ct2) holding ctranslate2 (CT2_VERSION), numpy and sentencepiece,
and runs benchmarks/peers/ct2_run.py there.

What it does, in one run:
1. converts the package's own `transformer` checkpoint to a CTranslate2 float32 model: the weights, exported as
   numpy arrays under dtmt's names, become a CTranslate2 TransformerSpec (pre-norm, embeddings scaled by sqrt(d)
   plus dtmt's sinusoidal table, the output projection tied to the target embedding);
2. checks the conversion: CTranslate2's log-probability of every target piece of `--check` dev pairs must equal
   dtmt's teacher-forced one (max difference <= 1e-3), else it stops;
3. times, on the test split's sources (`--sentences`, default all), beam 4, for each thread count of `--threads`:
   each `--system` checkpoint decoded by dtmt in float32 and with int8 weight matrices (`--int8`; leave out
   with --no-int8), and with `--early-stop` also in float32 under that stopping rule (`translate`, the library
   call of `dtmt translate`; batch 1 is one sentence a call, as an interactive user or `dtmt serve` with one
   client gets it; batched is `translate`'s own batching by `--max-tokens`), the transformer decoded by dtmt's
   PyTorch decoder (batched), and by CTranslate2 at batch 1 and at `--ct2-batch` (32, CTranslate2's usual
   setting), each with its two CPU GEMM backends (MKL, its x86 default, and CT2_USE_MKL=0; the faster counts),
   and CTranslate2 with int8 weights (compute_type int8, both backends, both batch sizes; leave out with
   --no-ct2-int8) beside `dtmt --int8`; model loading excluded
   everywhere, the same sentences in the same order. The sentences are cut into `--rounds` consecutive parts
   (default 4) and each round decodes one part with every decoder of the thread count in turn, the order reversed
   from one round to the next, so that the VM's drift within a run falls on every decoder alike
   (docs/design/decoding.md, "Measuring"); a decoder's time is the sum of its rounds, and each ratio also shows
   its range over the rounds;
4. the BLEU of every output against the references (sacrebleu, as `dtmt evaluate`), sentences/s and output
   words/s, and the ratios the issue sets goals for: each system at batch 1 over CTranslate2 at batch 1 (goal
   >= 1.5) and batched over the faster of CTranslate2 batched and OpenNMT-py's LSTM (goal >= 1.0), CTranslate2 in
   float32 as the goal says, each also within every round (`ratios`); and `dtmt --int8` over CTranslate2 int8 at
   the same batch kind, no goal. OpenNMT-py's LSTM is decoded in this run by OpenNMT-py's own translator with
   `--peer-lstm-run DIR` (the LSTM a bench_peers.py run trained in DIR; the same sentences, thread counts and
   beam, batches of --max-tokens source tokens, its BLEU beside the others), or given as a figure from elsewhere
   with `--peer-lstm THREADS=RATE`.
Length normalisation differs: dtmt uses GNMT's ((5+|y|)/6)^0.6, CTranslate2 offers |y|^alpha only (alpha 0.6
here); the BLEU columns show what each gives.
Output: OUT/bench_deploy.md (machine, command, table) and OUT/bench_deploy.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

CT2_VERSION = "4.8.5"
CT2_RUN = os.path.join(HERE, "peers", "ct2_run.py")


def run(cmd, log, env=None) -> str:
    """Runs `cmd`, appending its output to `log`; returns its stdout; RuntimeError naming the log on failure."""
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n" + res.stdout + res.stderr)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (exit {res.returncode}); see {log}")
    return res.stdout


def ensure_ct2_env(env_dir: str, log: str) -> str:
    """The CTranslate2 environment, made on first use (bench_peers.ensure_env); returns its python."""
    from bench_peers import ensure_env

    return ensure_env(env_dir, {"ctranslate2": CT2_VERSION},
                      [[f"ctranslate2=={CT2_VERSION}", "numpy", "sentencepiece"]],
                      "import ctranslate2; print('ctranslate2', ctranslate2.__version__)", f"CTranslate2 {CT2_VERSION}",
                      log)


def export_transformer(ckpt: str, out_dir: str) -> tuple:
    """Writes the transformer's weights (numpy, dtmt's names, plus `pe` and `readout.bias`) and its configuration
    with both vocabularies' pieces; returns (weights path, config path)."""
    import numpy as np

    from dtmt_models.models.checkpoint import load_model

    model, sv, tv, c = load_model(ckpt)
    if c["model_name"] != "transformer":
        raise ValueError(f"{ckpt}: a {c['model_name']} checkpoint, not a transformer")
    arrays = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    arrays["pe"] = model.pe.float().numpy()
    arrays["readout.bias"] = arrays.pop("readout.proj.bias")
    os.makedirs(out_dir, exist_ok=True)
    weights, config = os.path.join(out_dir, "weights.npz"), os.path.join(out_dir, "config.json")
    np.savez(weights, **arrays)
    cfg = {"embed_dim": model.embed_dim, "heads": model.transformer.encoder.layers[0].self_attn.num_heads,
           "encoder_layers": len(model.transformer.encoder.layers),
           "decoder_layers": len(model.transformer.decoder.layers),
           "src_pieces": [sv.sp.id_to_piece(i) for i in range(len(sv))],
           "tgt_pieces": [tv.sp.id_to_piece(i) for i in range(len(tv))]}
    with open(config, "w") as f:
        json.dump(cfg, f)
    return weights, config


def teacher_forced_log_probs(ckpt: str, sources, targets):
    """dtmt's log-probability of each target piece (EOS included), per pair, and the piece strings of both sides."""
    import torch

    from dtmt_models.data.vocabulary import BOS, EOS
    from dtmt_models.models.checkpoint import load_model

    model, sv, tv, _ = load_model(ckpt)
    out, src_pieces, tgt_pieces = [], [], []
    with torch.no_grad():
        for s, t in zip(sources, targets):
            x, y = sv.encode(s), tv.encode(t) + [EOS]
            lp = model(torch.tensor([x]), torch.tensor([len(x)]), torch.tensor([[BOS] + y[:-1]]))[0]
            out.append(lp[torch.arange(len(y)), torch.tensor(y)].tolist())
            src_pieces.append(" ".join(sv.sp.id_to_piece(i) for i in x))
            tgt_pieces.append(" ".join(tv.sp.id_to_piece(i) for i in y[:-1]))
    return out, src_pieces, tgt_pieces


def time_dtmt(ckpt: str, sentences, threads: int, batch_one: bool, max_tokens: int, beam: int,
              int8: bool = False, early_stop: bool = False) -> dict:
    """Decodes with dtmt in this process on `threads` threads (restored after), with int8 weight matrices if
    `int8` (`dtmt translate --int8`), with beam search's `early_stop` rule if `early_stop` (`dtmt translate
    --early-stop`); returns seconds (model load and int8 conversion excluded) and the one-best outputs."""
    import torch
    from common import torch_threads

    from dtmt_models.decoding.translate import translate
    from dtmt_models.models.checkpoint import load_model

    model, sv, tv, c = load_model(ckpt)
    with torch_threads(threads), torch.no_grad():
        model.eval()
        decoder = model.inference_decoder(int8=int8)
        translate(model, sv, tv, sentences[:2], beam=beam, decoder=decoder)           # warm-up
        t0 = time.perf_counter()
        if batch_one:
            hyps = [translate(model, sv, tv, [s], beam=beam, decoder=decoder, early_stop=early_stop)[0][0][0]
                    for s in sentences]
        else:
            hyps = [h[0][0] for h in translate(model, sv, tv, sentences, beam=beam, max_tokens=max_tokens,
                                               decoder=decoder, early_stop=early_stop)]
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "hyps": hyps, "model": c["model_name"],
            "parameters": sum(p.numel() for p in model.parameters())}


# CTranslate2's CPU GEMM backends as a user can choose them (its CT2_USE_MKL variable): Intel MKL (its default on
# x86) and its other one (oneDNN). Each setting is timed with both and the faster counts: on some VMs one of them
# collapses with 2 threads (docs/design/decoding.md, "Measuring").
CT2_BACKENDS = {"mkl": {}, "no-mkl": {"CT2_USE_MKL": "0"}}


def time_ct2(py: str, model_dir: str, src: str, tv, threads: int, batch: int, beam: int, work: str, log: str,
             backend: str = "mkl", compute_type: str = "float32") -> dict:
    """CTranslate2 over the source pieces in `src` (one sentence a line) with one of CT2_BACKENDS, computing in
    `compute_type` (float32, or int8: its weights quantized when the model loads); seconds (its own timing, the
    model load excluded) and the detokenised one-best outputs."""
    out = os.path.join(work, f"ct2.b{batch}.t{threads}.{backend}.{compute_type}.{os.path.basename(src)}.out")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), **CT2_BACKENDS[backend])
    line = run([py, CT2_RUN, "translate", "--model", model_dir, "--src", src, "--out", out, "--beam", str(beam),
                "--batch", str(batch), "--threads", str(threads), "--compute-type", compute_type], log,
               env=env).strip().splitlines()[-1]
    with open(out, encoding="utf-8") as f:
        hyps = [tv.sp.decode(line_.split()) for line_ in f.read().splitlines()]
    return {"seconds": json.loads(line)["seconds"], "hyps": hyps}


def lstm_run(run_dir: str, data: str) -> dict:
    """The OpenNMT-py LSTM a `bench_peers.py --out run_dir` run trained: its last checkpoint (the step of
    onmt-lstm/train.jsonl's end record, as bench_peers decodes it) and the SentencePiece models of its pieces/."""
    from bench_peers import read_jsonl

    from dtmt_models.data.corpus import read_manifest

    journal = os.path.join(run_dir, "onmt-lstm", "train.jsonl")
    if not os.path.isfile(journal):
        raise FileNotFoundError(f"{run_dir}: no onmt-lstm/train.jsonl (not a bench_peers.py --out directory with "
                                "the OpenNMT-py LSTM)")
    ends = [r for r in read_jsonl(journal) if r["kind"] == "end"]
    if not ends:
        raise RuntimeError(f"{journal}: the LSTM's training did not finish (no end record)")
    model = os.path.join(run_dir, "onmt-lstm", f"model_step_{ends[-1]['step']}.pt")
    manifest = read_manifest(data)
    spm = {side: os.path.join(run_dir, "pieces", f"spm.{manifest[side + '_lang']}.model") for side in ("src", "tgt")}
    for path in (model, *spm.values()):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing")
    return {"model": model, "src_spm": spm["src"], "tgt_spm": spm["tgt"]}


def time_lstm(py: str, lstm: dict, sentences, threads: int, beam: int, max_tokens: int, work: str,
              log: str) -> dict:
    """OpenNMT-py's own translator (bench_peers.onmt_translate: batches of `max_tokens` source tokens, GNMT's
    length penalty with alpha 0.6, as dtmt) over `sentences` cut by the LSTM's own SentencePiece model; seconds
    (its own timing, model load excluded) and the detokenised one-best outputs."""
    from bench_peers import onmt_translate

    from dtmt_models.data.vocabulary import Vocabulary

    sv, tv = Vocabulary.load(lstm["src_spm"]), Vocabulary.load(lstm["tgt_spm"])
    src = os.path.join(work, "lstm.test.src.pieces")
    with open(src, "w", encoding="utf-8") as f:
        f.write("".join(" ".join(sv.sp.encode(s, out_type=str)) + "\n" for s in sentences))
    out = os.path.join(work, f"lstm.t{threads}.hyp")
    seconds = onmt_translate(py, lstm["model"], src, out, beam, threads, log, tv, max_tokens)["seconds"]
    with open(out, encoding="utf-8") as f:
        hyps = f.read().splitlines()
    if len(hyps) != len(sentences):
        raise RuntimeError(f"OpenNMT-py gave {len(hyps)} translations for {len(sentences)} sentences; see {log}")
    return {"seconds": seconds, "hyps": hyps}


def cut(n: int, parts: int) -> list:
    """`parts` consecutive (start, end) ranges covering range(n), sizes differing by at most one (fewer parts if
    n < parts; none if n is 0)."""
    parts = max(1, min(parts, n))
    bounds = [n * k // parts for k in range(parts + 1)]
    return [(bounds[k], bounds[k + 1]) for k in range(parts) if bounds[k] < bounds[k + 1]]


def alternate(decoders: dict, sentences, rounds: int, say=None) -> dict:
    """Times every decoder of `decoders` (name -> f(first, sentences) -> {"seconds", "hyps"}, where `first` is the
    index of the part's first sentence) on the same sentences, cut into `rounds` consecutive parts: round k runs
    every decoder on part k, in the given order on even rounds and the reverse on odd ones, so that a machine
    whose speed drifts during the run slows every decoder alike. Returns name -> {"seconds": the sum over the
    rounds, "hyps": the parts' outputs in order, "round_seconds": each round's seconds}; `say(line)`, if given,
    hears of each decoding as it ends."""
    out = {name: {"seconds": 0.0, "hyps": [], "round_seconds": []} for name in decoders}
    names = list(decoders)
    parts = cut(len(sentences), rounds)
    for k, (start, end) in enumerate(parts):
        for name in names if k % 2 == 0 else names[::-1]:
            r = decoders[name](start, sentences[start:end])
            if say:
                say(f"round {k + 1}/{len(parts)}, sentences {start}-{end - 1}: {name} {r['seconds']:.2f} s")
            if len(r["hyps"]) != end - start:
                raise RuntimeError(f"{name} gave {len(r['hyps'])} translations for {end - start} sentences")
            if not r["seconds"] > 0:   # OpenNMT-py times itself to 0.1 s: too small a part
                raise RuntimeError(f"{name} reported {r['seconds']} s for sentences {start}-{end - 1}; use fewer "
                                   "--rounds")
            out[name]["seconds"] += r["seconds"]
            out[name]["hyps"] += r["hyps"]
            out[name]["round_seconds"].append(r["seconds"])
    return out


def ratios(rows: list, ct2_batch: int, lstm: dict) -> None:
    """Adds to each row of a recurrent system decoded by dtmt (not the transformer) the goal's ratios, over the
    whole run ("vs") and within each round ("vs_rounds"), and "goal": batch 1 over the faster CTranslate2 float32
    backend at batch 1 (goal 1.5); batched over the faster of CTranslate2 float32 at `ct2_batch` and OpenNMT-py's
    LSTM (goal 1.0): its "opennmt-py" row of the same thread count where there is one, else lstm[threads] (a
    figure from elsewhere, the same for every round) where given. "dtmt --int8" rows also get "vs_int8" /
    "vs_int8_rounds": over the faster CTranslate2 int8 backend at the same batch kind, where it was timed."""
    def ct2_best(row, int8):
        peers = [r for r in rows if r["decoder"].startswith("ctranslate2") and r["threads"] == row["threads"]
                 and r["decoder"].endswith(" int8") == int8
                 and r["batch"] == ("1" if row["batch"] == "1" else str(ct2_batch))]
        if not peers:
            return None, None
        return (max(r["sentences_per_s"] for r in peers),
                [max(rates) for rates in zip(*(r["round_rates"] for r in peers))])

    for row in rows:
        if not row["decoder"].startswith("dtmt") or row["model"] == "transformer":
            continue
        if row["decoder"] == "dtmt --int8":   # beside the goal: int8 against int8
            best, best_rounds = ct2_best(row, True)
            if best is not None:
                row["vs_int8"] = row["sentences_per_s"] / best
                row["vs_int8_rounds"] = [ours / theirs for ours, theirs in zip(row["round_rates"], best_rounds)]
        best, best_rounds = ct2_best(row, False)
        if row["batch"] == "1":
            row["goal"] = 1.5
        else:
            row["goal"] = 1.0
            measured = [r for r in rows if r["decoder"] == "opennmt-py" and r["threads"] == row["threads"]]
            if measured:
                best = max(best, measured[0]["sentences_per_s"])
                best_rounds = [max(x, y) for x, y in zip(best_rounds, measured[0]["round_rates"])]
            elif row["threads"] in lstm:
                best = max(best, lstm[row["threads"]])
                best_rounds = [max(x, lstm[row["threads"]]) for x in best_rounds]
        row["vs"] = row["sentences_per_s"] / best
        row["vs_rounds"] = [ours / theirs for ours, theirs in zip(row["round_rates"], best_rounds)]


def train_missing(name: str, data: str, budget: str, out: str, log: str) -> str:
    ckpt = os.path.join(out, "best.pt")
    if not os.path.isfile(ckpt):
        print(f"== training {name} for {budget} (1 thread) into {out}", flush=True)
        run([sys.executable, "-m", "dtmt_models.cli", "train", "--data", data, "--model", name, "--max-time", budget,
             "--threads", "1", "--valid-every", "250", "--progress", "lines", "--out", out], log)
    return ckpt


def main(argv=None):
    from common import machine_name, write_report
    from sacrebleu.metrics import BLEU

    from dtmt_models.data.corpus import corpus_paths, read_parallel
    from dtmt_models.models.checkpoint import read_checkpoint
    from dtmt_models.data.vocabulary import Vocabulary

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--transformer", help="dtmt's transformer checkpoint (default: OUT/train_transformer/best.pt)")
    p.add_argument("--system", action="append", default=[], metavar="NAME=CKPT",
                   help="a recurrent system's checkpoint (repeatable; default dtmt and rnnsearch-atr under OUT)")
    p.add_argument("--train", metavar="BUDGET", help="train the missing checkpoints first, e.g. 30m")
    p.add_argument("--data", default=os.path.join(ROOT, "data", "bible"))
    p.add_argument("--sentences", type=int, default=0, help="the first N test sources (0: all)")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rounds", type=int, default=4,
                   help="consecutive parts of the sentences, each decoded by every decoder in turn (see 3.)")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=2000, help="dtmt's batched decoding budget")
    p.add_argument("--ct2-batch", type=int, default=32)
    p.add_argument("--check", type=int, default=20, help="dev pairs for the conversion check")
    p.add_argument("--peer-lstm", action="append", default=[], metavar="THREADS=RATE",
                   help="OpenNMT-py's LSTM batched sentences/s on this machine at THREADS threads (bench_peers.py's "
                        "decode column), for the batched goal; repeatable")
    p.add_argument("--peer-lstm-run", metavar="DIR",
                   help="a bench_peers.py --out directory: its OpenNMT-py LSTM is decoded here, in this run, on the "
                        "same sentences and thread counts (batched, beam --beam), and its rate counts for the batched "
                        "goal in place of --peer-lstm's")
    p.add_argument("--peer-env", default=os.path.join(HERE, "out", "peers", "env-ct2"))
    p.add_argument("--onmt-env", default=os.path.join(HERE, "out", "peers", "env-onmt"),
                   help="OpenNMT-py's environment (bench_peers.py makes it on first use)")
    p.add_argument("--out", default=os.path.join(HERE, "out", "deploy"))
    p.add_argument("--no-int8", dest="int8", action="store_false",
                   help="leave out the int8 decodings (`dtmt translate --int8`) of each --system")
    p.add_argument("--no-ct2-int8", dest="ct2_int8", action="store_false",
                   help="leave out CTranslate2 with int8 weights (compute_type int8), the peer of `dtmt --int8`")
    p.add_argument("--early-stop", action="store_true",
                   help="also decode each --system in float32 with `dtmt translate --early-stop` (a sentence ends "
                        "once beam hypotheses are finished: CTranslate2's own rule at its default patience 1), rows "
                        "'dtmt --early-stop' beside the default 'dtmt'")
    p.add_argument("--setup-only", action="store_true")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error("--rounds must be >= 1")
    if a.ct2_batch < 2:
        p.error("--ct2-batch must be >= 2 (batch 1 is timed anyway)")
    try:
        lstm = {int(t): float(r) for t, r in (x.split("=", 1) for x in a.peer_lstm)}
    except ValueError:
        p.error(f"--peer-lstm: THREADS=RATE, e.g. 1=57.4, got {a.peer_lstm}")
    os.makedirs(a.out, exist_ok=True)
    log = os.path.join(a.out, "bench_deploy.log")
    py = ensure_ct2_env(a.peer_env, log)
    if a.peer_lstm_run:
        from bench_peers import ensure_peer_env

        lstm_peer = lstm_run(a.peer_lstm_run, a.data)
        onmt_py = ensure_peer_env(a.onmt_env, log)
    if a.setup_only:
        return None
    systems = dict(s.split("=", 1) for s in a.system) if a.system else {
        name: os.path.join(a.out, f"train_{name}", "best.pt") for name in ("dtmt", "rnnsearch-atr")}
    transformer = a.transformer or os.path.join(a.out, "train_transformer", "best.pt")
    for name, ckpt in [("transformer", transformer)] + list(systems.items()):
        if not os.path.isfile(ckpt):
            if not a.train:
                p.error(f"{ckpt} does not exist (give the checkpoint, or --train 30m to train it)")
            trained = train_missing(name, a.data, a.train, os.path.dirname(ckpt), log)
            assert trained == ckpt
    # 1-2: convert, check
    work = os.path.join(a.out, "ct2")
    weights, config = export_transformer(transformer, work)
    model_dir = os.path.join(work, "model")
    run([py, CT2_RUN, "convert", "--weights", weights, "--config", config, "--out", model_dir], log)
    dev = read_parallel(*corpus_paths(a.data, "dev"))[:a.check]
    ours, src_p, tgt_p = teacher_forced_log_probs(transformer, [s for s, _ in dev], [t for _, t in dev])
    for name, lines in (("check.src", src_p), ("check.tgt", tgt_p)):
        with open(os.path.join(work, name), "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    scores_path = os.path.join(work, "check.json")
    run([py, CT2_RUN, "score", "--model", model_dir, "--src", os.path.join(work, "check.src"), "--tgt",
         os.path.join(work, "check.tgt"), "--out", scores_path], log)
    with open(scores_path) as f:
        theirs = json.load(f)
    if not ours or len(theirs) != len(ours) or any(len(x) != len(y) for x, y in zip(ours, theirs)):
        raise RuntimeError(f"the CTranslate2 scores do not line up with dtmt's ({len(theirs)} against {len(ours)})")
    diff = max(abs(x - y) for a_, b_ in zip(ours, theirs) for x, y in zip(a_, b_))
    if not diff <= 1e-3:   # NaN fails too
        raise RuntimeError(f"the CTranslate2 conversion is wrong: log-probabilities differ by up to {diff:.2e}")
    print(f"conversion check: {len(ours)} dev pairs, {sum(map(len, ours))} pieces, max |Δ log p| = {diff:.1e}",
          flush=True)
    # 3-4: timings
    src_path, ref_path = corpus_paths(a.data, "test")
    pairs = read_parallel(src_path, ref_path)
    if a.sentences:
        pairs = pairs[:a.sentences]
    sentences, refs = [s for s, _ in pairs], [t for _, t in pairs]
    ck = read_checkpoint(transformer)
    sv, tv = Vocabulary(ck["src_vocab"]), Vocabulary(ck["tgt_vocab"])
    parts = cut(len(sentences), a.rounds)
    src_pieces = {}   # a part's first sentence -> CTranslate2's input for that part, written once for every run
    for start, end in parts:
        src_pieces[start] = os.path.join(work, f"test.src.{start}-{end}.pieces")
        with open(src_pieces[start], "w", encoding="utf-8") as f:
            f.write("".join(" ".join(sv.sp.id_to_piece(i) for i in sv.encode(s)) + "\n"
                            for s in sentences[start:end]))
    sizes = [end - start for start, end in parts]
    rows = []

    def add(decoder, model, ckpt, threads, batch, r):
        words = sum(len(h.split()) for h in r["hyps"])
        row = {"decoder": decoder, "model": model, "checkpoint": os.path.relpath(ckpt, ROOT), "threads": threads,
               "batch": batch, "seconds": r["seconds"], "sentences_per_s": len(sentences) / r["seconds"],
               "words_per_s": words / r["seconds"], "bleu": BLEU().corpus_score(r["hyps"], [refs]).score,
               "round_rates": [n / t for n, t in zip(sizes, r["round_seconds"])]}
        rows.append(row)
        print(f"{decoder:>12s} {model:>14s} threads {threads} batch {batch:>7s}: {row['sentences_per_s']:6.1f} "
              f"sentences/s, {row['words_per_s']:7.0f} words/s, BLEU {row['bleu']:.2f}", flush=True)

    for threads in (int(t) for t in a.threads.split(",")):
        decoders, ckpts = {}, {}   # "decoder | model | batch" -> f(first, part) -> {"seconds", "hyps"}; its file

        def put(decoder, model, batch, ckpt, f):
            decoders[f"{decoder} | {model} | {batch}"], ckpts[f"{decoder} | {model} | {batch}"] = f, ckpt

        # dtmt's variants of each system: row name -> time_dtmt's options
        variants = {"dtmt": {}, **({"dtmt --int8": {"int8": True}} if a.int8 else {}),
                    **({"dtmt --early-stop": {"early_stop": True}} if a.early_stop else {})}
        for name, ckpt in systems.items():
            for decoder, options in variants.items():
                for one, batch in ((True, "1"), (False, f"≤{a.max_tokens}t")):
                    put(decoder, name, batch, ckpt,
                        lambda first, part, ckpt=ckpt, one=one, options=options, threads=threads:
                        time_dtmt(ckpt, part, threads, one, a.max_tokens, a.beam, **options))
        put("dtmt", "transformer", f"≤{a.max_tokens}t", transformer,
            lambda first, part, threads=threads: time_dtmt(transformer, part, threads, False, a.max_tokens, a.beam))
        for compute_type in ("float32", "int8") if a.ct2_int8 and a.int8 else ("float32",):
            for batch in (1, a.ct2_batch):
                for backend in CT2_BACKENDS:
                    put(f"ctranslate2 {backend}{' int8' if compute_type == 'int8' else ''}", "transformer", batch,
                        transformer,
                        lambda first, part, batch=batch, backend=backend, threads=threads, ct=compute_type:
                        time_ct2(py, model_dir, src_pieces[first], tv, threads, batch, a.beam, work, log, backend,
                                 ct))
        if a.peer_lstm_run:
            put("opennmt-py", "lstm", f"≤{a.max_tokens}t", lstm_peer["model"],
                lambda first, part, threads=threads:
                time_lstm(onmt_py, lstm_peer, part, threads, a.beam, a.max_tokens, work, log))
        print(f"== {threads} thread(s): {len(decoders)} decoders, {len(parts)} rounds of {min(sizes)}-{max(sizes)} "
              "sentences", flush=True)
        for key, r in alternate(decoders, sentences, a.rounds, say=lambda x: print(x, flush=True)).items():
            decoder, model, batch = key.split(" | ")
            add(decoder, model, ckpts[key], threads, batch, r)
            if decoder == "opennmt-py":
                lstm[threads] = rows[-1]["sentences_per_s"]   # measured here: it replaces a --peer-lstm figure
    ratios(rows, a.ct2_batch, lstm)
    cmd = "python benchmarks/bench_deploy.py " + " ".join(argv if argv is not None else sys.argv[1:])
    machine = machine_name(threads=False)   # a column here
    int8_column = any("vs_int8" in r for r in rows)
    md = [f"Decoding against CTranslate2 {CT2_VERSION}: {machine}; beam {a.beam}; the {len(sentences)} first "
          f"test sources of {os.path.relpath(a.data, ROOT)} in {len(parts)} rounds; model loading excluded. "
          f"Conversion check: max |Δ log p| = {diff:.1e} over {sum(map(len, ours))} dev pieces. "
          f"Command: `{cmd.strip()}`", "",
          "| decoder | model | threads | batch | sentences/s | words/s | BLEU | vs goal |" +
          (" vs CTranslate2 int8 |" if int8_column else ""),
          "|---|---|---:|---|---:|---:|---:|---|" + ("---|" if int8_column else "")]
    for r in rows:
        vs = (f"{r['vs']:.2f}× ({min(r['vs_rounds']):.2f}-{max(r['vs_rounds']):.2f}; goal ≥ {r['goal']})"
              if "vs" in r else "")
        vs8 = (f"{r['vs_int8']:.2f}× ({min(r['vs_int8_rounds']):.2f}-{max(r['vs_int8_rounds']):.2f})"
               if "vs_int8" in r else "")
        md.append(f"| {r['decoder']} | {r['model']} | {r['threads']} | {r['batch']} | {r['sentences_per_s']:.1f} | "
                  f"{r['words_per_s']:.0f} | {r['bleu']:.2f} | {vs} |" + (f" {vs8} |" if int8_column else ""))
    md.append("")
    lstm_rates = ", ".join(f"{r:.1f} sentences/s at {t} thread(s)" for t, r in sorted(lstm.items()))
    if a.peer_lstm_run:
        lstm_rates += f", decoded in this run: {os.path.relpath(lstm_peer['model'], ROOT)}"
    md.append("vs: batch 1 over CTranslate2 batch 1; batched over the faster of CTranslate2 batched and OpenNMT-py's "
              f"LSTM ({lstm_rates or 'no figure given'}), same thread count; CTranslate2 as the faster of its two CPU "
              "backends, mkl (its default) and no-mkl (CT2_USE_MKL=0), in float32 as the goal says; "
              + ("vs CTranslate2 int8: `dtmt --int8` over CTranslate2 with int8 weights (compute_type int8) at the "
                 "same batch kind, no goal; " if int8_column else "") + "in brackets, the lowest and highest of the "
              f"same ratio within each of the {len(parts)} rounds (each round: every decoder of the thread count "
              "on the same part of the sentences, one after the other).")
    text = "\n".join(md) + "\n"
    write_report(a.out, "bench_deploy", text, {"rows": rows, "conversion_max_abs_diff": diff, "machine": machine})
    print(text)
    return rows


if __name__ == "__main__":
    main()
