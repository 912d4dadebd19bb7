"""Times OpenNMT-py's own training update on given batches (runs in the peer environment; see bench_peers.py).

    python onmt_profile.py CHECKPOINT BATCHES.json OUT.json --threads 1

BATCHES.json: {"src": [[piece, ...], ...], "tgt": [...], "batches": [[line index, ...], ...]} (the same batches
dtmt is timed on). The update is OpenNMT-py's `Trainer._gradient_accumulation` (zero_grad, forward, loss with
label smoothing through the generator, backward, clipping and Adam), built from the checkpoint's options by
OpenNMT-py's own builders; the optimizer starts fresh.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from update_timer import profile_updates  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint")
    p.add_argument("batches")
    p.add_argument("out")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--size", default=None, metavar="E,H",
                   help="time a freshly initialised model of these embedding and hidden sizes instead of the "
                        "checkpoint's weights (same vocabularies and other options), e.g. to match a parameter count")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(1)

    from onmt.inputters.inputter import dict_to_vocabs
    from onmt.inputters.text_utils import numericalize, tensorify
    from onmt.model_builder import build_model
    from onmt.trainer import build_trainer
    from onmt.utils.optimizers import Optimizer
    from onmt.utils.parse import ArgumentParser
    from onmt.utils.statistics import Statistics

    ckpt = torch.load(a.checkpoint, map_location="cpu", weights_only=False)   # the peer's own file
    opt = ArgumentParser.ckpt_model_opts(ckpt["opt"])
    vocabs = dict_to_vocabs(ckpt["vocab"])
    if a.size:
        opt.word_vec_size, opt.hidden_size = (int(x) for x in a.size.split(","))
        opt.src_word_vec_size = opt.tgt_word_vec_size = opt.word_vec_size
        opt.enc_hid_size = opt.dec_hid_size = opt.hidden_size
        ckpt = None
    model = build_model(opt, opt, vocabs, ckpt, -1)
    model.train()
    optim = Optimizer.from_opt(model, opt, checkpoint=None)
    trainer = build_trainer(opt, -1, model, vocabs, optim, model_saver=None)

    with open(a.batches) as f:
        data = json.load(f)
    batches = []
    for idx in data["batches"]:
        exs = []
        for k, i in enumerate(idx):
            ex = {"src": {"src": " ".join(data["src"][i])}, "tgt": {"tgt": " ".join(data["tgt"][i])},
                  "cid": "corpus_1", "cid_line_number": i}
            exs.append((numericalize(vocabs, ex), k))
        batch = tensorify(vocabs, exs, torch.device("cpu"))
        ntok = int(batch["tgt"][:, 1:, 0].ne(trainer.train_loss.padding_idx).sum())
        batches.append((batch, ntok))

    def update(item, timer):
        batch, ntok = item
        original_backward, original_step = optim.backward, optim.step

        def backward(loss):
            with timer.phase("backward"):
                original_backward(loss)

        def step():
            with timer.phase("clip + optimizer"):
                original_step()

        optim.backward, optim.step = backward, step
        try:
            trainer._gradient_accumulation([batch], ntok, Statistics(), Statistics())
        finally:
            optim.backward, optim.step = original_backward, original_step
        return ntok

    parts = {"encoder": [model.encoder], "decoder recurrence": [model.decoder], "output layer": [model.generator]}
    result = profile_updates(update, batches, parts)
    result["params"] = sum(p.numel() for p in model.parameters())
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
