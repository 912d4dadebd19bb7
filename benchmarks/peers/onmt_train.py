"""OpenNMT-py's own `onmt_train`, run until a stop signal with dtmt's learning-rate schedule.

Runs inside the peer environment that `benchmarks/bench_peers.py` makes (never imported by dtmt):

    python onmt_train.py --log run.jsonl --schedule rnmt:200:1500:6000:0.05 -config onmt.yaml

Everything after the runner's own flags goes to OpenNMT-py's argument parser unchanged. The runner changes
three things from the outside, without touching OpenNMT-py's files:
- the learning-rate multiplier is dtmt's RNMT+ schedule (paper 000 eq. 17, n = 1, with a floor; the same
  numbers as `dtmt_models.training.schedules.RNMTPlusSchedule`), so both toolkits follow the same schedule;
- SIGTERM (or SIGINT) ends training as it ends `dtmt train`: the update in progress finishes, a checkpoint is
  written, and the process exits. bench_peers sends it to both toolkits when their budget of wall time since
  launch is spent, so both are timed by one clock with everything they do inside it (reading and batching the
  data, validation, checkpoints). `--budget-s` stops by itself after that many seconds since launch instead;
- a JSON line per `--every` updates (and per validation) goes to --log: step, wall seconds since the process
  began, target tokens (non-pad target tokens after BOS, i.e. the tokens the loss is computed on, as dtmt counts
  them); validation reports the plain dev NLL per target token (OpenNMT-py's own includes the label smoothing).
"""
from __future__ import annotations

import time

STARTED = time.perf_counter()   # before OpenNMT-py and torch load: the launch, as near as Python sees it

import argparse  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402


class BudgetReached(Exception):
    pass


def rnmt_multiplier(warmup: int, start: int, end: int, floor: float):
    """Paper 000 eq. 17 with n = 1: 1 until `start`, then 2^((s - t)/(e - s)); never below `floor`.
    With n = 1 the warm-up term 1 + t(n - 1)/(n p) is 1 throughout, as in dtmt's schedule, so `warmup` has no
    effect; it is taken to keep the flag in dtmt's terms."""
    del warmup

    def fn(step: int) -> float:
        t = max(step - 1, 0)     # OpenNMT-py counts decay steps from 1, dtmt's LambdaLR from 0
        return max(min(1.0, 2.0 ** ((start - t) / (end - start))), floor)
    return fn


def main() -> None:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--budget-s", type=float, default=None, help="stop after this many seconds since launch")
    p.add_argument("--log", required=True)
    p.add_argument("--schedule", default=None, help="rnmt:WARMUP:START:END:FLOOR (default: OpenNMT-py's own)")
    p.add_argument("--every", type=int, default=50)
    own, rest = p.parse_known_args()

    import onmt.trainer as trainer_mod
    import onmt.utils.optimizers as optim_mod
    from onmt.bin.train import _get_parser, train

    if own.schedule:
        kind, *nums = own.schedule.split(":")
        if kind != "rnmt" or len(nums) != 4:
            raise SystemExit(f"--schedule {own.schedule}: expected rnmt:WARMUP:START:END:FLOOR")
        fn = rnmt_multiplier(int(nums[0]), int(nums[1]), int(nums[2]), float(nums[3]))
        optim_mod.make_learning_rate_decay_fn = lambda opt: fn

    log = open(own.log, "a", buffering=1)
    clock = {"tokens": 0, "window_tokens": 0, "window_s": 0.0, "signal": None}

    def wall() -> float:
        return time.perf_counter() - STARTED

    def on_signal(signum, _frame):
        clock["signal"] = signal.Signals(signum).name   # the update in progress finishes first

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    original_step = trainer_mod.Trainer._gradient_accumulation
    original_validate = trainer_mod.Trainer.validate

    def step(self, true_batches, normalization, total_stats, report_stats):
        t0 = time.perf_counter()
        original_step(self, true_batches, normalization, total_stats, report_stats)
        tokens = int(normalization)
        clock["tokens"] += tokens
        clock["window_tokens"] += tokens
        clock["window_s"] += time.perf_counter() - t0
        n = self.optim.training_step - 1     # updates done
        done = clock["signal"] is not None or (own.budget_s is not None and wall() >= own.budget_s)
        if n % own.every == 0 or done:
            log.write(json.dumps({"kind": "train", "step": n, "wall_s": round(wall(), 2),
                                  "tokens": clock["tokens"], "lr": self.optim.learning_rate(),
                                  "tokens_per_s": clock["window_tokens"] / max(clock["window_s"], 1e-9)}) + "\n")
            clock["window_tokens"], clock["window_s"] = 0, 0.0
        if done:
            stopped = wall()
            if self.model_saver is not None:
                self.model_saver.save(n, moving_average=self.moving_average)
            log.write(json.dumps({"kind": "end", "step": n, "wall_s": round(stopped, 2), "tokens": clock["tokens"],
                                  "signal": clock["signal"]}) + "\n")
            raise BudgetReached()

    def validate(self, valid_iter, moving_average=None):
        # OpenNMT-py 3.5.1 validates with the training criterion, label smoothing included; dtmt's dev loss is
        # the plain NLL: smoothing off while validating, so that the two dev losses are the same quantity
        criterion = self.valid_loss.criterion
        smoothing = getattr(criterion, "label_smoothing", None)
        if smoothing is not None:
            criterion.label_smoothing = 0.0
        try:
            stats = original_validate(self, valid_iter, moving_average=moving_average)
        finally:
            if smoothing is not None:
                criterion.label_smoothing = smoothing
        log.write(json.dumps({"kind": "valid", "step": self.optim.training_step - 1,
                              "wall_s": round(wall(), 2), "dev_loss": stats.xent(),
                              "dev_ppl": stats.ppl(), "dev_acc": stats.accuracy()}) + "\n")
        return stats

    trainer_mod.Trainer._gradient_accumulation = step
    trainer_mod.Trainer.validate = validate

    parser = _get_parser()
    opt, _unknown = parser.parse_known_args(rest)
    try:
        train(opt)
    except BudgetReached:
        pass
    log.close()


if __name__ == "__main__":
    sys.exit(main())
