"""Decoding speed: words/s and ms per sentence, beam 1 and beam 4, batch 1 and batched, every system.

    python benchmarks/bench_decode.py                       # untrained models, fixed output length
    python benchmarks/bench_decode.py --checkpoints runs/dtmt/best.pt runs/transformer/best.pt \
        --input data/bible/test.es --sentences 100          # trained models on real sentences

Two modes:
  synthetic (default)  every system of --systems built from its `small` preset with random weights; sources of
                       --src-len tokens; the end-of-sentence token is suppressed (log-prob −1e4) so that every
                       system decodes exactly --tgt-len steps per hypothesis: a like-for-like cost per word.
  checkpoints          trained models translate the first --sentences lines of --input (real lengths and
                       early stopping); words are the whitespace words of the detokenised output.
Each model's decoder (`inference_decoder()`) is built once, before the timing, as `dtmt translate` and `dtmt serve`
build it. For each setting (beam, batch) every model translates the sentences once to warm up, then --repeat rounds run
one pass of every model in turn (so that a drift of the machine's speed moves all models alike: the ratios are
what the bars judge); the median pass is kept.
`batched` uses batches of --batch-size sentences. The transformer decodes incrementally with a cache (see
dtmt_models/models/systems/transformer.py).

Size-matched baselines (synthetic mode, unless --no-match): the issue's bar compares each recurrent system with
"the transformer baseline of similar size", so for each recurrent system a transformer with the small preset's
layers and heads is built at the model width (a multiple of 8, feed-forward 4×) whose parameter count is
nearest to the system's; the `× matched` column is the ratio to that one, `× transformer` to the small preset.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import torch  # noqa: E402

from dtmt_models.decoding.beam_search import beam_search  # noqa: E402
from dtmt_models.data.vocabulary import EOS  # noqa: E402


class NoEOS(torch.nn.Module):
    """Wraps a model so that EOS is (almost) never chosen before the length limit."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def inference_decoder(self):
        """The wrapped model's decoder, wrapped (itself when it wraps a decoder already: beam_search then builds
        nothing)."""
        build = getattr(self.model, "inference_decoder", None)   # (a decoder without one: an AutocastDecoder)
        decoder = self.model if build is None else build()
        return self if decoder is self.model else NoEOS(decoder)

    def encode(self, src, lengths):
        return self.model.encode(src, lengths)

    def step(self, state, prev):
        log_probs, state = self.model.step(state, prev)
        log_probs = log_probs.clone()
        log_probs[:, EOS] = -1e4
        return log_probs, state

    def reorder(self, state, index):
        return self.model.reorder(state, index)


LOOPS = {"host": False, "device": True, "graph": True}   # --loops: beam_search's on_device for each


def decode_pass(model, batches, beam, max_len_a, max_len_b, loop=None):
    """(seconds, the best hypothesis' tokens of each sentence) of one pass over the batches. `loop`: None for
    beam_search's default, or one of LOOPS: the Python loop (host), the loop whose bookkeeping stays on the device
    (device), the same with its steps replayed as CUDA graphs (graph, device_search.GRAPHS). The clock stops when
    the hypotheses are on the host."""
    from dtmt_models.decoding import device_search

    graphs, device_search.GRAPHS = device_search.GRAPHS, loop == "graph"
    try:
        t0 = time.perf_counter()
        best = [hyps[0].tokens for src, lengths in batches
                for hyps in beam_search(model, src, lengths, beam=beam, alpha=0.6, max_len_a=max_len_a,
                                        max_len_b=max_len_b, on_device=None if loop is None else LOOPS[loop])]
        return time.perf_counter() - t0, best
    finally:
        device_search.GRAPHS = graphs


def time_decode(model, batches, beam, repeat, max_len_a, max_len_b, loop=None):
    """(median seconds over `repeat` passes after a warm-up pass, the best hypothesis' tokens of each sentence)."""
    return time_interleaved([(model, batches, max_len_a, max_len_b, loop)], beam, repeat)[0]


def time_interleaved(jobs, beam, repeat):
    """For jobs [(model, batches, max_len_a, max_len_b, loop)]: one warm-up pass each, then `repeat` rounds in
    which every job runs one pass in turn, so that each model's passes spread over the same minutes and a drift of
    the machine's speed (large on a shared VM) moves all of them alike. Returns [(median seconds, best tokens)]."""
    for job in jobs:
        decode_pass(*job[:2], beam, *job[2:])
    times, best = [[] for _ in jobs], [None] * len(jobs)
    for r in range(repeat):
        for i in [(r + j) % len(jobs) for j in range(len(jobs))]:   # rotated: no job always follows the same one
            seconds, best[i] = decode_pass(*jobs[i][:2], beam, *jobs[i][2:])
            times[i].append(seconds)
    return [(statistics.median(t), b) for t, b in zip(times, best)]


class TableModel:
    """No network: the next-token log-probs are a fixed random [V, V] table indexed by the previous token, so a
    decode with it times the beam search's own bookkeeping (--bookkeeping)."""

    def __init__(self, vocab: int):
        g = torch.Generator().manual_seed(0)
        self.table = torch.log_softmax(torch.randn(vocab, vocab, generator=g), -1)
        self.table[:, EOS] = -1e4

    def encode(self, src, lengths):
        return {"dummy": torch.zeros(src.shape[0], 1)}

    def step(self, state, prev):
        return self.table[prev], state

    @staticmethod
    def reorder(state, index):
        return {k: v.index_select(0, index) for k, v in state.items()}


def count_params(model) -> int:
    return sum(q.numel() for q in model.parameters())


def matched_transformer(target: int, vocab: int):
    """(width, options) of the transformer with the small preset's layers and heads whose parameter count is
    nearest to `target`: widths are multiples of 8 (and of the heads), feed-forward 4× the width."""
    from dtmt_models.models.presets import get_preset
    from dtmt_models.models.registry import build_model

    base = dict(get_preset("transformer", "small")["model"])
    step = 8 * base["heads"] // math.gcd(8, base["heads"])
    best = None
    for width in range(step, 1025, step):
        options = dict(base, embed_dim=width, hidden_size=4 * width)
        with torch.device("meta"):
            n = count_params(build_model("transformer", vocab, vocab, **options))
        if best is None or abs(n - target) < best[0]:
            best = (abs(n - target), width, options)
        if n > target:
            break
    return best[1], best[2]


def make_batches(sentences, batch_size):
    """sentences: lists of ids -> [(src [B, S], lengths [B])] in the given order."""
    from dtmt_models.data.vocabulary import PAD

    out = []
    for i in range(0, len(sentences), batch_size):
        chunk = sentences[i:i + batch_size]
        S = max(len(s) for s in chunk)
        src = torch.full((len(chunk), S), PAD, dtype=torch.long)
        for b, s in enumerate(chunk):
            src[b, :len(s)] = torch.tensor(s)
        out.append((src, torch.tensor([len(s) for s in chunk])))
    return out


def main(argv=None):
    from common import (check_checkpoint, check_options, machine_name, make_out_dir, provenance, provenance_line,
                        write_csv)

    from dtmt_models.models.presets import PRESETS, get_preset
    from dtmt_models.models.registry import build_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", nargs="+", default=sorted(PRESETS))
    p.add_argument("--checkpoints", nargs="*", default=None)
    p.add_argument("--input", default=None, help="source sentences (checkpoint mode)")
    p.add_argument("--sentences", type=int, default=16)
    p.add_argument("--src-len", type=int, default=25)
    p.add_argument("--tgt-len", type=int, default=25)
    p.add_argument("--vocab", type=int, default=4000)
    p.add_argument("--beams", type=int, nargs="+", default=[1, 4])
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where the models and batches are (cuda: the GPU)")
    p.add_argument("--loops", nargs="+", choices=sorted(LOOPS), default=None,
                   help="beam search's loop, each timed in the same run: host (the Python loop, three reads a "
                        "step), device (the bookkeeping on the device, a read every few steps) or graph (the same, "
                        "its steps replayed as CUDA graphs); default: beam_search's choice")
    p.add_argument("--bookkeeping", action="store_true",
                   help="time only the beam search's bookkeeping (a table model, no network): ms per step")
    p.add_argument("--amp", nargs="+", choices=("off", "bf16", "fp16"), default=["off"],
                   help="decode each model in each of these precisions in the same run, as `dtmt translate --amp` "
                        "(a 16-bit copy under autocast; `dtmt translate` offers it on the GPU only): rows named "
                        "MODEL [bf16], with × off, the ratio to the same model in float32")
    p.add_argument("--no-match", action="store_true", help="no size-matched transformers (synthetic mode)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=os.path.join(HERE, "out"))
    a = p.parse_args(argv)
    check_options(p, a, (("sentences", 1), ("src_len", 1), ("tgt_len", 1), ("vocab", 5), ("beams", 1),
                         ("batch_size", 1), ("repeat", 1), ("threads", 0)), systems=("systems", PRESETS),
                  device="device")
    if "graph" in (a.loops or []) and not a.device.startswith("cuda"):   # (labelled "graph", it ran the eager loop)
        p.error("--loops graph replays CUDA graphs: with --device cuda")
    if a.quick:   # (the options not given: a --sentences or --repeat given with it had been replaced without a word)
        for name, value in dict(sentences=2, src_len=5, tgt_len=4, vocab=100, repeat=1, batch_size=2).items():
            if getattr(a, name) == p.get_default(name):
                setattr(a, name, value)
    amps = list(dict.fromkeys(a.amp))
    lines = None
    if a.checkpoints:   # (each checked before anything runs: a missing one was a FileNotFoundError's traceback)
        from dtmt_models.data.corpus import CorpusError, read_lines

        if not a.input:
            p.error("--checkpoints needs --input")
        # (an empty line was a CorpusError; `dtmt translate` writes an empty line for it, decoding nothing)
        try:
            lines = [line for line in read_lines(a.input, allow_empty=True) if line.strip()][:a.sentences]
        except CorpusError as exc:   # (a missing or unreadable file: a traceback)
            p.error(f"--input {a.input}: {exc}")
        if not lines:   # (a division by zero after decoding)
            p.error(f"--input {a.input}: no sentences")
        for path in a.checkpoints:
            check_checkpoint(p, path, option="--checkpoints")
    if not a.bookkeeping:   # (the table's CSV)
        make_out_dir(p, a.out)
    record = provenance(__file__, argv, a.device)
    print(provenance_line(record), flush=True)

    def decoders(label, model):
        """(label, the model's decoder) in each --amp precision, as `dtmt translate` builds it."""
        from dtmt_models.engine import as_decoder
        return [(label if amp == "off" else f"{label} [{amp}]", as_decoder(model, amp=None if amp == "off" else amp))
                for amp in amps]
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.bookkeeping:
        table = TableModel(a.vocab)
        table.table = table.table.to(a.device)
        src = [[4] * a.src_len for _ in range(a.sentences)]
        rows = []
        for beam in a.beams:
            for bs in (1, a.batch_size):
                batches = [(s.to(a.device), n.to(a.device)) for s, n in make_batches(src, bs)]
                for loop in a.loops or [None]:
                    seconds, _ = time_decode(table, batches, beam, a.repeat, 0.0, a.tgt_len + 1, loop)
                    steps = (a.tgt_len + 1) * -(-a.sentences // bs)
                    rows.append({"beam": beam, "batch": bs, "loop": loop or "default",
                                 "ms_per_step": 1000 * seconds / steps})
                    print(f"bookkeeping, beam {beam} batch {bs:>3}, {loop or 'default'} loop: "
                          f"{rows[-1]['ms_per_step']:.3f} ms per step (vocabulary {a.vocab}, {a.device})", flush=True)
        return rows
    match_of = {}  # recurrent system -> the name of its size-matched transformer (synthetic mode)
    models = []   # (name, decoder, sentences as id lists, words counter, max_len_a, max_len_b)
    params = {}   # name -> the model's parameter count
    # each model's decoder is built once, as translate and serve build it (not once per batch: for dtmt's small preset
    # at V = 4,000 that build, its tables included, costs ~125 ms, more than decoding a sentence)
    if a.checkpoints:
        from dtmt_models.models.checkpoint import load_model

        for path in a.checkpoints:
            model, sv, tv, ckpt = load_model(path)
            model = model.to(a.device)
            sents = [sv.encode(line)[:250] for line in lines]
            label = f"{ckpt['model_name']} ({os.path.basename(os.path.dirname(path))})"
            for named, decoder in decoders(label, model):
                params[named] = count_params(model)
                models.append((named, decoder, sents, tv, 2.0, 10))
        mode = f"trained checkpoints on {a.sentences} sentences of {a.input}"
    else:
        g = torch.Generator().manual_seed(0)
        sents = [torch.randint(4, a.vocab, (a.src_len,), generator=g).tolist() for _ in range(a.sentences)]
        matched = {}
        for name in a.systems:
            torch.manual_seed(0)
            model = build_model(name, a.vocab, a.vocab, **get_preset(name, "small")["model"]).eval().to(a.device)
            for named, decoder in decoders(name, model):
                params[named] = count_params(model)
                models.append((named, NoEOS(decoder), sents, None, 0.0, a.tgt_len + 1))
            if name != "transformer" and not a.no_match:
                width, options = matched_transformer(count_params(model), a.vocab)
                if options == get_preset("transformer", "small")["model"] and "transformer" in a.systems:
                    match_of[name] = "transformer"   # the small preset itself
                else:
                    match_of[name] = f"transformer d{width}"
                    matched[width] = options
        for width, options in sorted(matched.items()):
            torch.manual_seed(0)
            model = build_model("transformer", a.vocab, a.vocab, **options).eval().to(a.device)
            for named, decoder in decoders(f"transformer d{width}", model):
                params[named] = count_params(model)
                models.append((named, NoEOS(decoder), sents, None, 0.0, a.tgt_len + 1))
        mode = (f"random weights, {a.sentences} sentences of {a.src_len} tokens, exactly {a.tgt_len} output tokens "
                f"(EOS suppressed)")
    rows = []
    for beam in a.beams:   # per setting, all models' passes interleaved (time_interleaved)
        for label, bs in (("1", 1), (f"{a.batch_size}", a.batch_size)):
            runs = [(m, loop) for m in models for loop in a.loops or [None]]
            jobs = [(model, [(s.to(a.device), n.to(a.device)) for s, n in make_batches(sents, bs)], la, lb, loop)
                    for (_, model, sents, _, la, lb), loop in runs]
            for ((name, model, sents, tv, _, _), loop), (seconds, best) in zip(runs,
                                                                              time_interleaved(jobs, beam, a.repeat)):
                if tv is None:   # synthetic: output tokens
                    words = sum(len(tokens) for tokens in best)
                else:            # real words of the detokenised output
                    words = sum(len(tv.decode(tokens).split()) for tokens in best)
                row = {"model": name, "params": params[name], "beam": beam, "batch": label, "loop": loop or "default",
                       "sentences": len(sents), "words": words, "seconds": seconds, "words_per_s": words / seconds,
                       "ms_per_sentence": 1000 * seconds / len(sents)}
                rows.append(row)
                print(f"  {name:<22s} beam {beam} batch {label:>3s} {row['loop']:>7s} loop: "
                      f"{row['words_per_s']:8,.0f} words/s "
                      f"{row['ms_per_sentence']:8.1f} ms/sentence", flush=True)
    order = {name: i for i, (name, *_) in enumerate(models)}
    rows.sort(key=lambda r: (order[r["model"]], r["beam"], r["batch"] != "1", r["loop"]))
    by = {(r["model"], r["beam"], r["batch"], r["loop"]): r for r in rows}
    def precision(name):   # (the model's name without its [amp], that suffix or "")
        plain, _, amp = name.partition(" [")
        return plain, f" [{amp}" if amp else ""

    for r in rows:   # ratios within one loop and one precision
        plain, suffix = precision(r["model"])
        amp = bool(suffix)
        # (the small preset's only: without it in --systems the column had compared with the first size-matched
        # transformer under the same heading)
        base = by.get(("transformer" + suffix, r["beam"], r["batch"], r["loop"]))
        r["vs_transformer"] = r["words_per_s"] / base["words_per_s"] if base else None
        fp32 = by.get((plain, r["beam"], r["batch"], r["loop"])) if amp else None
        r["vs_off"] = r["words_per_s"] / fp32["words_per_s"] if fp32 else None
        m = by.get(((match_of.get(plain) or "") + suffix, r["beam"], r["batch"], r["loop"]))
        r["matched"] = m["model"] if m else None
        r["vs_matched"] = r["words_per_s"] / m["words_per_s"] if m else None
        host = by.get((r["model"], r["beam"], r["batch"], "host"))
        r["vs_host_loop"] = r["words_per_s"] / host["words_per_s"] if host and r["loop"] in ("device", "graph") \
            else None
    write_csv(os.path.join(a.out, "bench_decode.csv"), rows, list(rows[0]), comment=provenance_line(record))
    where = machine_name() if a.device == "cpu" else f"{torch.cuda.get_device_name(a.device)}, {machine_name()}"
    print(f"\nDecoding speed ({where}; {a.device}; {mode})\n")
    print("| model | params | beam | batch | loop | words/s | ms/sentence | × transformer | × matched (which) "
          "| × host loop |" + (" × off |" if len(amps) > 1 else ""))
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|" + ("---:|" if len(amps) > 1 else ""))
    for r in rows:
        vs = f"{r['vs_transformer']:.2f}×" if r["vs_transformer"] else ""
        vm = f"{r['vs_matched']:.2f}× ({r['matched']})" if r["vs_matched"] else ""
        vh = f"{r['vs_host_loop']:.2f}×" if r["vs_host_loop"] else ""
        vo = (f" {r['vs_off']:.2f}× |" if r["vs_off"] else " |") if len(amps) > 1 else ""
        print(f"| {r['model']} | {r['params']:,} | {r['beam']} | {r['batch']} | {r['loop']} | "
              f"{r['words_per_s']:,.0f} | {r['ms_per_sentence']:.1f} | {vs} | {vm} | {vh} |{vo}")
    return rows


if __name__ == "__main__":
    main()
