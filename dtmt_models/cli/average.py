"""`dtmt average`: one checkpoint whose weights are the mean of several of the same run (checkpoint averaging).

    dtmt average runs/dtmt/step_0003000.pt runs/dtmt/step_0003500.pt -o runs/dtmt/avg.pt
    dtmt average --run runs/dtmt --last 5 -o runs/dtmt/avg5.pt     # the last 5 kept by `dtmt train --keep-last`

The result translates and evaluates like any checkpoint (`dtmt translate -c runs/dtmt/avg5.pt`); it holds no
training state, so it cannot be resumed.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from dtmt_models.cli.common import reporting_warnings
from dtmt_models.errors import (ArgumentParser, UsageError, check_input_dir, check_input_file, check_output_file,
                                 one_line)
from dtmt_models.models.checkpoint import average_checkpoints, read_checkpoint, save_checkpoint
from dtmt_models.run_lock import holder
from dtmt_models.training.trainer import BEST, CONFIG, CURVE, LAST, LOG, STEP_NAME, step_checkpoints

PROG = "dtmt average"


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("checkpoints", nargs="*", metavar="CKPT", help="checkpoints of one model")
    p.add_argument("--run", help="a run directory: average its step_<updates>.pt files (see --last)")
    p.add_argument("--last", type=int, default=None, metavar="N",
                   help="with --run: the N latest (default: all); more than the run holds is refused, nothing written")
    p.add_argument("--output", "-o", required=True, help="the averaged checkpoint to write")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if bool(a.checkpoints) == bool(a.run):
        p.error("give either checkpoints or --run DIR")
    if a.last is not None and (not a.run or a.last < 1):
        p.error("--last N needs --run and N >= 1")
    if not a.output or a.output == "-":   # (translate's -o - is stdout; here it made a file named "-")
        p.error("--output: give a file name (a checkpoint is written to a file, not to stdout)")
    try:
        paths = _checkpoints(a)
        check_output_file(a.output, "--output", paths)
        check_not_a_run_s(a.output)
        payload = reporting_warnings(PROG, lambda: average_checkpoints(paths), category=Warning)
        if len(paths) == 1:
            print(f"{PROG}: warning: one checkpoint: the output holds its weights as they are", file=sys.stderr)
    except (UsageError, ValueError, FileNotFoundError) as exc:   # the checkpoints named cannot be averaged
        print(f"{PROG}: {_without_prefix(one_line(exc))}", file=sys.stderr)
        return 2
    try:
        save_checkpoint(a.output, payload, through_link=True)   # (a link named: its target, as translate -o)
    except (OSError, ValueError) as exc:
        print(f"{PROG}: {_without_prefix(one_line(exc))}", file=sys.stderr)
        return 1
    # (on stderr, as prepare's: an output of -o /dev/stdout had this line in its bytes)
    print(f"{PROG}: wrote {a.output}: the mean of {len(paths)} checkpoint{'s' if len(paths) != 1 else ''} "
          f"({', '.join(payload['averaged_from'])})", file=sys.stderr)
    return 0


def _checkpoints(a: argparse.Namespace) -> List[str]:
    """The files to average: those given, or the last --last step checkpoints of --run (UsageError if none)."""
    if not a.run:
        for path in a.checkpoints:
            check_input_file(path, noun="checkpoint file")
        return list(a.checkpoints)
    check_input_dir(a.run, "--run", "run folder")
    kept = step_checkpoints(a.run)
    if not kept:
        raise UsageError(f"--run {a.run}: holds no step_<updates>.pt checkpoints (train with --keep-last N)")
    if a.last is not None and a.last > len(kept):   # (it averaged the fewer there were, as if asked for them)
        raise UsageError(f"--last {a.last}: --run {a.run} holds {len(kept)} step_<updates>.pt checkpoint"
                         f"{'s' if len(kept) != 1 else ''} ({', '.join(os.path.basename(p) for _, p in kept)}); "
                         f"ask for at most {len(kept)}")
    return [path for _, path in kept[-(a.last or len(kept)):]]


def check_not_a_run_s(output: str) -> None:
    """UsageError for an --output that a training run owns: a file that a dtmt train running in its folder writes
    (last.pt, best.pt, step_N.pt, ...: its next validation would replace the mean), or any run's checkpoint with
    its training state (a last.pt), which the mean would lose, or a finished run's best.pt, step_N.pt, train_log.csv,
    learning_curve.png or config.yaml (all were written, exit 0), or a new file of those names in a run's folder;
    or an existing file that is not a checkpoint (a mistyped -o replaced a corpus file or a config, exit 0)."""
    folder, name = os.path.split(os.path.realpath(output))   # (a link is written through: its target's)
    running = holder(folder)
    if running is not None and (name in (LAST, BEST, LOG, CURVE, CONFIG) or STEP_NAME.fullmatch(name)):
        raise UsageError(f"--output {output}: a file of the run in {folder}, where a dtmt train runs (process "
                         f"{running}) and writes it; give another name")
    # (a run's folder: its last.pt, or its config and log; a folder of the user's own with a config.yaml is none)
    run_folder = os.path.exists(os.path.join(folder, LAST)) or all(os.path.exists(os.path.join(folder, f))
                                                                   for f in (CONFIG, LOG))
    if run_folder and (name in (LAST, BEST, LOG, CURVE, CONFIG) or STEP_NAME.fullmatch(name)):
        # (a finished run's step_N.pt or best.pt was replaced, exit 0, and the next --run average took the mean in
        # its place; a new step_N.pt was averaged by the next --run as the run's own, and a resumed run replaced it
        # or its --keep-last removed it; its train_log.csv replaced, --resume refused the run)
        kind = {LAST: "last checkpoint, which --resume continues from", BEST: "best checkpoint, which translate reads",
                LOG: "training log, which --resume reads",
                CURVE: "learning curve", CONFIG: "settings, which --config reruns"
                }.get(name, "step checkpoint, which --run averages")
        if os.path.exists(output):
            raise UsageError(f"--output {output}: the {kind}, of the run in {folder}; the mean would replace it: "
                             f"give another name")
        also = " (or --run take the mean for one)" if STEP_NAME.fullmatch(name) else ""
        raise UsageError(f"--output {output}: the name of a {kind}, in the run folder {folder}, which the run's "
                         f"own would replace{also}; give another name")
    if os.path.isfile(output) and os.path.getsize(output):   # (an empty file: made for the output, mktemp's)
        try:
            state = "training" in read_checkpoint(output, mmap=True)
        except FileNotFoundError:   # (gone meanwhile)
            state = False
        except ValueError:   # (a corpus file, a config, a source file, mistyped: it was replaced, exit 0)
            raise UsageError(f"--output {output}: an existing file that is not a checkpoint, which the mean would "
                             f"replace; give another name (or remove it first)") from None
        if state:
            raise UsageError(f"--output {output}: a run's checkpoint with its training state (what --resume "
                             f"continues from), which the mean would replace; give another name")


def _without_prefix(message: str) -> str:
    return message[len("average: "):] if message.startswith("average: ") else message


if __name__ == "__main__":
    sys.exit(main())
