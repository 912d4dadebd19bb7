"""Before/after timings of pieces of a dtmt training update (docs/design/training.md, "Loss and optimizer"), each
pair in one process:

    python benchmarks/bench_update_pieces.py --run benchmarks/out/peers_30m     # a bench_peers.py output dir

1. the loss: `model(..., target=)` (log-softmax and label-smoothed loss fused, `smoothed_cross_entropy`) against
   `label_smoothed_nll(model(...))`, whole updates on the batches `bench_peers.py --profile` wrote
   (DIR/profile_batches.json) with the model of DIR/dtmt/last.pt, the two alternated --rounds times;
2. one decoder step's attention-weight gradient in the unrolled context: the C++ context backward without the
   values' part (`torch.ops.dtmt.attention_context_backward(..., values_grad=False)`) against the batched GEMV it replaced
   (a per-head copy of the values times the step's gradient), at 66 × 26 × 512, 4 heads;
3. one Adam step over the dtmt small preset's parameters: torch's default (on the CPU a loop of per-tensor
   operators) against `fused=True` and against `build_optimizer` (fused, plus the hook that bumps the parameters'
   version counters);
4. the loss alone on [--loss-rows, 4,000] logits, forward and backward: the C++ kernel
   (`torch.ops.dtmt.smoothed_cross_entropy`, the default on the CPU) against the portable autograd node it
   replaced there (`PortableSmoothedCrossEntropy`) and against log_softmax + `label_smoothed_nll`.
5. whole updates of a freshly initialised dtmt (small preset) on the first batches of the prepared corpus
   (--data), alternated --rounds times: as before (the portable loss node, torch's default Adam) against now (the
   C++ loss kernel, `build_optimizer`).
One thread (--threads). Prints target tokens/s per round and the ratio, and µs / ms per call.

    python benchmarks/bench_update_pieces.py --pieces 3 4 5        # 3-5 need no bench_peers.py run
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def main(argv=None):
    import torch

    import dtmt_models.models.systems  # noqa: F401
    import dtmt_kernels  # noqa: F401 - registers torch.ops.dtmt

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", help="a bench_peers.py output directory (after its --profile): pieces 1 and 2")
    p.add_argument("--pieces", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    p.add_argument("--data", default=os.path.join(os.path.dirname(HERE), "data", "bible"),
                   help="piece 5: a corpus prepared by `dtmt prepare` (binarized)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="piece 5: its binarized copy's BPE size (default: the small preset's, 4,000)")
    p.add_argument("--max-tokens", type=int, default=None, help="piece 5: the batches' token budget (default: the "
                   "small preset's, 2,000)")
    p.add_argument("--loss-rows", type=int, default=1700, help="piece 4: target tokens (rows of logits)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", type=int, default=12)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    if {1, 2} & set(a.pieces) and not a.run:
        p.error("pieces 1 and 2 need --run (a bench_peers.py output directory)")
    out = {}
    if 1 in a.pieces:
        out.update(_loss_in_updates(a))
    if 2 in a.pieces:
        out.update(_context_dalpha())
    if 3 in a.pieces:
        out.update(_adam(a))
    if 4 in a.pieces:
        out.update(_loss_alone(a))
    if 5 in a.pieces:
        out.update(_whole_updates(a))
    return out


def _whole_updates(a) -> dict:
    import torch

    import dtmt_models.models.loss as loss_module
    from dtmt_kernels.ops.loss.op import PortableSmoothedCrossEntropy
    from dtmt_models.data.batching import collate, token_batches
    from dtmt_models.data.binarized import open_binarized
    from dtmt_models.models.presets import get_preset
    from dtmt_models.models.registry import build_model
    from dtmt_models.training.trainer import build_optimizer

    preset = get_preset("dtmt", "small")
    train = preset["train"]
    vocab = a.vocab_size or train["vocab_size"]
    split = open_binarized(a.data, "bpe", vocab).split("train")
    lengths = [tuple(int(v) for v in row) for row in split.lengths()]
    batches = [collate(split.pairs(list(b))) for b in token_batches(lengths, a.max_tokens or train["max_tokens"],
                                                                     seed=1, epoch=0)[:a.batches]]
    if len(batches) < 3:
        raise SystemExit(f"piece 5: {a.data} gives {len(batches)} batches; it needs 3 (2 to warm up)")
    torch.manual_seed(0)
    model = build_model("dtmt", vocab, vocab, **preset["model"]).train()
    optimizers = {"before": torch.optim.Adam(model.parameters(), lr=1e-5, betas=(0.9, 0.998), eps=1e-9),
                  "now": build_optimizer(model, 1e-5)}
    kernel_loss = loss_module.dk.functional.smoothed_cross_entropy

    def portable_loss(logits, target, smoothing=0.0, ignore_index=-100):
        return PortableSmoothedCrossEntropy.apply(logits, target, float(smoothing), int(ignore_index))

    def update(batch, way):
        src, lengths_, prev, target = batch
        loss_module.dk.functional.smoothed_cross_entropy = portable_loss if way == "before" else kernel_loss
        try:
            loss, _, n = model(src, lengths_, prev, target=target, smoothing=train["smoothing"])
        finally:
            loss_module.dk.functional.smoothed_cross_entropy = kernel_loss
        opt = optimizers[way]
        opt.zero_grad(set_to_none=True)
        (loss / n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train["clip"])
        opt.step()
        return n

    for b in batches[:2]:
        for way in optimizers:
            update(b, way)
    rates = {}
    for _ in range(a.rounds):
        for way in optimizers:
            t0 = time.perf_counter()
            n = sum(update(b, way) for b in batches[2:])
            rates.setdefault(way, []).append(n / (time.perf_counter() - t0))
    ratios = [n / b for b, n in zip(rates["before"], rates["now"])]
    print(f"5. whole updates ({len(batches) - 2} batches a round), target tok/s: before",
          [round(x) for x in rates["before"]], "| now", [round(x) for x in rates["now"]], "| ratio per round",
          [round(r, 3) for r in ratios])
    return {"updates_tok_s": rates, "updates_ratio_per_round": ratios}


def _loss_in_updates(a) -> dict:
    import torch

    from dtmt_models.data.batching import collate
    from dtmt_models.models.checkpoint import load_model
    from dtmt_models.models.loss import label_smoothed_nll
    from dtmt_models.training.trainer import build_optimizer

    out = {}
    # 1. the loss, in whole updates
    with open(os.path.join(a.run, "profile_batches.json")) as f:
        data = json.load(f)
    model, sv, tv, _ = load_model(os.path.join(a.run, "dtmt", "last.pt"))
    model.train()
    opt = build_optimizer(model, 1e-5)
    batches = [collate([([sv.sp.piece_to_id(x) for x in data["src"][i]], [tv.sp.piece_to_id(x) for x in data["tgt"][i]])
                        for i in idx]) for idx in data["batches"][:a.batches]]

    def update(batch, fused):
        src, lengths, prev, target = batch
        if fused:
            loss, _, n = model(src, lengths, prev, target=target, smoothing=0.1)
        else:
            loss, _, n = label_smoothed_nll(model(src, lengths, prev), target, 0.1)
        opt.zero_grad(set_to_none=True)
        (loss / n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return n

    for b in batches[:2]:
        update(b, True)
        update(b, False)
    rates = {False: [], True: []}
    for _ in range(a.rounds):
        for fused in (False, True):
            t0 = time.perf_counter()
            n = sum(update(b, fused) for b in batches[2:])
            rates[fused].append(n / (time.perf_counter() - t0))
    out["loss"] = {"unfused_tok_s": rates[False], "fused_tok_s": rates[True],
                   "ratio_per_round": [f / u for u, f in zip(rates[False], rates[True])]}
    print("1. loss: target tok/s, log_softmax + label_smoothed_nll", [round(x) for x in rates[False]], "| fused",
          [round(x) for x in rates[True]], "| ratio per round", [round(r, 3) for r in out["loss"]["ratio_per_round"]])
    return out


def _context_dalpha() -> dict:
    import torch

    out = {}
    # 2. one step's attention-weight gradient
    B, S, C, NH = 66, 26, 512, 4
    g = torch.Generator().manual_seed(0)
    values, grad = torch.randn(B, S, C, generator=g), torch.randn(B, C, generator=g)
    alpha = torch.softmax(torch.randn(B, NH, S, generator=g), -1)
    per_head = values.reshape(B, S, NH, C // NH).permute(0, 2, 1, 3).contiguous()
    gemv = lambda: torch.matmul(per_head, grad.reshape(B, NH, -1).unsqueeze(-1)).squeeze(-1)  # noqa: E731
    kernel = lambda: torch.ops.dtmt.attention_context_backward(grad, alpha, values, False)[0]  # noqa: E731
    torch.testing.assert_close(kernel(), gemv())
    times = {}
    for name, f in (("batched GEMV", gemv), ("C++ kernel", kernel)) * 2:
        t0 = time.perf_counter()
        for _ in range(300):
            f()
        times.setdefault(name, []).append((time.perf_counter() - t0) / 300 * 1e6)
    out["context_dalpha_us"] = times
    print("2. attention-weight gradient of one step, µs:", {k: [round(x) for x in v] for k, v in times.items()})
    return out


def _adam(a) -> dict:
    import torch

    from dtmt_models.models.presets import get_preset
    from dtmt_models.models.registry import build_model
    from dtmt_models.training.trainer import build_optimizer

    out = {}
    # 3. one Adam step
    m = build_model("dtmt", 4000, 4000, **get_preset("dtmt", "small")["model"])
    for q in m.parameters():
        q.grad = torch.randn_like(q)
    optims = {"default": torch.optim.Adam(m.parameters(), lr=1e-6, betas=(0.9, 0.998), eps=1e-9),
              "fused": torch.optim.Adam(m.parameters(), lr=1e-6, betas=(0.9, 0.998), eps=1e-9, fused=True),
              "build_optimizer": build_optimizer(m, 1e-6)}
    steps = {}
    for _ in range(a.rounds):
        for name, o in optims.items():
            for _ in range(3):
                o.step()
            t0 = time.perf_counter()
            for _ in range(30):
                o.step()
            steps.setdefault(name, []).append((time.perf_counter() - t0) / 30 * 1e3)
    out["adam_step_ms"] = steps
    print("3. Adam step, ms:", {k: [round(x, 1) for x in v] for k, v in steps.items()})
    return out


def _loss_alone(a) -> dict:
    import torch

    from dtmt_kernels.functional import smoothed_cross_entropy
    from dtmt_kernels.ops.loss.op import PortableSmoothedCrossEntropy
    from dtmt_models.models.loss import label_smoothed_nll

    g = torch.Generator().manual_seed(0)
    N, V = a.loss_rows, 4000
    logits = (3 * torch.randn(N, V, generator=g)).requires_grad_()
    target = torch.randint(1, V, (N,), generator=g)
    target[::25] = 0                                                   # some padding
    ways = {"log_softmax + label_smoothed_nll": lambda: label_smoothed_nll(torch.log_softmax(logits, -1), target,
                                                                           0.1)[0],
            "portable node": lambda: PortableSmoothedCrossEntropy.apply(logits, target, 0.1, 0)[0],
            "C++ kernel": lambda: smoothed_cross_entropy(logits, target, 0.1, 0)[0]}
    ref = torch.autograd.grad(ways["portable node"]() / N, logits)[0]
    torch.testing.assert_close(torch.autograd.grad(ways["C++ kernel"]() / N, logits)[0], ref, rtol=1e-5, atol=1e-8)
    times = {}
    for _ in range(a.rounds):
        for name, f in ways.items():
            for i in range(12):
                t0 = time.perf_counter()
                torch.autograd.grad(f() / N, logits)
                if i >= 2:
                    times.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)
    ms = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(f"4. the loss alone, [{N}, {V}] logits, forward + backward, median ms:",
          {k: round(v, 2) for k, v in ms.items()})
    return {"loss_alone_ms": ms}


if __name__ == "__main__":
    main()
