"""Before/after timings of three pieces of a dtmt training update (NOTES log item 19), each pair in one process:

    python benchmarks/bench_update_pieces.py --run benchmarks/out/peers_30m     # a bench_peers.py output dir

1. the loss: `model(..., target=)` (log-softmax and label-smoothed loss fused, `smoothed_cross_entropy`) against
   `label_smoothed_nll(model(...))`, whole updates on the batches `bench_peers.py --profile` wrote
   (DIR/profile_batches.json) with the model of DIR/dtmt/last.pt, the two alternated --rounds times;
2. one decoder step's attention-weight gradient in the unrolled context: the C++ context backward without the
   values' part (`torch.ops.dtmt.attention_context_backward(..., values_grad=False)`) against the batched GEMV it replaced
   (a per-head copy of the values times the step's gradient), at 66 × 26 × 512, 4 heads;
3. one Adam step over the dtmt small preset's parameters: torch's default (foreach) against `fused=True`.
One thread (--threads). Prints target tokens/s per round and the ratio, and µs / ms per call.
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
    from dtmt_models.data.batching import collate
    from dtmt_models.models.checkpoint import load_model
    from dtmt_models.models.loss import label_smoothed_nll
    from dtmt_models.models.presets import get_preset
    from dtmt_models.models.registry import build_model
    from dtmt_models.training.trainer import build_optimizer

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", required=True, help="a bench_peers.py output directory (after its --profile)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", type=int, default=12)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
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

    # 3. one Adam step
    m = build_model("dtmt", 4000, 4000, **get_preset("dtmt", "small")["model"])
    for q in m.parameters():
        q.grad = torch.randn_like(q)
    optims = {"foreach": torch.optim.Adam(m.parameters(), lr=1e-6, betas=(0.9, 0.998), eps=1e-9),
              "fused": torch.optim.Adam(m.parameters(), lr=1e-6, betas=(0.9, 0.998), eps=1e-9, fused=True)}
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


if __name__ == "__main__":
    main()
