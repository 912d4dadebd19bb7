"""The trainer behind `dtmt train` (dtmt_models/cli/train.py): trains a system of the registry on a prepared
corpus (contract §5-6).

    dtmt train --data data/bible --model dtmt                      # small CPU preset
    dtmt train --data DIR --model nematus --preset paper --device cuda --opt decoder=bideep
    torchrun --nproc_per_node 4 -m dtmt_models.cli.train --data DIR --model dtmt   # DistributedDataParallel

What a run does, in order:
  1. opens the binarized corpus of DIR for --vocab-type/--vocab-size (dtmt_models.data.binarized: `dtmt prepare`
     writes it; a run that finds none builds it once), whose SentencePiece models were trained on the training
     side only; the token ids stay on disk and each batch's are read when it is trained on; pairs longer than
     --max-len subwords are left out (the count is printed);
  2. trains with Adam (or Adadelta: paper 001), a learning-rate schedule (RNMT+ paper 000 eq. 17, inverse square
     root paper 003 eq. 26-27, halved each epoch paper 004, or constant), label smoothing, the system's dropouts
     and gradient-norm clipping, on token-budget batches bucketed by length and shuffled per epoch with the seed;
  3. every --valid-every updates: validation loss on dev, dev BLEU (greedy by default) and chrF; `best.pt` is
     the model of the lowest dev loss (--best-by bleu: of the highest dev BLEU), and --patience validations
     without a better one stop the run; `last.pt` written (atomically), and with --keep-last N the model of each
     of the last N validations as step_<updates>.pt;
  4. logs to OUT/train_log.csv (a train row every --log-every updates and at the end, each the mean over the
     updates since the last) and draws OUT/learning_curve.png; a progress line shows tokens/s.
SIGINT/SIGTERM finish the current update, save `last.pt` and exit; `--resume` continues from `last.pt` so that
the losses after resuming are exactly those an uninterrupted run would have produced (the batch order, the
random states, the optimizer, the schedule and the log window in progress are all restored); a run that had
stopped early stays stopped unless --patience is raised.
"""
from __future__ import annotations

import contextlib
import csv
import math
import os
import random
import re
import shutil
import signal
import sys
import threading
import time
from typing import List, Optional, Sequence, Set, Tuple

import torch

import dtmt_models
from dtmt_models.atomic import WriteError, atomic_write
from dtmt_models.data import binarized
from dtmt_models.data.batching import Batches, collate, kept_indices, length_dtype, token_batches
from dtmt_models.data.corpus import CorpusError, corpus_paths, read_manifest, read_parallel
from dtmt_models.decoding.beam_search import NonFiniteScores
from dtmt_models.errors import one_line
from dtmt_models.models.checkpoint import IMPLEMENTATION, CheckpointError, check_training_state, save_checkpoint
from dtmt_models.models.registry import build_model, init_weights, position_bound, used_options
from dtmt_models.plotting import figure, save
from dtmt_models.progress import Progress
from dtmt_models.signals import give_back, take_signals
from dtmt_models.training.config import TrainConfig
from dtmt_models.training import graphs
from dtmt_models.training.distributed import Dist
from dtmt_models.training.schedules import InverseSqrtSchedule, RNMTPlusSchedule

LAST, BEST, LOG, CURVE, CONFIG = "last.pt", "best.pt", "train_log.csv", "learning_curve.png", "config.yaml"
TENSORBOARD = "tensorboard"            # the event files: tensorboard --logdir runs/
STEP_CHECKPOINT = "step_{:07d}.pt"     # --keep-last: the model at a validation, by its number of updates
STEP_NAME = re.compile(r"step_(\d+)\.pt")   # such a file's name (the updates however many digits)
# elapsed_s: the time inside updates (what --max-time counts, carried over a resume); wall_s: this process's wall
# time since it began (dtmt_models.STARTED), everything included
LOG_FIELDS = ["kind", "step", "epoch", "elapsed_s", "lr", "loss", "nll", "ppl", "tokens", "tokens_per_s",
              "dev_loss", "dev_ppl", "dev_bleu", "dev_chrf", "best_bleu", "wall_s"]


def step_checkpoints(run_dir: str) -> List[Tuple[int, str]]:
    """The step_<updates>.pt files of a run directory (kept by --keep-last), oldest first, as (updates, path); none
    for a folder that does not exist (yet)."""
    found = []
    for name in os.listdir(run_dir) if os.path.isdir(run_dir) else ():
        m = STEP_NAME.fullmatch(name)
        if m:
            found.append((int(m.group(1)), os.path.join(run_dir, name)))
    return sorted(found)


# ---------------------------------------------------------------------------------------------- output
def format_time(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class CsvLog:
    """train_log.csv, and the same numbers as TensorBoard scalars in `tensorboard_dir` (tags "train/loss",
    "valid/dev_bleu", ...); on resume, rows and events after the checkpoint's step are dropped first (they will
    be redone)."""

    def __init__(self, path: str, resume_step: Optional[int], tensorboard_dir: Optional[str] = None,
                 source: Optional[str] = None):
        """source: the log whose rows up to resume_step start this one (default: `path` itself)."""
        self.path = path
        source = path if source is None else source
        rows = [] if resume_step is None or not os.path.lexists(source) else self._rows_until(source, resume_step)
        self.events = None   # (made once the log has been read: a log refused leaves no events file behind)
        self.tensorboard_dir = tensorboard_dir
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            _quiet_event_writer_errors()
            with self._writing_events():
                self.events = SummaryWriter(tensorboard_dir,
                                            purge_step=None if resume_step is None else resume_step + 1)
        self.rows = rows
        self._write_all()   # (read whole first: a log that cannot be kept is never emptied)

    def _write_all(self) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with atomic_write(self.path) as f:
            w = csv.DictWriter(f, LOG_FIELDS)
            w.writeheader()
            w.writerows(self.rows)

    @staticmethod
    def _rows_until(source: str, step: int) -> List[dict]:
        """The rows of the log `source` up to `step`, LOG_FIELDS only (cells a spreadsheet added are dropped, missing
        ones empty). CheckpointError in one line for a log that cannot be read (not UTF-8 text, no step column, a
        step that is not a whole number): the run resumes from its checkpoint, the log says what it did."""
        def unreadable(why: str) -> CheckpointError:
            return CheckpointError(f"--resume: {source}: {why}; mend it, or move it aside to resume with a log that "
                                   f"starts here")
        try:
            with open(source, newline="", encoding="utf-8-sig") as f:   # (a spreadsheet's save may begin with a BOM)
                reader = csv.DictReader(f)
                if "step" not in (reader.fieldnames or ()):
                    raise unreadable("not a training log (no step column)")
                rows = []
                for r in reader:
                    value = (r.get("step") or "").strip()
                    if not (value.isascii() and value.isdigit()):
                        raise unreadable(f"line {reader.line_num}: step {value[:20]!r} is not a whole number")
                    if int(value) <= step:
                        rows.append({k: r.get(k) or "" for k in LOG_FIELDS})
                return rows
        except (UnicodeDecodeError, csv.Error) as exc:
            raise unreadable(f"not a training log ({one_line(exc)[:100]})") from None
        except OSError as exc:
            raise unreadable(f"cannot be read ({exc.strerror or exc})") from None

    def write(self, **row) -> None:
        row.setdefault("wall_s", f"{time.perf_counter() - dtmt_models.STARTED:.1f}")
        row = {k: ("" if row.get(k) is None else row[k]) for k in LOG_FIELDS}
        if not os.path.exists(self.path):   # (removed under the run, its folder with it: appending made a log of
            self._write_all()               # the later rows without a header, which --resume refused) whole again
        self._append(row)
        self.rows.append({k: str(v) for k, v in row.items()})
        if self.events is not None:
            with self._writing_events():
                for k in LOG_FIELDS[3:]:   # the numbers after kind, step and epoch
                    try:
                        value = float(row[k])
                    except (TypeError, ValueError):
                        continue   # not given for this kind of row
                    self.events.add_scalar(f"{row['kind']}/{k}", value, int(row["step"]))
                self.events.flush()

    def _append(self, row: dict) -> None:
        """The row at the log's end; WriteError naming the log when it cannot be written (a full disk), the log cut
        back to its earlier rows (a part row left there made the log one that --resume refuses)."""
        try:
            with open(self.path, "a", newline="") as f:
                end = f.tell()
                try:
                    csv.DictWriter(f, LOG_FIELDS).writerow(row)
                    f.flush()
                except OSError:
                    with contextlib.suppress(OSError):
                        f.truncate(end)
                    raise
        except OSError as exc:
            raise LogWriteError(f"cannot write {self.path}: {exc.strerror or exc} (the log keeps its rows up to "
                                f"the last one written)") from None

    @contextlib.contextmanager
    def _writing_events(self):
        """WriteError naming the TensorBoard folder for an event file that cannot be written (a full disk: the
        writer's thread and flush raised a bare OSError, a traceback)."""
        try:
            yield
        except OSError as exc:
            raise LogWriteError(f"cannot write the TensorBoard events in {self.tensorboard_dir}: "
                                f"{exc.strerror or exc}") from None

    def close(self, quiet: bool = False) -> None:
        """Flushes and closes the event file; `quiet`: a failure to is ignored (another error is being reported)."""
        if self.events is not None:
            try:
                with self._writing_events():
                    self.events.close()
            except WriteError:
                if not quiet:
                    raise


class LogWriteError(WriteError):
    """The log or the TensorBoard events could not be written (a full disk, a read-only file): the run then saves
    last.pt where it can, its updates since the last one not lost (Trainer.run)."""


def _quiet_event_writer_errors() -> None:
    """The TensorBoard writer's thread, failing to write (a full disk), printed its traceback, then the main thread
    raised its error again at the next flush, which the run reports in one line (CsvLog._writing_events). This
    hook, installed once, leaves that thread's OSError unprinted; every other thread's exception as before."""
    from tensorboard.summary.writer import event_file_writer as tb

    writer, previous = getattr(tb, "_AsyncWriterThread", None), threading.excepthook
    if writer is None or getattr(previous, "_dtmt_quiet", False):   # (another TensorBoard: its tracebacks stay)
        return

    def hook(args):
        if not (isinstance(args.thread, writer) and issubclass(args.exc_type, OSError)):
            previous(args)
    hook._dtmt_quiet = True
    threading.excepthook = hook


def _points(rows: List[dict], kind: str, key: str) -> List[Tuple[int, float]]:
    """(step, value) of the log's rows of `kind` whose `key` and step read as numbers: a cell edited by hand ("abc",
    a spreadsheet's "8,43") is left out of the figure (it had ended every resumed run at its first validation, with
    best.pt saved and last.pt not)."""
    out = []
    for r in rows:
        if r.get("kind") == kind and r.get(key, "") != "":
            try:
                out.append((int(r["step"]), float(r[key])))
            except (TypeError, ValueError):
                continue
    return out


def plot_curve(rows: List[dict], path: str, title: str) -> Optional[str]:
    """Training and dev loss against updates, dev BLEU on a second axis, written to `path`. None (and a
    warning) when matplotlib is absent."""
    fig = figure(7, 4, what="the learning curve")
    if fig is None:
        return None
    tr, dv, bl = (_points(rows, kind, key) for kind, key in (("train", "loss"), ("valid", "dev_loss"),
                                                               ("valid", "dev_bleu")))
    ax = fig.add_subplot(1, 1, 1)
    if tr:   # (one row, a run shorter than --log-every: a point, where a line of one point drew nothing)
        ax.plot(*zip(*tr), label="train loss (smoothed CE / token)", lw=1, marker="o" if len(tr) == 1 else None)
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
    return save(fig, path, dpi=110)


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


def build_optimizer(model: torch.nn.Module, lr: float, beta2: float = 0.998, eps: float = 1e-9, *,
                    kind: str = "adam", rho: float = 0.95) -> torch.optim.Optimizer:
    """The run's optimizer over `model`'s parameters at rate `lr`:
      - kind "adam": Adam with β = (0.9, beta2) and ε = eps (the run's --adam-beta2 and --adam-eps: each paper's in
        its presets, 0.998 and 1e-9 elsewhere), in torch's fused implementation (one kernel over all parameters;
        torch's default on CPU is a loop of per-tensor operators);
      - kind "adadelta": Adadelta (Zeiler 2012, Algorithm 1; paper 001 l.160-177) with decay ρ = rho and ε = eps,
        its update Δx scaled by `lr` (1 is Zeiler's, which has no rate), torch's multi-tensor implementation (it
        has no fused one).
    The fused CPU step writes the parameters without bumping their version counters, which autograd's in-place
    checks and the unrolled sessions (dtmt_kernels.nn.unrolled) rely on, so a step hook bumps them (tests/
    test_train.py: `test_inference_sees_the_optimizer_steps`,
    `test_the_optimizer_bumps_the_parameters_versions_and_steps_as_torchs_adam`)."""
    params = list(model.parameters())
    if kind == "adam":
        opt = torch.optim.Adam(params, lr=lr, betas=(0.9, beta2), eps=eps, fused=True)
    elif kind == "adadelta":
        opt = torch.optim.Adadelta(params, lr=lr, rho=rho, eps=eps, foreach=True)
    else:
        raise ValueError(f"unknown optimizer {kind!r}; choose adam or adadelta")
    trained = [p for p in params if p.requires_grad]
    opt.register_step_post_hook(lambda *_: torch.autograd.graph.increment_version(trained))
    return opt


def run_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """build_optimizer with a run's settings (--optimizer, --lr and the chosen optimizer's own)."""
    eps = cfg.adam_eps if cfg.optimizer == "adam" else cfg.adadelta_eps
    return build_optimizer(model, cfg.lr, cfg.adam_beta2, eps, kind=cfg.optimizer, rho=cfg.adadelta_rho)


def load_optimizer_state(opt: torch.optim.Optimizer, state: dict) -> None:
    """Loads a checkpoint's optimizer state into `opt` (build_optimizer's), keeping `opt`'s own implementation:
    torch's load_state_dict also takes each group's `fused`/`foreach` flags from the checkpoint, so a checkpoint
    written before the fused Adam would resume on the per-tensor loop. The state itself (moments, steps) and the
    hyperparameters are the checkpoint's, for an exact continuation."""
    mine = [{k: g[k] for k in IMPLEMENTATION if k in g} for g in opt.param_groups]
    opt.load_state_dict(state)
    for group, flags in zip(opt.param_groups, mine):
        group.update(flags)


def is_better(best_by: str, loss: float, bleu: float, best_loss: float, best_bleu: float) -> bool:
    """Whether a validation's (dev loss, dev BLEU) beats best.pt's under `best_by` ("loss": lower loss, ties to the
    higher BLEU; "bleu": higher BLEU, ties to the lower loss). Which of the two tracks test BLEU:
    docs/design/training.md, "Checkpoint choice"."""
    if best_by == "loss":
        return loss < best_loss or (loss == best_loss and bleu > best_bleu)
    return bleu > best_bleu or (bleu == best_bleu and loss < best_loss)


class TrainingDiverged(ArithmeticError):
    """The training loss (summed over the processes) or the dev decoding became NaN or infinite: the run stops at
    once, without saving the non-finite weights (last.pt and best.pt keep the last state saved before)."""


class Trainer:
    def __init__(self, cfg: TrainConfig, dist: Dist, ckpt: Optional[dict] = None, resumed_from: Optional[str] = None,
                 ckpt_path: Optional[str] = None):
        """ckpt: a last.pt's contents to continue from (ckpt_path: its file, for messages; it is checked against the
        model and optimizer before any of it is loaded: models.checkpoint.check_training_state); resumed_from: the
        folder it was read from, when that is not cfg.out (a run continued in a new folder: its best.pt and
        train_log.csv come along, the original untouched)."""
        self.cfg, self.dist, self.device = cfg, dist, dist.device
        self.resume_path = ckpt_path or os.path.join(cfg.out, LAST)
        self.out = cfg.out
        # a bar on stderr; in a log, a line on stdout every --log-every updates
        self.progress = Progress(cfg.progress if dist.main else "silent", desc="dtmt train", unit="update",
                                 line_stream=sys.stdout)
        self.stop_reason: Optional[str] = None
        self.log = self.progress.message
        self._dev_warnings: Set[str] = set()   # what decoding dev said (validate): each said once
        # ---- data and vocabularies
        manifest = read_manifest(cfg.data)
        self.langs = (manifest["src_lang"], manifest["tgt_lang"])
        if "dev" in manifest.get("counts", {}):   # (a dev split whose file is missing or broken is an error)
            self.dev_pairs = read_parallel(*corpus_paths(cfg.data, "dev"))   # the references of dev BLEU
        else:
            self.dev_pairs = []
            self.log(f"note: {cfg.data} has no dev split: no validation, no early stopping, no best.pt")
            unused = [f"--{k.replace('_', '-')} {getattr(cfg, k)}" for k in ("patience", "best_by", "keep_last",
                                                                            "valid_beam", "bleu_sentences")
                      if getattr(cfg, k) != getattr(TrainConfig, k)]   # (--keep-last: no step checkpoints either)
            if unused:
                named = ", ".join(unused[:-1]) + " and " + unused[-1] if len(unused) > 1 else unused[0]
                self.log(f"warning: {named} {'has' if len(unused) == 1 else 'have'} no effect without a dev split")
        corpus = self._binarized(None if ckpt is None else (ckpt["src_vocab"], ckpt["tgt_vocab"]))
        self.src_vocab, self.tgt_vocab = corpus.vocabularies()
        # the training pairs stay on disk; in memory: their lengths (2 bytes a pair with --max-len < 255), and
        # during an epoch its batches (4 bytes a pair)
        self.train_data = corpus.split("train")
        # every split the run reads, checked whole before the first update: offsets and ids (issue 71 item 4; the
        # dev split below)
        sizes = (len(self.src_vocab), len(self.tgt_vocab))
        self.train_data.verify(sizes)
        self.lengths = self.train_data.lengths(length_dtype(cfg.max_len))
        kept = kept_indices(self.lengths, cfg.max_len)
        n_kept = len(kept)
        n_long = sum(int((self.lengths[i:i + (1 << 20)] > cfg.max_len).any(axis=1).sum())
                     for i in range(0, len(self.lengths), 1 << 20))
        empty = len(self.lengths) - n_long - n_kept
        self.dev_ids = []
        if self.dev_pairs and "dev" in corpus.splits:
            dev = corpus.split("dev")
            dev.verify(sizes)
            self.dev_ids = [p for p in dev.pairs(range(len(dev))) if p[0]]
        if cfg.data_fingerprint is not None and binarized.fingerprint(cfg.data) != cfg.data_fingerprint:
            # (a dtmt prepare moved another corpus into --data between the run's fingerprint and its reads: the run
            # would have trained on one corpus and recorded the other's, or scored dev BLEU on another dev split)
            raise CorpusError(f"--data {cfg.data} changed while the run started (a dtmt prepare wrote it); start "
                              f"again once it is done")
        self.log(f"data: {n_kept:,} training pairs ({n_long:,} longer than {cfg.max_len} subwords "
                 f"dropped{f', {empty} empty after segmentation dropped' if empty else ''}); {len(self.dev_pairs):,} "
                 f"dev pairs; vocabularies {len(self.src_vocab):,} / {len(self.tgt_vocab):,} ({corpus.path})")
        if not n_kept:
            raise CorpusError(f"no training pairs left: {n_long:,} longer than --max-len {cfg.max_len} subwords, "
                              f"{empty:,} empty after segmentation" + ("; raise --max-len" if n_long else ""))
        if cfg.max_len + 1 > cfg.max_tokens:   # a kept pair can pass a batch's budget alone: it goes in a batch of one
            over = sum(int((self.lengths[kept[i:i + (1 << 20)]].max(axis=1) + 1 > cfg.max_tokens).sum())
                       for i in range(0, n_kept, 1 << 20))
            if over:
                self.log(f"warning: {over:,} training pairs are longer than --max-tokens {cfg.max_tokens} allows a "
                         f"batch (their longer side + 1); each is a batch of its own, over the budget (raise "
                         f"--max-tokens or lower --max-len {cfg.max_len})")
        self._first_batches: Optional[Batches] = None   # the first epoch's, made here: epoch_batches takes them
        if dist.world > 1:   # each process takes every world-th batch of an epoch, the last (len % world) skipped
            self._first_batches = token_batches(self.lengths, cfg.max_tokens, seed=cfg.seed, epoch=0, keep=kept,
                                                max_sentences=cfg.max_sentences)   # (made twice, they delayed it)
            n_batches = len(self._first_batches)
            if n_batches < dist.world:   # (none for any process: the run looped over empty epochs, a signal unheard)
                raise CorpusError(f"an epoch makes {n_batches:,} batch(es) of --max-tokens {cfg.max_tokens:,} for "
                                  f"{dist.world} processes, which need one each; lower --max-tokens (or "
                                  f"--max-sentences), or train with fewer processes")
        # ---- model, optimizer, schedule
        torch.manual_seed(cfg.seed)
        # (a run of before the unused options' refusal may hold some: built without them, the same model)
        self.model = build_model(cfg.model, len(self.src_vocab), len(self.tgt_vocab),
                                 **used_options(cfg.model, cfg.model_options))
        if cfg.init_uniform:   # (a resumed run's weights then come from last.pt)
            init_weights(self.model, "uniform", cfg.init_uniform)
        elif cfg.init_normal:
            init_weights(self.model, "normal", cfg.init_normal)
        bound = position_bound(self.model)
        if bound is not None and self.dev_ids:   # (the dev loss of a pair past the model's positions: none to score)
            n_dev = len(self.dev_ids)
            self.dev_ids = [(s, t) for s, t in self.dev_ids if len(s) <= bound and len(t) < bound]
            if not self.dev_ids:   # (validation, early stopping and best.pt need a dev loss)
                self.log(f"warning: every dev pair is longer than {cfg.model}'s {bound} positions: no validation, no "
                         f"early stopping, no best.pt (raise --opt max_len)")
            elif len(self.dev_ids) < n_dev:
                self.log(f"note: {n_dev - len(self.dev_ids):,} dev pairs longer than {cfg.model}'s {bound} positions "
                         f"are left out of the dev loss (dev BLEU cuts their sources there)")
        if cfg.backend != "auto":
            if not hasattr(self.model, "set_backend"):
                raise ValueError(f"--backend: {cfg.model} has no fused recurrent layers")
            self.model.set_backend(cfg.backend)
        self.model.to(self.device)
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.step, self.epoch, self.batch_index, self.elapsed = 0, 0, 0, 0.0   # (epoch-halving's rate reads the epoch)
        self._update_lr: Optional[float] = None   # the rate of this process's last update (update_lr)
        self._update_epoch: Optional[int] = None  # and its epoch (update_epoch)
        self.optimizer = run_optimizer(self.model, cfg)
        self.replicas = cfg.replicas or dist.world   # the schedules' n: the processes, unless given
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._schedule())
        self.net = self.model
        if dist.world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.net = DDP(self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        # ---- position (step, epoch, batch_index, elapsed: above)
        self.best_bleu, self.best_loss, self.bad_validations = -1.0, math.inf, 0
        # the log window in progress (loss, NLL and target tokens summed since the last train row, its seconds): kept
        # in last.pt, so that a run resumed after Ctrl-C writes the rows an uninterrupted run writes
        self.log_window = [0.0, 0.0, 0.0, 0.0]
        self.stopped_early_by: Optional[str] = None   # the --best-by whose patience ran out, once it has
        # the update of the last validation (kept in last.pt: a run interrupted at an update due for one validates it
        # when resumed, as the uninterrupted run did; it had lost that validation, its step_N.pt and its best.pt)
        self.validated_step = self.step
        # the run's identity, in every checkpoint it writes and kept by --resume: dtmt average warns of files of two
        # runs by it (the output folder and seed had missed a run started again with --overwrite, and had named a
        # run copied to another folder and resumed there as two); from the OS, not the seeded streams
        self.run_id = os.urandom(8).hex()
        # dropout streams differ per process; (mod 2^64, what manual_seed takes: a --seed past 2.3e15 overflowed)
        torch.manual_seed((cfg.seed * 7919 + 1 + dist.rank) % 2 ** 64)
        if ckpt is not None:
            self._restore(ckpt)
        # updates replayed as graphs (cfg.replays_updates: --cuda-graphs, or by default one process on a CUDA device
        # with Adam; an explicit --cuda-graphs elsewhere is refused by the command line)
        self.graphs = (graphs.GraphedUpdates(self.update, self.model, self.optimizer, self.device, log=self.log)
                       if cfg.replays_updates(self.device.type, dist.world) else None)
        self._saved_step = self.step if ckpt is not None else None   # the update last.pt holds (in its folder)
        carried = (ckpt is not None and resumed_from is not None
                   and os.path.abspath(resumed_from) != os.path.abspath(self.out))
        if carried and dist.main and os.path.isfile(os.path.join(resumed_from, BEST)):
            os.makedirs(self.out, exist_ok=True)
            best = os.path.join(self.out, BEST)
            with open(os.path.join(resumed_from, BEST), "rb") as src, atomic_write(best, "wb") as dst:
                shutil.copyfileobj(src, dst)
        kept_log = os.path.join(resumed_from if carried else self.out, LOG)
        if ckpt is not None and dist.main and self.step > 0 and not os.path.lexists(kept_log):   # (it went on
            # from the checkpoint's update without a word)
            self.log(f"warning: {kept_log} is missing: the log goes on from update {self.step + 1:,}, without the "
                     f"rows of the updates before")
        self.csv = (CsvLog(os.path.join(self.out, LOG), self.step if ckpt is not None else None,
                           os.path.join(self.out, TENSORBOARD),
                           source=os.path.join(resumed_from, LOG) if carried else None) if dist.main else None)

    # -------------------------------------------------------------------------------------------- setup
    def _binarized(self, protos=None) -> binarized.BinarizedCorpus:
        """The binarized corpus for the run's vocabulary (--vocab-type, --vocab-size): the one `dtmt prepare` wrote,
        or, when there is none or its text has changed, one built now by the main process (once: later runs
        reuse it) while the others wait. Resuming (`protos`: the checkpoint's SentencePiece models), a copy with
        other models is not used: the text is encoded with the run's own models instead (bin-models-<hash>)."""
        c = self.cfg

        def find():
            try:
                corpus = binarized.open_binarized(c.data, c.vocab_type, c.vocab_size)
                if protos is None or tuple(corpus.protos) == tuple(protos):
                    return corpus, None
            except binarized.NotBinarized as exc:
                if protos is None:
                    return None, exc.reason
            try:
                return binarized.open_binarized(c.data, c.vocab_type, c.vocab_size, protos), None
            except binarized.NotBinarized as exc:
                return None, f"{exc.reason} (with this run's vocabularies)"

        if self.dist.main:
            corpus, reason = find()
            if corpus is None:
                self.log(f"{reason}: building it now (once; later runs reuse it)")
                try:
                    binarized.binarize(c.data, c.vocab_size, c.vocab_type, log=self.log, protos=protos)
                except OSError as err:
                    raise CorpusError(f"cannot write the binarized corpus into {c.data} ({one_line(err)}); make it "
                                      f"where it can be written with `dtmt prepare binarize`") from None
        self.dist.broadcast(None)   # the others wait for it
        corpus, reason = find()
        if corpus is None:   # (process 0 builds the copy in its --data: another's own --data has none; one built
            # apart would have vocabularies of its own, which nothing compares)
            raise CorpusError(reason if self.dist.main else f"{reason} (process 0 builds one in its own --data "
                              f"only: copy the bin-* folders of process 0's --data into {c.data}, or give every "
                              f"process one --data)")
        return corpus

    def _schedule(self):
        c = self.cfg
        n = self.replicas
        if c.schedule == "rnmt":
            return RNMTPlusSchedule(c.warmup, c.decay_start, c.decay_end, n=n, floor=0.05)
        if c.schedule == "inverse-sqrt":
            dim = c.model_options.get("embed_dim", c.model_options.get("hidden_size", 256))
            return InverseSqrtSchedule(dim, c.warmup, num_gpu=n)
        if c.schedule == "constant":
            return lambda step: 1.0
        if c.schedule == "epoch-halving":   # paper 004 §4.2: lr0 · 0.5^epoch (a function, not kept in last.pt)
            return lambda step: 0.5 ** self.epoch
        raise ValueError(f"unknown schedule {c.schedule!r}")

    def _restore(self, ckpt: dict) -> None:
        check_training_state(self.resume_path, ckpt, self.model, self.optimizer, self.scheduler)   # before any load
        self.model.load_state_dict(ckpt["model"])
        t = ckpt["training"]
        load_optimizer_state(self.optimizer, t["optimizer"])
        self.scheduler.load_state_dict(t["scheduler"])
        self.step, self.epoch, self.batch_index, self.elapsed = t["step"], t["epoch"], t["batch_index"], t["elapsed"]
        self.best_bleu, self.best_loss, self.bad_validations = t["best_bleu"], t["best_loss"], t["bad_validations"]
        self.log_window = [float(x) for x in t.get("log_window", [0.0, 0.0, 0.0, 0.0])]   # (older last.pt: none)
        self.stopped_early_by = t.get("stopped_early_by")
        self.validated_step = t.get("validated_step", self.step)   # (older last.pt: none due)
        self.run_id = ckpt.get("run_id", self.run_id)   # (older last.pt: none; its files are told apart as before)
        rngs = t["rng"]
        if len(rngs) != self.dist.world:
            raise ValueError(f"the checkpoint was written by {len(rngs)} process(es); resume with the same number "
                             f"(got {self.dist.world}): its batches and random streams are split among them")
        mine = rngs[self.dist.rank]
        torch.set_rng_state(mine["torch"])
        random.setstate(mine["python"])
        if mine.get("cuda") is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(mine["cuda"], self.device)
        self.log(f"resumed from step {self.step:,} (epoch {self.epoch + 1}, batch {self.batch_index})")

    def payload(self, full: bool) -> dict:
        c = self.cfg
        p = {"model_name": c.model, "model_options": c.model_options, "src_vocab": self.src_vocab.proto,
             "tgt_vocab": self.tgt_vocab.proto, "model": self.model.state_dict(), "langs": self.langs,
             "config": c.to_dict(), "step": self.step, "run_id": self.run_id}
        if full:
            rng = {"torch": torch.get_rng_state(), "python": random.getstate(),
                   "cuda": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None}
            p["training"] = {
                "optimizer": graphs.float_lrs(self.optimizer.state_dict()), "scheduler": self.scheduler.state_dict(),
                "step": self.step, "epoch": self.epoch, "batch_index": self.batch_index, "elapsed": self.elapsed,
                "best_bleu": self.best_bleu, "best_loss": self.best_loss, "bad_validations": self.bad_validations,
                "log_window": list(self.log_window), "stopped_early_by": self.stopped_early_by,
                "validated_step": self.validated_step, "rng": self.dist.gather(rng)}
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
        """last.pt, once its weights are checked finite: an update's loss is taken before its step, so the last
        update of a run without a dev split (no validation after it) had saved infinite weights, exit 0, which
        translate then refused. (Every process holds the same weights: all raise together.)"""
        with torch.no_grad():
            finite = bool(torch.stack([p.isfinite().all() for p in self.model.parameters()]).all())
        if not finite:
            raise TrainingDiverged(self._diverged(f"the weights after update {self.step:,} are not finite"))
        payload = self.payload(full=True)     # every rank takes part in gathering the random states
        if self.dist.main:
            save_checkpoint(os.path.join(self.out, LAST), payload)
        self._saved_step = self.step

    # ---------------------------------------------------------------------------------------- training
    def epoch_batches(self) -> Batches:
        made, self._first_batches = self._first_batches, None
        if made is not None and self.epoch == 0:
            batches = made
        else:
            batches = token_batches(self.lengths, self.cfg.max_tokens, seed=self.cfg.seed, epoch=self.epoch,
                                    keep=kept_indices(self.lengths, self.cfg.max_len),
                                    max_sentences=self.cfg.max_sentences)
        w = self.dist.world
        if w > 1:   # every process takes the same number of batches: the last (len % w) of the epoch are skipped
            batches = batches[:len(batches) - len(batches) % w][self.dist.rank::w]
        return batches

    def autocast(self):
        """The context of an update's forward: torch.autocast in bfloat16 with --amp bf16 (contract §3: the fused ops'
        autocast rules keep states and layer-norm statistics in float32), else nothing."""
        if self.cfg.amp == "bf16":   # (no cache of cast weights under graphs: a capture would keep stale ones)
            return torch.autocast(self.device.type, dtype=torch.bfloat16, cache_enabled=self.graphs is None)
        return contextlib.nullcontext()

    def train_step(self, batch: List[int]) -> Tuple[float, float, float]:
        self.net.train()
        self._update_lr, self._update_epoch = self.next_lr(), self.epoch
        pairs = self.train_data.pairs(batch)
        if self.graphs is not None:   # (padded on the host, then copied into the bucket's tensors)
            loss_sum, nll_sum, ntok = self.graphs.update(*collate(pairs))
        else:
            loss_sum, nll_sum, ntok = self.update(*collate(pairs, self.device))
        self.scheduler.step()
        return float(loss_sum), float(nll_sum), float(ntok)

    def update_lr(self) -> float:
        """The learning rate the last update took, which the logs show beside its loss (the scheduler has already
        stepped to the next update's; before any update in this process, the rate the schedule gives the update
        before the next). Not read from the optimizer: under --cuda-graphs its learning rate is a device tensor."""
        return self._update_lr if self._update_lr is not None else self._lr_at(max(self.scheduler.last_epoch - 1, 0))

    def update_epoch(self) -> int:
        """The epoch (from 1) of the last update, which the logs show beside it: a run that ends with an epoch has
        moved its counter on by the time its last rows are written."""
        return (self.epoch if self._update_epoch is None else self._update_epoch) + 1

    def next_lr(self) -> float:
        """The rate the next update takes: the schedule's at the scheduler's count (and, for epoch-halving, the
        epoch)."""
        return self._lr_at(self.scheduler.last_epoch)

    def _lr_at(self, count: int) -> float:
        """The schedule's rate after `count` updates (read on the host: the scheduler's base rate and lambda)."""
        s = self.scheduler
        return float(s.base_lrs[0]) * s.lr_lambdas[0](count)

    def refresh_lr(self) -> None:
        """The optimizer's rate set to next_lr() without counting a step: after a new epoch begins, whose rate
        epoch-halving changes (torch's scheduler computes a rate only when it steps). A tensor rate (--cuda-graphs)
        is filled in place, as the scheduler does."""
        lr = self.next_lr()
        for group in self.optimizer.param_groups:
            if torch.is_tensor(group["lr"]):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self.scheduler._last_lr = [lr for _ in self.optimizer.param_groups]

    def update(self, src, lengths, prev, target):
        """One update on a collated batch: forward, backward, clipping, Adam step; (loss sum, NLL sum, target
        tokens). With --cuda-graphs it is what a graph records (training.graphs), so it reads nothing on the host
        while captured."""
        with self.autocast():
            loss_sum, nll_sum, ntok = self.net(src, lengths, prev, target=target, smoothing=self.cfg.smoothing)
        self.optimizer.zero_grad(set_to_none=True)
        (loss_sum / ntok).backward()
        if self.cfg.clip and self.cfg.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip)
        self.optimizer.step()
        return loss_sum.detach(), nll_sum.detach(), ntok

    def should_stop(self) -> Optional[str]:
        c = self.cfg
        if self.stopped_early_by == c.best_by and c.patience and self.bad_validations >= c.patience:
            # a resumed run that had stopped early (not one given a lower --patience or another --best-by now)
            return (f"no better dev {self.best_by_name()} in {c.patience} validations (early stopping, before this "
                    f"resume; a larger --patience goes on)")
        if c.max_steps is not None and self.step >= c.max_steps:   # (past it: a run resumed with a lower one)
            return f"reached --max-steps {c.max_steps}" + (f" (the run was past it, at update {self.step:,}, before "
                                                           f"this resume)" if self.step > c.max_steps else "")
        if c.max_time_s is not None and self.elapsed >= c.max_time_s:
            return f"reached --max-time {c.max_time}"
        if c.max_epochs is not None and self.epoch >= c.max_epochs:
            return f"reached --max-epochs {c.max_epochs}"
        return None

    def run(self) -> int:
        c = self.cfg
        if self.dist.main:
            self.log(f"model {c.model} ({c.preset} preset): {self.n_params:,} parameters; options "
                     f"{c.model_options}; device {self.device}, backend {c.backend}, {self.dist.world} "
                     f"process(es); {c.optimizer}, schedule {c.schedule} (n = {self.replicas}); output {self.out}")
            if c.amp == "bf16" and self.device.type == "cpu" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
                self.log("warning: --amp bf16 on a CPU without bfloat16 dot products (AVX512_BF16 / AMX): PyTorch "
                         "runs bfloat16 GEMMs here by a fallback many times slower than float32 "
                         "(docs/design/training.md, 'bfloat16 on the CPU'); --amp off is the fast choice on this "
                         "machine")
        handlers = self._install_signals()
        self.started = True   # (a KeyboardInterrupt from here on is the run's own: its handlers')
        first_step = self.step
        interrupted = False   # by a signal to any process (every rank sees it through the summed stop flag)
        try:
            if self.step != self.validated_step and self.step % c.valid_every == 0:   # (due when it was interrupted)
                self.validated_step = self.step
                self.validate()
            while self.stop_reason is None:
                self.stop_reason = self.should_stop()
                if self.stop_reason:
                    break
                batches = self.epoch_batches()
                if self.batch_index > len(batches):   # (resumed on a corpus changed under --allow-changed-data: the
                    self.log(f"the run stopped at batch {self.batch_index:,} of epoch {self.epoch + 1}, past the "
                             f"{len(batches):,} batches an epoch of {c.data} (--allow-changed-data): epoch "
                             f"{self.epoch + 2} begins")   # epoch's rest was skipped without a word)
                while self.batch_index < len(batches):
                    if self.step == self.validated_step and self._signalled():   # (came during the validation: the
                        self.stop_reason = self._interruption()
                        interrupted = True   # run trained one more update before it stopped)
                        break
                    t0 = time.perf_counter()
                    loss, nll, ntok = self.train_step(batches[self.batch_index])
                    self.batch_index += 1
                    self.step += 1
                    loss, nll, ntok, *signals = self.dist.sum([loss, nll, ntok, *self._signal_flags()])
                    stop = self._note_signals(signals)
                    if not math.isfinite(loss):   # (every process sees the same sum: all stop here)
                        raise TrainingDiverged(self._diverged(f"the training loss is {loss} at update {self.step:,}"))
                    dt = time.perf_counter() - t0
                    self.elapsed += dt
                    if self.dist.world > 1:   # (the processes' mean: each counted its own time, so --max-time
                        # stopped one an update before the others, which waited in their next all-reduce for ever)
                        self.elapsed = self.dist.sum([self.elapsed])[0] / self.dist.world
                    w = self.log_window = [a + b for a, b in zip(self.log_window, (loss, nll, ntok, dt))]
                    logged = self.step % c.log_every == 0
                    text = (f"epoch {self.epoch + 1} step {self.step:,} loss {loss / ntok:.3f} "
                            f"lr {self.update_lr():.2e} {w[2] / max(w[3], 1e-9):,.0f} tok/s "
                            f"time {format_time(self.elapsed)}")
                    self.progress.show(self.step, c.max_steps, status=text, line=text if logged else None)
                    if logged:
                        self._write_train_row()
                        self.log_window = [0.0, 0.0, 0.0, 0.0]
                    if stop:
                        self.stop_reason = self._interruption()
                        interrupted = True
                        break
                    if self.step % c.valid_every == 0:
                        self.validated_step = self.step
                        if self.validate():
                            break
                    self.stop_reason = self.should_stop()
                    if self.stop_reason:
                        break
                else:
                    self.epoch += 1
                    self.batch_index = 0
                    self.refresh_lr()
            if not interrupted and self.step % c.log_every and self.log_window[2] and (
                    self.step > first_step or not self._train_row_written()):
                # the window in progress at the end of the run: its row too (a run shorter than --log-every had none);
                # the window stays in last.pt, so a run extended from here writes the rows of an uninterrupted one. A
                # run resumed at its last update writes it where the log lacks it (interrupted during that update,
                # the run had saved the window unwritten, and the resumed one, with no update to make, left it out)
                self._write_train_row()
            if self.step != self.validated_step and not interrupted and self.dev_ids:
                self.validated_step = self.step
                self.validate()
            self.save_last()
            if self.dist.main:   # (the rows after the last validation, or a run without a dev split: not drawn)
                self._draw_curve()
            digest = self.check_sync()
            if digest and self.dist.main:
                self.log(f"{self.dist.world} processes in sync at step {self.step}: parameters sha1 {digest[:12]}")
        except LogWriteError as exc:   # (the run ended with the updates since its last.pt unsaved: up to a validation
            # interval's; one process only, where saving is no collective the others would wait in)
            if self.dist.world > 1 or self._saved_step == self.step:
                raise
            try:
                self.save_last()
            except (WriteError, OSError, TrainingDiverged):
                raise exc from None
            raise LogWriteError(f"{exc}; {os.path.join(self.out, LAST)} saved at update {self.step:,}: resume with "
                                f"--resume once the log can be written") from None
        except BrokenPipeError:   # stdout's reader left (`dtmt train | tee log`, tee killed): the run ends, as SIGPIPE
            # would end it, but with its updates saved (it had ended in silence, last.pt up to a validation behind)
            if self.dist.world == 1 and self._saved_step != self.step:
                try:
                    self.save_last()
                    print(f"dtmt train: stdout was closed (its reader left); {os.path.join(self.out, LAST)} saved "
                          f"at update {self.step:,}: resume with --resume", file=sys.stderr, flush=True)
                except (WriteError, OSError, TrainingDiverged):
                    pass
            raise
        finally:
            give_back(handlers)
            self.progress.close()
            if self.csv:   # (its own error only where none is reported already)
                self.csv.close(quiet=sys.exc_info()[0] is not None)
        if self.dist.main:
            self.log(f"stopped: {self.stop_reason}. {self.step:,} updates, {format_time(self.elapsed)} of training; "
                     f"best.pt: {self.best_description()}. Checkpoints: {os.path.join(self.out, LAST)}"
                     + (f", {os.path.join(self.out, BEST)}" if os.path.isfile(os.path.join(self.out, BEST)) else ""))
            if self.graphs is not None:
                self.log(self.graphs.summary())
            if interrupted:   # (a signal to any process)
                self.log(f"resume with: {self._command()} --data {c.data} --model {c.model} --out {self.out} --resume")
            elif self._signal:   # (during the last update's validation or saving: the run had reached its end,
                # and was told to resume, exit 130)
                self.log(f"{self._signal} came as the run ended: it is complete, nothing to resume")
        if not interrupted:
            return 0
        # (this process's signal; else another's, SIGTERM before SIGINT: exit 0 had said an interrupted run finished)
        return 130 if (self._signal or self._run_signal) == "SIGINT" else 143

    def _command(self) -> str:
        """The command that runs this training again: `dtmt train`, or torchrun's with as many processes."""
        if self.dist.world == 1:
            return "dtmt train"
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.dist.world))
        nodes = (f" --nnodes {self.dist.world // per_node} (on each node, with its --node_rank and the run's "
                 "rendezvous options)") if self.dist.world > per_node else ""
        return f"torchrun{nodes} --nproc_per_node {per_node} -m dtmt_models.cli.train"

    def _train_row_written(self) -> bool:
        """Whether the log holds a train row at this update (a resumed run's, written before it was saved)."""
        return bool(self.csv) and any(r.get("kind") == "train" and r.get("step") == str(self.step)
                                      for r in self.csv.rows)

    def _write_train_row(self) -> None:
        """train_log.csv's (and TensorBoard's) train row for the log window: its mean loss and NLL per target token."""
        loss, nll, ntok, seconds = self.log_window
        if self.csv:
            self.csv.write(kind="train", step=self.step, epoch=self.update_epoch(), elapsed_s=f"{self.elapsed:.1f}",
                           lr=self.update_lr(), loss=repr(loss / ntok), nll=repr(nll / ntok),
                           ppl=f"{math.exp(min(nll / ntok, 50)):.2f}", tokens=int(ntok),
                           tokens_per_s=f"{ntok / max(seconds, 1e-9):.0f}")

    # -------------------------------------------------------------------------------------- validation
    def dev_loss(self) -> Tuple[float, int]:
        return corpus_nll(self.model, self.dev_ids, self.cfg.max_tokens, self.device)

    def validate(self) -> bool:
        """Dev loss, BLEU and chrF on the main process, best.pt and last.pt; returns True to stop early."""
        decision = None
        if self.dist.main and self.dev_ids:
            from dtmt_models.decoding.evaluate import corpus_scores
            from dtmt_models.decoding.translate import input_warnings, translate_best

            t0 = time.perf_counter()
            loss, _ = self.dev_loss()
            n = self.cfg.bleu_sentences or len(self.dev_pairs)
            sources = [s for s, _ in self.dev_pairs[:n]]
            refs = [t for _, t in self.dev_pairs[:n]]
            try:
                hyps, said = input_warnings(lambda: translate_best(
                    self.model, self.src_vocab, self.tgt_vocab, sources, beam=self.cfg.valid_beam, alpha=0.6,
                    device=self.device)) if math.isfinite(loss) else (None, [])
                for message in said:   # (about the dev sources: one log line each, once a run, not Python's form)
                    if message not in self._dev_warnings:
                        self._dev_warnings.add(message)
                        self.log(f"warning: dev BLEU: {message}")
            except NonFiniteScores as exc:
                hyps, loss = None, f"finite, but decoding dev {str(exc).split(': its weights')[0]}"
            if hyps is None:   # told to every process, which all stop
                decision = self._diverged(f"the dev loss is {loss} at update {self.step:,}")
                self.dist.broadcast(decision)
                raise TrainingDiverged(decision)
            scores = corpus_scores(hyps, refs, self.langs[1])   # (BLEU tokenised for the target language)
            bleu, chrf = scores["bleu"], scores["chrf"]
            improved = is_better(self.cfg.best_by, loss, bleu, self.best_loss, self.best_bleu)
            if improved:   # best_loss and best_bleu: best.pt's own dev loss and BLEU
                self.best_bleu, self.best_loss, self.bad_validations = bleu, loss, 0
                save_checkpoint(os.path.join(self.out, BEST), self.payload(full=False))
            else:
                self.bad_validations += 1
            if self.cfg.keep_last:
                self.keep_step_checkpoint()
            self.csv.write(kind="valid", step=self.step, epoch=self.update_epoch(), elapsed_s=f"{self.elapsed:.1f}",
                           lr=self.update_lr(), dev_loss=repr(loss),
                           dev_ppl=f"{math.exp(min(loss, 50)):.2f}", dev_bleu=f"{bleu:.2f}", dev_chrf=f"{chrf:.2f}",
                           best_bleu=f"{self.best_bleu:.2f}")
            self._draw_curve()
            p = self.cfg.patience
            stop = bool(p) and self.bad_validations >= p
            self.log(f"step {self.step:,}: dev loss {loss:.3f} (ppl {math.exp(min(loss, 50)):.1f}), BLEU {bleu:.2f}, "
                     f"chrF {chrf:.2f}{' (best)' if improved else f' (best: {self.best_description()})'}; "
                     f"{time.perf_counter() - t0:.0f}s")
            decision = (stop, self.best_bleu, self.best_loss, self.bad_validations)
        decision = self.dist.broadcast(decision)
        if isinstance(decision, str):
            raise TrainingDiverged(decision)
        self.save_last()
        if decision is None:
            return False
        stop, self.best_bleu, self.best_loss, self.bad_validations = decision
        if stop:
            self.stop_reason = f"no better dev {self.best_by_name()} in {self.cfg.patience} validations (early stopping)"
            self.stopped_early_by = self.cfg.best_by
        return stop

    _drawn_rows = 0   # the log's rows learning_curve.png shows

    def _draw_curve(self) -> None:
        """learning_curve.png from the log's rows, where it has rows the figure does not show yet."""
        if self.csv and len(self.csv.rows) > self._drawn_rows:
            plot_curve(self.csv.rows, os.path.join(self.out, CURVE), f"{self.cfg.model} on {self.cfg.data}")
            self._drawn_rows = len(self.csv.rows)

    def _diverged(self, what: str) -> str:
        """TrainingDiverged's message: what became non-finite, what to change, what is kept."""
        last = os.path.join(self.out, LAST)
        kept = (f"{last} keeps update {self._saved_step:,}" if self._saved_step is not None and os.path.isfile(last)
                else "nothing was saved")
        return (f"{what}: the run diverged and stops without saving it ({kept}); a new run with a lower --lr, a "
                f"longer --warmup or --clip may not")

    def best_description(self) -> str:
        if self.best_loss == math.inf:
            return "none yet"
        return f"dev loss {self.best_loss:.3f}, BLEU {self.best_bleu:.2f} (picked by dev {self.best_by_name()})"

    def best_by_name(self) -> str:
        """--best-by as the log words it: "loss" or "BLEU"."""
        return {"loss": "loss", "bleu": "BLEU"}[self.cfg.best_by]

    def keep_step_checkpoint(self) -> None:
        """step_<updates>.pt for this validation; the oldest beyond --keep-last are removed."""
        save_checkpoint(os.path.join(self.out, STEP_CHECKPOINT.format(self.step)), self.payload(full=False))
        kept = step_checkpoints(self.out)
        for _, path in kept[:max(len(kept) - self.cfg.keep_last, 0)]:
            os.remove(path)

    # ----------------------------------------------------------------------------------------- signals
    _signal: Optional[str] = None
    started = False   # run() has begun: the signal handlers are the run's
    _run_signal: Optional[str] = None   # a signal that came to any process of the run (SIGTERM before SIGINT)

    def _interruption(self) -> str:
        """The stop reason of a run that a signal to any process interrupted."""
        return f"interrupted by {self._signal or f'{self._run_signal} in another process'}"

    def _signal_flags(self) -> List[float]:
        """This process's signal as (SIGINT, SIGTERM) flags, for the processes' sum."""
        return [float(self._signal == "SIGINT"), float(self._signal == "SIGTERM")]

    def _note_signals(self, summed: List[float]) -> bool:
        """Whether the summed flags say a signal came to any process (kept in _run_signal)."""
        self._run_signal = "SIGTERM" if summed[1] else "SIGINT" if summed[0] else None
        return self._run_signal is not None

    def _signalled(self) -> bool:
        """Whether a signal came to any process (each calls this at the same update)."""
        return self._note_signals(self.dist.sum(self._signal_flags()))

    def _install_signals(self):
        def handler(signum, frame):
            name = signal.Signals(signum).name
            if self._signal:                      # a second signal: stop now
                raise KeyboardInterrupt(name)
            self._signal = name
            self.progress.message(f"{name}: finishing this update (or validation), then saving "
                                  f"{os.path.join(self.out, LAST)} (again to abort without saving)")
        return take_signals((signal.SIGINT, signal.SIGTERM), handler)
