"""Learning-rate schedules of the papers, as multipliers of the optimizer's base learning rate
(use with torch.optim.lr_scheduler.LambdaLR; `step` counts updates from 0)."""
from __future__ import annotations


class RNMTPlusSchedule:
    """Paper 000 eq. 17 (from RNMT+): lr(t) = lr0 · min(1 + t(n−1)/(n p), n, n (2n)^((s − n t)/(e − s))):
    warm up from lr0 to n·lr0 (reached at t = n·p), hold, then decay exponentially from step s (lr0/2 at n·t = e).
    n is the paper's number of replicas; `floor` (authors' code: 5e-5 absolute) is given here as a multiple
    of lr0, 0 for none."""

    def __init__(self, warmup: int = 500, decay_start: int = 8000, decay_end: int = 64000, n: int = 1,
                 floor: float = 0.0):
        if not (warmup >= 1 and decay_end > decay_start >= 0 and n >= 1):
            raise ValueError("RNMTPlusSchedule: needs warmup >= 1, decay_end > decay_start >= 0, n >= 1")
        self.p, self.s, self.e, self.n, self.floor = warmup, decay_start, decay_end, n, floor

    def __call__(self, step: int) -> float:
        n, t = self.n, step
        x = (self.s - n * t) / (self.e - self.s)
        # (before the decay, x >= 0: the third term is at least n and the min is the first two; computed, it overflowed
        # a float for a short decay window, 2^1100 at update 0 of --decay-start 1100 --decay-end 1101)
        decay = n * (2.0 * n) ** x if x < 0 else float(n)
        return max(min(1.0 + t * (n - 1) / (n * self.p), float(n), decay), self.floor)


class InverseSqrtSchedule:
    """Paper 003 eq. 26-27 (the Transformer's): lr = d^-0.5 · min(α^-0.5, α · β^-1.5), α = step / num_gpu,
    β = warm-up steps. Use with base lr 1.0 (or a scale). Steps are counted from 1 so step 0 is not 0/0."""

    def __init__(self, model_dim: int, warmup: int = 6000, num_gpu: int = 1, scale: float = 1.0):
        if model_dim < 1 or warmup < 1 or num_gpu < 1:
            raise ValueError("InverseSqrtSchedule: model_dim, warmup and num_gpu must be >= 1")
        self.d, self.beta, self.num_gpu, self.scale = model_dim, warmup, num_gpu, scale

    def __call__(self, step: int) -> float:
        alpha = max(step + 1, 1) / self.num_gpu
        return self.scale * self.d ** -0.5 * min(alpha ** -0.5, alpha * self.beta ** -1.5)
