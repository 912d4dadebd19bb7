"""dtmt_models: the recurrent NMT systems of the five papers, built on dtmt_kernels (contract §4).

    import dtmt_models as dm
    model = dm.build_model("dtmt", src_vocab_size, tgt_vocab_size, depth=4, cell="lgru")
    dm.list_models(); dm.summary(model)

The names below are imported on first use, so that the parts that need no torch (dtmt_models.data: corpora,
vocabularies, the binarized corpus and its encoding workers) load without it.
"""
from __future__ import annotations

import importlib
import time

# when this process began, as near as Python lets us see it: the origin of train_log.csv's wall_s (a run's wall
# time from its launch, data reading, validation and checkpoints included)
STARTED = time.perf_counter()

_LAZY = {"build_model": "dtmt_models.models.registry", "list_models": "dtmt_models.models.registry",
         "register_model": "dtmt_models.models.registry", "Seq2Seq": "dtmt_models.models.seq2seq",
         "summary": "dtmt_models.models.seq2seq"}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dtmt_models' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
