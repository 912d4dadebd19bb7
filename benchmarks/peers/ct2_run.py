"""Runs inside a peer environment with CTranslate2 (made by benchmarks/bench_deploy.py or bench_peers.py; never
imports dtmt).

    python ct2_run.py convert   --weights W.npz --config C.json --out DIR
    python ct2_run.py convert-onmt --model model_step_N.pt --out DIR --quantization int8
    python ct2_run.py score     --model DIR --src S.pieces --tgt T.pieces --out scores.json
    python ct2_run.py translate --model DIR --src S.pieces --out O.pieces --beam 4 --batch 1 --threads 1

convert: builds a CTranslate2 TransformerSpec from the weights of dtmt's `transformer` system (pre-norm
torch.nn.Transformer layers, embeddings scaled by sqrt(d) plus the model's own sinusoidal table, the output
projection tied to the target embedding), exported by bench_deploy.py as numpy arrays under dtmt's parameter
names, and saves it as a float32 CTranslate2 model.
convert-onmt: CTranslate2's own converter on an OpenNMT-py checkpoint (in the OpenNMT-py environment, which has
torch), float32 or int8 weights. OpenNMT-py 3.5 trains its Transformer with `self_attn_type` scaled-dot-flash (torch's
scaled_dot_product_attention), which the converter refuses by name: the checkpoint's option is renamed scaled-dot,
the same attention computed by another kernel, in a copy converted.
score: the per-token log-probabilities CTranslate2 gives the target pieces (the conversion check: they must
equal dtmt's teacher-forced ones).
translate: beam search over the source pieces, `--batch` sentences at a time in input order (or, with --batch-type
tokens, batches of `--batch` source tokens grouped by CTranslate2), timed (the model load excluded); writes the
output pieces and a JSON line with the seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def _linear(spec, weight, bias=None):
    spec.weight = weight
    if bias is not None:
        spec.bias = bias


def _norm(spec, w, name):
    spec.gamma, spec.beta = w[f"{name}.weight"], w[f"{name}.bias"]


def convert(weights: str, config: str, out: str) -> None:
    import ctranslate2
    from ctranslate2.specs import transformer_spec

    w = dict(np.load(weights))
    with open(config) as f:
        cfg = json.load(f)
    E = cfg["embed_dim"]
    spec = transformer_spec.TransformerSpec.from_config((cfg["encoder_layers"], cfg["decoder_layers"]), cfg["heads"],
                                                        pre_norm=True)
    spec.config.layer_norm_epsilon = 1e-5          # torch.nn.LayerNorm's default
    spec.config.decoder_start_token = "<s>"
    for side, stack in (("encoder", spec.encoder), ("decoder", spec.decoder)):
        emb = w["src_embed.weight" if side == "encoder" else "tgt_embed.weight"]
        (stack.embeddings[0] if isinstance(stack.embeddings, list) else stack.embeddings).weight = emb
        stack.scale_embeddings = True              # emb * sqrt(d) + pe, as dtmt's
        stack.position_encodings.encodings = w["pe"]
        _norm(stack.layer_norm, w, f"transformer.{side}.norm")
        for i, layer in enumerate(stack.layer):
            p = f"transformer.{side}.layers.{i}"
            _linear(layer.self_attention.linear[0], w[f"{p}.self_attn.in_proj_weight"], w[f"{p}.self_attn.in_proj_bias"])
            _linear(layer.self_attention.linear[1], w[f"{p}.self_attn.out_proj.weight"],
                    w[f"{p}.self_attn.out_proj.bias"])
            _norm(layer.self_attention.layer_norm, w, f"{p}.norm1")
            if side == "decoder":
                q_w, q_b = w[f"{p}.multihead_attn.in_proj_weight"], w[f"{p}.multihead_attn.in_proj_bias"]
                _linear(layer.attention.linear[0], q_w[:E], q_b[:E])
                _linear(layer.attention.linear[1], q_w[E:], q_b[E:])
                _linear(layer.attention.linear[2], w[f"{p}.multihead_attn.out_proj.weight"],
                        w[f"{p}.multihead_attn.out_proj.bias"])
                _norm(layer.attention.layer_norm, w, f"{p}.norm2")
                _norm(layer.ffn.layer_norm, w, f"{p}.norm3")
            else:
                _norm(layer.ffn.layer_norm, w, f"{p}.norm2")
            _linear(layer.ffn.linear_0, w[f"{p}.linear1.weight"], w[f"{p}.linear1.bias"])
            _linear(layer.ffn.linear_1, w[f"{p}.linear2.weight"], w[f"{p}.linear2.bias"])
    _linear(spec.decoder.projection, w["tgt_embed.weight"], w["readout.bias"])
    spec.register_source_vocabulary(cfg["src_pieces"])
    spec.register_target_vocabulary(cfg["tgt_pieces"])
    spec.validate()
    spec.optimize(quantization=None)
    os.makedirs(out, exist_ok=True)
    spec.save(out)
    print(f"ctranslate2 {ctranslate2.__version__}: wrote {out}")


def _read_pieces(path: str):
    with open(path, encoding="utf-8") as f:
        return [line.split() for line in f.read().splitlines()]


def score(model: str, src: str, tgt: str, out: str) -> None:
    import ctranslate2

    translator = ctranslate2.Translator(model, device="cpu", compute_type="float32", intra_threads=1)
    results = translator.score_batch(_read_pieces(src), _read_pieces(tgt))
    with open(out, "w") as f:
        json.dump([r.log_probs for r in results], f)


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
    c = sub.add_parser("convert")
    c.add_argument("--weights", required=True)
    c.add_argument("--config", required=True)
    c.add_argument("--out", required=True)
    o = sub.add_parser("convert-onmt")
    o.add_argument("--model", required=True)
    o.add_argument("--out", required=True)
    o.add_argument("--quantization", choices=("float32", "int8"), default="float32")
    s = sub.add_parser("score")
    s.add_argument("--model", required=True)
    s.add_argument("--src", required=True)
    s.add_argument("--tgt", required=True)
    s.add_argument("--out", required=True)
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
    if a.cmd == "convert":
        convert(a.weights, a.config, a.out)
    elif a.cmd == "convert-onmt":
        convert_onmt(a.model, a.out, a.quantization)
    elif a.cmd == "score":
        score(a.model, a.src, a.tgt, a.out)
    else:
        translate(a.model, a.src, a.out, a.beam, a.batch, a.threads, a.length_penalty, a.compute_type, a.batch_type)


if __name__ == "__main__":
    main()
