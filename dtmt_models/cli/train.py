"""`dtmt train`: the command line (flags, run configuration files, --resume checks) over
dtmt_models.training.trainer.Trainer, which holds what a run does (see its docstring).

    dtmt train --data data/bible --model dtmt                      # small CPU preset
    dtmt train --config run.yaml --max-time 30m                    # a run configuration, a flag overriding it
    torchrun --nproc_per_node 4 -m dtmt_models.cli.train --data DIR --model dtmt   # DistributedDataParallel
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import signal
import sys
import time
from typing import List, Optional, Sequence, Tuple

import torch
import yaml

from dtmt_models.atomic import WriteError, atomic_write, remove_stale_temporaries
from dtmt_models.data import binarized
from dtmt_models.data.corpus import PREPARE_STAGE, CorpusError
from dtmt_models.data.vocabulary import PAD, Vocabulary
from dtmt_models.errors import (MAX_COUNT, MAX_THREADS, MAX_VOCAB_SIZE, ArgumentParser, check_counts, check_finite,
                                 check_output_dir, command_line_values, cut, did_you_mean, one_line, refuse,
                                 threads_warning)
from dtmt_models.models.checkpoint import CheckpointError, read_checkpoint, same_value
from dtmt_models.models.presets import PAPER_ROWS_BY_NAME, get_preset
from dtmt_models.models.registry import (check_model_options, list_models, position_bound, unused_options,
                                         used_options)
from dtmt_models.run_lock import RunLock
from dtmt_models.signals import give_back, take_signals
from dtmt_models.training.allocator import tune_malloc
from dtmt_models.training.config import TrainConfig
from dtmt_models.training.graphs import CaptureFailed
from dtmt_models.training.distributed import (Dist, Meeting, RefusedByAll, by_hand, check_environment, lost_peer,
                                              process_device, rank, refusal_line, resolve_auto, world_size)
from dtmt_models.training.trainer import (BEST, CONFIG, CURVE, LAST, LOG, LOG_FIELDS, TENSORBOARD, Trainer,
                                          TrainingDiverged, step_checkpoints)

# training settings that may be changed when resuming (how long to go on, how often to report)
RESUMABLE = ("max_steps", "max_epochs", "max_time", "patience", "valid_every", "valid_beam", "log_every", "progress",
             "threads", "bleu_sentences", "keep_last", "amp", "best_by", "device", "backend",
             "cuda_graphs")



# ------------------------------------------------------------------------------------------- arguments
class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None ("not given": the preset's value, or the checkpoint's on --resume)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    D = TrainConfig.defaults()   # the flags left None ("not given") take these, or the preset's
    p = ArgumentParser(
        prog="dtmt train", description="Train an NMT system on a corpus prepared by `dtmt prepare`.",
        formatter_class=_HelpFormatter)
    p.add_argument("--config", default=None, metavar="YAML",
                   help="a run configuration: the flags below as keys without the dashes (max_time: 30m), model "
                        "options under opt (opt: {depth: 2}); flags given on the command line override it. Every "
                        "run writes its resolved configuration to OUT/config.yaml, which reproduces it")
    p.add_argument("--data", required=True, help="prepared corpus directory (with corpus.json)")
    p.add_argument("--model", default=None, help=f"system: one of {', '.join(list_models())} (default {D['model']})")
    p.add_argument("--preset", default=None,
                   help="size/settings preset: small (CPU; the default), paper, or a paper's table row such as "
                        "000-T3-dtmt4 (which also names the model; list them with `dtmt models`)")
    p.add_argument("--out", default=None, help="output directory (default runs/<model>)")
    p.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                   help="model option override, e.g. --opt depth=4 --opt cell=gru (repeatable)")
    p.add_argument("--resume", nargs="?", const="", default=None, metavar="CHECKPOINT",
                   help="continue a run from its last.pt: CHECKPOINT (a run's last.pt or its folder; default "
                        "OUT/last.pt), in --out (default: CHECKPOINT's folder); a --data holding another corpus, or a "
                        "model or training setting given with a value other than the run's, is an error")
    p.add_argument("--allow-changed-data", action="store_true",
                   help="with --resume: continue on a --data whose corpus differs from the run's")
    p.add_argument("--overwrite", action="store_true", help="start afresh even if OUT has a checkpoint (the earlier "
                   "run's last.pt, best.pt, step_N.pt, learning curve and TensorBoard events are removed first)")
    g = p.add_argument_group("training (defaults come from the preset)")
    g.add_argument("--lr", type=float, default=None, help="base learning rate")
    g.add_argument("--schedule", choices=("rnmt", "inverse-sqrt", "constant", "epoch-halving"), default=None,
                   help="rnmt: paper 000 eq. 17; inverse-sqrt: paper 003 eq. 26-27; epoch-halving: lr halved after "
                        "each epoch (paper 004 §4.2)")
    g.add_argument("--warmup", type=int, default=None, help="warm-up updates")
    g.add_argument("--decay-start", type=int, default=None, help="RNMT+ schedule: decay start s")
    g.add_argument("--decay-end", type=int, default=None, help="RNMT+ schedule: decay end e")
    g.add_argument("--replicas", type=int, default=None,
                   help="n of the schedules (RNMT+ eq. 17: concurrent replicas; inverse-sqrt: num_gpu) "
                        "(default: the number of processes)")
    g.add_argument("--smoothing", type=float, default=None, help="label smoothing")
    g.add_argument("--clip", type=float, default=None, help="gradient-norm clipping (0: off)")
    g.add_argument("--optimizer", choices=("adam", "adadelta"), default=None,
                   help="adam (the default of every preset but paper 001's), or adadelta (Zeiler 2012; paper 001 "
                        "l.160-177: deeplau's paper preset, at --lr 1, Zeiler's, which has no rate)")
    g.add_argument("--adam-beta2", type=float, default=None,
                   help="Adam's β2 (β1 is 0.9; default: the preset's, each paper's own in its presets, else 0.998)")
    g.add_argument("--adam-eps", type=float, default=None, help="Adam's ε (default: the preset's, else 1e-9)")
    g.add_argument("--adadelta-rho", type=float, default=None,
                   help=f"Adadelta's decay ρ (default {D['adadelta_rho']}, paper 001's)")
    g.add_argument("--adadelta-eps", type=float, default=None,
                   help=f"Adadelta's ε (default {D['adadelta_eps']:g}, paper 001's)")
    g.add_argument("--init-uniform", type=float, default=None, metavar="R",
                   help="draw every weight and bias from U(-R, R) (layer norm's gains and offsets keep 1 and 0; "
                        "default: the preset's, 0.08 for papers 000 and 004; 0: each module's own)")
    g.add_argument("--init-normal", type=float, default=None, metavar="S",
                   help="draw every weight and bias from N(0, S²) instead (layer norm's as --init-uniform; default: "
                        "the preset's, 0.04 for paper 001; 0: each module's own)")
    g.add_argument("--max-tokens", type=int, default=None,
                   help="token budget per batch (per process), counted padded: pairs x (longer side + 1)")
    g.add_argument("--max-sentences", type=int, default=None,
                   help="at most this many sentence pairs a batch (per process; default: the preset's, else no bound "
                        "but the token budget)")
    g.add_argument("--vocab-size", type=int, default=None, help="SentencePiece size per side")
    g.add_argument("--vocab-type", choices=("bpe", "unigram"), default=None,
                   help=f"SentencePiece model (default {D['vocab_type']})")
    g.add_argument("--max-len", type=int, default=None, help="drop training pairs longer than this (subwords)")
    g.add_argument("--seed", type=int, default=None, help=f"random seed (default {D['seed']})")
    s = p.add_argument_group("stopping and reporting")
    s.add_argument("--max-epochs", type=int, default=None,
                   help="stop after this many epochs (default: the preset's, 6 for small, unless --max-steps or "
                        "--max-time is given, which also lifts a --config file's or, on --resume, the run's)")
    s.add_argument("--max-steps", type=int, default=None, help="stop after this many updates")
    s.add_argument("--max-time", default=None, help="stop after this much training time, e.g. 90s, 30m, 2h")
    s.add_argument("--patience", type=int, default=None, help="stop after this many validations without a better "
                                                              f"dev score (0: never; default {D['patience']})")
    s.add_argument("--best-by", default=None, choices=("loss", "bleu"),
                   help=f"the dev score that picks best.pt and counts --patience: loss (lower) or bleu (higher, "
                        f"of --bleu-sentences with --valid-beam); a tie goes to the other score, then to the "
                        f"earlier model (default {D['best_by']})")
    s.add_argument("--valid-every", type=int, default=None,
                   help=f"validate every N updates (and at the end; default {D['valid_every']})")
    s.add_argument("--valid-beam", type=int, default=None,
                   help=f"beam for dev BLEU (default {D['valid_beam']}; 1: greedy)")
    s.add_argument("--bleu-sentences", type=int, default=None,
                   help=f"dev sentences translated for BLEU (default {D['bleu_sentences']}; 0: all)")
    s.add_argument("--log-every", type=int, default=None,
                   help=f"write a training row (the mean over the updates since the last one) every N updates and at "
                        f"the end of the run (default {D['log_every']})")
    s.add_argument("--keep-last", type=int, default=None, metavar="N",
                   help="also keep the model of each of the last N validations, as step_UPDATES.pt (default "
                        f"{D['keep_last']}; 0: none), "
                        "e.g. for checkpoint averaging")
    s.add_argument("--progress", choices=("auto", "bar", "lines", "none"), default=None,
                   help=f"progress display (default {D['progress']}; auto: a live bar on a terminal, else lines every "
                        "--log-every updates; none: neither, the run's messages and scores still printed)")
    d = p.add_argument_group("device")
    d.add_argument("--device", default=None,
                   help=f"cpu, cuda, cuda:N or auto (default {D['device']}; on --resume, the run's)")
    d.add_argument("--backend", default=None,
                   help=f"recurrent kernels: auto, cpp, reference, triton, cuda (default {D['backend']}; on --resume, "
                        f"the run's)")
    d.add_argument("--threads", type=int, default=None,
                   help=f"CPU threads (default {D['threads']}; 0: torch's default)")
    d.add_argument("--amp", choices=("off", "bf16"), default=None,
                   help=f"mixed precision (default {D['amp']}): bf16 runs each update's forward under torch.autocast in bfloat16 (GEMMs "
                        "in bfloat16 with float32 accumulation; recurrent states, layer-norm statistics, losses and "
                        "the optimizer in float32). Faster only where the CPU has bfloat16 dot products (AVX512_BF16, "
                        "AMX) or on a GPU")
    d.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay each update as a CUDA graph (default: on where a GPU run tested it, one process "
                        "on a CUDA device with Adam, the default backend and --amp off; --no-cuda-graphs for eager "
                        "updates): batches padded to buckets of "
                        "lengths in steps of 8 and rows in steps of 16, a "
                        "bucket's first batch eager, its second captured, every later one replayed with one launch "
                        "(docs/design/gpu.md, 'Updates as CUDA graphs')")
    return p


# the settings that make a run what it is: on --resume a value given for one of them must equal the run's
# the training settings a preset may hold (a flag given replaces the preset's value)
PRESET_SETTINGS = ("lr", "schedule", "warmup", "decay_start", "decay_end", "replicas", "smoothing", "clip", "optimizer",
                   "adam_beta2", "adam_eps", "adadelta_rho", "adadelta_eps", "init_uniform", "init_normal",
                   "max_tokens", "max_sentences", "vocab_size", "max_len")
FIXED_ON_RESUME = ("model", "preset", *PRESET_SETTINGS, "vocab_type", "seed")
# each optimizer's own settings: given for the other one, an error; config.yaml holds the run's optimizer's only
OPTIMIZER_SETTINGS = {"adam": ("adam_beta2", "adam_eps"), "adadelta": ("adadelta_rho", "adadelta_eps")}


def check_arguments(args: argparse.Namespace) -> None:
    """Every numeric flag in its range, before any work (ValueError, one line naming flag, value and range)."""
    from dtmt_models.decoding.hypotheses import MAX_BEAM   # (a leaf: torch and the search's constants)

    counts = [(name, 1, MAX_COUNT) for name in ("max_steps", "max_epochs", "valid_every", "log_every", "max_tokens",
                                                 "max_sentences", "max_len", "replicas")]
    counts += [(name, 0, MAX_COUNT) for name in ("warmup", "decay_start", "decay_end", "patience", "bleu_sentences",
                                                  "keep_last")]
    check_counts(args, counts + [("valid_beam", 1, MAX_BEAM), ("threads", 0, MAX_THREADS, " (0: torch's default)"),
                                 ("vocab_size", 8, MAX_VOCAB_SIZE, " (4 special pieces + at least the characters)")])
    if args.seed is not None and not 0 <= args.seed < 2 ** 63:
        raise refuse("--seed", args.seed, "an integer in [0, 2^63)")
    check_finite("--lr", args.lr, 0, above=True)
    if args.smoothing is not None and not 0 <= args.smoothing < 1:
        raise refuse("--smoothing", args.smoothing, "in [0, 1)")
    check_finite("--clip", args.clip, 0, note=" (0: off)")
    if args.adam_beta2 is not None and not 0 <= args.adam_beta2 < 1:   # (1: Adam's bias correction divides by 0)
        raise refuse("--adam-beta2", args.adam_beta2, "in [0, 1)")
    check_finite("--adam-eps", args.adam_eps, 0, above=True)
    if args.adadelta_rho is not None and not 0 <= args.adadelta_rho < 1:
        raise refuse("--adadelta-rho", args.adadelta_rho, "in [0, 1)")
    check_finite("--adadelta-eps", args.adadelta_eps, 0, above=True)
    # (at most 10: the papers draw from 0.04 to 0.1; 3.5e38 had been a traceback from the draw, 1e30 a divergence at
    # the first update, each after the run's folder was made)
    check_finite("--init-uniform", args.init_uniform, 0, 10.0, note=" (0: each module's own initialisation)")
    check_finite("--init-normal", args.init_normal, 0, 10.0, note=" (0: each module's own initialisation)")
    if args.init_uniform and args.init_normal:
        raise ValueError(f"--init-uniform {args.init_uniform:g} and --init-normal {args.init_normal:g}: the weights "
                         f"are drawn from one law; give one of them")
    options = parse_options(args.opt)
    if "backend" in options:
        raise ValueError(f"--opt backend={options['backend']}: the recurrent kernels are not a model option; use "
                         f"--backend")
    seconds = parse_duration(args.max_time)
    if seconds is not None and not 0 < seconds < math.inf:
        raise refuse("--max-time", args.max_time, "a finite duration > 0, e.g. 90s, 30m or 2h")
    if args.allow_changed_data and args.resume is None:
        raise ValueError("--allow-changed-data applies to --resume only")
    if args.resume is not None and args.overwrite:
        raise ValueError("--resume and --overwrite contradict each other: continue the run in --out, or start it "
                         "again")


# the schedule flags each schedule reads (the others' values, a preset's, stay unread)
SCHEDULE_READS = {"rnmt": ("warmup", "decay_start", "decay_end", "replicas"), "inverse-sqrt": ("warmup", "replicas"),
                  "constant": (), "epoch-halving": ()}
SCHEDULE_FLAGS = tuple(dict.fromkeys(k for read in SCHEDULE_READS.values() for k in read))   # (warmup, ..., replicas)


def check_schedule(cfg: TrainConfig, explicit: set = frozenset(), preset_train: Optional[dict] = None,
                   typed: Optional[set] = None) -> List[str]:
    """The learning-rate schedule's settings as the run resolves them (the preset's where not given): ValueError in
    one line naming the flags, before any work (the schedule itself refused them only once training started). Given
    flags (`explicit`) that the schedule does not read are refused (taken without a word before), and, for a new run
    (`preset_train`: its preset's settings), a --schedule whose --lr means another thing than the preset's without an
    --lr: inverse-sqrt's is a multiplier of d^-0.5 (the presets give 1 or 2), the others' the rate itself (a
    transformer at constant 1.0 had diverged, an RNN at inverse-sqrt 2e-3 trained at 1e-7). Returns warnings: --warmup
    given to the rnmt schedule of one replica, which (eq. 17) warms up from lr0 to n lr0 and so not at all. The
    refusal of unread flags and the warning look at `typed`, the flags of the command line itself (None: `explicit`):
    a --config run file holds every schedule setting, read or not."""
    typed = explicit if typed is None else typed
    unread = [f"--{k.replace('_', '-')}" for k in SCHEDULE_FLAGS
              if k in typed and k not in SCHEDULE_READS.get(cfg.schedule, ())]
    if unread:
        raise ValueError(f"{' and '.join(unread)}: the {cfg.schedule} schedule reads "
                         + (" and ".join(f"--{k.replace('_', '-')}" for k in SCHEDULE_READS[cfg.schedule]) or "none")
                         + " of them")
    warnings = []
    replicas = cfg.replicas if cfg.replicas is not None else world_size()
    if cfg.schedule == "rnmt" and "warmup" in typed and replicas == 1:
        warnings.append(f"warning: --warmup {cfg.warmup}: the rnmt schedule (paper 000 eq. 17) warms up from lr0 to "
                        f"n lr0 with n = --replicas, 1 here: there is no warm-up")
    if cfg.schedule in ("rnmt", "inverse-sqrt") and cfg.warmup < 1:
        raise ValueError(f"--warmup {cfg.warmup}: the {cfg.schedule} schedule needs at least 1 warm-up update")
    if cfg.schedule == "rnmt" and not 0 <= cfg.decay_start < cfg.decay_end:
        raise ValueError(f"--decay-start {cfg.decay_start} --decay-end {cfg.decay_end}: the rnmt schedule decays "
                         f"between them, so it needs 0 <= --decay-start < --decay-end")
    if preset_train is not None and "schedule" in explicit and "lr" not in explicit:
        ours = preset_train.get("schedule", TrainConfig.schedule)
        if (ours == "inverse-sqrt") != (cfg.schedule == "inverse-sqrt"):
            raise ValueError(f"--schedule {cfg.schedule}: the preset's --lr {cfg.lr:g} is for {ours}, where it is "
                             + ("a multiplier of d^-0.5" if ours == "inverse-sqrt" else "the rate itself")
                             + f"; give --lr for {cfg.schedule}")
    return warnings


def resume_conflicts(args: argparse.Namespace, explicit: set, run: TrainConfig) -> List[str]:
    """The settings given on the command line with values other than those of the run being resumed."""
    from dtmt_models.models.registry import option_defaults

    given = resolve_config(args)

    def effective(cfg, k):   # (the run's None: the default it ran with, which a flag may name: --replicas 1)
        return world_size() if k == "replicas" and cfg.replicas is None else getattr(cfg, k)
    out = [f"--{k.replace('_', '-')} {getattr(given, k)} (the run's is {effective(run, k)})"
           for k in FIXED_ON_RESUME if k in explicit and effective(given, k) != effective(run, k)]
    missing, defaults = object(), option_defaults(run.model)
    for k, v in parse_options(args.opt).items():
        had = run.model_options.get(k, defaults.get(k, missing))   # (left out: the model's default)
        if had is missing or had != v or (isinstance(had, bool) and type(had) is not type(v)):   # (True == 1)
            if k not in run.model_options and k not in defaults:   # (it had read "the run's is unset")
                out.append(f"--opt {k}={v} ({run.model} has no option {k!r}{did_you_mean(k, defaults)})")
                continue
            shown = run.model_options[k] if k in run.model_options else f"the default, {defaults[k]}"
            out.append(f"--opt {k}={v} (the run's is {shown})")
    return out


# flags a run configuration does not hold: what to do with OUT this time, and the file itself
NOT_IN_CONFIG = ("config", "resume", "overwrite", "allow_changed_data")


def _flags(parser: argparse.ArgumentParser) -> dict:
    """dest -> long flag of the parser's options (help excluded)."""
    return {a.dest: a.option_strings[-1] for a in parser._actions if a.option_strings and a.dest != "help"}


def _yaml_kind(value) -> str:
    """What a YAML value is, for a message: a short scalar as itself, else its kind (a list of aliased lists may
    stand for millions of values)."""
    kinds = {dict: "mapping", list: "list", bool: "true/false", bytes: "binary value"}
    kind = next((name for t, name in kinds.items() if isinstance(value, t)), type(value).__name__)
    return repr(value) if isinstance(value, (bool, int, float, str)) and len(repr(value)) <= 60 else f"a {kind}"


MAX_CONFIG_BYTES = 1 << 20   # a run configuration is a few hundred bytes
_INT = re.compile(r"[-+]?\d+")
_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


@functools.lru_cache(maxsize=None)   # (one class, whichever reader asks)
def _config_loader():
    """PyYAML's safe loader read as YAML 1.2 reads plain scalars, which is how a person writing a run configuration
    means them: true/false are the only booleans (1.1 also took yes/no/on/off, so `amp: off` was false), a number
    with a leading 0 is decimal (1.1: `seed: 010` was 8), `1:30` is text (1.1: 90, base 60, taken as seconds where
    --max-time 1:30 is refused), `1e-1` is a number (1.1: text). A key given twice is refused (1.1: the last won)."""
    import yaml

    tags = {f"tag:yaml.org,2002:{t}" for t in ("bool", "int", "float")}

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if not isinstance(key, (str, int, float, bool)):
                    continue   # (no option's name: refused later)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"{key!r} is given twice, the second time on line {key_node.start_mark.line + 1}")
                seen.add(key)
            return super().construct_mapping(node, deep)

    Loader.yaml_implicit_resolvers = {c: [(t, rx) for t, rx in rs if t not in tags]
                                      for c, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                 list("tTfF"))
    Loader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0x[0-9a-fA-F]+)$"),
                                 list("-+0123456789"))
    Loader.add_constructor("tag:yaml.org,2002:int",   # (decimal, or hexadecimal after 0x; 1.1 read 010 as octal)
                           lambda loader, node: int(loader.construct_scalar(node), 0 if "x" in node.value else 10))
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(
        r"^(?:[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
        list("-+0123456789."))
    return Loader


def _load_config(path: str):
    """The YAML data of the run configuration `path` (config_arguments, config_edits), as _config_loader reads it:
    at most MAX_CONFIG_BYTES (more is a ValueError naming the file), decoded whole, so that a parser's offset counts
    from its start. The reader's and the parser's own errors are the caller's to word."""
    import yaml

    with open(path, "rb") as f:
        text = f.read(MAX_CONFIG_BYTES + 1)   # (bounded: --config /dev/zero read until the kernel killed it)
    if len(text) > MAX_CONFIG_BYTES:
        raise ValueError(f"--config {path}: more than {MAX_CONFIG_BYTES:,} bytes, not a run configuration")
    return yaml.load(text.decode("utf-8"), Loader=_config_loader())


def config_arguments(path: str) -> List[str]:
    """The command-line arguments that the run configuration `path` stands for (YAML: `dtmt train` flags without
    their dashes as keys, model options as the mapping `opt`), to go before the command line's own, which override
    them. ValueError (one line naming the file) for an unreadable file, a key that is no flag, or a value the flag
    does not take."""
    import yaml

    try:
        data = _load_config(path)
    except OSError as exc:
        raise ValueError(f"--config {path}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"--config {path}: not UTF-8 text (byte {exc.start})") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"--config {path}: not valid YAML ({one_line(exc)})") from None
    except RecursionError:   # (the parser's recursion on thousands of nested brackets: no YAMLError)
        raise ValueError(f"--config {path}: nested too deeply to be a run configuration") from None
    except ValueError as exc:   # (a decimal of over 4,300 digits: Python's int() refuses it inside the parser)
        if str(exc).startswith(f"--config {path}: "):
            raise
        raise ValueError(f"--config {path}: not a run configuration ({one_line(exc)})") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of option: value, got a {type(data).__name__}")
    parser = build_parser()
    flags = _flags(parser)
    switches = {a.dest: a.option_strings for a in parser._actions if isinstance(a, argparse.BooleanOptionalAction)}
    argv = []
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest not in flags or dest in NOT_IN_CONFIG:
            guess = did_you_mean(dest, set(flags) - set(NOT_IN_CONFIG))
            raise ValueError(f"--config {path}: unknown option {key!r}{guess} (the keys are `dtmt train` flags "
                             f"without the dashes, e.g. max_time, and opt for the model options)")
        if value is None:   # (it was skipped: a forgotten value trained with the preset's)
            raise ValueError(f"--config {path}: {key} has no value; give one, or leave the key out")
        for v in (value.values() if dest == "opt" and isinstance(value, dict) else [value]):
            if isinstance(v, int) and v.bit_length() > 256:   # (Python will not write one of over 4,300 digits)
                raise ValueError(f"--config {path}: {key}: a number of {v.bit_length():,} bits, past any option's "
                                 f"range")
        if dest == "opt":
            if not isinstance(value, dict):
                raise ValueError(f"--config {path}: opt must be a mapping of model option: value, e.g. "
                                 f"opt: {{depth: 2}}")
            for k, v in value.items():
                # one value (an aliased list may be huge; a date or bytes is no option's value)
                if v is not None and not isinstance(v, (bool, int, float, str)):
                    raise ValueError(f"--config {path}: opt: {k} takes one number, word or true/false, got "
                                     f"{_yaml_kind(v)}")
                argv += ["--opt", f"{k}={json.dumps(v)}"]
        elif dest in switches:   # (a switch: true or false)
            if not isinstance(value, bool):
                raise ValueError(f"--config {path}: {key} takes true or false, got {_yaml_kind(value)}")
            argv.append(switches[dest][0 if value else 1])
        elif isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(f"--config {path}: {key} takes one {'number or word' if dest != 'data' else 'path'}, "
                             f"got {_yaml_kind(value)}")
        elif dest in ("out", "data") and isinstance(value, str):   # (~ as the shell expands it in a flag: a folder
            argv += [flags[dest], os.path.expanduser(value)]          # named ~ had been made in the current one)
        else:
            argv += [flags[dest], str(value)]
    if "optimizer" not in data and any(k in data for k in OPTIMIZER_SETTINGS["adam"]):
        argv += ["--optimizer", "adam"]   # (a config.yaml from before --optimizer: its run trained with Adam)
    check = build_parser()

    def fail(message):
        raise ValueError(f"--config {path}: {message}")

    check.error = fail   # argparse's own checks of types and choices, naming the file
    check.parse_args(argv if "data" in data else [*argv, "--data", "."])
    return argv


def run_configuration(cfg: TrainConfig) -> dict:
    """The resolved configuration of a run as `--config` reads it (what config.yaml holds)."""
    unused = {k for kind, keys in OPTIMIZER_SETTINGS.items() if kind != cfg.optimizer for k in keys}
    out = {k: getattr(cfg, k) for k in _flags(build_parser()) if k not in NOT_IN_CONFIG and k != "opt"
           and k not in unused and getattr(cfg, k, None) is not None}
    out["opt"] = dict(cfg.model_options)
    return out


def config_edits(path: str, run: TrainConfig) -> List[str]:
    """How the config.yaml at `path` differs from the run configuration `run` (its last.pt's), one entry a setting
    ('key: the file's value where last.pt has its own'), or one saying the file cannot be read: an edit that --resume,
    which reads last.pt, would not take. None where the file is absent."""
    import yaml

    if not os.path.exists(path):
        return []
    try:
        data = _load_config(path)
        if not isinstance(data, dict):
            raise ValueError("not a mapping")
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ValueError, RecursionError) as exc:
        return [f"it is not a run configuration that can be read ({one_line(exc)[:200]})"]
    recorded = yaml.load(yaml.safe_dump(run_configuration(run), sort_keys=False),   # (as the file reads back)
                         Loader=_config_loader())
    missing = "none"
    # (the file's values as _yaml_kind says them: a value of nested aliases, a few hundred bytes, had been written out
    # whole, a warning line of megabytes)
    def shown(value) -> str:
        return str(value) if isinstance(value, (bool, int, float, str)) and len(str(value)) <= 60 else _yaml_kind(value)

    return [f"{shown(k)}: {shown(data.get(k, missing))} where {LAST} has {recorded.get(k, missing)}"
            for k in dict.fromkeys([*recorded, *data])
            if k not in ("out", "data") and data.get(k, missing) != recorded.get(k, missing)]


def parse_duration(text: Optional[str]) -> Optional[float]:
    """'90', '90s', '30m', '1.5h' -> seconds."""
    if text is None:
        return None
    units = {"s": 1, "m": 60, "h": 3600}
    t = str(text).strip().lower()
    try:
        return float(t[:-1]) * units[t[-1]] if t[-1] in units else float(t)
    except (ValueError, IndexError):
        raise ValueError(f"--max-time: cannot read {text!r}; use e.g. 90s, 30m or 2h") from None


def parse_options(items: Sequence[str]) -> dict:
    """--opt KEY=VALUE items as {key: value} (the value as JSON, or a number as Python writes it, true / false /
    none, else the text); ValueError naming the item that is none (no '=', no key, a number past Python's digits)."""
    out = {}
    for item in items:
        k, v = item.split("=", 1) if "=" in item else ("", None)
        if not k.strip():
            raise ValueError(f"--opt expects KEY=VALUE, got {item!r}")
        try:
            out[k.strip()] = _option_value(v)
        except ValueError as exc:   # (a number of 5,000 digits: the conversion's own limit, a traceback)
            raise ValueError(f"--opt {k.strip()}: its value cannot be read ({one_line(exc)[:120]})") from None
    return out


def _option_value(v: str):
    try:
        return json.loads(v)
    except json.JSONDecodeError:   # (numbers as Python writes them too: .1, 1., +0.1, 010)
        text = v.strip()
        return (int(text) if _INT.fullmatch(text) else float(text) if _FLOAT.fullmatch(text)
                else {"true": True, "false": False, "none": None}.get(v.lower(), v))


def budget_lifts_epochs(values: dict) -> bool:
    """Whether `values` (dest -> value, an absent key or None: not given) give a step or time budget and no epoch
    bound: the budget then replaces the epoch bound of the preset, of a --config file, or, on --resume, of the run."""
    return values.get("max_epochs") is None and (values.get("max_steps") is not None
                                                 or values.get("max_time") is not None)


def resolve_config(args: argparse.Namespace) -> TrainConfig:
    """The full run configuration: TrainConfig's defaults, the preset, then the values given (a flag's None
    is "not given")."""
    preset = get_preset(args.model, args.preset)
    train = dict(preset["train"])
    for law, other in (("init_uniform", "init_normal"), ("init_normal", "init_uniform")):
        if getattr(args, law) is not None and getattr(args, other) is None:
            train.pop(other, None)   # (the law given replaces the preset's)
    for k in PRESET_SETTINGS:
        v = getattr(args, k)
        if v is not None:
            train[k] = v
    if budget_lifts_epochs(vars(args)):
        train["max_epochs"] = None      # an explicit step or time budget replaces the preset's epoch bound
    elif args.max_epochs is not None:
        train["max_epochs"] = args.max_epochs
    given_options = parse_options(args.opt)
    model_options = {**preset["model"], **given_options}
    model_options.pop("backend", None)   # (a preset's: --backend chooses the kernels; check_arguments refuses --opt's)
    # the options the structure given leaves unused are left out, but for those typed with --opt, which build_model
    # refuses (the preset's encoder_depth with --opt deep_encoder=False had been refused, naming an option the user
    # never gave; a --config run file's likewise)
    typed = set(given_options) if getattr(args, "typed_opt", None) is None else set(args.typed_opt)
    unused = unused_options(args.model, model_options) if args.model in list_models() else {}
    model_options = {k: v for k, v in model_options.items() if k not in unused or k in typed}
    fields = set(TrainConfig.defaults()) | {"data", "model_options"}
    given = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    return TrainConfig(**{**given, **train, "model_options": model_options,
                          "max_time_s": parse_duration(args.max_time)})


def check_cuda_graphs(cfg: TrainConfig) -> None:
    """--cuda-graphs needs one process on a CUDA device and Adam (training/graphs.py captures its step)."""
    if cfg.cuda_graphs and (not resolve_auto(cfg.device).startswith("cuda") or world_size() > 1):   # (True: asked)
        raise ValueError("--cuda-graphs: needs one process on a CUDA device (--device cuda, no torchrun); leave it "
                         "out here (--no-cuda-graphs to resume a run that had it)")
    if cfg.cuda_graphs and cfg.optimizer != "adam":
        raise ValueError(f"--cuda-graphs: captures Adam's update only; train --optimizer {cfg.optimizer} without it")


def check_optimizer(cfg: TrainConfig, explicit: set, preset_train: Optional[dict]) -> None:
    """An optimizer's settings given for a run of the other one, and (preset_train: a new run's preset settings) an
    --optimizer other than the preset's without an --lr (the preset's rate is its optimizer's: Adadelta's 1 would
    throw Adam's weights out at the first update): ValueError in one line, before any work."""
    for kind, keys in OPTIMIZER_SETTINGS.items():
        given = [f"--{k.replace('_', '-')}" for k in keys if k in explicit]
        if kind != cfg.optimizer and given:
            raise ValueError(f"{' and '.join(given)}: {kind}'s, and the run's optimizer is {cfg.optimizer}")
    if preset_train is not None and "optimizer" in explicit and "lr" not in explicit:
        ours = preset_train.get("optimizer", TrainConfig.optimizer)
        if ours != cfg.optimizer:
            raise ValueError(f"--optimizer {cfg.optimizer}: the preset's --lr {cfg.lr:g} is for {ours}; give the "
                             f"rate for {cfg.optimizer} with --lr")


_KINDS = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "Dict[str, Any]": (dict,)}
# what every preset sets and the trainer cannot go without (a None there was a TypeError in the optimizer or schedule)
_REQUIRED = ("lr", "schedule", "warmup", "decay_start", "decay_end", "smoothing", "clip", "max_tokens", "vocab_size")


def _kind(f: dataclasses.Field) -> Tuple[str, bool]:
    """(the kind of a TrainConfig field, as _KINDS names it; whether it may be None)."""
    kind = str(f.type)
    optional = kind.startswith("Optional[")
    return (kind[len("Optional["):-1] if optional else kind), optional


def resumed_config(source: str, config) -> TrainConfig:
    """The TrainConfig of the checkpoint `source` (its `config`), held to what the flags are held to: each field of
    its type, the numbers in the flags' ranges, a system of the registry its options can build. ValueError in one
    line naming the checkpoint (a hand-edited or crafted one was a traceback: a TypeError from the optimizer for an
    lr of 'abc', a KeyError for no config)."""
    def refused(why: str) -> ValueError:
        return ValueError(f"--resume {source}: {why}; the checkpoint cannot be resumed")
    try:
        cfg = TrainConfig.from_dict(config) if isinstance(config, dict) else None
    except TypeError:   # (a field without a default missing: data)
        cfg = None
    if cfg is None:
        raise refused("it holds no training settings (config) or not all of them")
    for f in dataclasses.fields(TrainConfig):
        value, (kind, optional) = getattr(cfg, f.name), _kind(f)
        if value is None and not optional or value is not None and not isinstance(value, _KINDS[kind]) or (
                isinstance(value, bool) and kind in ("int", "float")):
            what = {"Dict[str, Any]": "a mapping"}.get(kind, f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}")
            raise refused(f"its setting {f.name} is {cut(repr(value))[:80]}, not {what}")
    missing = [k for k in _REQUIRED if getattr(cfg, k) is None]
    if missing:
        raise refused(f"its settings lack {', '.join(missing)}")
    parser = build_parser()
    for action in parser._actions:   # (a setting of a flag with choices: one of them)
        value = getattr(cfg, action.dest, None)
        if action.choices is not None and value is not None and value not in action.choices:
            raise refused(f"its setting {action.dest} is {cut(repr(value))[:80]}, not one of "
                          f"{', '.join(map(str, action.choices))}")
    if cfg.max_time_s is not None and not (math.isfinite(cfg.max_time_s) and cfg.max_time_s > 0):
        raise refused(f"its time budget max_time_s is {cfg.max_time_s!r}, not a number of seconds > 0")
    given = argparse.Namespace(**{a.dest: None for a in parser._actions})
    vars(given).update({k: v for k, v in dataclasses.asdict(cfg).items() if k in vars(given)}, opt=[])
    try:
        check_arguments(given)
        if cfg.model not in list_models():
            raise ValueError(f"unknown model {cfg.model!r}")
        # (a run of before their refusal may hold unused options: checked and built without them, kept as they are
        # in its settings, which its best.pt and step files are compared by)
        check_model_options(cfg.model, used_options(cfg.model, cfg.model_options)
                            if isinstance(cfg.model_options, dict) else cfg.model_options)
    except ValueError as exc:
        raise refused(f"its settings: {one_line(exc)}") from None
    return cfg


def check_best_is_of_the_run(best: str, source: str, ckpt: dict) -> None:
    """ValueError when the run folder's best.pt is of another model than the checkpoint `source` resumed there
    (another system, options or vocabularies: a last.pt copied in from another run), whose first better validation
    would replace it; a best.pt that cannot be read is left to be replaced."""
    if not os.path.isfile(best) or os.path.samefile(best, source):
        return
    try:
        own = read_checkpoint(best, mmap=True)   # (its settings only: the weights stay on disk)
    except ValueError:
        return
    differ = [k for k in ("model_name", "model_options", "src_vocab", "tgt_vocab")   # (a tensor among the options:
              if not same_value(own.get(k), ckpt.get(k))]                           # != had been a traceback)
    if differ:
        raise ValueError(f"--resume {source}: not the model of {best} beside it (its {', '.join(differ)} differ"
                         f"{'s' if len(differ) == 1 else ''}), which the run's first better validation would "
                         f"replace; resume it in a new --out")


# what each process of a run may set apart (where it runs and what it prints); every other setting, and the corpus's
# fingerprint, must be the same in all: a process given another --seed or --data trained on, exit 0
PER_PROCESS = ("data", "out", "threads", "progress")


def check_processes_agree(dist: Dist, cfg: TrainConfig, resumed: Optional[dict] = None) -> None:
    """RefusedByAll in every process (the same one line, printed by process 0) when the processes of a run were
    given different settings or corpora, or resume different checkpoints (`resumed`: the training state each read;
    each reads the last.pt of its own --out: an older one in one process trained other updates in the same
    all-reduces, and both waited for ever at the end, deaf to signals): compared once, before any work (another --lr
    was found by the parameters' check at the end of the run, a traceback; another --max-steps left one process
    waiting for the other's last update for half an hour)."""
    if dist.world == 1:
        return
    settings = {k: v for k, v in cfg.to_dict().items() if k not in PER_PROCESS}
    if resumed is not None:   # (the update it was saved at, and its training time: two saves share neither)
        settings["resumed checkpoint"] = (f"update {resumed.get('step')}, "
                                          f"{resumed.get('elapsed')} s of training")
    every = dist.gather(settings)
    first = every[0]
    for number, other in enumerate(every[1:], start=1):   # (each against process 0's: the same message in all)
        differ = sorted(k for k in set(first) | set(other) if first.get(k) != other.get(k))
        if differ:
            shown = ", ".join(f"{k} ({first.get(k)!r} in process 0, {other.get(k)!r} in process {number})"
                              for k in differ[:3])
            dist.close()   # (every process ends here alike; one gone before another's gather had finished broke it)
            raise RefusedByAll(f"the run's processes were started with different settings: {shown}"
                             f"{' ...' if len(differ) > 3 else ''}; start every process with the same options and "
                             f"corpus" + (", and the same checkpoint to resume (the same --resume and --out)"
                                          if "resumed checkpoint" in differ else ""))


def changed_dev_warning(best_by: str, training: dict) -> Optional[str]:
    """The log's warning for a run resumed (--allow-changed-data) on a dev set other than the one it validated on,
    where its best.pt was chosen by a score on that one (`training`: last.pt's training state); None before any
    validation chose one."""
    bleu, loss = training["best_bleu"], training["best_loss"]
    if best_by == "bleu" and bleu >= 0:
        score = f"dev BLEU {bleu:.2f}"
    elif best_by == "loss" and math.isfinite(loss):
        score = f"dev loss {loss:.4f}"
    else:
        return None
    return (f"warning: the dev set differs from the one this run validated on; best.pt was chosen there ({score}) "
            f"and a validation on this one replaces it only by a better score than that (--patience counts on too): "
            f"scores of two dev sets compared")


def resume_changes(before: dict, after: dict) -> List[str]:
    """On --resume, each setting whose value the command line changed, as "name old -> new" (max_time_s, the seconds
    of max_time, left out)."""
    return [f"{k} {before.get(k)!r} -> {v!r}" for k, v in after.items()
            if k != "max_time_s" and before.get(k) != v]


def held_checkpoints(out: str) -> List[str]:
    """The checkpoints a run left in `out` that tell it is a run's folder: its last.pt and best.pt, or else its first
    step_N.pt (a run killed between them, or one whose last.pt was removed)."""
    return [os.path.join(out, name) for name in (LAST, BEST) if os.path.isfile(os.path.join(out, name))] or [
        path for _, path in step_checkpoints(out)][:1]


# the files a run writes in its folder, each through an atomic write (the temporaries of theirs that an interrupted
# run left are removed; no other file of the folder is)
RUN_FILES = re.compile("|".join(re.escape(name) for name in (LAST, BEST, LOG, CURVE, CONFIG)) + r"|step_\d+\.pt")


def check_run_names(out: str) -> None:
    """ValueError, in one line, where one of the names a run writes in `out` is something else than a file (a folder
    best.pt had ended a run at its first validation, its updates lost; a folder config.yaml a resumed one after its
    start, a new events file written), or its TensorBoard folder something else than a folder (a file there had
    ended the run after its data was read, exit 1): before a new run, and before a resumed one."""
    for name in (LAST, BEST, LOG, CURVE, CONFIG):
        path = os.path.join(out, name)
        if os.path.lexists(path) and not os.path.isfile(path):
            raise ValueError(f"--out {out}: {name} there is not a file, and the run writes its {name} there; move it "
                             f"or give another --out")
    board = os.path.join(out, TENSORBOARD)
    if os.path.lexists(board) and not os.path.isdir(board):
        raise ValueError(f"--out {out}: {TENSORBOARD} there is not a folder, and the run writes its TensorBoard "
                         f"events in one of that name; move it or give another --out")


def check_run_files(out: str) -> None:
    """ValueError, in one line, before a new run writes into `out` (no checkpoint there, or --overwrite): where one of
    the names the run writes is something else than a file (a folder best.pt had ended the run at its first
    validation, its updates lost), and where config.yaml or train_log.csv are not a dtmt run's (a user's own
    config.yaml in `--out .` had been replaced without a word; a run's own, even the --config file, is rewritten with
    the settings resolved)."""
    check_run_names(out)
    own = os.path.join(out, CONFIG)
    if os.path.isfile(own):
        try:   # (read as a --config file is: bounded, the run configurations' loader)
            held = _load_config(own)
        except (OSError, UnicodeDecodeError, yaml.YAMLError, ValueError, RecursionError):
            held = None
        if not (isinstance(held, dict) and {"model", "vocab_size", "opt"} <= set(held)):
            raise ValueError(f"--out {out}: its {CONFIG} is not a dtmt run's, and the run writes its own there; move "
                             f"it or give another --out")
    # (a run draws it beside its config.yaml and log, checked above as a run's: a user's own picture of that name
    # had been replaced without a word)
    if os.path.isfile(os.path.join(out, CURVE)) and not held_checkpoints(out) and not os.path.isfile(own):
        raise ValueError(f"--out {out}: its {CURVE} is not a dtmt run's (no run's checkpoint or {CONFIG} beside it), "
                         f"and the run draws its own there; move it or give another --out")
    log = os.path.join(out, LOG)
    if os.path.isfile(log):
        try:
            with open(log, encoding="utf-8-sig") as f:
                header = f.readline(1024).strip()   # (the header, bounded: a file of one long line is no log)
        except (OSError, UnicodeDecodeError):
            header = ""
        if header.split(",")[:2] != LOG_FIELDS[:2]:
            raise ValueError(f"--out {out}: its {LOG} is not a dtmt run's log, and the run writes its own there; move "
                             f"it or give another --out")


def same_folder(a: str, b: str) -> bool:
    """Whether the folders `a` and `b` are one (through links too)."""
    return a == b or os.path.isdir(a) and os.path.isdir(b) and os.path.samefile(a, b)


def earlier_run_files(out: str) -> Tuple[List[str], List[str], List[str]]:
    """--overwrite: what the earlier run in `out` left that this one does not rewrite at its start (its log and
    config are): its last.pt, best.pt and learning curve (until this run wrote its own, an interrupted or unvalidated
    run left them, the earlier run's, as this one's: a resume refused, `translate -c OUT/best.pt` the old model), its
    step_N.pt (which `dtmt average --run` averaged with this run's or instead of them) and its TensorBoard events
    (drawn over this run's). Listed before this run starts, removed by forget_earlier_run once it has started."""
    files = [os.path.join(out, name) for name in (LAST, BEST, CURVE) if os.path.isfile(os.path.join(out, name))]
    steps = [path for _, path in step_checkpoints(out)]
    board = os.path.join(out, TENSORBOARD)   # (not through a link: a folder shared with other runs lost their events)
    events = [os.path.join(board, n) for n in os.listdir(board) if n.startswith("events.out.tfevents.")] \
        if os.path.isdir(board) and not os.path.islink(board) else []
    return files, steps, events


def forget_earlier_run(out: str, earlier: Tuple[List[str], List[str], List[str]]) -> None:
    """Removes `earlier` (earlier_run_files), once this run has started (a run refused before it did, for its data
    or a checkpoint, left them), and says so in one line."""
    files, steps, events = earlier
    for path in files + steps + events:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    if files or steps or events:
        named = "".join(f"{os.path.basename(path)}, " for path in files)
        print(f"dtmt train: --overwrite: removed the earlier run's {named}{len(steps)} step checkpoint(s) and "
              f"{len(events)} TensorBoard event file(s) in {out}", file=sys.stderr)


# ------------------------------------------------------------------------------------------------ main
def meet_the_others() -> Optional[Meeting]:
    """With several processes started by hand, the run's Meeting, joined first thing (None with one, or under
    torchrun, which ends the others itself); the launch variables are checked first."""
    check_environment()
    return Meeting() if by_hand() else None


def _interrupt_status(exc: KeyboardInterrupt) -> int:
    """The exit status of a run a KeyboardInterrupt stopped: 143 where SIGTERM raised it (the handlers name it),
    130 for Ctrl-C."""
    return 128 + signal.SIGTERM if str(exc) == "SIGTERM" else 130


def _stopped_before_training(exc: KeyboardInterrupt, lock: List[RunLock]) -> int:
    """Ctrl-C or SIGTERM before training started (the trainer's own handlers not yet there): nothing written stays
    (a folder made for the lock goes too), one line, 130 or 143."""
    for held in lock:
        held.release(discard=True)
    status = _interrupt_status(exc)
    said = "terminated (SIGTERM)" if status != 130 else "interrupted"
    print(f"\ndtmt train: {said} before training started", file=sys.stderr)
    return status


def _terminated(signum, frame):   # SIGTERM before the trainer takes it: as Ctrl-C (it killed the process without a
    raise KeyboardInterrupt("SIGTERM")   # word, exit 143, a new --out left holding only the lock file)


def main(argv: Optional[List[str]] = None) -> int:
    lock: List[RunLock] = []   # the run directory's lock, once taken (held until the run ends)
    meeting = None
    interrupted = False   # (Ctrl-C: a process leaving the meeting does not wait for the others then)
    started = time.time()   # (a last.pt older than this is an earlier run's: --overwrite removes it only later)
    taken = take_signals((signal.SIGTERM,), _terminated)
    try:
        try:
            meeting = meet_the_others()
        except ValueError as exc:
            print(f"dtmt train: {one_line(exc)}", file=sys.stderr)
            return 2
        return _main(argv, lock, meeting)
    except KeyboardInterrupt as exc:   # Ctrl-C or SIGTERM before training started (the training loop saves itself)
        interrupted = True
        return _stopped_before_training(exc, lock)
    except MemoryError as exc:   # (a model too large for this machine: registry.build_model's, one line)
        for held in lock:
            held.release(discard=True)
        print(f"dtmt train: out of memory{f': {exc}' if str(exc) else ''}", file=sys.stderr)
        return 1
    except RuntimeError as exc:   # another process of the run gone (killed, or its own error): gloo's traceback
        reason = lost_peer(exc) if world_size() > 1 else None
        if reason is None:
            raise
        # (process 0 writes the checkpoints and holds the lock of their folder: it says whether one stands; it had
        # said so where none was written)
        last = os.path.join(lock[0].directory, LAST) if lock else None
        kept = last is not None and os.path.isfile(last)
        said = ("" if last is None else f" {last} stands" if kept and os.path.getmtime(last) >= started
                else f" No checkpoint of this run was written ({last} is as it was before it)" if kept
                else " No checkpoint was written")   # (with --overwrite, an earlier run's: not this run's)
        print(f"dtmt train: process {os.environ.get('RANK', '?')} of {world_size()}: another process of the run "
              f"ended ({reason}); its own messages say why.{said}", file=sys.stderr)
        return 1
    finally:
        for held in lock:
            held.release()
        if meeting is not None:   # (ended before saying whether it would run: the others stop too)
            meeting.leave(wait=not interrupted)
        give_back(taken)


def _main(argv: Optional[List[str]], lock: List["RunLock"], meeting: Optional[Meeting] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = ArgumentParser(prog="dtmt train", add_help=False)
    pre.add_argument("--config", action="append", default=[])
    configs = pre.parse_known_args(argv)[0].config
    if len(configs) > 1:   # (the last one was read, the others ignored without a word)
        print(f"dtmt train: --config given {len(configs)} times ({', '.join(configs)}); give one run "
              f"configuration (the command line's flags override it)", file=sys.stderr)
        return 2
    config = configs[0] if configs else None
    budget_given = False   # the command line gives a step or time budget and no epoch bound
    edits = []   # on --resume, what the run's config.yaml says otherwise than its last.pt (config_edits)
    changes = []   # on --resume, the run's settings this command changes (resume_changes)
    # what this command line itself gives, not a --config file (whose run wrote every setting, read or not)
    typed = command_line_values(build_parser(), argv)
    if config is not None:
        try:
            budget_given = budget_lifts_epochs(typed)
            from_file = config_arguments(config)
            held = from_file[from_file.index("--preset") + 1] if "--preset" in from_file else None
            if held is not None and typed.get("preset", held) != held:   # (a run's config.yaml holds its preset's
                # every value, which override the other preset's: a mixed model labelled with the other preset)
                raise ValueError(f"--preset {typed['preset']}: --config {config} holds the settings of preset "
                                 f"{held}, which would override {typed['preset']}'s; leave out --config, or change "
                                 f"the file's preset and remove the settings it should take from it")
            model = from_file[from_file.index("--model") + 1] if "--model" in from_file else None
            specific = held is not None or "--opt" in from_file   # (settings of the file's model)
            if model is not None and specific and typed.get("model", model) != model:   # (likewise its preset's
                # values and options: a transformer with an RNN's learning rate, schedule and widths, without a word)
                raise ValueError(f"--model {typed['model']}: --config {config} holds the settings of a {model} run "
                                 f"(its preset's and options), which would override {typed['model']}'s; leave out "
                                 f"--config, or change the file's model and remove the settings it should take "
                                 f"from it")
            argv = from_file + argv   # the command line's flags come last: they override
        except ValueError as exc:
            print(f"dtmt train: {one_line(exc)}", file=sys.stderr)
            return 2
    args = build_parser().parse_args(argv)
    if budget_given:   # it replaces the configuration's epoch bound, as it replaces a preset's (resolve_config)
        args.max_epochs = None
    explicit = {k for k, v in vars(args).items() if v is not None and k not in ("opt", "config")}
    try:   # (before the checks below: a mistyped --opt had been a traceback)
        args.typed_opt = list(parse_options(typed.get("opt") or []))
    except ValueError as exc:
        print(f"dtmt train: {one_line(exc)}", file=sys.stderr)
        return 2
    if args.model is None and args.preset in PAPER_ROWS_BY_NAME:   # a paper row names its system
        args.model = PAPER_ROWS_BY_NAME[args.preset].model
    defaults = TrainConfig.defaults()
    for k in ("model", "preset", "vocab_type", "seed"):   # named before the preset is read
        if getattr(args, k) is None:
            setattr(args, k, defaults[k])
    try:
        # everything the command line says is checked here, before any file is read or written
        check_arguments(args)
        if config is not None and args.resume == "" and "out" not in typed and args.out is not None:
            # (a run folder copied with its config.yaml: the file records the original's --out, which --resume then
            # continued, the copy untouched)
            here = os.path.dirname(os.path.abspath(config))
            if os.path.isfile(os.path.join(here, LAST)) and not same_folder(here, os.path.abspath(args.out)):
                raise ValueError(f"--config {config} --resume: the file records the run in {args.out}, not in {here} "
                                 f"where it lies (a copied run folder?); give --out {here} to resume the run there, "
                                 f"or --out {args.out}")
        if args.model not in list_models():
            raise ValueError(f"unknown model {args.model!r}{did_you_mean(args.model, list_models())}; choose one of "
                             f"{list_models()}")
        if args.resume is None:   # (a mistyped preset, named before --out's refusals: an --out holding a run had
            get_preset(args.model, args.preset)   # answered "already holds a checkpoint", the typo unsaid)
        resume_from = None   # the checkpoint --resume names, if it names one
        if args.resume:
            resume_from = os.path.abspath(args.resume)
            if os.path.isdir(resume_from):
                resume_from = os.path.join(resume_from, LAST)
            if args.out is None:
                args.out = os.path.dirname(resume_from)
        args.out = os.path.abspath(args.out or os.path.join("runs", args.model))
        check_output_dir(args.out, "--out")
        inside = binarized.copy_holding(args.data, args.out)
        if inside is not None:   # (the refusal came later, blaming the run's own lock file)
            raise ValueError(f"--out {args.out}: inside --data's binarized copy {inside}, which dtmt prepare "
                             f"rebuilds whole; give a folder outside it")
        if rank() == 0:   # one run per directory (the main process holds it)
            lock.append(RunLock(args.out).acquire())
            # what an interrupted earlier run left (its process gone): in --out, and the corpus' binarized build; not
            # a dtmt prepare's stage, which says the corpus there was being replaced (prepare then takes the folder
            # for a corpus of its own, not the user's files: without it prepare refused, and so did this)
            for folder in (args.out, args.data):   # (--data: only build folders; no file of its is written there)
                for path in remove_stale_temporaries(folder, keep=PREPARE_STAGE, folders_only=folder == args.data,
                                                     files=RUN_FILES if folder == args.out else None):
                    print(f"dtmt train: removed {path} (left by an interrupted run)", file=sys.stderr)
        last = os.path.join(args.out, LAST)
        ckpt = source = dev_warning = None
        fingerprint = binarized.fingerprint(args.data)
        if args.resume is not None:
            source = resume_from or last
            ckpt = read_checkpoint(source)   # (first: what cannot be resumed at all is said before where it may go)
            if "training" not in ckpt:
                raise ValueError(f"{source} has no training state (a run's last.pt has)")
            if resume_from is not None and not (os.path.isfile(last) and os.path.exists(resume_from)
                                                and os.path.samefile(resume_from, last)):   # (not --out's own last.pt)
                here, held = same_folder(os.path.dirname(resume_from), args.out), held_checkpoints(args.out)
                if here and os.path.isfile(last):
                    raise ValueError(f"--resume {resume_from}: continuing it in {args.out} would replace the run's "
                                     f"own last.pt there; give a new --out")
                if not here and held:
                    # (continued elsewhere, the run takes --out as its own: another run's best.pt, step checkpoints
                    # and log there, without a last.pt, were replaced and mixed with this one's, as a new run's were)
                    raise ValueError(f"--out {args.out} already holds a checkpoint of its own "
                                     f"({os.path.basename(held[0])}); continue {resume_from} in a new --out")
            check_best_is_of_the_run(os.path.join(args.out, BEST), source, ckpt)
            check_run_names(args.out)
            for key in ("src_vocab", "tgt_vocab"):   # (the rest is checked against the model: Trainer)
                try:
                    Vocabulary(ckpt[key])
                except (KeyError, RuntimeError, ValueError, TypeError) as exc:
                    raise ValueError(f"{source}: its {key} cannot be read ({one_line(exc)[:200]}); the checkpoint "
                                     f"cannot be resumed") from None
            rngs = ckpt["training"].get("rng", ()) if isinstance(ckpt["training"], dict) else None
            if not isinstance(rngs, (list, tuple)):
                raise ValueError(f"--resume {source}: its training state is malformed; the checkpoint cannot be "
                                 f"resumed")
            if len(rngs) != world_size():   # (before the process group starts: Trainer checks it again, later)
                raise ValueError(f"--resume: the run was trained by {len(rngs)} process(es); continue it with as many "
                                 f"(got {world_size()}): its batches and random streams are split among them")
            cfg = resumed_config(source, ckpt.get("config"))
            edits = [] if config is not None else config_edits(os.path.join(args.out, CONFIG), cfg)
            conflicts = resume_conflicts(args, explicit, cfg)
            if conflicts:
                raise ValueError(f"--resume continues the run in {args.out} with its own settings, but "
                                 + "; ".join(conflicts) + " (start a new run with another --out to change them)")
            recorded = cfg.data_fingerprint or {}   # (a run of before the dev set's SHA-1: the rest compared)
            differ = [k for k in fingerprint if k in recorded and fingerprint[k] != recorded[k]]
            if differ and not args.allow_changed_data:
                raise ValueError(f"--data {args.data} is not the corpus this run was trained on ({', '.join(differ)} "
                                 f"differ); pass --allow-changed-data to continue on it anyway")
            if "dev_sha1" in differ:
                dev_warning = changed_dev_warning(cfg.best_by, ckpt["training"])
            given = resolve_config(args)
            before = cfg.to_dict()
            for k in RESUMABLE:   # how long to go on and how to report may change; the rest is the checkpoint's
                if getattr(args, k) is not None:
                    setattr(cfg, k, getattr(given, k))
            if budget_lifts_epochs(vars(args)):
                cfg.max_epochs = None   # a step or time budget replaces the run's epoch bound, as a preset's
            if args.max_time is not None:
                cfg.max_time_s = given.max_time_s
            changes = resume_changes(before, cfg.to_dict())
        else:
            held = held_checkpoints(args.out)
            if held and not args.overwrite:   # (a best.pt without last.pt: a run killed between the two, or one's
                # own, which it replaced; --resume needs last.pt, so it is offered only where there is one)
                first = os.path.basename(held[0])
                raise ValueError(f"{args.out} already holds a checkpoint ({first}); pass "
                                 + ("--resume to continue it or " if first == LAST else "")
                                 + "--overwrite to start again" + ("" if first == LAST else
                                                                   f" (it has no {LAST} to resume)"))
            check_run_files(args.out)
            cfg = resolve_config(args)
            if cfg.model_options.get("pad_id", PAD) != PAD:
                raise ValueError(f"--opt pad_id={cfg.model_options['pad_id']}: dtmt train pads with the vocabularies' "
                                 f"id {PAD} (SentencePiece's pad); leave pad_id out")
            bound = position_bound(check_model_options(cfg.model, cfg.model_options))
            if bound is not None and cfg.max_len is not None and cfg.max_len + 1 > bound:
                raise ValueError(f"--max-len {cfg.max_len}: {cfg.model} has {bound} positions (its max_len option) "
                                 f"and a pair of --max-len subwords needs {cfg.max_len + 1} with BOS; give --max-len "
                                 f"{bound - 1} or less, or a larger --opt max_len")
        preset_train = None if args.resume is not None else get_preset(args.model, args.preset)["train"]
        schedule_warnings = check_schedule(cfg, explicit, preset_train, set(typed) - {"opt", "config"})
        check_optimizer(cfg, explicit, preset_train)
        # the run lives in --out and reads --data, wherever it was started from before
        cfg.out, cfg.data, cfg.data_fingerprint = args.out, os.path.abspath(args.data), fingerprint
        from dtmt_models.cli.common import check_device_and_backend   # (decoding's modules: only now)

        try:
            check_device_and_backend(resolve_auto(cfg.device), cfg.backend)
        except ValueError as exc:
            if args.resume is not None and (args.device is None or args.backend is None):
                raise ValueError(f"{exc} (the run's setting: --device / --backend choose another)") from None
            raise
        check_cuda_graphs(cfg)
        process_device(cfg.device)   # (before the processes meet: no such device is one process's refusal)
        if meeting is not None:   # (every process's checks have passed, or none starts the process group)
            line = refusal_line(meeting.settle(None), meeting.rank)
            if line is not None:
                raise ValueError(line)
        dist = Dist(cfg.device, meeting)
        check_processes_agree(dist, cfg, ckpt["training"] if ckpt is not None else None)
    except (ValueError, FileNotFoundError, CorpusError) as exc:
        for held in lock:   # nothing written: a directory made for the lock goes too
            held.release(discard=True)
        line = None if isinstance(exc, RefusedByAll) and meeting is not None and meeting.rank else one_line(exc)
        if meeting is not None and not meeting.settled:   # (this process refused: the others are told, and a refusal
            if meeting.rank == 0:                          # they all made is printed once: by process 0, at once)
                print(f"dtmt train: {line}", file=sys.stderr, flush=True)
            try:
                shown = refusal_line(meeting.settle(line), meeting.rank)
            except (ValueError, KeyboardInterrupt) as stop:   # (the wait ended otherwise: this refusal is the news)
                shown = line if meeting.rank else None
                if isinstance(stop, KeyboardInterrupt):
                    if shown is not None:
                        print(f"dtmt train: {shown}", file=sys.stderr)
                    raise
            line = shown if meeting.rank else None
        if line is not None:
            print(f"dtmt train: {line}", file=sys.stderr)
        return 2
    finished = False   # (the run ended in every process alike: their last barrier is met)
    trainer = None
    try:
        earlier = earlier_run_files(cfg.out) if args.resume is None and args.overwrite and dist.main else None
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        tune_malloc()   # freed update memory stays for the next update (DTMT_MALLOC=default: glibc's own)
        # makes --out only once the data and the model are usable
        trainer = Trainer(cfg, dist, ckpt, resumed_from=os.path.dirname(resume_from) if resume_from else None,
                          ckpt_path=source)
        if earlier is not None:
            forget_earlier_run(cfg.out, earlier)
        if dist.main:   # once the corpus and the vocabularies are known to be usable
            if edits:   # (they were replaced without a word)
                print(f"warning: {os.path.join(cfg.out, CONFIG)} differs from the settings in {LAST} "
                      f"({'; '.join(edits)}); --resume continues with {LAST}'s and writes them there: give a change "
                      f"as a flag, or take the file's with --config {os.path.join(cfg.out, CONFIG)} --resume",
                      flush=True)
            if changes:   # (said nowhere before: a run's log showed a changed --valid-every only by its rows)
                print(f"resumed with changed settings: {'; '.join(changes)}", flush=True)
            for line in [*schedule_warnings, threads_warning(cfg.threads), dev_warning]:
                if line:
                    print(line, flush=True)
            with atomic_write(os.path.join(cfg.out, CONFIG)) as f:
                yaml.safe_dump(run_configuration(cfg), f, sort_keys=False, allow_unicode=True)
        code = trainer.run()
        finished = True
        return code
    except (CorpusError, CheckpointError) as exc:   # (before anything was written)
        for held in lock:
            held.release(discard=True)
        print(f"dtmt train: {one_line(exc)}", file=sys.stderr)
        return 2
    except (WriteError, TrainingDiverged, CaptureFailed) as exc:   # a checkpoint, log or figure unwritable (full
        # disk, read-only directory); a loss that became NaN; an update that did not capture (it had been a traceback)
        print(f"dtmt train: {one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:   # a second SIGINT/SIGTERM while saving, or one before training started
        if not getattr(trainer, "started", False):   # (Python's own, the run's handlers not yet there: it said
            return _stopped_before_training(exc, lock)   # "aborted ()" and left the folder it had made)
        print(f"\ndtmt train: aborted ({str(exc) or 'SIGINT'}); the last checkpoint written is "
              f"{os.path.join(cfg.out, LAST)} if it exists", file=sys.stderr)
        return _interrupt_status(exc)
    finally:
        # (after an error in one process the others still train: a barrier waited for them for ever, a full disk
        # in process 0 hung the job; this one ends, and torchrun ends the others)
        dist.close(barrier=finished)


if __name__ == "__main__":
    sys.exit(main())
