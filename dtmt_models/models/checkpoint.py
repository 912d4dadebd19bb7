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

import collections
import contextlib
import errno
import hashlib
import os
import pickle
import random
import re
import shutil
import warnings
import zipfile
import zlib
from typing import Any, Dict, Optional, Set, Tuple

import torch

from dtmt_models.atomic import atomic_write
from dtmt_models.data.vocabulary import PAD, Vocabulary
from dtmt_models.errors import MAX_COUNT, check_device_present, one_line
from dtmt_models.models.registry import build_model, shapes_only, used_options

FORMAT = "dtmt-checkpoint-1"
IMPLEMENTATION = ("fused", "foreach", "capturable", "differentiable")   # how an optimizer steps, not what it does


def save_checkpoint(path: str, payload: Dict[str, Any], through_link: bool = False) -> None:
    """Writes `payload` (a dict with at least model_name, model_options, src_vocab, tgt_vocab, model)
    atomically to `path` (through a symbolic link where `through_link`: an output the user names, see
    dtmt_models.atomic). The file's format is this module's, whatever a `format` key of the payload says."""
    missing = [k for k in ("model_name", "model_options", "src_vocab", "tgt_vocab", "model") if k not in payload]
    if missing:
        raise ValueError(f"save_checkpoint: payload lacks {missing}")
    _check_plain(payload, "payload")   # (what the loader refuses is not written: a numpy number saved, then refused)
    with atomic_write(path, "wb", through_link=through_link) as f, _with_check_sums():
        try:
            torch.save({**payload, "format": FORMAT}, f)
        except RuntimeError as exc:   # torch's zip writer reports a failed write (a full disk) as its own error
            if isinstance(exc.__context__, KeyboardInterrupt):   # and a signal's in the write as one too (a second
                raise exc.__context__ from None                  # Ctrl-C while `dtmt train` saved: not the disk)
            limit = _file_size_limit()
            if limit is not None and f.tell() >= limit:   # (`ulimit -f`: EFBIG, Python ignoring SIGXFSZ)
                raise OSError(f"the write stopped at this process's file size limit of {limit:,} bytes (ulimit -f); "
                              f"the checkpoint needs more") from None
            if isinstance(exc.__context__, OSError):   # the file's own error (a pipe closed by its reader, -o
                raise exc.__context__ from None         # /dev/stdout | head: it was blamed on the disk's free space)
            free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
            raise OSError(f"the write stopped with {free:,} bytes free on its device"
                          + (" (the disk is full)" if free < (1 << 20) else f" ({one_line(exc)})")) from None


PLAIN = (str, bytes, int, float, bool, type(None))
CONTAINERS = (dict, collections.OrderedDict, list, tuple)
TENSORS = (torch.Tensor, torch.nn.Parameter)


def _check_plain(obj: Any, where: str, owner: str = "save_checkpoint") -> None:
    """ValueError naming `owner` and the first object under `obj` (at `where`, e.g. payload['config']['bleu']) that
    is not a checkpoint's data (the module docstring): exact types, so a numpy number, a Path or an enum, which the
    weights-only loader refuses, is refused here before anything is written; and what that loader takes but a
    checkpoint never holds (a set, a torch.Size: a crafted file's) when one is read."""
    stack = [(obj, where)]
    while stack:
        x, at = stack.pop()
        kind = type(x)
        if kind is bytes and not x:   # (pickled as a call of bytes(), which the loader refuses as code it would run)
            raise ValueError(f"{owner}: {at} is empty bytes, which the weights-only loader cannot read back")
        if kind in PLAIN or kind in TENSORS:
            continue
        if kind not in CONTAINERS:
            raise ValueError(f"{owner}: {at} is a {kind.__module__}.{kind.__qualname__}, which a checkpoint "
                             f"cannot hold (tensors, numbers, strings, bytes, None and lists, tuples and dicts of "
                             f"them: what its loader reads)")
        if isinstance(x, dict):
            for k, v in x.items():
                if type(k) not in PLAIN:
                    raise ValueError(f"{owner}: {at} has a key of type {type(k).__module__}."
                                     f"{type(k).__qualname__}, which a checkpoint cannot hold (keys are strings "
                                     f"or numbers)")
                stack.append((v, f"{at}[{k!r}]"))
        else:
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(x))


def _file_size_limit() -> Optional[int]:
    """The most bytes this process may write into a file (RLIMIT_FSIZE), None where unlimited or unknown."""
    try:
        import resource
    except ImportError:   # (not a POSIX system)
        return None
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def _with_check_sums():
    """A context in which torch.save stores each record's CRC-32 (what read_checkpoint checks), whatever a caller set
    in torch's serialization config."""
    try:
        from torch.utils.serialization import config
    except ImportError:   # (a torch before the config: it always computed them)
        return contextlib.nullcontext()
    return config.patch({"save.compute_crc32": True})


class CheckpointError(ValueError):
    """A checkpoint whose contents cannot be used as they are (a damaged record, non-finite weights, optimizer state
    that does not fit the model, counters of the wrong type): its message is one line naming the file and what is
    wrong."""


def damaged_record(path: str) -> Optional[str]:
    """The name of the first record of the zip file `path` whose bytes fail the CRC-32 that torch.save stored with
    them (a changed byte: a disk or a copy error, which torch.load does not check: the weights were read as they
    were), or None: all are whole, or `path` is no zip file read here (torch.load then says what it is). A record
    whose stored CRC is 0 is not checked: torch writes 0 when told not to compute them (its serialization config's
    save.compute_crc32; save_checkpoint always does). CheckpointError for a compressed record, which torch.save never
    writes: it is not read (a record of 1 GiB of zeros in 1 MB took 5 s to check, and a larger one minutes, in every
    reader of the file)."""
    compressed = None
    try:
        with zipfile.ZipFile(path) as z:
            for record in z.infolist():
                if record.compress_type != zipfile.ZIP_STORED:
                    compressed = record.filename
                    break
                if record.CRC == 0 and record.file_size:
                    continue
                with z.open(record) as f:   # (read to its end, the stored CRC is compared: BadZipFile if it differs)
                    try:
                        while f.read(1 << 20):
                            pass
                    except zipfile.BadZipFile:
                        return record.filename
    except (zipfile.BadZipFile, zlib.error, EOFError, ValueError, NotImplementedError, OSError):
        return None
    if compressed is not None:
        raise CheckpointError(f"{path}: its record {compressed} is compressed, which torch.save never writes: not a "
                              f"checkpoint of torch's (refused unread)")
    return None


def read_checkpoint(path: str, mmap: bool = False) -> Dict[str, Any]:
    """The raw checkpoint dict; a clear error for a missing, foreign or damaged file (each record's CRC is checked,
    a read of the whole file at GB/s). `mmap`: the tensors are mapped from the file, not read, nor checked (what a
    caller that needs only the settings asks)."""
    if os.path.isdir(path):
        raise ValueError(f"{path}: is a directory, not a checkpoint file")
    if os.path.exists(path) and not os.path.isfile(path):   # (/dev/null, a pipe: it said "does not exist")
        raise ValueError(f"{path}: not a regular file, not a checkpoint")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    record = None if mmap else damaged_record(path)
    if record is not None:
        raise CheckpointError(f"{path}: damaged: its record {record} does not match the check sum written with it "
                              f"(a disk or copy error); use another copy or an earlier checkpoint")
    try:
        with warnings.catch_warnings():   # (torch's notes on old pickle formats: the file is refused or read here)
            warnings.simplefilter("ignore")
            ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
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
        if exc.errno == errno.EINVAL:   # (torch's zip reader on a file cut short)
            raise ValueError(f"{path}: not a dtmt checkpoint (not a file torch.save wrote, or a truncated one)"
                             ) from None
        raise ValueError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except MemoryError:
        raise
    except Exception:  # truncated or not a torch file (torch's message says little: KeyError(101) for a text file)
        raise ValueError(f"{path}: not a dtmt checkpoint (not a file torch.save wrote, or a truncated one)") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ValueError(f"{path}: not a dtmt checkpoint (expected format {FORMAT!r})")
    _check_plain(ckpt, "checkpoint", owner=path)   # (a crafted field had been found when a copy was written: dtmt
    return ckpt                                     # average's error named save_checkpoint, not the file)


def _finite_problem(name: str, t: Any) -> Optional[str]:
    if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        return f"{name} holds {bad:,} NaN or infinite value{'s' if bad != 1 else ''}"
    return None


def _dense_problem(name: str, t: torch.Tensor) -> Optional[str]:
    """A tensor from a file that is not a dense one in memory (sparse, nested, quantized or meta): the checks read
    its values, and a model or optimizer takes it as one."""
    if t.layout != torch.strided or t.is_nested or t.is_quantized or t.is_meta:
        kind = ("nested" if t.is_nested else "quantized" if t.is_quantized else "meta" if t.is_meta
                else str(t.layout).replace("torch.", ""))
        return f"{name} is a {kind} tensor, not a dense one"
    return None


def _whole_problem(name: str, t: torch.Tensor) -> Optional[str]:
    """A tensor from a file whose storage is smaller than its elements (an expanded view: strides 0, or overlapping
    ones): a few bytes standing for any size, which the checks' passes and the model built from the file's options
    would then spend in full (a 380 KB file stood for 3.8 billion parameters). A view with gaps holds its elements."""
    if t.untyped_storage().nbytes() < t.numel() * t.element_size():
        return (f"{name} does not hold its elements ({t.untyped_storage().nbytes():,} bytes stored for "
                f"{t.numel():,} of {t.element_size()} bytes: strides {list(t.stride())})")
    return None


def check_finite_weights(path: str, state: Dict[str, Any]) -> None:
    """CheckpointError if a floating-point weight of `state` (a state dict) holds NaN or an infinity: such a model
    translates nothing (every score NaN), so it is refused when loaded, not decoded into empty lines."""
    for name, t in state.items():
        problem = _finite_problem(f"weight {name}", t)
        if problem:
            raise CheckpointError(f"{path}: {problem}; the checkpoint is corrupt (use an earlier one)")


def weights_problem(state: Any, own: Dict[str, torch.Tensor]) -> Optional[str]:
    """What keeps a checkpoint's weights `state` from being a model's whose own state dict is `own` (the model built
    on the meta device will do: only names, shapes and dtypes are read), in a few words, or None: every name of
    `own` and no other, each a dense tensor in memory (not sparse, nested, quantized or meta) of its dtype and
    shape, holding each of its elements (not an expanded view). load_state_dict would cast a bool, integer or complex
    tensor to the weight's dtype without a word, and a model built from a file's options before its weights are
    compared allocates what the options ask for."""
    if not isinstance(state, dict):
        return f"a {type(state).__name__} where the weights should be"
    missing = sorted(set(own) - set(state))
    extra = sorted(set(state) - set(own), key=repr)
    if missing or extra:
        return f"{len(missing)} weights missing, e.g. {missing[:1]}; {len(extra)} unknown, e.g. {extra[:1]}"
    for name, t in own.items():
        w = state[name]
        if not isinstance(w, torch.Tensor):
            return f"weight {name} is not a tensor (a Python {type(w).__name__})"
        problem = _dense_problem(f"weight {name}", w)
        if problem:
            return problem
        if w.shape != t.shape or w.dtype != t.dtype:
            return f"weight {name} is {w.dtype} {list(w.shape)}, the model's {t.dtype} {list(t.shape)}"
        problem = _whole_problem(f"weight {name}", w)
        if problem:
            return problem
    return None


def tied_problem(model: torch.nn.Module, state: Dict[str, Any]) -> Optional[str]:
    """Where `model` ties parameters (one tensor under two names: the target embedding and the output matrix),
    whether the file's weights `state` differ under those names, in a few words, or None. load_state_dict copies
    each name into the one tensor, the last winning: a file whose two differ (tie_embeddings turned on in its
    options) lost one of them without a word."""
    names: Dict[int, list] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for first, *rest in names.values():
        for other in rest:
            a, b = state.get(first), state.get(other)
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and not (
                    a.shape == b.shape and bool(torch.equal(a, b))):
                return f"weights {first} and {other} are one tied weight of the model, but differ in the file"
    return None


def _count(value: Any, low: float = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _scalar(value: Any) -> Any:
    """A one-element dense tensor's value (an optimizer's step or rate, kept as a tensor by some of torch's forms),
    else `value` as it is (a meta or sparse one is no number)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and _dense_problem("", value) is None:
        return float(value)
    return value


def _number(value: Any, allow_inf: bool = False) -> bool:
    """A number a float holds: not a bool, not NaN, infinite only where `allow_inf` (an int past a float's range,
    10**400, had been an OverflowError's traceback once the run used it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        value = float(value)
    except OverflowError:
        return False
    return value == value and (allow_inf or abs(value) != float("inf"))


# what each optimizer keeps a parameter (its step counter and moments), the moments that are sums of squares
OPTIMIZER_STATE = {"Adam": ("step", "exp_avg", "exp_avg_sq"), "Adadelta": ("step", "square_avg", "acc_delta")}
SQUARES = ("exp_avg_sq", "square_avg", "acc_delta", "max_exp_avg_sq")


def check_training_state(path: str, ckpt: Dict[str, Any], model: torch.nn.Module,
                         optimizer: torch.optim.Optimizer, scheduler=None) -> None:
    """A last.pt's training state checked against the model, optimizer and learning-rate scheduler built to continue
    it, before any of it is loaded (issue 71 item 3): the weights' names, shapes and values (finite); the optimizer
    state's structure, each parameter's step counter and moments (each there, of its parameter's shape and dtype,
    finite, the sums of squares >= 0); the scheduler's state (the fields of `scheduler`'s, the run's schedule); the
    run's counters (types and ranges) and random states (each one its generator takes). CheckpointError, one line
    naming the file and the field. (A malformed field was a traceback at the resume, after its files were written.)"""
    def fail(what: str) -> None:
        raise CheckpointError(f"{path}: {what}; the checkpoint cannot be resumed")

    weights = ckpt.get("model")
    problem = weights_problem(weights, model.state_dict()) or tied_problem(model, weights)
    if problem:
        fail(f"its weights are not this model's ({problem})")
    for name, w in weights.items():
        problem = _finite_problem(f"weight {name}", w)
        if problem:
            fail(problem)
    t = ckpt.get("training")
    if not isinstance(t, dict):
        fail("it has no training state")
    state = t.get("optimizer")
    if not isinstance(state, dict) or not isinstance(state.get("state"), dict) or not isinstance(
            state.get("param_groups"), list):
        fail("its optimizer state is not an optimizer's state dict")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    indices = []
    for g in state["param_groups"]:
        if not isinstance(g, dict) or not isinstance(g.get("params"), list) or not all(_count(i) for i in g["params"]):
            fail("its optimizer's parameter groups are malformed")
        indices += g["params"]
    if len(state["param_groups"]) != len(optimizer.param_groups) or sorted(indices) != list(range(len(params))):
        fail(f"its optimizer state is for {len(indices)} parameters in {len(state['param_groups'])} groups, the "
             f"model has {len(params)} in {len(optimizer.param_groups)}")
    wanted = OPTIMIZER_STATE.get(type(optimizer).__name__, ())   # (what each parameter's entry holds)
    wanted += ("max_exp_avg_sq",) if wanted and optimizer.param_groups[0].get("amsgrad") else ()
    not_settings = ("params", *IMPLEMENTATION)
    for i, (g, own) in enumerate(zip(state["param_groups"], optimizer.param_groups)):
        # the hyperparameters are the run's settings, which a resume keeps (a crafted maximize=True climbed the loss,
        # exit 0; weight_decay=10 was kept); the rate is the schedule's; how the step is computed is this machine's
        for key, value in g.items():
            if key in ("lr", "initial_lr"):
                v = _scalar(value)
                if not _number(v) or v < 0:
                    fail(f"its optimizer's {key} of group {i} is {_short(value)}, not a rate")
            elif key in own and key not in not_settings and not _same_number(value, own[key]):
                fail(f"its optimizer's {key} of group {i} is {_short(value)}, the run's settings give {own[key]!r}")
        for key, value in own.items():   # (torch fills in a missing flag, not a missing number: a KeyError later)
            if key not in g and key not in not_settings and not isinstance(value, (bool, type(None))):
                fail(f"its optimizer's group {i} has no {key}")
    storages: Dict[int, str] = {}   # each moment's storage, by address: what holds it
    for index, entry in state["state"].items():
        if not _count(index) or index >= len(params) or not isinstance(entry, dict):
            fail(f"its optimizer state has an entry {_short(index)} that is no parameter's")
        p = params[index]
        missing = [key for key in wanted if key not in entry]
        if missing:
            fail(f"the optimizer state of parameter {index} has no {', '.join(missing)}")
        for key, value in entry.items():
            if key == "step":
                v = _scalar(value)
                if not _number(v) or v < 0 or v != int(v) or v > MAX_COUNT:
                    fail(f"the optimizer's step of parameter {index} is {_short(value)}, not a count")
            elif key in wanted and not isinstance(value, torch.Tensor):
                fail(f"the optimizer's {key} of parameter {index} is a {type(value).__name__}, not a tensor")
            elif isinstance(value, torch.Tensor):
                problem = _dense_problem(f"the optimizer's {key} of parameter {index}", value)
                if problem:
                    fail(problem)
                if value.untyped_storage().nbytes():   # (two moments in one storage: each step overwrote the other)
                    shared = storages.setdefault(value.untyped_storage().data_ptr(), f"{key} of parameter {index}")
                    if shared != f"{key} of parameter {index}":
                        fail(f"the optimizer's {key} of parameter {index} shares its storage with its {shared}")
                if value.shape != p.shape or value.dtype != p.dtype:
                    fail(f"the optimizer's {key} of parameter {index} is {value.dtype} {list(value.shape)}, the "
                         f"parameter {p.dtype} {list(p.shape)}")
                problem = (_whole_problem(f"the optimizer's {key} of parameter {index}", value)
                           or _finite_problem(f"the optimizer's {key} of parameter {index}", value))
                if problem:
                    fail(problem)
                if key in SQUARES and value.is_floating_point() and bool((value < 0).any()):
                    fail(f"the optimizer's {key} of parameter {index} holds negative values (a sum of squares)")
    for key in ("step", "epoch", "batch_index", "bad_validations"):   # (--max-steps's bound: no run counts past it)
        if not _count(t.get(key)) or t[key] > MAX_COUNT:
            fail(f"its {key} is {_short(t.get(key))}, not a count in [0, {MAX_COUNT:,}]")
    run_id = ckpt.get("run_id", "0")   # (older last.pt: none)
    if not isinstance(run_id, str) or not re.fullmatch(r"[0-9a-f]{1,64}", run_id):
        fail(f"its run_id is {_short(run_id)}, not a run's identity (hexadecimal digits)")
    validated = t.get("validated_step", t["step"])   # (older last.pt: none)
    if not _count(validated) or validated > t["step"]:
        fail(f"its validated_step is {_short(validated)}, not a count up to its step {t['step']:,}")
    if not _number(t.get("elapsed")) or t["elapsed"] < 0:
        fail(f"its elapsed time is {_short(t.get('elapsed'))}")
    for key in ("best_bleu", "best_loss"):
        if not _number(t.get(key), allow_inf=True):
            fail(f"its {key} is {_short(t.get(key))}, not a number")
    stopped = t.get("stopped_early_by")   # (read when the run stops, saved again at its end: a set was a traceback
    if stopped is not None and not (type(stopped) is str and stopped in ("loss", "bleu")):   # there, after best.pt)
        fail(f"its stopped_early_by is {_short(stopped)}, not a --best-by")
    window = t.get("log_window", [0.0] * 4)
    if not isinstance(window, (list, tuple)) or len(window) != 4 or not all(_number(x) for x in window):
        fail(f"its log window is {_short(window)}")
    sched = t.get("scheduler")
    if not isinstance(sched, dict) or not _count(sched.get("last_epoch")) or sched["last_epoch"] > MAX_COUNT:
        fail("its scheduler state is malformed")
    if scheduler is not None:   # (loaded by updating the scheduler's attributes: any name, any value, the schedule's
        _check_scheduler(sched, scheduler.state_dict(), fail)   # too)
    rngs = t.get("rng")
    if not isinstance(rngs, (list, tuple)) or not all(
            isinstance(r, dict) and isinstance(r.get("torch"), torch.Tensor) and r["torch"].dtype == torch.uint8
            and isinstance(r.get("python"), tuple) for r in rngs):
        fail("its random states are malformed")
    for i, r in enumerate(rngs):   # (each tried on a generator of its own: a wrong length was a traceback)
        try:
            torch.Generator().set_state(r["torch"])
            random.Random().setstate(r["python"])
        except (RuntimeError, ValueError, TypeError, IndexError) as exc:
            fail(f"its random state of process {i} is not a generator's ({one_line(exc)[:120]})")


def _same_schedules(value: Any, mine: list) -> bool:
    """Whether a scheduler state's lr_lambdas are `mine`'s: a schedule object's fields (a dict each; a plain function
    None), every field it has of the same value (an older one may lack a field added since)."""
    return isinstance(value, list) and len(value) == len(mine) and all(
        a is None and b is None or isinstance(a, dict) and isinstance(b, dict)
        and all(k in b and _same_number(v, b[k]) for k, v in a.items()) for a, b in zip(value, mine))


# the scheduler's fields that torch's versions add or drop (verbose: torch 2.1 to 2.6; the rest newer), with their types
VERSION_FIELDS = {"verbose": bool, "_is_initial": bool, "_get_lr_called_within_step": bool}


def _check_scheduler(state: Dict[str, Any], own: Dict[str, Any], fail) -> None:
    """The scheduler state of a last.pt against `own`, the state of the one built to continue it: only its fields,
    each of its type; the base rates and the schedule's parameters the run's (they are its settings); the last
    rates numbers >= 0 and the counters counts."""
    for key, value in state.items():
        if key not in own and key in VERSION_FIELDS:   # (another torch's: a last.pt written before an upgrade)
            if type(value) is not VERSION_FIELDS[key]:
                fail(f"its scheduler's {key} is {_short(value)}, not a {VERSION_FIELDS[key].__name__}")
            continue
        if key not in own:
            fail(f"its scheduler state has a field {_short(key)} a scheduler does not")
        mine = own[key]
        if key in ("last_epoch", "_step_count"):
            if not _count(value) or value > MAX_COUNT:
                fail(f"its scheduler's {key} is {_short(value)}, not a count")
        elif key in ("base_lrs", "lr_lambdas"):
            if not (_same_number(value, mine) if key == "base_lrs" else _same_schedules(value, mine)):
                fail(f"its scheduler's {key} is {value!r}, the run's settings give {mine!r}")
        elif key == "_last_lr":
            if not isinstance(value, list) or len(value) != len(mine) or not all(
                    _number(_scalar(v)) and _scalar(v) >= 0 for v in value):
                fail(f"its scheduler's last rates are {value!r}")
        elif type(value) is not type(mine):
            fail(f"its scheduler's {key} is {value!r}, not a {type(mine).__name__}")


def translation_parts(path: str, ckpt: Dict[str, Any]) -> Tuple[Vocabulary, Vocabulary, Dict[str, torch.Tensor]]:
    """(source vocabulary, target vocabulary, the state dict of the model the checkpoint's name and options describe,
    built on the meta device: names, shapes and dtypes, nothing allocated whatever sizes the options ask for) of a
    translation checkpoint; ValueError, one line naming the file, where it lacks one of them or they cannot be
    read or built."""
    missing = [k for k in ("model_name", "model_options", "model", "src_vocab", "tgt_vocab") if k not in ckpt]
    if missing:
        raise ValueError(f"{path}: not a translation checkpoint (it has no {', '.join(missing)})")
    try:
        src_vocab, tgt_vocab = Vocabulary(ckpt["src_vocab"]), Vocabulary(ckpt["tgt_vocab"])
    except (RuntimeError, ValueError, TypeError) as exc:   # SentencePiece's own message is C++ internals
        raise ValueError(f"{path}: its vocabularies cannot be read ({one_line(exc)[:200]})") from None
    options = ckpt["model_options"]
    if not isinstance(options, dict):
        raise ValueError(f"{path}: its model cannot be built (its options are a {type(options).__name__})")
    pad = options.get("pad_id", PAD)
    if not (type(pad) is int and pad == PAD):   # (its vocabularies pad with PAD: a sentence holding the model's pad
        # id as a word was a traceback, and the word was never written)
        raise ValueError(f"{path}: its model's pad_id is {_short(pad)}, but its vocabularies pad with id {PAD}; the "
                         f"file is inconsistent")
    try:
        with shapes_only():
            own = build_model(ckpt["model_name"], len(src_vocab), len(tgt_vocab),
                              **used_options(ckpt["model_name"], options)).state_dict()
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ValueError(f"{path}: its model cannot be built ({one_line(exc)[:300]})") from None
    return src_vocab, tgt_vocab, own


def check_weights_fit(path: str, ckpt: Dict[str, Any], own: Dict[str, torch.Tensor]) -> None:
    """ValueError, one line naming the file, unless the checkpoint's weights are the model's whose state dict is
    `own` (weights_problem) and finite (CheckpointError)."""
    problem = weights_problem(ckpt["model"], own)
    if problem:
        raise ValueError(f"{path}: its weights do not fit a {ckpt['model_name']} model with its options "
                         f"({problem[:300]})")
    check_finite_weights(path, ckpt["model"])


def load_model(path: str, device: str = "cpu", backend: Optional[str] = None
               ) -> Tuple[torch.nn.Module, Vocabulary, Vocabulary, Dict[str, Any]]:
    """(model in eval mode on `device`, source vocabulary, target vocabulary, checkpoint dict). The model records its
    vocabularies' digests (`vocab_digests`, Vocabulary.digest), which translate and Ensemble check. `backend`
    switches the fused recurrent layers (None keeps "auto"). The weights are checked against the model before it is
    built (check_weights_fit)."""
    try:
        device = torch.device(device)   # (before the file is read: torch's own message came after all of it)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"load_model: device {device!r} is not a device torch knows ({one_line(exc)})") from None
    check_device_present(device, "load_model")   # (torch's own error came after the file was read, the model built)
    if backend is not None and backend != "auto":   # (it was taken, and the first translation said it cannot run)
        from dtmt_kernels.backends import resolve_backend
        try:
            resolve_backend(backend, device)
        except ValueError as exc:
            raise ValueError(f"load_model: {one_line(exc)}") from None
    ckpt = read_checkpoint(path)
    src_vocab, tgt_vocab, own = translation_parts(path, ckpt)
    check_weights_fit(path, ckpt, own)
    model = build_model(ckpt["model_name"], len(src_vocab), len(tgt_vocab),
                        **used_options(ckpt["model_name"], ckpt["model_options"]))
    problem = tied_problem(model, ckpt["model"])
    if problem:
        raise ValueError(f"{path}: its weights do not fit a {ckpt['model_name']} model with its options ({problem})")
    model.load_state_dict(ckpt["model"])
    if backend is not None and hasattr(model, "set_backend"):
        model.set_backend(backend)
    # which vocabularies the model reads and writes, for translate and Ensemble to check (sizes alone let another
    # model's vocabularies of the same size through, or the two swapped: fluent nonsense)
    model.vocab_digests = (src_vocab.digest, tgt_vocab.digest)
    return model.to(device).eval(), src_vocab, tgt_vocab, ckpt


def average_checkpoints(paths) -> Dict[str, Any]:
    """The element-wise mean of the weights of checkpoints of one model (same system, options, vocabularies,
    languages and parameter shapes, compared with their types: 256.0 is not 256; floating-point tensors averaged in
    float64 and cast back, integer buffers must agree), as a translation checkpoint payload: the model's
    description is the first file's (the one checked to build), the rest the latest file's (its config, its step:
    the file of the most updates, whatever the order given), plus `averaged_from` (the file names, or their paths
    where the files are not of one folder) and `averaged_sources` (the real paths of the files whose weights the
    mean holds). `paths`: a list of paths (a single string is refused, not read letter by letter). Raises ValueError
    naming the first file that does not match the first one, a file given twice (by another name too, or a copy:
    the weights of two files equal, as a run's best.pt and its step checkpoint of the same update; or an average
    beside one of the files it is the mean of), or a weight that is not finite; warns
    (UserWarning) when the files come from different training runs (their `run_id`s differ, which --resume keeps
    and a new run renews; files written before run ids: their `config`s name another output folder or seed): the
    mean of separately trained weights is rarely a model that translates."""
    if isinstance(paths, (str, bytes, os.PathLike)):
        raise TypeError(f"average: give a list of checkpoint paths, not one path ({os.fsdecode(paths)!r})")
    paths = list(paths)
    if not paths:
        raise ValueError("average: no checkpoints given")
    twice = given_twice(paths)
    if twice:
        raise ValueError(f"average: {twice[0]} is given twice (as {twice[1]} too); each checkpoint counts once")
    first = read_checkpoint(paths[0])
    own = translation_parts(paths[0], first)[2]
    check_weights_fit(paths[0], first, own)   # (the mean would hold a NaN or an infinity too)
    runs = [(paths[0], _run_id(first), _run_folder(first))]
    weights = {_weights_digest(first["model"]): paths[0]}
    sources = {source: paths[0] for source in _sources(paths[0], first)}
    sums = {k: v.double() if v.is_floating_point() else v for k, v in first["model"].items()}
    last = first
    for path in paths[1:]:
        ckpt = read_checkpoint(path)
        for key in MODEL_KEYS:
            if not same_value(ckpt.get(key), first.get(key)):
                mine, theirs = ckpt.get(key), first.get(key)
                shown = ""
                if isinstance(mine, dict) and isinstance(theirs, dict):   # (which option, and the two values)
                    differ = sorted((k for k in set(mine) | set(theirs)
                                     if not same_value(mine.get(k), theirs.get(k))), key=str)
                    shown = ": " + ", ".join(f"{k} {_short(mine.get(k))} against {_short(theirs.get(k))}"
                                             for k in differ[:3]) + (" ..." if len(differ) > 3 else "")
                raise ValueError(f"average: {path} is not the same model as {paths[0]} (its {key} differs{shown})")
        if "model" not in ckpt:
            raise ValueError(f"{path}: not a translation checkpoint (it has no model)")
        runs.append((path, _run_id(ckpt), _run_folder(ckpt)))
        check_weights_fit(path, ckpt, own)   # (the first file's model: the same name, options and vocabularies)
        twin = weights.setdefault(_weights_digest(ckpt["model"]), path)
        if twin != path:   # (its weights counted twice: best.pt beside the step checkpoint it was written with)
            raise ValueError(f"average: {path} holds the same weights as {twin} (a copy, or best.pt or last.pt written "
                             f"at the same update as a step checkpoint); each checkpoint counts once")
        for source in _sources(path, ckpt):   # (an average given with one of the files it is the mean of)
            held = sources.setdefault(source, path)
            if held != path:
                raise ValueError(f"average: {path} and {held} both hold the weights of {source} (one is an average "
                                 f"of it); each checkpoint counts once: average the files themselves")
        for k, v in ckpt["model"].items():
            if v.is_floating_point():
                sums[k] += v.double()
            elif not torch.equal(v, sums[k]):
                raise ValueError(f"average: {path}: the integer tensor {k} differs from {paths[0]}'s")
        if _updates(ckpt) >= _updates(last):
            last = ckpt
    # by run id among the files that have one; where one has none (written before run ids), also by output folder
    # and seed among all (a run copied elsewhere and resumed is then told as two, as before run ids)
    by_id = [(run_id, path) for path, run_id, _ in runs if run_id is not None]
    by_folder = [] if len(by_id) == len(runs) else [(folder, path) for path, _, folder in runs]
    for pairs, why in ((by_id, "their run ids differ"), (by_folder, "their output folder or seed differ")):
        firsts = {}   # (each run's first file)
        for key, path in pairs:
            firsts.setdefault(key, path)
        if len(firsts) > 1:
            a, b = list(firsts.values())[:2]
            warnings.warn(f"{a} and {b} come from different training runs ({why}): the mean of separately trained "
                          f"weights is rarely a model that translates", UserWarning)
            break
    n = len(paths)
    averaged = {k: (s / n).to(first["model"][k].dtype) if s.is_floating_point() else s for k, s in sums.items()}
    payload = {k: v for k, v in last.items() if k not in ("format", "training", "model", *MODEL_KEYS)}
    payload.update({k: first[k] for k in MODEL_KEYS if k in first}, model=averaged)
    one_folder = len({os.path.dirname(os.path.abspath(p)) for p in paths}) == 1   # (runs/a/step_12.pt and
    payload["averaged_from"] = [os.path.basename(p) if one_folder else os.fspath(p) for p in paths]   # runs/b/'s)
    payload["averaged_sources"] = sorted(sources)   # (the real paths of the files whose weights the mean holds)
    return payload


def _updates(ckpt: Dict[str, Any]) -> int:
    """A checkpoint's `step` (its updates), -1 where it holds none that is a count."""
    step = ckpt.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else -1


def _short(value: Any) -> str:
    """A value of a checkpoint's description for a message: its repr, cut to 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# what describes a translation checkpoint's model: the files averaged must agree on each
MODEL_KEYS = ("model_name", "model_options", "src_vocab", "tgt_vocab", "langs")


def same_value(a: Any, b: Any) -> bool:
    """Whether two values of a checkpoint's plain data are the same, types included (256.0 == 256 and True == 1 in
    Python, but a model built from them differs or is refused)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    return bool(a == b) or a != a and b != b   # (NaN is NaN here)


def _same_number(a: Any, b: Any) -> bool:
    """same_value, but an int and a float of one value are the same number (an optimizer's 0 and 0.0 weight decay);
    a bool is no number."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_number(x, y) for x, y in zip(a, b))
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool) and not isinstance(b, bool):
        return a == b
    return same_value(a, b)


def given_twice(paths) -> Optional[Tuple[str, str]]:
    """The first path of `paths` that names a file named before (however: a symlink or a hard link to it too), with
    that earlier path; None where each is its own. A path that cannot be read counts by its real path (its reader
    says what is wrong with it)."""
    seen = {}
    for path in paths:
        try:
            stat = os.stat(path)
            key = (stat.st_dev, stat.st_ino)
        except OSError:
            key = os.path.realpath(path)
        if key in seen:
            return path, seen[key]
        seen[key] = path
    return None


def _weights_digest(state: Dict[str, torch.Tensor]) -> bytes:
    """A digest of a state dict's names, dtypes, shapes and values: equal for equal weights."""
    h = hashlib.blake2b(digest_size=20)
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous().reshape(-1)
        h.update(f"{name}:{t.dtype}:{tuple(state[name].shape)};".encode())
        h.update(t.view(torch.uint8).numpy() if t.numel() else b"")
    return h.digest()


def _run_id(ckpt: Dict[str, Any]) -> Any:
    """The training run a checkpoint comes from: its `run_id` (as a key), None for a file written before run ids."""
    return None if ckpt.get("run_id") is None else _hashable(ckpt["run_id"])


def _run_folder(ckpt: Dict[str, Any]) -> Tuple[Any, Any]:
    """The training run a checkpoint comes from as files written before run ids tell it: (output folder, seed) of
    its config."""
    config = ckpt.get("config")
    if not isinstance(config, dict):   # (a crafted or damaged field: a str was an AttributeError's traceback)
        return None, None
    return tuple(_hashable(config.get(k)) for k in ("out", "seed"))


def _hashable(value: Any) -> Any:
    """A value of a checkpoint's plain data as a key: itself, or its repr (a list was "unhashable type", a
    traceback)."""
    return value if isinstance(value, (str, int, float, type(None))) else repr(value)


def _sources(path: str, ckpt: Dict[str, Any]) -> Set[str]:
    """The files whose weights a checkpoint holds, as real paths: an average's `averaged_sources`, or the file
    itself (an average written before that key: itself too)."""
    names = ckpt.get("averaged_sources")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        return {os.path.realpath(path)}
    return set(names)
