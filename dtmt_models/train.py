"""`dtmt train`: trains a system of the registry on a prepared corpus (SPEC §5-6, issue 5).

    dtmt train --data data/bible --model dtmt                      # small CPU preset
    dtmt train --data DIR --model nematus --preset paper --device cuda --opt decoder=bideep
    torchrun --nproc_per_node 4 -m dtmt_models.train --data DIR --model dtmt   # DistributedDataParallel

What a run does, in order:
  1. reads DIR/train and DIR/dev (see `dtmt prepare`), trains one SentencePiece model per side on the training
     side only, segments, and drops pairs longer than --max-len subwords (the count is printed);
  2. trains with Adam, a learning-rate schedule (RNMT+ paper 000 eq. 17, inverse square root paper 003
     eq. 26-27, or constant), label smoothing, the system's dropouts and gradient-norm clipping, on
     token-budget batches bucketed by length and shuffled per epoch with the seed;
  3. every --valid-every updates: validation loss on dev, dev BLEU (greedy by default) and chrF, early stopping
     on dev BLEU with --patience, `best.pt` kept, `last.pt` written (atomically), and with --keep-last N the
     model of each of the last N validations as step_<updates>.pt;
  4. logs to OUT/train_log.csv and draws OUT/learning_curve.png; a progress line shows tokens/s.
SIGINT/SIGTERM finish the current update, save `last.pt` and exit; `--resume` continues from `last.pt` so that
the losses after resuming are exactly those an uninterrupted run would have produced (the batch order, the
random states, the optimizer and the schedule are all restored).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import re
import signal
import sys
import time
from typing import List, Optional, Sequence, Tuple

import torch
import yaml

from .atomic import WriteError, atomic_path, atomic_write
from .batching import collate, token_batches
from .checkpoint import read_checkpoint, save_checkpoint
from .data import CorpusError, corpus_fingerprint, corpus_paths, filter_by_length, read_manifest, read_parallel
from .errors import one_line
from .presets import PAPER_ROWS_BY_NAME, get_preset
from .registry import build_model, check_model_options, list_models
from .schedules import InverseSqrtSchedule, RNMTPlusSchedule
from .vocabulary import Vocabulary

LAST, BEST, LOG, CURVE, CONFIG = "last.pt", "best.pt", "train_log.csv", "learning_curve.png", "config.yaml"
STEP_CHECKPOINT = "step_{:07d}.pt"     # --keep-last: the model at a validation, by its number of updates
LOG_FIELDS = ["kind", "step", "epoch", "elapsed_s", "lr", "loss", "nll", "ppl", "tokens", "tokens_per_s",
              "dev_loss", "dev_ppl", "dev_bleu", "dev_chrf", "best_bleu"]
# training settings that may be changed when resuming (how long to go on, how often to report)
RESUMABLE = ("max_steps", "max_epochs", "max_time", "patience", "valid_every", "valid_beam", "log_every", "progress",
             "threads", "bleu_sentences", "keep_last")
# their defaults (None on the command line means "not given", so that --resume keeps the checkpoint's values)
REPORTING_DEFAULTS = dict(patience=5, valid_every=500, valid_beam=1, bleu_sentences=0, log_every=50, progress="auto",
                          threads=0, keep_last=0)


def step_checkpoints(run_dir: str) -> List[Tuple[int, str]]:
    """The step_<updates>.pt files of a run directory (kept by --keep-last), oldest first, as (updates, path)."""
    found = []
    for name in os.listdir(run_dir):
        m = re.fullmatch(r"step_(\d+)\.pt", name)
        if m:
            found.append((int(m.group(1)), os.path.join(run_dir, name)))
    return sorted(found)


# ------------------------------------------------------------------------------------------- arguments
class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None ("not given": the preset's value, or the checkpoint's on --resume)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dtmt train", description="Train an NMT system on a corpus prepared by `dtmt prepare`.",
        formatter_class=_HelpFormatter)
    p.add_argument("--config", default=None, metavar="YAML",
                   help="a run configuration: the flags below as keys without the dashes (max_time: 30m), model "
                        "options under opt (opt: {depth: 2}); flags given on the command line override it. Every "
                        "run writes its resolved configuration to OUT/config.yaml, which reproduces it")
    p.add_argument("--data", required=True, help="prepared corpus directory (with corpus.json)")
    p.add_argument("--model", default=None, help=f"system: one of {', '.join(list_models())} (default dtmt)")
    p.add_argument("--preset", default=None,
                   help="size/settings preset: small (CPU; the default), paper, or a paper's table row such as "
                        "000-T3-dtmt4 (which also names the model; list them with `dtmt models`)")
    p.add_argument("--out", default=None, help="output directory (default runs/<model>)")
    p.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                   help="model option override, e.g. --opt depth=4 --opt cell=gru (repeatable)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in OUT from OUT/last.pt; a --data holding another corpus, or a model or "
                        "training setting given with a value other than the run's, is an error")
    p.add_argument("--allow-changed-data", action="store_true",
                   help="with --resume: continue on a --data whose corpus differs from the run's")
    p.add_argument("--overwrite", action="store_true", help="start afresh even if OUT has a checkpoint")
    g = p.add_argument_group("training (defaults come from the preset)")
    g.add_argument("--lr", type=float, default=None, help="base learning rate")
    g.add_argument("--schedule", choices=("rnmt", "inverse-sqrt", "constant"), default=None)
    g.add_argument("--warmup", type=int, default=None, help="warm-up updates")
    g.add_argument("--decay-start", type=int, default=None, help="RNMT+ schedule: decay start s")
    g.add_argument("--decay-end", type=int, default=None, help="RNMT+ schedule: decay end e")
    g.add_argument("--replicas", type=int, default=None,
                   help="n of the schedules (RNMT+ eq. 17: concurrent replicas; inverse-sqrt: num_gpu) "
                        "(default: the number of processes)")
    g.add_argument("--smoothing", type=float, default=None, help="label smoothing")
    g.add_argument("--clip", type=float, default=None, help="gradient-norm clipping (0: off)")
    g.add_argument("--max-tokens", type=int, default=None, help="token budget per batch (per process)")
    g.add_argument("--vocab-size", type=int, default=None, help="SentencePiece size per side")
    g.add_argument("--vocab-type", choices=("bpe", "unigram"), default=None, help="SentencePiece model (default bpe)")
    g.add_argument("--max-len", type=int, default=None, help="drop training pairs longer than this (subwords)")
    g.add_argument("--seed", type=int, default=None, help="random seed (default 1)")
    s = p.add_argument_group("stopping and reporting")
    s.add_argument("--max-epochs", type=int, default=None,
                   help="stop after this many epochs (default: the preset's, 6 for small, unless --max-steps or "
                        "--max-time is given)")
    s.add_argument("--max-steps", type=int, default=None, help="stop after this many updates")
    s.add_argument("--max-time", default=None, help="stop after this much training time, e.g. 90s, 30m, 2h")
    s.add_argument("--patience", type=int, default=None, help="stop after this many validations without a better "
                                                              "dev score (0: never; default 5)")
    s.add_argument("--valid-every", type=int, default=None, help="validate every N updates (and at the end; default 500)")
    s.add_argument("--valid-beam", type=int, default=None, help="beam for dev BLEU (default 1: greedy)")
    s.add_argument("--bleu-sentences", type=int, default=None, help="dev sentences translated for BLEU (default 0: all)")
    s.add_argument("--log-every", type=int, default=None, help="write a training row every N updates (default 50)")
    s.add_argument("--keep-last", type=int, default=None, metavar="N",
                   help="also keep the model of each of the last N validations, as step_UPDATES.pt (default 0: none), "
                        "e.g. for checkpoint averaging")
    s.add_argument("--progress", choices=("auto", "bar", "lines", "none"), default=None,
                   help="progress display (default auto: a live bar on a terminal, else lines every --log-every updates)")
    d = p.add_argument_group("device")
    d.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    d.add_argument("--backend", default="auto", help="recurrent kernels: auto, cpp, reference, triton, cuda")
    d.add_argument("--threads", type=int, default=None, help="CPU threads (default 0: torch's default)")
    return p


# defaults of the flags whose parser default is None, so that a value given on the command line can be told
# from the default (--resume compares the given ones with the run's)
CLI_DEFAULTS = dict(model="dtmt", preset="small", vocab_type="bpe", seed=1)
# the settings that make a run what it is: on --resume a value given for one of them must equal the run's
FIXED_ON_RESUME = ("model", "preset", "lr", "schedule", "warmup", "decay_start", "decay_end", "replicas",
                   "smoothing", "clip", "max_tokens", "vocab_size", "vocab_type", "max_len", "seed")


def check_arguments(args: argparse.Namespace) -> None:
    """Every numeric flag in its range, before any work (ValueError, one line naming flag, value and range)."""
    def need(ok: bool, flag: str, allowed: str) -> None:
        if not ok:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be {allowed}")

    for flag in ("max_steps", "max_epochs", "valid_every", "log_every", "max_tokens", "max_len", "valid_beam",
                 "replicas"):
        if getattr(args, flag) is not None:
            need(getattr(args, flag) >= 1, flag, "an integer >= 1")
    for flag in ("warmup", "decay_start", "decay_end", "patience", "bleu_sentences", "threads", "keep_last"):
        if getattr(args, flag) is not None:
            need(getattr(args, flag) >= 0, flag, "an integer >= 0")
    if args.vocab_size is not None:
        need(args.vocab_size >= 8, "vocab_size", "an integer >= 8 (4 special pieces + at least the characters)")
    if args.lr is not None:
        need(0 < args.lr < math.inf, "lr", "a finite number > 0")
    if args.smoothing is not None:
        need(0 <= args.smoothing < 1, "smoothing", "in [0, 1)")
    if args.clip is not None:
        need(0 <= args.clip < math.inf, "clip", "a finite number >= 0 (0: off)")
    seconds = parse_duration(args.max_time)
    if seconds is not None and not 0 < seconds < math.inf:
        raise ValueError(f"--max-time {args.max_time}: must be a finite duration > 0, e.g. 90s, 30m or 2h")
    if args.allow_changed_data and not args.resume:
        raise ValueError("--allow-changed-data applies to --resume only")


def resume_conflicts(args: argparse.Namespace, explicit: set, run: dict) -> List[str]:
    """The settings given on the command line with values other than those of the run being resumed."""
    given = resolve_config(args)
    out = [f"--{k.replace('_', '-')} {given[k]} (the run's is {run.get(k)})"
           for k in FIXED_ON_RESUME if k in explicit and given[k] != run.get(k)]
    missing = object()
    for k, v in parse_options(args.opt).items():
        if run["model_options"].get(k, missing) != v:
            out.append(f"--opt {k}={v} (the run's is {run['model_options'].get(k, 'unset')})")
    return out


# flags a run configuration does not hold: what to do with OUT this time, and the file itself
NOT_IN_CONFIG = ("config", "resume", "overwrite", "allow_changed_data")


def _flags(parser: argparse.ArgumentParser) -> dict:
    """dest -> long flag of the parser's options (help excluded)."""
    return {a.dest: a.option_strings[-1] for a in parser._actions if a.option_strings and a.dest != "help"}


def config_arguments(path: str) -> List[str]:
    """The command-line arguments that the run configuration `path` stands for (YAML: `dtmt train` flags without
    their dashes as keys, model options as the mapping `opt`), to go before the command line's own, which override
    them. ValueError (one line naming the file) for an unreadable file, a key that is no flag, or a value the flag
    does not take."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ValueError(f"--config {path}: cannot read it ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"--config {path}: not valid YAML ({one_line(exc)})") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of option: value, got a {type(data).__name__}")
    flags = _flags(build_parser())
    argv = []
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest not in flags or dest in NOT_IN_CONFIG:
            raise ValueError(f"--config {path}: unknown option {key!r} (the keys are `dtmt train` flags without the "
                             f"dashes, e.g. max_time, and opt for the model options)")
        if value is None:
            continue
        if dest == "opt":
            if not isinstance(value, dict):
                raise ValueError(f"--config {path}: opt must be a mapping of model option: value, e.g. "
                                 f"opt: {{depth: 2}}")
            argv += [a for k, v in value.items() for a in ("--opt", f"{k}={json.dumps(v)}")]
        elif isinstance(value, (dict, list, bool)):
            raise ValueError(f"--config {path}: {key} takes one {'number or word' if dest != 'data' else 'path'}, "
                             f"got {value!r}")
        else:
            argv += [flags[dest], str(value)]
    check = build_parser()

    def fail(message):
        raise ValueError(f"--config {path}: {message}")

    check.error = fail   # argparse's own checks of types and choices, naming the file
    check.parse_args(argv if "data" in data else [*argv, "--data", "."])
    return argv


def run_configuration(cfg: dict) -> dict:
    """The resolved configuration of a run as `--config` reads it (what config.yaml holds)."""
    out = {k: cfg[k] for k in _flags(build_parser()) if k not in NOT_IN_CONFIG and k != "opt"
           and cfg.get(k) is not None}
    out["opt"] = dict(cfg["model_options"])
    return out


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
    out = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--opt expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        try:
            out[k.strip()] = json.loads(v)
        except json.JSONDecodeError:
            out[k.strip()] = {"true": True, "false": False, "none": None}.get(v.lower(), v)
    return out


def resolve_config(args: argparse.Namespace) -> dict:
    """The full run configuration: preset, then explicit command-line values."""
    preset = get_preset(args.model, args.preset)
    train = dict(preset["train"])
    for k in ("lr", "schedule", "warmup", "decay_start", "decay_end", "replicas", "smoothing", "clip", "max_tokens",
              "vocab_size", "max_len"):
        v = getattr(args, k)
        if v is not None:
            train[k] = v
    if args.max_epochs is None and (args.max_steps is not None or args.max_time is not None):
        train["max_epochs"] = None      # an explicit step or time budget replaces the preset's epoch bound
    elif args.max_epochs is not None:
        train["max_epochs"] = args.max_epochs
    model_options = {**preset["model"], **parse_options(args.opt)}
    model_options.pop("backend", None)
    cfg = dict(vars(args))
    cfg.pop("opt")
    for k, v in REPORTING_DEFAULTS.items():
        if cfg[k] is None:
            cfg[k] = v
    cfg.update(train)
    cfg["model_options"] = model_options
    cfg["max_time_s"] = parse_duration(args.max_time)
    return cfg


# ---------------------------------------------------------------------------------------- distribution
class Dist:
    """Process-group bookkeeping; a single process is rank 0 of 1 and every collective is a no-op."""

    def __init__(self, device_arg: str):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if device_arg == "auto":
            device_arg = "cuda" if torch.cuda.is_available() else "cpu"
        if device_arg == "cuda" and self.world > 1:
            device_arg = f"cuda:{local}"
        self.device = torch.device(device_arg)
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError("--device cuda: no CUDA device is available")
            if self.device.index is None:   # "cuda": the current device, named (set_device needs an index)
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        if self.world > 1:
            import torch.distributed as td

            td.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
            self.td = td

    @property
    def main(self) -> bool:
        return self.rank == 0

    def broadcast(self, obj):
        if self.world == 1:
            return obj
        box = [obj]
        self.td.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj) -> list:
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        self.td.all_gather_object(out, obj)
        return out

    def sum(self, values: List[float]) -> List[float]:
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        self.td.all_reduce(t)
        return t.tolist()

    def close(self):
        if self.world > 1 and self.td.is_initialized():
            self.td.destroy_process_group()


# ---------------------------------------------------------------------------------------------- output
class Progress:
    """A one-line live display on a terminal, or plain lines every `log_every` updates."""

    def __init__(self, mode: str, enabled: bool):
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        self.mode = mode if enabled else "none"
        self.width = 0

    def update(self, text: str, logged: bool) -> None:
        if self.mode == "bar":
            sys.stderr.write("\r" + text.ljust(self.width))
            sys.stderr.flush()
            self.width = len(text)
        elif self.mode == "lines" and logged:
            print(text, flush=True)

    def message(self, text: str) -> None:
        if self.mode == "bar" and self.width:
            sys.stderr.write("\n")
            self.width = 0
        if self.mode != "none":
            print(text, flush=True)


def format_time(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class CsvLog:
    """train_log.csv; on resume, rows after the checkpoint's step are dropped first (they will be redone)."""

    def __init__(self, path: str, resume_step: Optional[int]):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        rows = []
        if resume_step is not None and os.path.isfile(path):
            with open(path, newline="") as f:
                rows = [r for r in csv.DictReader(f) if int(r["step"]) <= resume_step]
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, LOG_FIELDS)
            w.writeheader()
            w.writerows(rows)
        self.rows = rows

    def write(self, **row) -> None:
        row = {k: ("" if row.get(k) is None else row[k]) for k in LOG_FIELDS}
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, LOG_FIELDS).writerow(row)
        self.rows.append({k: str(v) for k, v in row.items()})


def plot_curve(rows: List[dict], path: str, title: str) -> Optional[str]:
    """Training and dev loss against updates, dev BLEU on a second axis. None when matplotlib is absent."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    tr = [(int(r["step"]), float(r["loss"])) for r in rows if r["kind"] == "train" and r["loss"] != ""]
    dv = [(int(r["step"]), float(r["dev_loss"])) for r in rows if r["kind"] == "valid" and r["dev_loss"] != ""]
    bl = [(int(r["step"]), float(r["dev_bleu"])) for r in rows if r["kind"] == "valid" and r["dev_bleu"] != ""]
    fig, ax = plt.subplots(figsize=(7, 4))
    if tr:
        ax.plot(*zip(*tr), label="train loss (smoothed CE / token)", lw=1)
    if dv:
        ax.plot(*zip(*dv), "o-", label="dev loss (NLL / token)")
    ax.set_xlabel("updates")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    lines, labels = ax.get_legend_handles_labels()
    if bl:
        ax2 = ax.twinx()
        ax2.plot(*zip(*bl), "s-", color="tab:green", label="dev BLEU")
        ax2.set_ylabel("BLEU")
        l2, lab2 = ax2.get_legend_handles_labels()
        lines, labels = lines + l2, labels + lab2
    ax.legend(lines, labels, loc="upper right", fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    try:
        with atomic_path(path, ".png") as tmp:
            fig.savefig(tmp, dpi=110)
    finally:
        plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------- trainer
@torch.no_grad()
def corpus_nll(model: torch.nn.Module, pairs: Sequence[Tuple[List[int], List[int]]], max_tokens: int,
               device=None) -> Tuple[float, int]:
    """(NLL per target token, number of target tokens) of id pairs under `model` in eval mode, no smoothing:
    the dev loss of a validation."""
    model.eval()
    total, count = 0.0, 0
    for batch in token_batches([(len(s), len(t)) for s, t in pairs], max_tokens, shuffle=False):
        src, src_len, prev, target = collate([pairs[i] for i in batch], device)
        _, nll, n = model(src, src_len, prev, target=target)
        total, count = total + float(nll), count + n
    return total / max(count, 1), count


def build_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """Adam with β = (0.9, 0.998), ε = 1e-9, in torch's default (foreach) implementation: its steps bump the
    parameters' version counters, which the inference weight caches are keyed on (`fused=True` does not: see
    benchmarks/NOTES.md, log item 19, and `tests/test_train.py::test_inference_sees_the_optimizer_steps`)."""
    return torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.998), eps=1e-9)


class Trainer:
    def __init__(self, cfg: dict, dist: Dist, ckpt: Optional[dict] = None):
        self.cfg, self.dist, self.device = cfg, dist, dist.device
        self.out = cfg["out"]
        self.progress = Progress(cfg["progress"], dist.main)
        self.stop_reason: Optional[str] = None
        self.log = self.progress.message
        # ---- data and vocabularies
        manifest = read_manifest(cfg["data"])
        self.langs = (manifest["src_lang"], manifest["tgt_lang"])
        train_pairs = read_parallel(*corpus_paths(cfg["data"], "train"))
        try:
            self.dev_pairs = read_parallel(*corpus_paths(cfg["data"], "dev"))
        except CorpusError:
            self.dev_pairs = []
            self.log(f"note: {cfg['data']} has no dev split: no validation, no early stopping, no best.pt")
        if ckpt is not None:
            protos = (ckpt["src_vocab"], ckpt["tgt_vocab"])
        else:
            protos = None
            if dist.main:
                t0 = time.time()
                try:
                    protos = tuple(Vocabulary.train([p[i] for p in train_pairs], cfg["vocab_size"],
                                                    cfg["vocab_type"]).proto for i in (0, 1))
                except RuntimeError as exc:   # SentencePiece: e.g. fewer pieces than the corpus has characters
                    raise CorpusError(f"--vocab-size {cfg['vocab_size']}: SentencePiece cannot build a vocabulary "
                                      f"of that size from {cfg['data']} ({one_line(exc)})") from None
                self.log(f"vocabularies: SentencePiece {cfg['vocab_type']} trained on {len(train_pairs):,} training "
                         f"pairs in {time.time() - t0:.1f}s")
            protos = dist.broadcast(protos)
        self.src_vocab, self.tgt_vocab = Vocabulary(protos[0]), Vocabulary(protos[1])
        encoded = [(self.src_vocab.encode(s), self.tgt_vocab.encode(t)) for s, t in train_pairs]
        self.train_ids, dropped = filter_by_length(encoded, cfg["max_len"])
        empty = sum(1 for s, t in self.train_ids if not s or not t)
        self.train_ids = [p for p in self.train_ids if p[0] and p[1]]
        self.lengths = [(len(s), len(t)) for s, t in self.train_ids]
        self.dev_ids = [(self.src_vocab.encode(s), self.tgt_vocab.encode(t)) for s, t in self.dev_pairs]
        self.dev_ids = [p for p in self.dev_ids if p[0]]
        self.log(f"data: {len(self.train_ids):,} training pairs ({dropped:,} longer than {cfg['max_len']} subwords "
                 f"dropped{f', {empty} empty after segmentation dropped' if empty else ''}); {len(self.dev_pairs):,} "
                 f"dev pairs; vocabularies {len(self.src_vocab):,} / {len(self.tgt_vocab):,}")
        if not self.train_ids:
            raise CorpusError("no training pairs left after length filtering; raise --max-len")
        # ---- model, optimizer, schedule
        torch.manual_seed(cfg["seed"])
        self.model = build_model(cfg["model"], len(self.src_vocab), len(self.tgt_vocab), **cfg["model_options"])
        if cfg["backend"] != "auto":
            if not hasattr(self.model, "set_backend"):
                raise ValueError(f"--backend: {cfg['model']} has no fused recurrent layers")
            self.model.set_backend(cfg["backend"])
        self.model.to(self.device)
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.optimizer = build_optimizer(self.model, cfg["lr"])
        self.replicas = cfg.get("replicas") or dist.world   # the schedules' n: the processes, unless given
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._schedule())
        self.net = self.model
        if dist.world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.net = DDP(self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        # ---- position
        self.step, self.epoch, self.batch_index, self.elapsed = 0, 0, 0, 0.0
        self.best_bleu, self.best_loss, self.bad_validations = -1.0, math.inf, 0
        torch.manual_seed(cfg["seed"] * 7919 + 1 + dist.rank)   # dropout streams differ per process
        if ckpt is not None:
            self._restore(ckpt)
        self.csv = CsvLog(os.path.join(self.out, LOG), self.step if ckpt is not None else None) if dist.main else None

    # -------------------------------------------------------------------------------------------- setup
    def _schedule(self):
        c = self.cfg
        n = self.replicas
        if c["schedule"] == "rnmt":
            return RNMTPlusSchedule(c["warmup"], c["decay_start"], c["decay_end"], n=n, floor=0.05)
        if c["schedule"] == "inverse-sqrt":
            dim = c["model_options"].get("embed_dim", c["model_options"].get("hidden_size", 256))
            return InverseSqrtSchedule(dim, c["warmup"], num_gpu=n)
        if c["schedule"] == "constant":
            return lambda step: 1.0
        raise ValueError(f"unknown schedule {c['schedule']!r}")

    def _restore(self, ckpt: dict) -> None:
        self.model.load_state_dict(ckpt["model"])
        t = ckpt["training"]
        self.optimizer.load_state_dict(t["optimizer"])
        self.scheduler.load_state_dict(t["scheduler"])
        self.step, self.epoch, self.batch_index, self.elapsed = t["step"], t["epoch"], t["batch_index"], t["elapsed"]
        self.best_bleu, self.best_loss, self.bad_validations = t["best_bleu"], t["best_loss"], t["bad_validations"]
        rngs = t["rng"]
        if len(rngs) != self.dist.world:
            raise ValueError(f"the checkpoint was written by {len(rngs)} process(es); resume with the same number "
                             f"(got {self.dist.world}) for an exact continuation")
        mine = rngs[self.dist.rank]
        torch.set_rng_state(mine["torch"])
        random.setstate(mine["python"])
        if mine.get("cuda") is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(mine["cuda"], self.device)
        self.log(f"resumed from step {self.step:,} (epoch {self.epoch + 1}, batch {self.batch_index})")

    def payload(self, full: bool) -> dict:
        c = self.cfg
        p = {"model_name": c["model"], "model_options": c["model_options"], "src_vocab": self.src_vocab.proto,
             "tgt_vocab": self.tgt_vocab.proto, "model": self.model.state_dict(), "langs": self.langs,
             "config": c, "step": self.step}
        if full:
            rng = {"torch": torch.get_rng_state(), "python": random.getstate(),
                   "cuda": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None}
            p["training"] = {
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "step": self.step, "epoch": self.epoch, "batch_index": self.batch_index, "elapsed": self.elapsed,
                "best_bleu": self.best_bleu, "best_loss": self.best_loss, "bad_validations": self.bad_validations,
                "rng": self.dist.gather(rng)}
        return p

    def check_sync(self) -> Optional[str]:
        """With several processes: the SHA-1 of every process's parameters must agree (DDP keeps them equal);
        a difference is an error. Returns the digest."""
        if self.dist.world == 1:
            return None
        import hashlib

        h = hashlib.sha1()
        for p in self.model.parameters():
            h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        digests = self.dist.gather(h.hexdigest())
        if len(set(digests)) != 1:
            raise RuntimeError(f"processes out of sync at step {self.step}: parameter digests {digests}")
        return digests[0]

    def save_last(self) -> None:
        payload = self.payload(full=True)     # every rank takes part in gathering the random states
        if self.dist.main:
            save_checkpoint(os.path.join(self.out, LAST), payload)

    # ---------------------------------------------------------------------------------------- training
    def epoch_batches(self) -> List[List[int]]:
        batches = token_batches(self.lengths, self.cfg["max_tokens"], seed=self.cfg["seed"], epoch=self.epoch)
        w = self.dist.world
        if w > 1:   # every process takes the same number of batches: the last (len % w) of the epoch are skipped
            batches = batches[:len(batches) - len(batches) % w][self.dist.rank::w]
        return batches

    def train_step(self, batch: List[int]) -> Tuple[float, float, float]:
        self.net.train()
        src, lengths, prev, target = collate([self.train_ids[i] for i in batch], self.device)
        loss_sum, nll_sum, ntok = self.net(src, lengths, prev, target=target, smoothing=self.cfg["smoothing"])
        self.optimizer.zero_grad(set_to_none=True)
        (loss_sum / ntok).backward()
        if self.cfg["clip"] and self.cfg["clip"] > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg["clip"])
        self.optimizer.step()
        self.scheduler.step()
        return float(loss_sum.detach()), float(nll_sum.detach()), float(ntok)

    def should_stop(self) -> Optional[str]:
        c = self.cfg
        if c["max_steps"] is not None and self.step >= c["max_steps"]:
            return f"reached --max-steps {c['max_steps']}"
        if c["max_time_s"] is not None and self.elapsed >= c["max_time_s"]:
            return f"reached --max-time {c['max_time']}"
        if c["max_epochs"] is not None and self.epoch >= c["max_epochs"]:
            return f"reached --max-epochs {c['max_epochs']}"
        return None

    def run(self) -> int:
        c = self.cfg
        if self.dist.main:
            self.log(f"model {c['model']} ({c['preset']} preset): {self.n_params:,} parameters; options "
                     f"{c['model_options']}; device {self.device}, backend {c['backend']}, {self.dist.world} "
                     f"process(es); schedule {c['schedule']} (n = {self.replicas}); output {self.out}")
        handlers = self._install_signals()
        window = [0.0, 0.0, 0.0]
        window_time, last_validated = 0.0, self.step
        try:
            while self.stop_reason is None:
                self.stop_reason = self.should_stop()
                if self.stop_reason:
                    break
                batches = self.epoch_batches()
                while self.batch_index < len(batches):
                    t0 = time.perf_counter()
                    loss, nll, ntok = self.train_step(batches[self.batch_index])
                    self.batch_index += 1
                    self.step += 1
                    local_stop = 1.0 if self._signal else 0.0
                    loss, nll, ntok, stop = self.dist.sum([loss, nll, ntok, local_stop])
                    dt = time.perf_counter() - t0
                    self.elapsed += dt
                    window = [window[0] + loss, window[1] + nll, window[2] + ntok]
                    window_time += dt
                    logged = self.step % c["log_every"] == 0
                    text = (f"epoch {self.epoch + 1} step {self.step:,} loss {loss / ntok:.3f} "
                            f"lr {self.scheduler.get_last_lr()[0]:.2e} {window[2] / max(window_time, 1e-9):,.0f} tok/s "
                            f"time {format_time(self.elapsed)}")
                    self.progress.update(text, logged)
                    if logged:
                        if self.csv:
                            self.csv.write(kind="train", step=self.step, epoch=self.epoch + 1,
                                           elapsed_s=f"{self.elapsed:.1f}", lr=self.scheduler.get_last_lr()[0],
                                           loss=repr(window[0] / window[2]), nll=repr(window[1] / window[2]),
                                           ppl=f"{math.exp(min(window[1] / window[2], 50)):.2f}",
                                           tokens=int(window[2]), tokens_per_s=f"{window[2] / window_time:.0f}")
                        window, window_time = [0.0, 0.0, 0.0], 0.0
                    if stop:
                        self.stop_reason = f"interrupted by {self._signal or 'a signal in another process'}"
                        break
                    if self.step % c["valid_every"] == 0:
                        last_validated = self.step
                        if self.validate():
                            break
                    self.stop_reason = self.should_stop()
                    if self.stop_reason:
                        break
                else:
                    self.epoch += 1
                    self.batch_index = 0
            if self.step != last_validated and not self._signal and self.dev_ids:
                self.validate()
            self.save_last()
            digest = self.check_sync()
            if digest and self.dist.main:
                self.log(f"{self.dist.world} processes in sync at step {self.step}: parameters sha1 {digest[:12]}")
        finally:
            self._restore_signals(handlers)
        if self.dist.main:
            self.log(f"stopped: {self.stop_reason}. {self.step:,} updates, {format_time(self.elapsed)} of training; "
                     f"best dev BLEU {max(self.best_bleu, 0):.2f}. Checkpoints: {os.path.join(self.out, LAST)}"
                     + (f", {os.path.join(self.out, BEST)}" if os.path.isfile(os.path.join(self.out, BEST)) else ""))
            if self._signal:
                self.log(f"resume with: dtmt train --data {c['data']} --model {c['model']} --out {self.out} --resume")
        return 130 if self._signal == "SIGINT" else 143 if self._signal == "SIGTERM" else 0

    # -------------------------------------------------------------------------------------- validation
    def dev_loss(self) -> Tuple[float, int]:
        return corpus_nll(self.model, self.dev_ids, self.cfg["max_tokens"], self.device)

    def validate(self) -> bool:
        """Dev loss, BLEU and chrF on the main process, best.pt and last.pt; returns True to stop early."""
        decision = None
        if self.dist.main and self.dev_ids:
            from .evaluate import corpus_scores
            from .translate import translate_best

            t0 = time.perf_counter()
            loss, _ = self.dev_loss()
            n = self.cfg["bleu_sentences"] or len(self.dev_pairs)
            sources = [s for s, _ in self.dev_pairs[:n]]
            refs = [t for _, t in self.dev_pairs[:n]]
            hyps = translate_best(self.model, self.src_vocab, self.tgt_vocab, sources, beam=self.cfg["valid_beam"],
                                  alpha=0.6, device=self.device)
            scores = corpus_scores(hyps, refs)
            bleu, chrf = scores["bleu"], scores["chrf"]
            improved = bleu > self.best_bleu or (bleu == self.best_bleu and loss < self.best_loss)
            if improved:
                self.best_bleu, self.best_loss, self.bad_validations = bleu, min(loss, self.best_loss), 0
                save_checkpoint(os.path.join(self.out, BEST), self.payload(full=False))
            else:
                self.bad_validations += 1
            if self.cfg.get("keep_last"):
                self.keep_step_checkpoint()
            self.csv.write(kind="valid", step=self.step, epoch=self.epoch + 1, elapsed_s=f"{self.elapsed:.1f}",
                           lr=self.scheduler.get_last_lr()[0], dev_loss=repr(loss),
                           dev_ppl=f"{math.exp(min(loss, 50)):.2f}", dev_bleu=f"{bleu:.2f}", dev_chrf=f"{chrf:.2f}",
                           best_bleu=f"{self.best_bleu:.2f}")
            plot_curve(self.csv.rows, os.path.join(self.out, CURVE), f"{self.cfg['model']} on {self.cfg['data']}")
            p = self.cfg["patience"]
            stop = bool(p) and self.bad_validations >= p
            self.log(f"step {self.step:,}: dev loss {loss:.3f} (ppl {math.exp(min(loss, 50)):.1f}), BLEU {bleu:.2f}, "
                     f"chrF {chrf:.2f}{' (best)' if improved else f' (best {self.best_bleu:.2f})'}; "
                     f"{time.perf_counter() - t0:.0f}s")
            decision = (stop, self.best_bleu, self.best_loss, self.bad_validations)
        decision = self.dist.broadcast(decision)
        self.save_last()
        if decision is None:
            return False
        stop, self.best_bleu, self.best_loss, self.bad_validations = decision
        if stop:
            self.stop_reason = f"no better dev BLEU in {self.cfg['patience']} validations (early stopping)"
        return stop

    def keep_step_checkpoint(self) -> None:
        """step_<updates>.pt for this validation; the oldest beyond --keep-last are removed."""
        save_checkpoint(os.path.join(self.out, STEP_CHECKPOINT.format(self.step)), self.payload(full=False))
        kept = step_checkpoints(self.out)
        for _, path in kept[:max(len(kept) - self.cfg["keep_last"], 0)]:
            os.remove(path)

    # ----------------------------------------------------------------------------------------- signals
    _signal: Optional[str] = None

    def _install_signals(self):
        def handler(signum, frame):
            name = signal.Signals(signum).name
            if self._signal:                      # a second signal: stop now
                raise KeyboardInterrupt(name)
            self._signal = name
            self.progress.message(f"{name}: finishing this update and saving {os.path.join(self.out, LAST)} "
                                  f"(again to abort without saving)")
        old = {}
        for s in (signal.SIGINT, signal.SIGTERM):
            try:
                old[s] = signal.signal(s, handler)
            except ValueError:   # not the main thread
                pass
        return old

    @staticmethod
    def _restore_signals(old) -> None:
        for s, h in old.items():
            signal.signal(s, h)


# ------------------------------------------------------------------------------------------------ main
def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    config = pre.parse_known_args(argv)[0].config
    if config is not None:
        try:
            argv = config_arguments(config) + argv   # the command line's flags come last: they override
        except ValueError as exc:
            print(f"dtmt train: {exc}", file=sys.stderr)
            return 2
    args = build_parser().parse_args(argv)
    explicit = {k for k, v in vars(args).items() if v is not None and k not in ("opt", "config")}
    if args.model is None and args.preset in PAPER_ROWS_BY_NAME:   # a paper row names its system
        args.model = PAPER_ROWS_BY_NAME[args.preset].model
    for k, v in CLI_DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    try:
        # everything the command line says is checked here, before any file is read or written
        check_arguments(args)
        if args.model not in list_models():
            raise ValueError(f"unknown model {args.model!r}; choose one of {list_models()}")
        args.out = os.path.abspath(args.out or os.path.join("runs", args.model))
        last = os.path.join(args.out, LAST)
        ckpt = None
        fingerprint = corpus_fingerprint(args.data)
        if args.resume:
            ckpt = read_checkpoint(last)
            if "training" not in ckpt:
                raise ValueError(f"{last} has no training state")
            cfg = dict(ckpt["config"])
            conflicts = resume_conflicts(args, explicit, cfg)
            if conflicts:
                raise ValueError(f"--resume continues the run in {args.out} with its own settings, but "
                                 + "; ".join(conflicts) + " (start a new run with another --out to change them)")
            recorded = cfg.get("data_fingerprint")
            if recorded is not None and recorded != fingerprint and not args.allow_changed_data:
                differ = [k for k in fingerprint if fingerprint[k] != recorded.get(k)]
                raise ValueError(f"--data {args.data} is not the corpus this run was trained on ({', '.join(differ)} "
                                 f"differ); pass --allow-changed-data to continue on it anyway")
            given = resolve_config(args)
            for k in RESUMABLE:   # how long to go on and how to report may change; the rest is the checkpoint's
                if getattr(args, k) is not None:
                    cfg[k] = given[k]
            if args.max_time is not None:
                cfg["max_time_s"] = given["max_time_s"]
        else:
            if os.path.isfile(last) and not args.overwrite:
                raise ValueError(f"{args.out} already holds a checkpoint; pass --resume to continue it or "
                                 f"--overwrite to start again")
            cfg = resolve_config(args)
            check_model_options(cfg["model"], cfg["model_options"])
        # the run lives in --out and reads --data, wherever it was started from before
        cfg.update(out=args.out, data=os.path.abspath(args.data), data_fingerprint=fingerprint)
        dist = Dist(cfg["device"])
    except (ValueError, FileNotFoundError, CorpusError) as exc:
        print(f"dtmt train: {exc}", file=sys.stderr)
        return 2
    try:
        if cfg["threads"]:
            torch.set_num_threads(cfg["threads"])
        trainer = Trainer(cfg, dist, ckpt)   # makes --out only once the data and the model are usable
        if dist.main:   # once the corpus and the vocabularies are known to be usable
            with atomic_write(os.path.join(cfg["out"], CONFIG)) as f:
                yaml.safe_dump(run_configuration(cfg), f, sort_keys=False, allow_unicode=True)
        return trainer.run()
    except CorpusError as exc:
        print(f"dtmt train: {exc}", file=sys.stderr)
        return 2
    except WriteError as exc:   # a checkpoint, log or figure: full disk, read-only directory
        print(f"dtmt train: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:   # a second SIGINT/SIGTERM while saving, or one before training started
        print(f"\ndtmt train: aborted ({exc or 'SIGINT'}); the last checkpoint written is "
              f"{os.path.join(cfg['out'], LAST)} if it exists", file=sys.stderr)
        return 130
    finally:
        dist.close()


if __name__ == "__main__":
    sys.exit(main())
