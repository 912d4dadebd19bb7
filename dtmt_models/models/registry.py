"""The one registry of NMT systems: `build_model(name, src_vocab_size, tgt_vocab_size, **options)`."""
from __future__ import annotations

import contextlib
import math
from typing import Dict, Iterator, List, Optional

import torch
import torch.nn as nn

from dtmt_models.data.vocabulary import BOS, EOS
from dtmt_models.errors import did_you_mean, one_line, out_of_memory
from dtmt_models.models.registered import MODELS as _MODELS, register_model  # noqa: F401  (the public name)


def list_models() -> List[str]:
    _import_systems()
    return sorted(_MODELS)


# options that size a part of a system: a positive int up to a bound (widths 64x the papers' widest, 1,024; counts
# of layers 32x their deepest, GNMT's 8: a value past it is a mistake, and a million layers took minutes to build).
# The transition depths, which may be 0 for the plain cell, are not here: each system checks its own, and the layers
# bound them (dtmt_kernels.nn.MAX_DEPTH).
SIZE_OPTIONS = {"embed_dim": 65536, "hidden_size": 65536, "heads": 1024, "attention_dim": 65536,
                "encoder_layers": 256, "decoder_layers": 256, "enc_depth": 256, "dec_depth": 256, "output_depth": 256,
                "max_len": 65536}


def build_model(name: str, src_vocab_size: int, tgt_vocab_size: int, **options) -> nn.Module:
    """Builds the system `name` (see list_models()); options are the keyword arguments of its class. Bad input is
    a ValueError in one line: an unknown name or option, a value of the wrong type for the option's default (numpy
    numbers count as ints and floats), a size below 1, a dropout rate outside [0, 1), a pad_id that is not an id of
    both vocabularies, or a value the system refuses."""
    _import_systems()
    if not isinstance(name, str) or name not in _MODELS:
        raise ValueError(f"unknown model {_shown(name)}{did_you_mean(name, _MODELS)}; choose one of {sorted(_MODELS)}")
    # numpy numbers (a sweep's np.arange, a config read through numpy) as the Python numbers the systems take
    src_vocab_size, tgt_vocab_size = _unwrapped(src_vocab_size), _unwrapped(tgt_vocab_size)
    # (a target vocabulary holds BOS and EOS, with which every search starts and ends a sentence)
    for arg, v, least in (("src_vocab_size", src_vocab_size, 2), ("tgt_vocab_size", tgt_vocab_size, EOS + 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < least:
            raise ValueError(f"{arg} must be an int >= {least}"
                             + (f" (BOS {BOS} and EOS {EOS} are target words)" if least > 2 else "") + f", got {v!r}")
    options = {k: _unwrapped(v) for k, v in options.items()}
    _check_option_values(name, options, min(src_vocab_size, tgt_vocab_size))
    try:
        model = _MODELS[name](src_vocab_size, tgt_vocab_size, **options)
    except torch.OutOfMemoryError:   # (a RuntimeError, but not the options' fault)
        raise
    except (ValueError, TypeError, RuntimeError, AssertionError, ZeroDivisionError) as exc:
        if out_of_memory(exc):   # (the CPU allocator's RuntimeError: the options are valid, only too large for
            # this machine)
            raise MemoryError(f"{name} with {options} does not fit in this machine's memory ({one_line(exc)})") \
                from None
        raise ValueError(f"{name} cannot be built with {options}: {one_line(exc)}") from exc
    defaults = option_defaults(name)   # (after the system's own checks of every value: theirs say more)
    for option, why in unused_options(name, options).items():
        if options[option] != defaults.get(option):   # (its default given, as a run's options hold it, is harmless)
            raise ValueError(f"{name}: {option}={_shown(options[option])} builds nothing here ({why}); leave it out")
    return model


def _unwrapped(v):
    """A numpy number as the Python number it holds; anything else as it is."""
    return v.item() if type(v).__module__ == "numpy" and getattr(v, "ndim", None) == 0 else v


INIT_LAWS = ("uniform", "normal")


def init_weights(model: nn.Module, law: str, scale: float) -> int:
    """Every weight and bias of `model` drawn in place (torch's global generator), as the papers initialise "all
    parameters": law "uniform" from U(-scale, scale) (papers 000 l.194 and 004 §4.2: 0.08), law "normal" from
    N(0, scale²) (paper 001 l.157: 0.04). Layer norm's gains and offsets keep 1 and 0 (a gain drawn near 0 would
    silence what it normalises: our reading, as the authors' toolkits give layer norm its own initialiser), and an
    embedding's padding row stays 0. Returns the number of tensors drawn."""
    if law not in INIT_LAWS:
        raise ValueError(f"init_weights: law must be one of {INIT_LAWS}, got {law!r}")
    if not (isinstance(scale, (int, float)) and 0 < scale < float("inf")):
        raise ValueError(f"init_weights: scale must be a finite number > 0, got {scale!r}")
    norms = {id(p) for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters(recurse=False)}
    drawn = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if id(p) in norms or "ln_weight" in name or "ln_bias" in name:   # (the fused cells': *_reverse too)
                continue
            if law == "uniform":
                p.uniform_(-scale, scale)
            else:
                p.normal_(0.0, scale)
            drawn += 1
        for m in model.modules():
            if isinstance(m, nn.Embedding) and m.padding_idx is not None:
                m.weight[m.padding_idx].zero_()
    return drawn


def _option_params(name: str) -> dict:
    """The keyword parameters of system `name`'s constructor (a subclass passing **kwargs on takes its base's)."""
    import inspect

    params = {}
    for cls in _MODELS[name].__mro__:
        if "__init__" not in vars(cls):
            continue
        sig = inspect.signature(cls.__init__).parameters
        for k, p in sig.items():
            if k not in ("self", "src_vocab_size", "tgt_vocab_size") and p.kind in (p.POSITIONAL_OR_KEYWORD,
                                                                                  p.KEYWORD_ONLY):
                params.setdefault(k, p)
        if not any(p.kind == p.VAR_KEYWORD for p in sig.values()):
            break
    return params


def unused_options(name: str, options: dict) -> Dict[str, str]:
    """The options given in `options` that system `name` builds nothing from, the others being what they are
    (nematus's enc_depth with a one-level encoder), each with why: its class's `unused_options(all options, defaults
    filled in)`. build_model refuses such an option given another value than its default (taken without a word, it
    had been recorded in the run's config.yaml as if the model had it)."""
    _import_systems()
    find = getattr(_MODELS[name], "unused_options", None)
    if find is None:
        return {}
    try:
        unused = find({**option_defaults(name), **options})
    except KeyError:   # (a user's subclass of a system, with a constructor of its own that lacks the base's options)
        return {}
    return {k: why for k, why in unused.items() if k in options}


def used_options(name: str, options: dict) -> dict:
    """`options` without its unused_options: the same model, which build_model takes. For the options a checkpoint
    holds: one written before such options were refused builds as it did."""
    _import_systems()
    unused = unused_options(name, options) if name in _MODELS else {}
    return {k: v for k, v in options.items() if k not in unused}


def option_defaults(name: str) -> dict:
    """System `name`'s model options that have a default, with it (what an option left out of a run's options is)."""
    _import_systems()
    return {k: p.default for k, p in _option_params(name).items() if p.default is not p.empty}


def _of_type(value, expected: type) -> bool:
    """Whether `value` fits an option whose default is of type `expected`: an int an int but a bool, a float an int
    or a float but a bool, anything else its type."""
    if isinstance(value, bool):
        return expected is bool
    if expected is float:
        return isinstance(value, (int, float))
    return isinstance(value, expected)


def _optional_type(annotation) -> Optional[type]:
    """X of an option annotated Optional[X] (bool, int, float or str; the annotation a string under postponed
    evaluation or a typing object), else None."""
    text = (annotation if isinstance(annotation, str) else repr(annotation)).replace("typing.", "").replace(" ", "")
    for kind in (bool, int, float, str):
        k = kind.__name__
        if text in (f"Optional[{k}]", f"Union[{k},None]", f"Union[None,{k}]", f"Union[{k},NoneType]",
                    f"{k}|None", f"None|{k}"):
            return kind
    return None


def _shown(value) -> str:
    """A value's repr for a message, cut short past 60 characters (an option's value may come from a file)."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:50]}... ({len(text):,} characters)"


def _check_option_values(name: str, options: dict, vocab_size: int) -> None:
    """Unknown options, values of the wrong type for the option's default, sizes below 1, dropout rates outside
    [0, 1), a pad_id that is not an id of both vocabularies (the smaller has `vocab_size` ids): ValueError in one
    line."""
    import inspect

    params = _option_params(name)
    for key, value in options.items():
        if key not in params:
            raise ValueError(f"unknown option {key!r} for {name}{did_you_mean(key, params)}; its options are: "
                             f"{', '.join(sorted(params))}")
        default = params[key].default
        expected = type(default) if default is not inspect.Parameter.empty and default is not None else None
        if default is None and value is not None:   # (an Optional option: its annotation's type; readout_layer_norm=
            expected = _optional_type(params[key].annotation)   # 'False' had turned the layer norm on)
        if expected is not None and not _of_type(value, expected):
            raise ValueError(f"option {key}={_shown(value)} for {name}: expected {expected.__name__} "
                             f"{'or None ' if default is None else ''}(default {default!r})")
        if isinstance(value, float) and not math.isfinite(value):   # (NaN passed every range check: dropout=nan
            # failed at the first training forward)
            raise ValueError(f"option {key}={value!r} for {name}: expected a finite number")
        if (key == "dropout" or key.endswith("_dropout")) and value is not None and not 0 <= value < 1:
            # (a rate of 1 zeroed every embedding and readout feature in training: the model learnt the output bias
            # alone, and nothing said so; torch's nn.Dropout takes 1)
            raise ValueError(f"option {key}={value!r} for {name}: expected a probability in [0, 1)")
        most = SIZE_OPTIONS.get(key)
        if most is not None and value is not None and (not _of_type(value, int) or not 1 <= value <= most):
            raise ValueError(f"option {key}={_shown(value)} for {name}: expected an int from 1 to {most:,}")
    pad = options.get("pad_id", 0)
    if not _of_type(pad, int) or pad < 0:
        raise ValueError(f"option pad_id={pad!r} for {name}: expected an int >= 0 (an id of both vocabularies)")
    if pad >= vocab_size:
        raise ValueError(f"option pad_id={pad!r} for {name}: expected an id of both vocabularies, in [0, {vocab_size})")
    if pad in (BOS, EOS):   # (padding is masked out of the loss and its embedding row kept at 0: EOS was never
        # trained, so the model never learnt to end a sentence; BOS, every target's first input, was a zero vector)
        which, does = ("BOS", "starts") if pad == BOS else ("EOS", "ends")
        raise ValueError(f"option pad_id={pad} for {name}: {pad} is {which}, with which every search {does} a "
                         f"sentence; padding needs an id of its own")


def _import_systems() -> None:
    # the systems register themselves on import
    from . import systems  # noqa: F401


class _SkipNormalInit(torch.overrides.TorchFunctionMode):
    """Under shapes_only: a normal_ fill (nn.init.normal_, Tensor.normal_) leaves its tensor as it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.normal_ or func is nn.init.normal_:
            return args[0] if args else kwargs.get("tensor", kwargs.get("self"))
        return func(*args, **kwargs)


@contextlib.contextmanager
def shapes_only() -> Iterator[None]:
    """A context to build a system whose parameters' names, shapes and dtypes alone are wanted (a checkpoint's
    weights compared before anything is allocated, options checked, the papers' counts): on the meta device, its
    normal_ initialisations skipped. A normal_ on the meta device goes through torch._refs, whose first call imports
    torch._dynamo: 1.3 s and 140 MiB more for every process that loaded a checkpoint (translate 1.34x the wall time
    of 400 verses; why: docs/design/decoding.md, "A checkpoint checked before its model is built")."""
    with torch.device("meta"), _SkipNormalInit():
        yield


def check_model_options(name: str, options: dict) -> nn.Module:
    """Raises ValueError, in one line, if `options` cannot build the system `name`: build_model's checks, the
    system built on the meta device (nothing allocated) with vocabularies large enough for the options' pad_id.
    Call it before any expensive work (the vocabularies need not exist yet). Returns that meta-device system (for
    what its options decide: `position_bound`)."""
    pad = options.get("pad_id", 0)
    vocab = max(8, pad + 1) if isinstance(pad, int) and not isinstance(pad, bool) else 8
    with shapes_only():
        return build_model(name, vocab, vocab, **options)


def position_bound(model) -> Optional[int]:
    """The most positions a source or a target (BOS included) may have in `model` (the transformer's max_len), None
    where neither has a bound."""
    bounds = [b for b in (getattr(model, "max_source_steps", None), getattr(model, "max_target_steps", None))
              if b is not None]
    return min(bounds) if bounds else None
