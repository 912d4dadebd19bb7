"""TrainConfig: everything a training run is, typed, with its defaults in this one place.

`dtmt train` (dtmt_models/cli/train.py) fills it from the preset (dtmt_models/models/presets.py: the model options
and the training settings of a system at a size) and the flags or run configuration file; the trainer reads it;
a checkpoint keeps it as a plain dict (`to_dict`, contract §7: data only) from which `--resume` rebuilds it
(`from_dict`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Optional


@dataclass
class TrainConfig:
    data: str                                   # the prepared corpus directory
    out: Optional[str] = None                   # the run directory (default runs/<model>)
    model: str = "dtmt"                         # a system of the registry
    preset: str = "small"                       # small, paper, or a paper's table row
    model_options: Dict[str, Any] = field(default_factory=dict)   # the preset's, with --opt on top
    # training: the preset's values unless given
    lr: Optional[float] = None
    schedule: Optional[str] = None              # rnmt, inverse-sqrt, constant or epoch-halving
    warmup: Optional[int] = None
    decay_start: Optional[int] = None
    decay_end: Optional[int] = None
    replicas: Optional[int] = None              # n of the schedules (None: the number of processes)
    smoothing: Optional[float] = None
    clip: Optional[float] = None                # gradient-norm clipping (0: off)
    optimizer: str = "adam"                     # adam, or adadelta (paper 001, l.160-177)
    adam_beta2: float = 0.998                   # Adam's β2 (β1 is 0.9 in every paper); the default is also what a
    adam_eps: float = 1e-9                      # Adam's ε   checkpoint from before these were settings ran with
    adadelta_rho: float = 0.95                  # Adadelta's ρ and ε (Zeiler 2012; paper 001's)
    adadelta_eps: float = 1e-6
    init_uniform: Optional[float] = None        # weights drawn from U(-r, r) (papers 000, 004); None: the modules' own
    init_normal: Optional[float] = None         # weights drawn from N(0, s²) (paper 001: s = 0.04); None: as above
    max_tokens: Optional[int] = None            # padded budget per batch and process: pairs x (longer side + 1)
    max_sentences: Optional[int] = None         # pairs per batch and process at most (None: the budget alone)
    vocab_size: Optional[int] = None            # SentencePiece pieces per side
    vocab_type: str = "bpe"                     # bpe or unigram
    max_len: Optional[int] = None               # training pairs longer than this (subwords) are dropped
    seed: int = 1
    # stopping and reporting
    max_epochs: Optional[int] = None
    max_steps: Optional[int] = None
    max_time: Optional[str] = None              # as given, e.g. "30m"
    max_time_s: Optional[float] = None          # the same in seconds
    patience: int = 5                           # validations without a better best_by score (0: never stop early)
    best_by: str = "loss"                       # what picks best.pt (and counts patience): dev "loss" or "bleu"
                                                # (why loss: docs/design/training.md, "Checkpoint choice")
    valid_every: int = 500
    valid_beam: int = 1                         # 1: greedy dev BLEU
    bleu_sentences: int = 0                     # dev sentences translated for BLEU (0: all)
    log_every: int = 50
    keep_last: int = 0                          # step_<updates>.pt kept from the last N validations
    progress: str = "auto"                      # auto, bar, lines or none (messages kept)
    # device
    device: str = "auto"
    backend: str = "auto"
    threads: int = 0                            # 0: torch's default
    amp: str = "off"                            # off, or bf16: forward under torch.autocast in bfloat16
    cuda_graphs: Optional[bool] = None          # updates replayed as CUDA graphs (training/graphs.py); None:
                                                # wherever they can be (replays_updates)
    data_fingerprint: Optional[Dict[str, Any]] = None   # of the corpus trained on (checked on --resume)

    def replays_updates(self, device_type: str, processes: int) -> bool:
        """Whether the updates are replayed as CUDA graphs: as asked (--cuda-graphs / --no-cuda-graphs), else where
        a GPU run has tested them: one process on a CUDA device with Adam (whose step the graph captures), the
        default backend (auto or cuda) and float32 (--amp off). On by default there since
        `tests/test_gpu_systems.py::test_command_line_on_gpu` first passed on a GPU with them (H200, bd1af5e,
        2026-12-04; docs/design/gpu.md, "Updates as CUDA graphs")."""
        if self.cuda_graphs is not None:
            return self.cuda_graphs
        return (device_type == "cuda" and processes == 1 and self.optimizer == "adam"
                and self.backend in ("auto", "cuda") and self.amp == "off")

    @classmethod
    def defaults(cls) -> Dict[str, Any]:
        """The fields' defaults (those that have one)."""
        return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "TrainConfig":
        """From `to_dict`'s output, or a checkpoint's config (keys that are not fields are left out; keys it lacks
        take the fields' defaults)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
