"""dtmt_kernels: fused deep-transition (L-GRU / GRU / LAU + T-GRU) and ATR recurrent kernels.

    import dtmt_kernels as dk
    rnn = dk.nn.DeepTransitionGRU(256, 512, depth=4, cell="lgru", layer_norm=True, bidirectional=True)
    out, h_n = rnn(x, lengths=lengths)

The equations and the API: the docstrings of `dk.reference` (each op folder's reference.py, their executable
form) and dtmt_kernels/nn.py. Every fused kernel is a torch.library custom op, torch.ops.dtmt.* (dtmt_kernels/ops/: one folder
per op), so the layers work under torch.compile(fullgraph=True), torch.export and torch.autocast.
"""
import torch

from . import functional, nn, reference
from .backends import available_backends, resolve_backend
from .ops.transition.persistent import PersistentPlan, persistent_plan
from .reference import TransitionWeights

__all__ = ["available_backends", "resolve_backend", "functional", "nn", "reference", "PersistentPlan",
           "persistent_plan", "TransitionWeights"]
__version__ = "0.1.0"

# MKL's vector math (torch.tanh, exp, sin, ... of CPU tensors) sets itself up on its first call. When that first call
# runs on two threads at once, one of them can compute with another code path: results an ulp apart in some
# processes, and translations that differed between runs (why: docs/design/decoding.md, "The first call of MKL's
# vector math"). So a first call here, on one thread (on the CPU whatever device is the default where this module is
# first imported: under `with torch.device("meta")`, as checkpoint loading builds a model to compare its weights,
# it would run nothing).
torch.exp(torch.zeros(16, device="cpu"))
