"""What int8 decoder weights cost in BLEU (issue 25, item 2), before any int8 kernel exists.

    python benchmarks/bench_int8.py --checkpoint benchmarks/out/peers_30m_b/dtmt/best.pt --data data/bible

Every matrix a decoding step reads (the query and decoder transitions' recurrent and input weights, the
attention's query and output projections, the readout and the output layer; not the embeddings, which a step
reads one row of, nor what runs once per sentence: the encoder, the attention keys, the initial state) is
replaced by its row-wise int8 round trip, scale * q (dtmt_kernels.ops.linear.quantize: one float scale per
output row, weights in [-127, 127]). A weight-only int8 kernel computes exactly this up to float summation
order, so the BLEU of this model is the BLEU such a kernel would give. Both models decode the test split with
the same settings (`translate`, beam 4); reported: BLEU of each, the difference (the issue's bar: within 0.3),
the sentences whose translation changed, and the bytes of weights a step reads in float32 and in int8 (+ scales).
Output: OUT/bench_int8.md and .json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

ONCE_PER_SENTENCE = ("encoder", "src_embed", "tgt_embed", "attention.key", "init_state")


def step_matrices(model):
    """(name, parameter) of every 2-D weight a decoding step reads (see the module docstring)."""
    # remove_duplicate=False: a projection tied to the target embedding is listed under its own name too
    return [(n, p) for n, p in model.named_parameters(remove_duplicate=False)
            if p.dim() == 2 and not n.startswith(ONCE_PER_SENTENCE)]


def quantize_step_weights(model):
    """Replaces each step matrix by its int8 round trip, in place (a matrix tied to an embedding gets its own
    copy first: the embedding stays float32); returns (float32 bytes, int8 bytes incl. scales)."""
    import torch

    from dtmt_kernels.ops.linear.quantize import dequantize_rows, quantize_rows

    f32 = i8 = 0
    for name, p in step_matrices(model):
        q, scale = quantize_rows(p)
        owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        setattr(owner, name.rsplit(".", 1)[-1], torch.nn.Parameter(dequantize_rows(q, scale, p.dtype),
                                                                    requires_grad=False))
        f32 += p.numel() * 4
        i8 += q.numel() + scale.numel() * 4
    return f32, i8


def main(argv=None):
    from bench_cells import torch_threads

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default=os.path.join(HERE, "out", "peers_30m_b", "dtmt", "best.pt"))
    p.add_argument("--data", default=os.path.join(ROOT, "data", "bible"))
    p.add_argument("--split", default="test")
    p.add_argument("--sentences", type=int, default=0, help="the first N (0: all)")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=os.path.join(HERE, "out", "int8"))
    a = p.parse_args(argv)
    with torch_threads(a.threads):
        return _run(a, argv)


def _run(a, argv):
    from bench_cells import machine_name
    from sacrebleu.metrics import BLEU

    from dtmt_models.data.corpus import corpus_paths, read_parallel
    from dtmt_models.decoding.translate import translate
    from dtmt_models.models.checkpoint import load_model

    pairs = read_parallel(*corpus_paths(a.data, a.split))
    if a.sentences:
        pairs = pairs[:a.sentences]
    sources, refs = [s for s, _ in pairs], [t for _, t in pairs]
    results = {}
    for label in ("float32", "int8 weights"):
        model, sv, tv, ckpt = load_model(a.checkpoint)
        sizes = quantize_step_weights(model) if label != "float32" else None
        t0 = time.perf_counter()
        hyps = [h[0][0] for h in translate(model, sv, tv, sources, beam=a.beam)]
        results[label] = {"hyps": hyps, "bleu": BLEU().corpus_score(hyps, [refs]).score,
                          "seconds": time.perf_counter() - t0}
        if sizes:
            results[label]["step_bytes_f32"], results[label]["step_bytes_int8"] = sizes
        print(f"{label}: BLEU {results[label]['bleu']:.2f}", flush=True)
    base, q8 = results["float32"], results["int8 weights"]
    changed = sum(x != y for x, y in zip(base["hyps"], q8["hyps"]))
    row = {"machine": machine_name(), "checkpoint": os.path.relpath(a.checkpoint, ROOT), "model": ckpt["model_name"],
           "sentences": len(sources), "bleu_float32": base["bleu"], "bleu_int8": q8["bleu"],
           "delta": q8["bleu"] - base["bleu"], "changed": changed, "step_bytes_f32": q8["step_bytes_f32"],
           "step_bytes_int8": q8["step_bytes_int8"]}
    cmd = "python benchmarks/bench_int8.py " + " ".join(argv if argv is not None else sys.argv[1:])
    md = (f"int8 decoder weights (row-wise, weight-only; simulated by the int8 round trip in float32): "
          f"{row['model']} ({row['checkpoint']}), the {len(sources)} {a.split} sentences, beam {a.beam}; "
          f"{row['machine']}. Command: `{cmd.strip()}`\n\n"
          "| weights | BLEU | Δ BLEU | translations changed | bytes of weights a step reads |\n|---|---:|---:|---:|---:|\n"
          f"| float32 | {row['bleu_float32']:.2f} | | | {row['step_bytes_f32'] / 1e6:.2f} MB |\n"
          f"| int8 rows + float scales | {row['bleu_int8']:.2f} | {row['delta']:+.2f} | {changed} of {len(sources)} | "
          f"{row['step_bytes_int8'] / 1e6:.2f} MB |\n")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bench_int8.md"), "w") as f:
        f.write(md)
    with open(os.path.join(a.out, "bench_int8.json"), "w") as f:
        json.dump(row, f, indent=2)
    print(md)
    return row


if __name__ == "__main__":
    main()
