"""Checkpoints: one file holds everything needed to translate (system name and options, both SentencePiece
models, weights) and, for training checkpoints, everything needed to resume exactly (optimizer, scheduler,
position in the epoch, random states, early-stopping record).

Files are written atomically (dtmt_models.atomic), so a crash, a kill or a full disk never leaves a
half-written checkpoint under the real name, and the previous one stays intact.

A checkpoint holds data only: tensors, numbers, strings, bytes (the SentencePiece models), None and lists,
tuples and dicts of them. It is read with torch's weights-only unpickler, which refuses any other object, so
loading a file from someone else never runs code that the file carries (a plain pickle can run anything).
"""
from __future__ import annotations

import os
import pickle
import re
import warnings
from typing import Any, Dict, Optional, Tuple

import torch

from dtmt_models.atomic import atomic_write
from dtmt_models.data.vocabulary import Vocabulary
from dtmt_models.errors import one_line
from dtmt_models.models.registry import build_model

FORMAT = "dtmt-checkpoint-1"


def save_checkpoint(path: str, payload: Dict[str, Any]) -> None:
    """Writes `payload` (a dict with at least model_name, model_options, src_vocab, tgt_vocab, model)
    atomically to `path`."""
    missing = [k for k in ("model_name", "model_options", "src_vocab", "tgt_vocab", "model") if k not in payload]
    if missing:
        raise ValueError(f"save_checkpoint: payload lacks {missing}")
    with atomic_write(path, "wb") as f:
        torch.save({"format": FORMAT, **payload}, f)


def read_checkpoint(path: str) -> Dict[str, Any]:
    """The raw checkpoint dict; a clear error for a missing or foreign file."""
    if os.path.isdir(path):
        raise ValueError(f"{path}: is a directory, not a checkpoint file")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    try:
        with warnings.catch_warnings():   # (torch's notes on old pickle formats: the file is refused or read here)
            warnings.simplefilter("ignore")
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # refused by the data-only loader: nothing of it has run
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        if found is None and "global" not in str(exc).lower():   # not an object it refused: not a pickle of ours
            raise ValueError(f"{path}: not a dtmt checkpoint (not a file torch.save wrote, or a truncated one; "
                             f"nothing of it was run)") from None
        what = f"it names {found.group(1)}" if found else "an unsupported object"
        raise ValueError(f"{path}: refused: it holds objects other than tensors and plain data, which a dtmt "
                         f"checkpoint never does, and loading them could run code ({what})"
                         ) from None
    except OSError as exc:   # the file itself (permissions, a disk error): its reason
        raise ValueError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except MemoryError:
        raise
    except Exception:  # truncated or not a torch file (torch's message says little: KeyError(101) for a text file)
        raise ValueError(f"{path}: not a dtmt checkpoint (not a file torch.save wrote, or a truncated one)") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ValueError(f"{path}: not a dtmt checkpoint (expected format {FORMAT!r})")
    return ckpt


def load_model(path: str, device: str = "cpu", backend: Optional[str] = None
               ) -> Tuple[torch.nn.Module, Vocabulary, Vocabulary, Dict[str, Any]]:
    """(model in eval mode on `device`, source vocabulary, target vocabulary, checkpoint dict).
    `backend` switches the fused recurrent layers (None keeps "auto")."""
    ckpt = read_checkpoint(path)
    missing = [k for k in ("model_name", "model_options", "model", "src_vocab", "tgt_vocab") if k not in ckpt]
    if missing:
        raise ValueError(f"{path}: not a translation checkpoint (it has no {', '.join(missing)})")
    try:
        src_vocab, tgt_vocab = Vocabulary(ckpt["src_vocab"]), Vocabulary(ckpt["tgt_vocab"])
    except (RuntimeError, ValueError, TypeError) as exc:   # SentencePiece's own message is C++ internals
        raise ValueError(f"{path}: its vocabularies cannot be read ({one_line(exc)[:200]})") from None
    try:
        model = build_model(ckpt["model_name"], len(src_vocab), len(tgt_vocab), **ckpt["model_options"])
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: its model cannot be built ({one_line(exc)[:300]})") from None
    try:
        model.load_state_dict(ckpt["model"])
    except (RuntimeError, TypeError, AttributeError) as exc:   # torch lists every key and shape, one a line
        detail = " ".join(str(exc).split())
        raise ValueError(f"{path}: its weights do not fit a {ckpt['model_name']} model with its options "
                         f"({detail[:300]}{' ...' if len(detail) > 300 else ''})") from None
    if backend is not None and hasattr(model, "set_backend"):
        model.set_backend(backend)
    return model.to(device).eval(), src_vocab, tgt_vocab, ckpt


def average_checkpoints(paths) -> Dict[str, Any]:
    """The element-wise mean of the weights of checkpoints of one model (same system, options, vocabularies and
    parameter shapes; floating-point tensors averaged in float64 and cast back, integer buffers must agree), as a
    translation checkpoint payload: everything else is the last file's, plus `averaged_from` (the file names).
    Raises ValueError naming the first file that does not match the first one, or a file given twice; warns
    (UserWarning) when the files come from different training runs (their `config`s name another output folder or
    seed: the mean of separately trained weights is rarely a model that translates)."""
    paths = list(paths)
    if not paths:
        raise ValueError("average: no checkpoints given")
    seen = {}
    for path in paths:
        key = os.path.realpath(path)
        if key in seen:
            raise ValueError(f"average: {path} is given twice (as {seen[key]} too); each checkpoint counts once")
        seen[key] = path
    first = read_checkpoint(paths[0])
    runs = {_run_of(first): paths[0]}
    sums = {k: v.double() if v.is_floating_point() else v for k, v in first["model"].items()}
    last = first
    for path in paths[1:]:
        ckpt = read_checkpoint(path)
        for key in ("model_name", "model_options", "src_vocab", "tgt_vocab"):
            if ckpt.get(key) != first.get(key):
                raise ValueError(f"average: {path} is not the same model as {paths[0]} (its {key} differs)")
        runs.setdefault(_run_of(ckpt), path)
        model = ckpt["model"]
        if set(model) != set(sums):
            raise ValueError(f"average: {path} has other parameters than {paths[0]}")
        for k, v in model.items():
            if v.shape != sums[k].shape:
                raise ValueError(f"average: {path}: {k} has shape {list(v.shape)}, {paths[0]} {list(sums[k].shape)}")
            if v.is_floating_point():
                sums[k] += v.double()
            elif not torch.equal(v, sums[k]):
                raise ValueError(f"average: {path}: the integer tensor {k} differs from {paths[0]}'s")
        last = ckpt
    if len(runs) > 1:
        a, b = list(runs.values())[:2]
        warnings.warn(f"{a} and {b} come from different training runs (their output folder or seed differ): the "
                      f"mean of separately trained weights is rarely a model that translates", UserWarning)
    n = len(paths)
    averaged = {k: (s / n).to(first["model"][k].dtype) if s.is_floating_point() else s for k, s in sums.items()}
    payload = {k: v for k, v in last.items() if k not in ("format", "training", "model")}
    payload["model"] = averaged
    payload["averaged_from"] = [os.path.basename(p) for p in paths]
    return payload


def _run_of(ckpt: Dict[str, Any]) -> Tuple[Any, Any]:
    """The training run a checkpoint comes from, as far as it says: (output folder, seed) of its config."""
    config = ckpt.get("config") or {}
    return config.get("out"), config.get("seed")
