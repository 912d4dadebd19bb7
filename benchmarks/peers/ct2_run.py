"""Runs inside bench_peers.py's OpenNMT-py environment, which has CTranslate2 (never imports dtmt).

    python ct2_run.py convert-onmt --model model_step_N.pt --out DIR --quantization int8
    python ct2_run.py translate --model DIR --src S.pieces --out O.pieces --beam 4 --batch 1 --threads 1

convert-onmt: CTranslate2's own converter on an OpenNMT-py checkpoint (in the OpenNMT-py environment, which has
torch), float32 or int8 weights. OpenNMT-py 3.5 trains its Transformer with `self_attn_type` scaled-dot-flash (torch's
scaled_dot_product_attention), which the converter refuses by name: the checkpoint's option is renamed scaled-dot,
the same attention computed by another kernel, in a copy converted.
translate: beam search over the source pieces, `--batch` sentences at a time in input order (or, with --batch-type
tokens, batches of `--batch` source tokens grouped by CTranslate2), timed (the model load excluded); writes the
output pieces and a JSON line with the seconds.
(The conversion of dtmt's own transformer and its scoring check served bench_deploy.py, retired: `git show
c01201d:benchmarks/peers/ct2_run.py`.)
"""
from __future__ import annotations

import argparse
import json
import os
import time


def _read_pieces(path: str):
    with open(path, encoding="utf-8") as f:
        return [line.split() for line in f.read().splitlines()]


def convert_onmt(model: str, out: str, quantization: str) -> None:
    import torch
    from ctranslate2.converters.opennmt_py import OpenNMTPyConverter

    checkpoint = torch.load(model, map_location="cpu", weights_only=False)   # (a file the peer wrote itself)
    if getattr(checkpoint["opt"], "self_attn_type", None) == "scaled-dot-flash":
        checkpoint["opt"].self_attn_type = "scaled-dot"
    copy = out.rstrip("/") + ".pt"
    torch.save(checkpoint, copy)
    try:
        OpenNMTPyConverter(copy, unsafe_deserialization=True).convert(
            out, quantization=None if quantization == "float32" else quantization, force=True)
    finally:
        os.remove(copy)


def translate(model: str, src: str, out: str, beam: int, batch: int, threads: int, length_penalty: float,
              compute_type: str, batch_type: str = "examples") -> None:
    import ctranslate2

    translator = ctranslate2.Translator(model, device="cpu", compute_type=compute_type, inter_threads=1,
                                        intra_threads=threads)
    sources = _read_pieces(src)
    translator.translate_batch(sources[:2], beam_size=beam)          # warm-up (allocations, first-call costs)
    t0 = time.perf_counter()
    hyps = []
    if batch_type == "tokens":   # CTranslate2 groups the sentences by length into batches of `batch` tokens
        results = translator.translate_batch(sources, beam_size=beam, max_batch_size=batch, batch_type="tokens",
                                             length_penalty=length_penalty, max_decoding_length=256)
        hyps, sources_left = [r.hypotheses[0] for r in results], []
    else:
        sources_left = sources
    for start in range(0, len(sources_left), batch):
        for r in translator.translate_batch(sources_left[start:start + batch], beam_size=beam, max_batch_size=batch,
                                            length_penalty=length_penalty, max_decoding_length=256):
            hyps.append(r.hypotheses[0])
    seconds = time.perf_counter() - t0
    with open(out, "w", encoding="utf-8") as f:
        f.write("".join(" ".join(h) + "\n" for h in hyps))
    print(json.dumps({"seconds": seconds, "sentences": len(sources), "ctranslate2": ctranslate2.__version__}))


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("convert-onmt")
    o.add_argument("--model", required=True)
    o.add_argument("--out", required=True)
    o.add_argument("--quantization", choices=("float32", "int8"), default="float32")
    t = sub.add_parser("translate")
    t.add_argument("--model", required=True)
    t.add_argument("--src", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--beam", type=int, default=4)
    t.add_argument("--batch", type=int, default=1)
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--length-penalty", type=float, default=0.6)
    t.add_argument("--compute-type", default="float32")
    t.add_argument("--batch-type", choices=("examples", "tokens"), default="examples",
                   help="--batch counts sentences (in input order) or source tokens (CTranslate2's own grouping)")
    a = p.parse_args()
    if a.cmd == "convert-onmt":
        convert_onmt(a.model, a.out, a.quantization)
    else:
        translate(a.model, a.src, a.out, a.beam, a.batch, a.threads, a.length_penalty, a.compute_type, a.batch_type)


if __name__ == "__main__":
    main()
