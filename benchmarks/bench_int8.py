"""What int8 decoding (`dtmt translate --int8`) costs in BLEU (issue 25, item 2), and what of it the weights cost.

    python benchmarks/bench_int8.py --checkpoint benchmarks/out/peers_30m_b/dtmt/step_0001734.pt --data data/bible

Three decodings of the test split with the same settings (`translate`, beam 4, batched):
  * float32: the model as trained;
  * weights only (simulated): every matrix a decoding step reads (the query and decoder transitions' recurrent and input
    weights, the attention's query and output projections, the readout and the output layer; not the
    embeddings, which a step reads one row of, nor the attention's scoring vector v, nor what runs once per
    sentence: the attention keys, the initial state) and the encoder's recurrent matrices (not its input
    matrices: one GEMM over all positions) replaced by its row-wise int8 round trip,
    scale * q (dtmt_kernels.ops.linear.quantize: one float scale per output row, weights in [-127, 127]),
    decoded in float32: the rounding of the weights alone;
  * int8: the int8 decoder (inference_decoder(int8=True): the fused step reading those matrices as int8 rows and
    multiplying them by int8 activations, each row of them quantized with its own scale: quantize.linear_int8),
    so the rounding of the weights and of the activations.
Reported: BLEU of each, the difference to float32 (the issue's bar: within 0.3), the sentences whose
translation changed (against float32 and against the weights-only rounding), the decoding time of each, and
the bytes of weights a step reads in float32 and in int8 (+ scales). Output: OUT/bench_int8.md and .json.
`--isa all` (or a comma list) also decodes float32 and int8 with each instruction-set copy of the CPU loops this
CPU runs (baseline, avx2, avx512: issue 70's bar, int8 within 0.1 BLEU of float32 in every copy), a table row
each ("copies" in the .json).
Speed against CTranslate2 (int8 against int8) is bench_peers.py's.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

# read once per sentence (mce's memory_init and gated annotations, gate_*, are its encoder's)
ONCE_PER_SENTENCE = ("encoder", "src_embed", "tgt_embed", "attention.key", "init_state", "memory_init", "gate_")
VECTORS = ("attention.v", "attention.v.weight")   # 2-D, but one vector per head: the int8 decoder keeps it float


def step_matrices(model):
    """(name, parameter) of every weight matrix a decoding step reads (see the module docstring)."""
    # remove_duplicate=False: a projection tied to the target embedding is listed under its own name too
    return [(n, p) for n, p in model.named_parameters(remove_duplicate=False)
            if p.dim() == 2 and not n.startswith(ONCE_PER_SENTENCE) and n not in VECTORS]


def encoder_recurrent_matrices(model):
    """(name, parameter) of the recurrent matrices (weight_hh, the T-GRUs' tgru{k}_weight_hh, both directions) of
    the model's sequence layers, the encoder's DeepTransitionGRU / ATR layers: int8 decoding rounds them too
    (dtmt_models.engine.forms.FrozenTransitionLayer.int8); their input matrices stay float32."""
    import dtmt_kernels as dk

    return [(f"{name}.{n}", p) for name, m in model.named_modules() if isinstance(m, (dk.nn.DeepTransitionGRU,
                                                                                       dk.nn.ATR))
            for n, p in m.named_parameters() if "weight_hh" in n]


def int8_matrices(model):
    """(name, parameter) of every matrix int8 decoding reads as int8 rows: the step matrices and the encoder's
    recurrent ones."""
    return step_matrices(model) + encoder_recurrent_matrices(model)


def quantize_step_weights(model):
    """Replaces each matrix int8 decoding rounds (int8_matrices) by its int8 round trip, in place (a matrix tied
    to an embedding gets its own copy first: the embedding stays float32); returns (float32 bytes, int8 bytes
    incl. scales) of the step matrices."""
    import torch

    from dtmt_kernels.ops.linear.quantize import dequantize_rows, quantize_rows

    f32 = i8 = 0
    step = {name for name, _ in step_matrices(model)}
    for name, p in int8_matrices(model):
        q, scale = quantize_rows(p)
        owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        setattr(owner, name.rsplit(".", 1)[-1], torch.nn.Parameter(dequantize_rows(q, scale, p.dtype),
                                                                    requires_grad=False))
        if name in step:   # the bytes a step reads
            f32 += p.numel() * 4
            i8 += q.numel() + scale.numel() * 4
    return f32, i8


DEFAULT_CHECKPOINT = os.path.join(HERE, "out", "peers_30m_b", "dtmt", "best.pt")


def main(argv=None):
    from common import torch_threads

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT)
    p.add_argument("--data", default=os.path.join(ROOT, "data", "bible"))
    p.add_argument("--split", default="test")
    p.add_argument("--sentences", type=int, default=0, help="the first N (0: all)")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=os.path.join(HERE, "out", "int8"))
    p.add_argument("--isa", default="", help="'all' (every instruction-set copy of the CPU loops this CPU runs) or "
                   "a comma list: float32 and int8 decoded with each copy too (default: none)")
    a = p.parse_args(argv)
    from common import PEERS_30M_MADE_BY, check_checkpoint, check_options

    from dtmt_models.data.corpus import corpus_paths
    from dtmt_models.decoding.hypotheses import MAX_BEAM

    # before any decoding: --beam 0 was beam_search's traceback after the checkpoint had loaded, --sentences -1
    # left the last sentence out without a word, --threads 0 torch's error, a --data without the split a traceback
    check_options(p, a, (("sentences", 0), ("beam", 1, MAX_BEAM), ("threads", 1)))
    try:
        a.copies = _copies(a.isa)   # (checked before any decoding)
    except ValueError as exc:   # (a bad option: exit 2, as argparse's)
        p.error(str(exc))
    # (the checkpoint first, as the other decoding benchmarks check it: a FileNotFoundError after the corpus before)
    check_checkpoint(p, a.checkpoint, DEFAULT_CHECKPOINT, PEERS_30M_MADE_BY)
    try:
        corpus_paths(a.data, a.split)
    except ValueError as exc:   # (CorpusError)
        p.error(f"--data {a.data} --split {a.split}: {exc}")
    with torch_threads(a.threads):
        return _run(a, argv)


def _run(a, argv):
    from common import machine_name, write_report
    from sacrebleu.metrics import BLEU

    from dtmt_models.data.corpus import corpus_paths, read_parallel
    from dtmt_models.decoding.translate import translate
    from dtmt_models.models.checkpoint import load_model

    pairs = read_parallel(*corpus_paths(a.data, a.split))
    if a.sentences:
        pairs = pairs[:a.sentences]
    sources, refs = [s for s, _ in pairs], [t for _, t in pairs]

    def decode(label):
        model, sv, tv, ckpt = load_model(a.checkpoint)
        sizes = quantize_step_weights(model) if label == "weights only" else None
        model.eval()
        decoder = model.inference_decoder(int8=label == "int8")
        t0 = time.perf_counter()
        hyps = [h[0][0] for h in translate(model, sv, tv, sources, beam=a.beam, decoder=decoder)]
        result = {"hyps": hyps, "bleu": BLEU().corpus_score(hyps, [refs]).score, "seconds": time.perf_counter() - t0,
                  "model": ckpt["model_name"]}
        if sizes:
            result["step_bytes_f32"], result["step_bytes_int8"] = sizes
        print(f"{label}: BLEU {result['bleu']:.2f} ({result['seconds']:.1f} s)", flush=True)
        return result

    def changed(x, y):
        return sum(a != b for a, b in zip(x["hyps"], y["hyps"]))

    results = {label: decode(label) for label in ("float32", "weights only", "int8")}
    base, sim, q8 = results["float32"], results["weights only"], results["int8"]
    per_copy = []
    if a.copies:
        from dtmt_kernels import _C

        loaded = _C.cpu_isa()
        try:
            for isa in a.copies:
                _C.set_cpu_isa(isa)
                print(f"== the {isa} copy", flush=True)
                f32, i8 = (base, q8) if isa == loaded else (decode("float32"), decode("int8"))
                per_copy.append({"isa": isa, "bleu_float32": f32["bleu"], "bleu_int8": i8["bleu"],
                                 "delta": i8["bleu"] - f32["bleu"], "changed": changed(f32, i8),
                                 "float32_changed_vs_loaded": changed(f32, base),
                                 "int8_changed_vs_loaded": changed(i8, q8),
                                 "seconds_float32": f32["seconds"], "seconds_int8": i8["seconds"]})
        finally:
            _C.set_cpu_isa(loaded)
    row = {"machine": machine_name(), "threads": a.threads, "checkpoint": os.path.relpath(a.checkpoint, ROOT),
           "model": base["model"], "sentences": len(sources), "bleu_float32": base["bleu"],
           "bleu_weights_only": sim["bleu"], "bleu_int8": q8["bleu"], "delta": q8["bleu"] - base["bleu"],
           "changed": changed(base, q8), "int8_vs_weights_only_changed": changed(sim, q8),
           "seconds_float32": base["seconds"], "seconds_int8": q8["seconds"],
           "step_bytes_f32": sim["step_bytes_f32"], "step_bytes_int8": sim["step_bytes_int8"]}
    cmd = "python benchmarks/bench_int8.py " + " ".join(argv if argv is not None else sys.argv[1:])
    n = len(sources)
    md = (f"int8 decoding (int8 weight rows x int8 activation rows): {row['model']} ({row['checkpoint']}), the {n} {a.split} "
          f"sentences, beam {a.beam}, batched, {a.threads} thread(s); {row['machine']}. Command: `{cmd.strip()}`\n\n"
          "| decoding | BLEU | Δ BLEU | translations changed | seconds | bytes of weights a step reads |\n"
          "|---|---:|---:|---:|---:|---:|\n"
          f"| float32 | {base['bleu']:.2f} | | | {base['seconds']:.1f} | {row['step_bytes_f32'] / 1e6:.2f} MB |\n"
          f"| weights only (int8 round trip, float32 kernels) | {sim['bleu']:.2f} | {sim['bleu'] - base['bleu']:+.2f} | "
          f"{changed(base, sim)} of {n} | {sim['seconds']:.1f} | |\n"
          f"| int8 (`--int8`) | {q8['bleu']:.2f} | {row['delta']:+.2f} | {row['changed']} of {n} "
          f"({row['int8_vs_weights_only_changed']} differ from weights only) | {q8['seconds']:.1f} | "
          f"{row['step_bytes_int8'] / 1e6:.2f} MB |\n")
    if per_copy:
        from dtmt_kernels import _C

        row["copies"] = per_copy
        md += (f"\nEach instruction-set copy of the CPU loops (the library loaded {_C.cpu_isa()}; translations changed "
               "against the loaded copy's):\n\n"
               "| copy | float32 BLEU | int8 BLEU | Δ BLEU | int8 changed vs float32 | float32 / int8 changed vs "
               "loaded copy | seconds float32 / int8 |\n|---|---:|---:|---:|---:|---:|---:|\n")
        for c in per_copy:
            md += (f"| {c['isa']} | {c['bleu_float32']:.2f} | {c['bleu_int8']:.2f} | {c['delta']:+.2f} | "
                   f"{c['changed']} of {n} | {c['float32_changed_vs_loaded']} / {c['int8_changed_vs_loaded']} | "
                   f"{c['seconds_float32']:.1f} / {c['seconds_int8']:.1f} |\n")
    write_report(a.out, "bench_int8", md, row)
    print(md)
    return row


def _copies(spec: str):
    """The instruction-set copies `--isa` names: [] for '', every copy this CPU runs for 'all' (best first), else
    the comma list (each one this CPU runs, else an error naming the choices)."""
    if not spec:
        return []
    from dtmt_kernels import _C

    runs = list(_C.supported_cpu_isas())
    if spec == "all":
        return runs
    wanted = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [w for w in wanted if w not in runs]
    if bad:
        raise ValueError(f"--isa {','.join(bad)}: not a copy this CPU runs (choices: {', '.join(runs)})")
    return wanted


if __name__ == "__main__":
    main()
