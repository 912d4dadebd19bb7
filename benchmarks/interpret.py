"""Interpretability of a trained system (paper 004 §3.3, §5.1, §5.3) and attention heat maps.

    python benchmarks/interpret.py --checkpoint runs/rnnsearch-atr/best.pt --data data/bible --split test \
        [--sentences N] [--example K] [--out D] [--layer NAME] [--quick]

For an ATR system (rnnsearch-atr, gnmt-atr with cell="atr"):
  - the input/forget gates of one encoder ATR layer over the source side of the first N sentences of the split
    (SentencePiece-encoded with the checkpoint's source vocabulary): Pearson r over every real
    (position, unit) pair (paper 004 §5.1 reports r = -0.9819 on newstest2014), and gates.png: a scatter of the
    gate values and the paper's Figure 3 (per-position unit means averaged over sentences);
  - dependencies.png: the eq.-10 weights g_{t,k} (mean over units) of example K's source sentence, each word
    joined to its strongest previous word (Figure 4).
  The layer: the first left-to-right `dtmt_kernels.nn.ATR` module of the model (see
  `dtmt_models.models.analysis.find_atr_layer`): the bottom encoder layer, whose input is the word embeddings, so that
  eq. 10 attributes every state to source words and "previous" means the words to the left. Its real input is
  captured with a forward pre-hook while `model.encode` runs, so embedding scaling, positional encodings or a
  different encoder wiring are taken as the system has them. `--layer NAME` picks another ATR layer.
  Paper 004 draws Figure 4 on the target side during decoding; its decoder is a stack of one-step ATR cells
  fed by attention (two inputs per step in the hierarchical decoder), so eq. 10 does not apply to it as is.
For every system whose decoder reports its attention (all the recurrent ones): attention.png, the attention of
example K's source against its reference target (forced decoding, EOS row included). The transformer exposes no
attention weights; it gets a note instead.

Writes D/interpret.json (r, the Figure-3 curves, the files) and prints a short summary.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from dtmt_models.models import analysis  # noqa: E402
from dtmt_models.atomic import atomic_write  # noqa: E402
from dtmt_models.models.checkpoint import load_model  # noqa: E402
from dtmt_models.data.corpus import corpus_paths, read_parallel  # noqa: E402
from dtmt_models.data.vocabulary import EOS, PAD  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="a checkpoint written by dtmt train")
    ap.add_argument("--data", required=True, help="prepared corpus directory (corpus.json + split files)")
    ap.add_argument("--split", default="test", help="split to analyse (default test)")
    ap.add_argument("--sentences", type=int, default=None,
                    help="gate statistics over the first N sentences of the split (default: all; --quick: 16)")
    ap.add_argument("--example", type=int, default=0, help="index (0-based) of the sentence to plot (default 0)")
    ap.add_argument("--out", default=os.path.join(HERE, "out", "interpret"), help="output directory")
    ap.add_argument("--layer", default=None, help="name of the ATR module to analyse (default: see the docstring)")
    ap.add_argument("--batch-size", type=int, default=32, help="sentences per encoder batch (default 32)")
    ap.add_argument("--max-points", type=int, default=20000, help="gate pairs sampled for the scatter plot")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--quick", action="store_true", help="a few sentences and a small scatter sample (tests)")
    args = ap.parse_args(argv)
    if args.quick:
        args.sentences = 16 if args.sentences is None else args.sentences
        args.max_points = min(args.max_points, 2000)
    if args.sentences is not None and args.sentences < 1:
        ap.error("--sentences must be >= 1")
    if args.example < 0 or args.batch_size < 1:
        ap.error("--example must be >= 0 and --batch-size >= 1")
    # before anything loads: a missing checkpoint or corpus, or cuda without a GPU, had been tracebacks
    from benchmarks.common import check_checkpoint, check_options
    check_options(ap, args, device="device")
    check_checkpoint(ap, args.checkpoint)
    try:
        corpus_paths(args.data, args.split)
    except ValueError as exc:   # (CorpusError)
        ap.error(f"--data {args.data} --split {args.split}: {exc}")
    return args


def pieces(vocab, ids):
    return [vocab.sp.id_to_piece(int(i)) for i in ids]


class InputCapture:
    """Records the input (x, h0, lengths) of a module's forward call while the model runs."""

    def __init__(self, module):
        self.calls = []
        self.handle = module.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        x = args[0] if args else kwargs["x"]
        h0 = args[1] if len(args) > 1 else kwargs.get("h0")
        lengths = args[2] if len(args) > 2 else kwargs.get("lengths")
        self.calls.append((x.detach(), None if h0 is None else h0.detach(), lengths))

    def close(self):
        self.handle.remove()


def layer_gates(model, layer, direction, src_ids, device):
    """atr_gates of `layer` for a batch of source id lists, fed exactly as model.encode feeds it."""
    S = max(len(s) for s in src_ids)
    src = torch.full((len(src_ids), S), PAD, dtype=torch.long)
    for b, s in enumerate(src_ids):
        src[b, :len(s)] = torch.tensor(s)
    lengths = torch.tensor([len(s) for s in src_ids])
    capture = InputCapture(layer)
    try:
        with torch.no_grad():
            model.encode(src.to(device), lengths.to(device))
    finally:
        capture.close()
    if len(capture.calls) != 1:
        raise RuntimeError(f"expected the analysed layer to run once per encode, it ran {len(capture.calls)} times")
    x, h0, lens = capture.calls[0]
    return analysis.atr_gates(layer, x, lens, direction, None if h0 is None else h0[direction])


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, src_vocab, tgt_vocab, ckpt = load_model(args.checkpoint, args.device)
    system = ckpt.get("model_name", type(model).__name__)
    src_path, tgt_path = corpus_paths(args.data, args.split)
    pairs = read_parallel(src_path, tgt_path)
    if args.example >= len(pairs):
        raise SystemExit(f"--example {args.example}: the {args.split} split has {len(pairs)} sentences")
    chosen = pairs if args.sentences is None else pairs[:args.sentences]
    os.makedirs(args.out, exist_ok=True)
    files, notes = [], []
    summary = {"checkpoint": os.path.abspath(args.checkpoint), "system": system, "split": args.split,
               "example": args.example}

    # ------------------------------------------------------------------------------ ATR gates (§5.1, §5.3)
    try:
        layer_name, layer, direction = analysis.find_atr_layer(model, args.layer)
    except ValueError as exc:
        if args.layer is not None:
            raise SystemExit(str(exc))
        layer = None
        notes.append(f"gates: skipped ({exc})")
    if layer is not None:
        stats = analysis.GateStatistics(max_points=args.max_points)
        encoded = [ids for ids in (src_vocab.encode(s) for s, _ in chosen) if ids]
        order = sorted(range(len(encoded)), key=lambda j: len(encoded[j]))   # similar lengths per batch
        for start in range(0, len(order), args.batch_size):
            batch = [encoded[j] for j in order[start:start + args.batch_size]]
            g = layer_gates(model, layer, direction, batch, args.device)
            stats.update(g["i"], g["f"], g["mask"])
        r = stats.correlation()
        curves = stats.position_curves()
        sample_i, sample_f = stats.sample()
        gates_png = analysis.plot_gate_scatter_and_positions(
            sample_i, sample_f, curves["input"], curves["forget"], os.path.join(args.out, "gates.png"), r=r,
            title=f"{system}: {layer_name} (direction {direction}), {stats.sentences} sentences of {args.split}")
        files.append(gates_png)
        ex_ids = src_vocab.encode(pairs[args.example][0])
        g = layer_gates(model, layer, direction, [ex_ids], args.device)
        weights = analysis.dependency_weights(g["i"], g["f"], g["mask"], reverse=g["reverse"])[0]
        dep_png = os.path.join(args.out, "dependencies.png")
        best = analysis.plot_dependencies(weights, pieces(src_vocab, ex_ids), dep_png, reverse=g["reverse"],
                                          title=f"eq. 10 weights, {layer_name}, {args.split} sentence {args.example}")
        files.append(dep_png)
        summary.update(layer=layer_name, direction=direction, sentences=stats.sentences, gate_values=stats.n,
                       pearson_r=r if math.isfinite(r) else None,
                       position_input=curves["input"].tolist(), position_forget=curves["forget"].tolist(),
                       position_count=curves["count"].tolist(),
                       example_tokens=pieces(src_vocab, ex_ids), example_strongest_previous=best)

    # ------------------------------------------------------------------------------------ attention map
    src_text, tgt_text = pairs[args.example]
    src_ids, tgt_ids = src_vocab.encode(src_text), tgt_vocab.encode(tgt_text) + [EOS]
    try:
        attn = analysis.attention_matrix(model, src_ids, len(src_ids), tgt_ids)
    except ValueError as exc:
        notes.append(f"attention: skipped ({exc})")
    else:
        attn_png = analysis.plot_attention(attn, pieces(src_vocab, src_ids), pieces(tgt_vocab, tgt_ids),
                                           os.path.join(args.out, "attention.png"),
                                           title=f"{system}: {args.split} sentence {args.example}")
        files.append(attn_png)
        summary["attention_shape"] = list(attn.shape)

    json_path = os.path.join(args.out, "interpret.json")
    files.append(json_path)
    summary.update(files=files, notes=notes)
    with atomic_write(json_path) as f:
        json.dump(summary, f, indent=2, ensure_ascii=False)
        f.write("\n")

    print(f"system {system}, checkpoint {args.checkpoint}")
    if "pearson_r" in summary:
        r = summary["pearson_r"]
        print(f"ATR layer {summary['layer']!r} (direction {direction}): {summary['sentences']} {args.split} "
              f"sentences, {summary['gate_values']:,} gate values")
        print(f"Pearson r(input gate, forget gate) = {'nan' if r is None else f'{r:.4f}'}   "
              f"(paper 004 §5.1: -0.9819 on newstest2014)")
    for note in notes:
        print(note)
    print("wrote: " + ", ".join(files))
    if "layer" not in summary and "attention_shape" not in summary:
        print(f"nothing to analyse for {system}: no ATR layer and no attention weights", file=sys.stderr)
    return summary


if __name__ == "__main__":
    main()
