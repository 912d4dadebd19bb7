"""dtmt train: resume exactness, signals, two-process DDP, presets, errors (issue 5)."""
import copy
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from dtmt_models.data.corpus import write_manifest, write_parallel
from dtmt_models.models.presets import PRESETS, get_preset
from dtmt_models.models.registry import build_model, list_models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEXICON = {"el": "the", "perro": "dog", "gato": "cat", "come": "eats", "ve": "sees", "casa": "house",
           "grande": "big", "rojo": "red", "hombre": "man", "mujer": "woman", "agua": "water", "pan": "bread",
           "bebe": "drinks", "y": "and", "niño": "child"}


def make_toy_corpus(directory, n_train=600, n_dev=30, n_test=30, seed=0):
    """A word-for-word toy translation task: learnable in a few hundred updates of a tiny model."""
    import random

    rng = random.Random(seed)
    words = sorted(LEXICON)
    counts = {}
    for split, n in (("train", n_train), ("dev", n_dev), ("test", n_test)):
        pairs = []
        for _ in range(n):
            ws = [rng.choice(words) for _ in range(rng.randint(2, 8))]
            pairs.append((" ".join(ws), " ".join(LEXICON[w] for w in ws)))
        if n:
            write_parallel(pairs, os.path.join(directory, f"{split}.es"), os.path.join(directory, f"{split}.en"))
            counts[split] = n
    write_manifest(str(directory), "es", "en", counts, origin="toy")
    return str(directory)


TINY = ["--model", "dtmt", "--vocab-size", "60", "--opt", "embed_dim=32", "--opt", "hidden_size=32",
        "--max-tokens", "400", "--progress", "lines", "--threads", "1"]


def run_train(args, timeout=300, env=None):
    cmd = [sys.executable, "-m", "dtmt_models.cli.train", *args]
    e = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e)


def train_here(args, capsys):
    """`dtmt train ARGS` in this process, as run_train's result (exit code, stdout, stderr): for runs that stop
    before or after a few updates, without starting another interpreter and torch (3-7 s each here)."""
    from dtmt_models.cli import train

    capsys.readouterr()
    try:
        code = train.main(list(args))
    except SystemExit as stop:   # argparse's refusals (status 2) and --help (0), as the process would end
        code = 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def two_processes(data, out, port, args, rank_args=lambda rank: []):
    """`dtmt train` as the two processes of one run, started without torchrun (which would end one process itself
    when the other ends): each with its RANK, stdout and stderr piped; `rank_args(rank)` added to its options."""
    env = dict(os.environ, PYTHONPATH=ROOT, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    env.pop("TORCHELASTIC_RUN_ID", None)   # (started by hand, whatever launched the tests)
    return [subprocess.Popen([sys.executable, "-m", "dtmt_models.cli.train", "--data", data, "--out", str(out), *args,
                              *rank_args(rank)], env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]


def until_an_update(proc):
    """proc's stdout lines up to the first update's log line (a run of --log-every 1 has then begun)."""
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("epoch ") and " loss " in line:
            break
    return seen


def losses(out_dir):
    with open(os.path.join(out_dir, "train_log.csv"), newline="") as f:
        return [(int(r["step"]), r["loss"], r["nll"]) for r in csv.DictReader(f) if r["kind"] == "train"]


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy_corpus(tmp_path_factory.mktemp("toy"))


@pytest.fixture(scope="module")
def toy_nodev(tmp_path_factory):
    return make_toy_corpus(tmp_path_factory.mktemp("toy_nodev"), n_dev=0, n_test=0)


@pytest.fixture(scope="module")
def uninterrupted(toy, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("run_a"))
    r = run_train(["--data", toy, "--out", out, "--max-steps", "24", "--log-every", "1", "--valid-every", "10",
                   "--keep-last", "2", *TINY])
    assert r.returncode == 0, r.stderr
    return out


def test_the_log_has_the_wall_time_beside_the_training_time(uninterrupted):
    """train_log.csv's wall_s (the process's wall time since it began: data reading, validation and checkpoints
    included, what a like-for-like clock against another toolkit counts) grows row by row and is never below the
    time inside updates (elapsed_s); a validation row's wall time includes the validation itself."""
    with open(os.path.join(uninterrupted, "train_log.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    wall = [float(r["wall_s"]) for r in rows]
    assert len(rows) == 24 + 3 and wall == sorted(wall) and wall[0] > 0
    assert all(float(r["wall_s"]) >= float(r["elapsed_s"]) for r in rows)
    valid = [i for i, r in enumerate(rows) if r["kind"] == "valid"]
    assert valid and all(wall[i] >= wall[i - 1] for i in valid)


def test_keep_last_keeps_the_models_of_the_last_validations(uninterrupted):
    from dtmt_models.models.checkpoint import read_checkpoint
    from dtmt_models.training.trainer import step_checkpoints

    kept = step_checkpoints(uninterrupted)     # validations at 10, 20 and the end (24); the oldest removed
    assert [step for step, _ in kept] == [20, 24]
    last, at20, at24 = (read_checkpoint(p) for p in (os.path.join(uninterrupted, "last.pt"), kept[0][1], kept[1][1]))
    assert at24["step"] == 24 and at20["step"] == 20 and "training" not in at24   # the model, not the optimizer
    for name, value in last["model"].items():
        assert torch.equal(at24["model"][name], value), name
    assert any(not torch.equal(at20["model"][n], v) for n, v in last["model"].items())


def test_resume_gives_the_same_losses(toy, uninterrupted, tmp_path):
    """Stopping at step 13 (mid-epoch, after a validation) and resuming reproduces every later loss exactly."""
    out = str(tmp_path / "run_b")
    r = run_train(["--data", toy, "--out", out, "--max-steps", "13", "--log-every", "1", "--valid-every", "10",
                   *TINY])
    assert r.returncode == 0, r.stderr
    assert len(losses(out)) == 13
    r = run_train(["--data", toy, "--out", out, "--resume", "--max-steps", "24", "--log-every", "1",
                   "--progress", "lines"])
    assert r.returncode == 0, r.stderr
    assert "resumed from step 13" in r.stdout
    a, b = losses(uninterrupted), losses(out)
    assert [s for s, *_ in a] == list(range(1, 25))
    assert a == b                       # the strings of the float reprs: bitwise equal
    assert len({x[1] for x in a}) > 20  # and they do change from step to step

    def validations(run):
        with open(os.path.join(run, "train_log.csv"), newline="") as f:
            return {int(r["step"]): r["dev_loss"] for r in csv.DictReader(f) if r["kind"] == "valid"}
    # the first run validated at its end (13), which stays: the uninterrupted run's validations, and that one more
    # (docs/usage.md, "Resume")
    whole, extended = validations(uninterrupted), validations(out)
    assert list(whole) == [10, 20, 24] and list(extended) == [10, 13, 20, 24]
    assert {k: v for k, v in extended.items() if k != 13} == whole


def test_log_windows_survive_a_resume_and_the_last_one_is_written(toy, tmp_path, capsys):
    """With --log-every 5 a row is the mean over its five updates: a run stopped at 13 and resumed writes at 15 the
    mean over 11-15, as the uninterrupted run (the window in progress is in last.pt; a Ctrl-C lost it), and every run
    ends with the row of its last, partial window (a run shorter than --log-every wrote none)."""
    args = ["--data", toy, "--log-every", "5", "--valid-every", "10", *TINY]
    whole, part = str(tmp_path / "whole"), str(tmp_path / "part")
    assert train_here([*args, "--out", whole, "--max-steps", "24"], capsys).returncode == 0
    assert train_here([*args, "--out", part, "--max-steps", "13"], capsys).returncode == 0
    assert [s for s, *_ in losses(part)] == [5, 10, 13]                      # 13: the mean over 11-13
    r = train_here(["--data", toy, "--out", part, "--resume", "--max-steps", "24", "--log-every", "5"], capsys)
    assert r.returncode == 0, r.stderr
    assert [s for s, *_ in losses(whole)] == [5, 10, 15, 20, 24]
    assert [row for row in losses(part) if row[0] != 13] == losses(whole)   # 15: over 11-15 in both, bit for bit
    short = str(tmp_path / "short")
    assert train_here([*args, "--out", short, "--max-steps", "3", "--log-every", "50"], capsys).returncode == 0
    assert [s for s, *_ in losses(short)] == [3]


def test_a_run_resumed_at_its_last_update_writes_the_row_its_interruption_left_out(toy, tmp_path, capsys):
    """Interrupted during its last update, a run saves the window of that update unwritten; the resumed run, with no
    update left to make, had left its row out of the log (a review found it). It writes it where the log lacks it,
    and a finished run resumed writes no second one."""
    part = str(tmp_path / "part")
    args = ["--data", toy, "--out", part, "--log-every", "5", "--valid-every", "100", "--max-steps", "13"]
    assert train_here([*args, *TINY], capsys).returncode == 0
    rows = losses(part)
    assert [s for s, *_ in rows] == [5, 10, 13]
    log = os.path.join(part, "train_log.csv")
    with open(log) as f:
        lines = f.readlines()
    with open(log, "w") as f:   # (as the interrupted run left it: the row of 11-13 not written)
        f.writelines(line for line in lines if not line.startswith("train,13,"))
    r = train_here([*args, "--resume"], capsys)
    assert r.returncode == 0, r.stderr
    assert losses(part) == rows
    r = train_here([*args, "--resume"], capsys)   # (finished, its row there: not written again)
    assert r.returncode == 0 and losses(part) == rows, r.stderr


def test_a_run_that_stopped_early_stays_stopped_on_resume(uninterrupted, toy, tmp_path, capsys):
    """Resuming a run whose patience ran out stops at once, saying so (it trained another --valid-every updates
    before stopping again); no new rows."""
    from dtmt_models.models.checkpoint import read_checkpoint, save_checkpoint

    out = str(tmp_path / "run")
    shutil.copytree(uninterrupted, out)
    last = read_checkpoint(os.path.join(out, "last.pt"))
    last["training"]["bad_validations"] = 5                      # as if the last five validations had not improved
    last["training"]["stopped_early_by"] = "loss"                # and the run had stopped for it
    last.pop("format")
    save_checkpoint(os.path.join(out, "last.pt"), last)
    before = losses(out)
    r = train_here(["--data", toy, "--out", out, "--resume", "--max-steps", "40", "--progress", "lines"], capsys)
    assert r.returncode == 0, r.stderr
    assert "in 5 validations (early stopping, before this resume; a larger --patience goes on)" in r.stdout, r.stdout
    assert read_checkpoint(os.path.join(out, "last.pt"))["training"]["step"] == 24 and losses(out) == before
    r = train_here(["--data", toy, "--out", out, "--resume", "--max-steps", "26", "--patience", "6"],   # goes on
                   capsys)
    assert r.returncode == 0 and "reached --max-steps 26" in r.stdout, r.stdout
    # a --max-steps below the updates made: it says so (it read as if the run had stopped there)
    r = train_here(["--data", toy, "--out", out, "--resume", "--max-steps", "10", "--patience", "6"], capsys)
    assert r.returncode == 0 and ("reached --max-steps 10 (the run was past it, at update 26, before this resume)"
                                  in r.stdout), r.stdout


def test_a_resume_without_the_run_s_log_says_the_earlier_rows_are_gone(uninterrupted, toy, tmp_path, capsys):
    """A run whose train_log.csv was removed resumed with a log starting at the next update, without a word."""
    out = str(tmp_path / "run")
    shutil.copytree(uninterrupted, out)
    os.remove(os.path.join(out, "train_log.csv"))
    r = train_here(["--data", toy, "--out", out, "--resume", "--max-steps", "25"], capsys)
    assert r.returncode == 0, r.stderr
    assert (f"warning: {os.path.join(out, 'train_log.csv')} is missing: the log goes on from update 25, without "
            f"the rows of the updates before") in r.stdout, r.stdout
    assert [s for s, *_ in losses(out)] == [25]


def test_pairs_over_the_batch_budget_are_announced(toy_nodev, tmp_path, capsys):
    r = train_here(["--data", toy_nodev, "--out", str(tmp_path / "a"), "--max-steps", "1", *TINY, "--max-tokens",
                    "6"], capsys)
    assert r.returncode == 0, r.stderr
    assert "training pairs are longer than --max-tokens 6 allows a batch" in r.stdout, r.stdout


def test_train_removes_what_an_interrupted_run_left_and_only_build_folders_in_data(toy_nodev, tmp_path, capsys):
    """dtmt train removes its interrupted runs' temporaries in --out (an atomic write's file) and the build folders
    of a binarized copy in --data; an atomic write's name in --data is no file of its (it writes none there): a
    user's .backup.tmpPID there had been removed (a review found it)."""
    import shutil
    import subprocess as sp

    gone = sp.Popen(["true"])
    gone.wait()   # a process id that no process has now
    data_dir, out = tmp_path / "data", tmp_path / "run"
    shutil.copytree(toy_nodev, data_dir)
    out.mkdir()
    stale = [out / f".last.pt.tmp{gone.pid}", data_dir / f".bin-bpe40.tmp-{gone.pid}"]
    stale[0].write_text("x")
    stale[1].mkdir()
    kept = data_dir / f".backup.tmp{gone.pid}"
    kept.write_text("a user's")
    # in --out only the temporaries of the run's own files go: a user's `.thesis.tmpPID` folder had been removed
    # whole, a `.notes.tmpPID` file too (a review's)
    users = [out / f".notes.tmp{gone.pid}", out / f".thesis.tmp{gone.pid}" / "ch1.tex",
             out / f".curve.png.tmp{gone.pid}.png"]
    users[1].parent.mkdir()
    for path in users:
        path.write_text("a user's")
    stale.append(out / f".step_0000040.pt.tmp{gone.pid}")
    stale[-1].write_text("x")
    r = train_here(["--data", str(data_dir), "--out", str(out), "--max-steps", "1", *TINY], capsys)
    assert r.returncode == 0, r.stderr
    assert not any(p.exists() for p in stale) and kept.read_text() == "a user's"
    assert all(p.read_text() == "a user's" for p in users)
    assert r.stderr.count("left by an interrupted run") == 3, r.stderr


def test_a_run_s_folder_holding_what_is_not_a_run_s_is_refused_before_any_work(toy_nodev, tmp_path, capsys):
    """A review's, each refused in one line, exit 2, before any work: a user's own learning_curve.png (no checkpoint
    beside it) had been replaced without a word; a file named tensorboard ended the run after its data was read
    (exit 1); a lock file that is a link (planted in a shared folder) had its target truncated to the process id.
    With --overwrite, a TensorBoard folder that is a link keeps the event files there (another run's were removed)."""
    for case in ("curve", "board", "lock"):
        out = tmp_path / case
        out.mkdir()
        victim = tmp_path / f"{case}.txt"
        victim.write_text("a user's")
        if case == "curve":
            (out / "learning_curve.png").write_text("a user's")
            said = f"--out {out}: its learning_curve.png is not a dtmt run's (no run's checkpoint or config.yaml"
        elif case == "board":
            (out / "tensorboard").write_text("a user's")
            said = f"--out {out}: tensorboard there is not a folder"
        else:
            os.symlink(victim, out / ".dtmt-train.lock")
            said = f"--out {out}: cannot be written (its lock file {out / '.dtmt-train.lock'} is a symbolic link)"
        r = train_here(["--data", toy_nodev, "--out", str(out), "--max-steps", "1", *TINY], capsys)
        assert r.returncode == 2 and r.stderr.startswith(f"dtmt train: {said}"), r.stderr
        assert r.stderr.count("\n") == 1 and victim.read_text() == "a user's"
        assert sorted(os.listdir(out)) == [{"curve": "learning_curve.png", "board": "tensorboard",
                                            "lock": ".dtmt-train.lock"}[case]]
    shared = tmp_path / "shared_board"
    shared.mkdir()
    theirs = shared / "events.out.tfevents.1.other"
    theirs.write_text("another run's")
    out = tmp_path / "linked"
    r = train_here(["--data", toy_nodev, "--out", str(out), "--max-steps", "1", *TINY], capsys)
    assert r.returncode == 0, r.stderr
    import shutil
    shutil.rmtree(out / "tensorboard")
    os.symlink(shared, out / "tensorboard")
    r = train_here(["--data", toy_nodev, "--out", str(out), "--max-steps", "1", "--overwrite", *TINY], capsys)
    assert r.returncode == 0 and theirs.read_text() == "another run's", r.stderr


def test_ctrl_c_before_training_is_one_line_and_130(toy_nodev, tmp_path, monkeypatch, capsys):
    """Ctrl-C while the options and the model are checked (a second or two after starting): one line and 130, as
    for any dtmt command (it was a 90-line traceback and status 1)."""
    from dtmt_models import cli
    from dtmt_models.cli import train

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(train, "check_model_options", interrupted)
    out = tmp_path / "run"
    r = train_here(["--data", toy_nodev, "--out", str(out), "--max-steps", "1", *TINY], capsys)
    assert r.returncode == 130 and r.stderr.strip() == "dtmt train: interrupted before training started", r.stderr
    assert not out.exists()
    # ... while the trainer reads the corpus and builds the model: it said "aborted ()" and left the folder it made
    from dtmt_models.training import trainer as trainer_module
    monkeypatch.undo()
    monkeypatch.setattr(trainer_module.Trainer, "_binarized", interrupted)
    r = train_here(["--data", toy_nodev, "--out", str(out), "--max-steps", "1", *TINY], capsys)
    assert r.returncode == 130 and r.stderr.strip() == "dtmt train: interrupted before training started", r.stderr
    assert not out.exists()
    # SIGTERM then (a review's: the process died without a word, exit 143, the new --out left holding the lock file):
    # as Ctrl-C, its own line and status
    import signal

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)   # (the handler runs at once: never slept through)
        raise AssertionError("SIGTERM did not stop the run")
    monkeypatch.setattr(trainer_module.Trainer, "_binarized", terminated)
    before = signal.getsignal(signal.SIGTERM)
    r = train_here(["--data", toy_nodev, "--out", str(out), "--max-steps", "1", *TINY], capsys)
    assert r.returncode == 143 and r.stderr.strip() == "dtmt train: terminated (SIGTERM) before training started", \
        r.stderr
    assert not out.exists() and signal.getsignal(signal.SIGTERM) is before   # (the handler given back)
    monkeypatch.setattr(train, "main", interrupted)   # a command without a handler of its own
    assert cli.main(["train", "--data", toy_nodev]) == 130
    assert capsys.readouterr().err.strip() == "dtmt train: interrupted"


def test_a_log_that_cannot_be_written_saves_last_pt_first(toy_nodev, tmp_path, monkeypatch, capsys):
    """A review's: the log becoming unwritable (a read-only file, a full disk, a file-size limit) ended the run with
    its updates since the last last.pt lost (up to a validation interval's; none at all in a run without a dev
    split). last.pt is saved at the update the log failed at, the error says so in one line (exit 1), and --resume
    goes on to the end."""
    from dtmt_models.models.checkpoint import read_checkpoint
    from dtmt_models.training import trainer as trainer_module

    append = trainer_module.CsvLog._append

    def failing(self, row):
        if row.get("kind") == "train" and str(row.get("step")) == "3":
            raise trainer_module.LogWriteError(f"cannot write {self.path}: File too large (the log keeps its rows up "
                                               f"to the last one written)")
        return append(self, row)
    monkeypatch.setattr(trainer_module.CsvLog, "_append", failing)
    out = tmp_path / "run"
    r = train_here(["--data", toy_nodev, "--out", str(out), "--max-steps", "5", "--log-every", "1", *TINY], capsys)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"dtmt train: cannot write {out / 'train_log.csv'}: File too large") and \
        r.stderr.rstrip().endswith(f"{out / 'last.pt'} saved at update 3: resume with --resume once the log can be "
                                   f"written"), r.stderr
    assert read_checkpoint(str(out / "last.pt"))["training"]["step"] == 3
    monkeypatch.undo()
    r = train_here(["--data", toy_nodev, "--out", str(out), "--max-steps", "5", "--log-every", "1", "--resume",
                    *TINY], capsys)
    assert r.returncode == 0 and read_checkpoint(str(out / "last.pt"))["training"]["step"] == 5, r.stderr


def signalled_in_validation(step):
    """Trainer.validate, with a SIGINT coming during the validation at update `step` (recorded as the run's handler
    records it)."""
    from dtmt_models.training.trainer import Trainer

    validate = Trainer.validate

    def signalled(self):
        stop = validate(self)
        if self.step == step:
            self._signal = "SIGINT"
        return stop
    return signalled


def test_a_signal_during_the_last_validation_leaves_a_complete_run(toy, tmp_path, monkeypatch, capsys):
    """SIGINT during the validation at --max-steps: the run had reached its end and saved it, yet exited 130 saying
    "resume with ...", and the resume did nothing. It now says the run is complete, exit 0."""
    from dtmt_models.training.trainer import Trainer

    monkeypatch.setattr(Trainer, "validate", signalled_in_validation(4))
    r = train_here(["--data", toy, "--out", str(tmp_path / "run"), "--max-steps", "4", "--valid-every", "2", *TINY],
                   capsys)
    assert r.returncode == 0 and "SIGINT came as the run ended: it is complete, nothing to resume" in r.stdout, r.stdout
    assert "resume with" not in r.stdout and "reached --max-steps 4" in r.stdout


def test_a_signal_during_a_validation_stops_before_the_next_update(toy, uninterrupted, tmp_path, monkeypatch,
                                                                   capsys):
    """SIGINT during the validation at update 10 of 24: the run trained update 11 before it stopped (what it had
    said it would do: 'finishing this update'). It now stops at 10, and the resumed run writes the uninterrupted
    run's losses and validations."""
    from dtmt_models.models.checkpoint import read_checkpoint
    from dtmt_models.training.trainer import Trainer

    out = str(tmp_path / "run")
    args = ["--data", toy, "--out", out, "--max-steps", "24", "--log-every", "1", "--valid-every", "10",
            "--keep-last", "2", *TINY]
    with monkeypatch.context() as m:
        m.setattr(Trainer, "validate", signalled_in_validation(10))
        r = train_here(args, capsys)
    assert r.returncode == 130 and "interrupted by SIGINT" in r.stdout and "resume with" in r.stdout, r.stdout
    state = read_checkpoint(os.path.join(out, "last.pt"))["training"]
    assert (state["step"], state["validated_step"]) == (10, 10)
    assert train_here([*args, "--resume"], capsys).returncode == 0
    assert losses(out) == losses(uninterrupted)
    with open(os.path.join(out, "train_log.csv"), newline="") as f:
        assert [r["step"] for r in csv.DictReader(f) if r["kind"] == "valid"] == ["10", "20", "24"]


def test_dev_split_settings_and_a_missing_dev_file(toy, toy_nodev, tmp_path, capsys):
    """Without a dev split, --patience / --best-by that would change nothing get a warning; a dev split the manifest
    lists whose target file is gone is an error naming the file (it was taken for 'no dev split', then failed
    later with contradictory messages)."""
    r = train_here(["--data", toy_nodev, "--out", str(tmp_path / "a"), "--max-steps", "1", *TINY, "--patience", "3",
                    "--best-by", "bleu"], capsys)
    code, out, err = r.returncode, r.stdout, r.stderr
    assert code == 0 and "warning: --patience 3 and --best-by bleu have no effect without a dev split" in out, out
    # ... nor --keep-last (no step checkpoints: a user planning to average them got none, without a word), nor the
    # dev BLEU settings; and the learning curve is drawn from the training rows (there was none)
    r = train_here(["--data", toy_nodev, "--out", str(tmp_path / "k"), "--max-steps", "2", *TINY, "--keep-last", "3",
                    "--valid-beam", "4", "--valid-every", "1"], capsys)
    assert r.returncode == 0 and ("warning: --keep-last 3 and --valid-beam 4 have no effect without a dev split"
                                  in r.stdout), r.stdout
    assert (tmp_path / "k" / "learning_curve.png").is_file() and not list((tmp_path / "k").glob("step_*.pt"))
    broken = str(tmp_path / "broken")
    shutil.copytree(toy, broken)
    os.remove(os.path.join(broken, "dev.en"))
    r = train_here(["--data", broken, "--out", str(tmp_path / "b"), "--max-steps", "1", *TINY], capsys)
    code, out, err = r.returncode, r.stdout, r.stderr
    assert code == 2 and "dev.en: no such file" in err and "Traceback" not in err, err
    assert "has no dev split" not in out


def test_sigint_saves_a_checkpoint_that_resumes_exactly(toy, uninterrupted, tmp_path):
    out = str(tmp_path / "run_c")
    cmd = [sys.executable, "-m", "dtmt_models.cli.train", "--data", toy, "--out", out, "--max-steps", "24",
           "--log-every", "1", "--valid-every", "10", *TINY]
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    log = os.path.join(out, "train_log.csv")
    deadline = time.time() + 120
    while time.time() < deadline:
        if os.path.isfile(log) and len(losses(out)) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "SIGINT" in stdout and "--resume" in stdout
    from dtmt_models.models.checkpoint import read_checkpoint

    ckpt = read_checkpoint(os.path.join(out, "last.pt"))
    stopped = ckpt["training"]["step"]
    assert 3 <= stopped < 24 and len(losses(out)) == stopped
    r = run_train(["--data", toy, "--out", out, "--resume", "--max-steps", "24", "--progress", "lines"])
    assert r.returncode == 0, r.stderr
    assert losses(out) == losses(uninterrupted)


def test_a_run_interrupted_at_an_update_due_for_validation_validates_it_when_resumed(toy, uninterrupted, tmp_path,
                                                                                    capsys, monkeypatch):
    """Found by a probe: a signal during an update due for validation (here update 10 of --valid-every 10) stopped
    the run before that validation, and the resumed run went on from update 11: the validation, its step_N.pt and
    its chance at best.pt were lost (11 of 12 validations with --valid-every 1). last.pt keeps the update of the
    last validation, and the resumed run validates first: the log's validation rows, the kept step checkpoints and
    best.pt are the uninterrupted run's."""
    from dtmt_models.models.checkpoint import read_checkpoint
    from dtmt_models.training import trainer
    from dtmt_models.training.trainer import step_checkpoints

    update = trainer.Trainer.train_step

    def signalled(self, batch):   # SIGINT arriving during update 10
        if self.step == 9:
            os.kill(os.getpid(), signal.SIGINT)
        return update(self, batch)

    out = str(tmp_path / "run")
    args = ["--data", toy, "--out", out, "--max-steps", "24", "--log-every", "1", "--valid-every", "10",
            "--keep-last", "2", *TINY]
    with monkeypatch.context() as m:
        m.setattr(trainer.Trainer, "train_step", signalled)
        assert train_here(args, capsys).returncode == 130
    state = read_checkpoint(os.path.join(out, "last.pt"))["training"]
    assert (state["step"], state["validated_step"]) == (10, 0)
    r = train_here([*args, "--resume"], capsys)
    assert r.returncode == 0, r.stderr

    def validations(folder):
        with open(os.path.join(folder, "train_log.csv"), newline="") as f:
            return [(r["step"], r["dev_loss"], r["dev_bleu"]) for r in csv.DictReader(f) if r["kind"] == "valid"]

    assert [v[0] for v in validations(out)] == ["10", "20", "24"]
    assert validations(out) == validations(uninterrupted) and losses(out) == losses(uninterrupted)
    assert [s for s, _ in step_checkpoints(out)] == [s for s, _ in step_checkpoints(uninterrupted)] == [20, 24]
    mine, theirs = (read_checkpoint(os.path.join(f, "best.pt")) for f in (out, uninterrupted))
    assert mine["step"] == theirs["step"] and all(torch.equal(mine["model"][k], v) for k, v in theirs["model"].items())


def test_the_log_shows_the_learning_rate_each_update_took(toy_nodev, tmp_path, capsys):
    """train_log.csv's lr beside update k is the rate update k took: paper 000 eq. 17 at t = k - 1, written out here
    (warm-up to n lr0, hold, exponential decay, the 0.05 lr0 floor), with n = 2 replicas, p = 2, s = 4, e = 8; the
    log line the same. (Until 2026-12-01 the row showed the next update's rate: the scheduler had stepped before it
    was read.)"""
    out = tmp_path / "run"
    r = train_here([*TINY, "--data", toy_nodev, "--out", str(out), "--max-steps", "9", "--log-every", "1",
                    "--schedule", "rnmt", "--lr", "1e-3", "--warmup", "2", "--decay-start", "4", "--decay-end", "8",
                    "--replicas", "2"], capsys)
    assert r.returncode == 0, r.stderr

    def eq17(t, n=2, p=2, s=4, e=8, lr0=1e-3):
        return lr0 * max(min(1 + t * (n - 1) / (n * p), n, n * (2 * n) ** ((s - n * t) / (e - s))), 0.05)

    with open(out / "train_log.csv", newline="") as f:
        rows = [(int(row["step"]), float(row["lr"])) for row in csv.DictReader(f) if row["kind"] == "train"]
    assert [k for k, _ in rows] == list(range(1, 10))
    for k, lr in rows:
        assert lr == pytest.approx(eq17(k - 1), rel=1e-12), (k, lr, eq17(k - 1))
    # by hand: warm-up 1, 1.25, 1.5 (the hold at n = 2 cut by the decay from n t > s), decay 2 (2n)^((s - n t) / (e -
    # s)) = 1, 0.5, ... halving, floored at 0.05
    assert [round(lr / 1e-3, 4) for _, lr in rows] == [1.0, 1.25, 1.5, 1.0, 0.5, 0.25, 0.125, 0.0625, 0.05]
    assert "step 1 loss" in r.stdout and "lr 1.00e-03" in r.stdout.split("step 2 loss")[0]


def _replayed_run(toy_nodev, out, capsys, flags, updates=3):
    """`dtmt train` for `updates` updates with `flags` (dropout off, a loss row each update), and what is needed to
    write its updates out: (last.pt, the run's model at its initial weights in float64, the collated batches the run
    took, the logged losses)."""
    from dtmt_models.data import binarized
    from dtmt_models.data.batching import collate, kept_indices, length_dtype, token_batches
    from dtmt_models.data.vocabulary import Vocabulary

    r = train_here([*TINY, "--data", toy_nodev, "--out", str(out), "--max-steps", str(updates), "--log-every", "1",
                    "--opt", "dropout=0", "--opt", "candidate_dropout=0", *flags], capsys)
    assert r.returncode == 0, r.stderr
    ckpt = torch.load(out / "last.pt", weights_only=False)
    cfg = ckpt["config"]
    corpus = binarized.open_binarized(toy_nodev, cfg["vocab_type"], cfg["vocab_size"])
    train = corpus.split("train")
    lengths = train.lengths(length_dtype(cfg["max_len"]))
    batches = token_batches(lengths, cfg["max_tokens"], seed=cfg["seed"], epoch=0,
                            keep=kept_indices(lengths, cfg["max_len"]))[:updates]
    torch.manual_seed(cfg["seed"])   # the run's initial weights
    model = build_model("dtmt", len(Vocabulary(corpus.protos[0])), len(Vocabulary(corpus.protos[1])),
                        **ckpt["model_options"]).double().train()
    return ckpt, model, [collate(train.pairs(batch)) for batch in batches], [float(loss) for _, loss, _ in losses(out)]


def _smoothed_loss(model, batch, eps):
    """The label-smoothed loss per target token of a collated batch, from the model's log-probabilities."""
    src, src_lengths, prev, target = batch
    log_probs = model(src, src_lengths, prev)                               # [B, T, V]
    keep = target.ne(0)
    nll = -log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return (((1 - eps) * nll - eps * log_probs.mean(-1)) * keep).sum() / keep.sum()


def _clipped(grads, bound):
    """The gradients clipped to global norm `bound` by torch's clip_grad_norm_ rule (the test needs it to act)."""
    norm = torch.sqrt(sum((g * g).sum() for g in grads))
    assert norm > bound, "the clipping must act for the test to see it"
    return [g * (bound / (norm + 1e-6)) for g in grads]


def test_three_updates_of_dtmt_train_are_the_papers_update_written_out(toy_nodev, tmp_path, capsys):
    """`dtmt train` against its update written out here: the label-smoothed loss per target token from the model's
    log-probabilities, the gradient norm clipped by hand, Adam (β = 0.9, 0.998, ε = 1e-9, bias-corrected) by hand
    at the schedule's rate (paper 000 eq. 17), in float64 on the batches the run took. Three updates, with clipping
    on (at 0.5 the norm is cut at every one); dropout off. Compared: each logged loss, Adam's moments in last.pt
    (linear in the clipped gradients: they see the clipping, the 1/tokens, β1 and β2), and the parameters to 5e-7
    (float32's rounding of them: 3.5e-8 measured; a rate 1% off moves them 1e-5) where Adam's step is well
    conditioned (an element whose gradient is nonzero but within 1e-5 of the largest, float32's rounding of 0, has
    a step of ± lr either way; 94% of them are checked)."""
    ckpt, model, batches, logged = _replayed_run(
        toy_nodev, tmp_path / "run", capsys, ["--schedule", "rnmt", "--lr", "1e-3", "--warmup", "2", "--decay-start",
                                              "4", "--decay-end", "8", "--replicas", "2", "--smoothing", "0.1",
                                              "--clip", "0.5"])
    params = list(model.parameters())
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    ill = [torch.zeros_like(p, dtype=torch.bool) for p in params]
    b1, b2 = 0.9, 0.998
    for t, batch in enumerate(batches, start=1):
        loss = _smoothed_loss(model, batch, 0.1)
        assert logged[t - 1] == pytest.approx(loss.item(), rel=1e-5), t
        grads = _clipped(torch.autograd.grad(loss, params), 0.5)
        lr = 1e-3 * min(1 + (t - 1) * (2 - 1) / (2 * 2), 2, 2 * 4 ** ((4 - 2 * (t - 1)) / (8 - 4)))
        largest = max(g.abs().max() for g in grads)
        with torch.no_grad():
            for p, g, mi, vi, bad in zip(params, grads, m, v, ill):
                mi.mul_(b1).add_((1 - b1) * g)
                vi.mul_(b2).add_((1 - b2) * g * g)
                p -= lr * (mi / (1 - b1 ** t)) / ((vi / (1 - b2 ** t)).sqrt() + 1e-9)
                bad |= (g != 0) & (g.abs() < 1e-5 * largest)
    names = [n for n, _ in model.named_parameters()]
    state = ckpt["training"]["optimizer"]["state"]
    checked = total = 0
    for i, (name, p) in enumerate(zip(names, params)):
        got = ckpt["model"][name].double()
        torch.testing.assert_close(state[i]["exp_avg"].double(), m[i], rtol=1e-4, atol=1e-4 * m[i].abs().max(),
                                   msg=lambda e: f"{name} m: {e}")
        torch.testing.assert_close(state[i]["exp_avg_sq"].double(), v[i], rtol=1e-3, atol=1e-3 * v[i].abs().max(),
                                   msg=lambda e: f"{name} v: {e}")
        good = ~ill[i]
        torch.testing.assert_close(got[good], p.detach()[good], rtol=0, atol=5e-7, msg=lambda e: f"{name}: {e}")
        checked, total = checked + int(good.sum()), total + p.numel()
    assert checked > 0.9 * total, (checked, total)


def test_three_adadelta_updates_are_zeilers_algorithm_written_out(toy_nodev, tmp_path, capsys):
    """--optimizer adadelta (paper 001 l.160-177) against Zeiler's Algorithm 1 written out here in float64:
    E[g²] ← ρ E[g²] + (1 - ρ) g²; Δx = -√(E[Δx²] + ε) / √(E[g²] + ε) g; E[Δx²] ← ρ E[Δx²] + (1 - ρ) Δx²; x ← x +
    lr Δx, on the clipped, label-smoothed gradients of the batches the run took (as the Adam test above). ρ, ε and
    the rate are not the defaults (0.9, 1e-5, 0.5), so that each flag is seen to reach the update. Compared: each
    logged loss, both accumulators in last.pt, and every parameter (Adadelta's step is smooth in the gradient: no
    element is left out)."""
    rho, eps, lr = 0.9, 1e-5, 0.5
    ckpt, model, batches, logged = _replayed_run(
        toy_nodev, tmp_path / "run", capsys, ["--optimizer", "adadelta", "--adadelta-rho", str(rho),
                                              "--adadelta-eps", str(eps), "--lr", str(lr), "--schedule", "constant",
                                              "--smoothing", "0.1", "--clip", "0.5"])
    params = list(model.parameters())
    sq = [torch.zeros_like(p) for p in params]
    acc = [torch.zeros_like(p) for p in params]
    for t, batch in enumerate(batches, start=1):
        loss = _smoothed_loss(model, batch, 0.1)
        assert logged[t - 1] == pytest.approx(loss.item(), rel=1e-5), t
        grads = _clipped(torch.autograd.grad(loss, params), 0.5)
        with torch.no_grad():
            for p, g, s, a in zip(params, grads, sq, acc):
                s.mul_(rho).add_((1 - rho) * g * g)
                step = -((a + eps).sqrt() / (s + eps).sqrt()) * g
                a.mul_(rho).add_((1 - rho) * step * step)
                p += lr * step
    group = ckpt["training"]["optimizer"]["param_groups"][0]
    assert (group["rho"], group["eps"], group["lr"]) == (rho, eps, lr)
    state = ckpt["training"]["optimizer"]["state"]
    for i, (name, p) in enumerate(model.named_parameters()):
        torch.testing.assert_close(state[i]["square_avg"].double(), sq[i], rtol=1e-4, atol=1e-4 * sq[i].abs().max(),
                                   msg=lambda e: f"{name} E[g²]: {e}")
        torch.testing.assert_close(state[i]["acc_delta"].double(), acc[i], rtol=1e-4, atol=1e-4 * acc[i].abs().max(),
                                   msg=lambda e: f"{name} E[Δx²]: {e}")
        torch.testing.assert_close(ckpt["model"][name].double(), p.detach(), rtol=0, atol=5e-7,
                                   msg=lambda e: f"{name}: {e}")   # (1.6e-7 at most measured)


def test_epoch_halving_halves_the_rate_after_each_epoch_and_resumes_exactly(toy_nodev, tmp_path, capsys,
                                                                            monkeypatch):
    """--schedule epoch-halving (paper 004 §4.2): every update of epoch k (from 1) takes lr0 / 2^(k-1), the first
    update of an epoch included (torch's scheduler computes a rate when it steps, after an update: the trainer sets
    the new epoch's before its first update), as Adam's step reads it and as the log shows it; last.pt holds the
    next update's rate; a run stopped inside the second epoch and resumed writes the losses and rates of an
    uninterrupted one."""
    applied = []
    adam_step = torch.optim.Adam.step

    def recording_step(self, *a, **k):
        applied.append(float(self.param_groups[0]["lr"]))
        return adam_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.Adam, "step", recording_step)
    args = [*TINY, "--data", toy_nodev, "--log-every", "1", "--schedule", "epoch-halving", "--lr", "1e-3"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    r = train_here([*args, "--out", str(whole), "--max-steps", "40"], capsys)
    assert r.returncode == 0, r.stderr

    def rows(out):
        with open(out / "train_log.csv", newline="") as f:
            return [(int(row["step"]), int(row["epoch"]), float(row["lr"]), row["loss"])
                    for row in csv.DictReader(f) if row["kind"] == "train"]

    logged = rows(whole)
    assert [s for s, _, _, _ in logged] == list(range(1, 41))
    epochs = sorted({e for _, e, _, _ in logged})
    assert epochs[:3] == [1, 2, 3], epochs                          # (the test needs two epoch boundaries)
    assert len(applied) == 40
    for step, epoch, lr, _ in logged:
        assert lr == applied[step - 1] == 1e-3 * 0.5 ** (epoch - 1), (step, epoch, lr, applied[step - 1])
    group = torch.load(whole / "last.pt", weights_only=False)["training"]["optimizer"]["param_groups"][0]
    assert group["lr"] == 1e-3 * 0.5 ** (logged[-1][1] - 1)      # (40 is not an epoch's last update here)
    first_of_2 = next(s for s, e, _, _ in logged if e == 2)
    r = train_here([*args, "--out", str(part), "--max-steps", str(first_of_2 + 2)], capsys)
    assert r.returncode == 0, r.stderr
    r = train_here([*args, "--out", str(part), "--max-steps", "40", "--resume"], capsys)
    assert r.returncode == 0, r.stderr
    assert [(s, e, lr, loss) for s, e, lr, loss in rows(part)] == logged
    # a run that ends with its second epoch: its last row (the window in progress, written after the loop) is the
    # second epoch's, at its rate (it read "epoch 3" until 2026-12-02)
    ended = tmp_path / "ended"
    r = train_here([*args, "--out", str(ended), "--max-epochs", "2", "--log-every", "7"], capsys)
    assert r.returncode == 0, r.stderr
    last = rows(ended)[-1]
    assert last[1] == 2 and last[2] == 5e-4 and last[0] == max(s for s, e, _, _ in logged if e == 2), last


def test_max_sentences_bounds_every_training_batch(toy_nodev, tmp_path, capsys, monkeypatch):
    """--max-sentences N: no update sees more than N sentence pairs (the budget alone gives more), and the setting is
    in config.yaml and fixed on --resume; 0 is refused in one line."""
    from dtmt_models.training import trainer

    sizes = []
    collate = trainer.collate
    monkeypatch.setattr(trainer, "collate", lambda pairs, *a: sizes.append(len(pairs)) or collate(pairs, *a))
    out = tmp_path / "run"
    r = train_here([*TINY, "--data", toy_nodev, "--out", str(out), "--max-steps", "6"], capsys)
    assert r.returncode == 0, r.stderr
    assert max(sizes) > 5, sizes
    sizes.clear()
    r = train_here([*TINY, "--data", toy_nodev, "--out", str(out), "--max-steps", "6", "--max-sentences", "5",
                    "--overwrite"], capsys)
    assert r.returncode == 0, r.stderr
    assert len(sizes) == 6 and max(sizes) == 5, sizes
    with open(out / "config.yaml") as f:
        assert "max_sentences: 5" in f.read()
    r = train_here([*TINY, "--data", toy_nodev, "--out", str(out), "--max-steps", "7", "--max-sentences", "6",
                    "--resume"], capsys)
    assert r.returncode == 2 and "--max-sentences 6 (the run's is 5)" in r.stderr
    r = train_here([*TINY, "--data", toy_nodev, "--out", str(tmp_path / "bad"), "--max-sentences", "0"], capsys)
    assert r.returncode == 2 and "--max-sentences 0: must be an integer in [1, " in r.stderr


@pytest.mark.parametrize("name", list_models())
def test_init_weights_draws_every_weight_but_layer_norms_and_padding(name):
    """init_weights (papers 000 l.194 and 004 §4.2: U(-0.08, 0.08); paper 001 l.157: N(0, 0.04²)): every parameter
    but layer norm's is drawn (uniform: each spans most of the interval and none leaves it; normal: the pooled draws'
    standard deviation is the scale's and their mean 0), the layer norms keep gain 1 and offset 0, the embeddings'
    padding rows stay 0; the same seed draws the same weights; a scale that is not a finite number > 0, or a law
    other than these two, is refused. The norms are found by what they are, not by the code's rule: a gain is the
    one parameter a fresh model holds at all ones, its offset the parameter of the same name with bias for weight
    (the reverse direction's too: a dtmt encoder's ln_weight_reverse was drawn until 2026-12-02)."""
    from dtmt_models.models.registry import init_weights

    torch.manual_seed(0)
    model = build_model(name, 30, 30, embed_dim=16, hidden_size=16)
    gains = {n for n, p in model.named_parameters() if torch.all(p == 1)}
    norms = gains | {n.replace("weight", "bias") for n in gains}
    assert norms <= dict(model.named_parameters()).keys(), norms
    if name == "dtmt":
        assert {"encoder.ln_weight_reverse", "encoder.tgru1_ln_bias_reverse"} <= norms
    for law, scale in (("uniform", 0.08), ("normal", 0.04)):
        torch.manual_seed(1)
        drawn = init_weights(model, law, scale)
        params = dict(model.named_parameters())
        assert drawn == len(params) - len(norms)
        pooled = []
        for n, p in params.items():
            if n in norms:
                assert torch.all(p == (1.0 if n in gains else 0.0)), n
            elif law == "uniform" and p.numel() >= 8:
                assert p.abs().max() <= 0.08 and p.abs().max() > 0.04, n
            elif law == "normal":
                pooled.append(p.detach().flatten())
        for m in model.modules():
            if isinstance(m, torch.nn.Embedding) and m.padding_idx is not None:
                assert torch.all(m.weight[m.padding_idx] == 0)
        if law == "normal":
            x = torch.cat(pooled)
            x = x[x.ne(0)]   # (the padding rows' zeros are not draws)
            assert x.numel() > 5000, x.numel()
            sd = 0.04 / (2 * x.numel()) ** 0.5   # (the standard error of the sample standard deviation)
            assert abs(x.std().item() - 0.04) < 5 * sd and abs(x.mean().item()) < 5 * 0.04 / x.numel() ** 0.5
        again = build_model(name, 30, 30, embed_dim=16, hidden_size=16)
        torch.manual_seed(1)
        init_weights(again, law, scale)
        assert all(torch.equal(p, params[n]) for n, p in again.named_parameters())
    for bad in (0, -0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale must be a finite number > 0"):
            init_weights(model, "normal", bad)
    with pytest.raises(ValueError, match="law must be one of"):
        init_weights(model, "xavier", 0.1)


def test_init_uniform_flag_reaches_the_model(toy_nodev, tmp_path, capsys):
    """--init-uniform 0.05: the run's first weights are U(-0.05, 0.05) (one update at lr 1e-3 moves each by about
    1e-3), the setting is in config.yaml; 0 is each module's own, below 0 refused in one line."""
    out = tmp_path / "run"
    r = train_here([*TINY, "--data", toy_nodev, "--out", str(out), "--max-steps", "1", "--lr", "1e-3",
                    "--init-uniform", "0.05"], capsys)
    assert r.returncode == 0, r.stderr
    weights = torch.load(out / "last.pt", weights_only=False)["model"]
    w = weights["encoder.weight_hh"]
    assert 0.04 < w.abs().max() <= 0.05 + 2e-3, w.abs().max()
    with open(out / "config.yaml") as f:
        assert "init_uniform: 0.05" in f.read()
    r = train_here([*TINY, "--data", toy_nodev, "--out", str(tmp_path / "bad"), "--init-uniform", "-1"], capsys)
    assert r.returncode == 2 and "--init-uniform -1: must be a finite number >= 0" in r.stderr


def test_adam_settings_reach_the_optimizer_and_the_presets_hold_the_papers(toy_nodev, tmp_path, capsys):
    """--adam-beta2 and --adam-eps are the optimizer's (last.pt's param groups, config.yaml); the small presets keep
    0.998 / 1e-9; the paper presets take each paper's own Adam: 000 l.194 (0.999, 1e-6), 003 l.227 (0.98, 1e-9),
    004 §4.2 and Nematus for 002 (0.999, Kingma and Ba's 1e-8); paper 004 names no label smoothing."""
    out = tmp_path / "run"
    r = train_here([*TINY, "--data", toy_nodev, "--out", str(out), "--max-steps", "1", "--adam-beta2", "0.98",
                    "--adam-eps", "1e-6"], capsys)
    assert r.returncode == 0, r.stderr
    group = torch.load(out / "last.pt", weights_only=False)["training"]["optimizer"]["param_groups"][0]
    assert tuple(group["betas"]) == (0.9, 0.98) and group["eps"] == 1e-6
    with open(out / "config.yaml") as f:
        text = f.read()
    assert "adam_beta2: 0.98" in text and "adam_eps: 1.0e-06" in text
    adam = {name: (get_preset(model, preset)["train"]["adam_beta2"], get_preset(model, preset)["train"]["adam_eps"])
            for name, model, preset in (("small", "dtmt", "small"), ("000", "dtmt", "000-T3-dtmt4"),
                                        ("000-paper", "dtmt", "paper"), ("002", "nematus", "002-T4-bideep-4x2"),
                                        ("003", "mce", "003-T1-ntm"), ("004", "rnnsearch-atr", "004-T4-rnnsearch-atr"),
                                        ("004-gnmt", "gnmt-atr", "paper"))}
    assert adam == {"small": (0.998, 1e-9), "000": (0.999, 1e-6), "000-paper": (0.999, 1e-6),
                    "002": (0.999, 1e-8), "003": (0.98, 1e-9), "004": (0.999, 1e-8), "004-gnmt": (0.999, 1e-8)}
    assert get_preset("rnnsearch-atr", "004-T2-rnnsearch-atr")["train"]["smoothing"] == 0.0


def test_an_adadelta_run_resumes_exactly_and_its_config_reproduces_it(toy_nodev, tmp_path, capsys):
    """--optimizer adadelta: a run stopped at update 2 and resumed writes the losses of an uninterrupted one and ends
    on its weights (Adadelta's accumulators come back from last.pt); config.yaml holds Adadelta's settings and not
    Adam's, and `--config` of it starts the same run again; --init-normal reaches the first weights."""
    args = [*TINY, "--data", toy_nodev, "--log-every", "1", "--optimizer", "adadelta", "--lr", "1",
            "--adadelta-rho", "0.9", "--init-normal", "0.05"]
    whole, part, again = tmp_path / "whole", tmp_path / "part", tmp_path / "again"
    assert train_here([*args, "--out", str(whole), "--max-steps", "4"], capsys).returncode == 0
    assert train_here([*args, "--out", str(part), "--max-steps", "2"], capsys).returncode == 0
    r = train_here([*args, "--out", str(part), "--max-steps", "4", "--resume"], capsys)
    assert r.returncode == 0, r.stderr
    assert losses(part) == losses(whole)
    a, b = (torch.load(d / "last.pt", weights_only=False) for d in (whole, part))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert set(a["training"]["optimizer"]["state"][0]) == {"step", "square_avg", "acc_delta"}
    with open(whole / "config.yaml") as f:
        text = f.read()
    assert "optimizer: adadelta" in text and "adadelta_rho: 0.9" in text and "init_normal: 0.05" in text
    assert "adam" not in text.replace("adadelta", ""), text
    r = train_here(["--config", str(whole / "config.yaml"), "--out", str(again), "--max-steps", "4"], capsys)
    assert r.returncode == 0, r.stderr
    assert losses(again) == losses(whole)
    # the first weights: N(0, 0.05²) (an update at rate 1 moves a weight by about √ε / √(1 - ρ) = 3e-3 at most)
    w = torch.load(part / "last.pt", weights_only=False)["model"]["encoder.weight_hh"]
    assert 0.04 < w.std() < 0.06, w.std()


def test_optimizer_flags_are_refused_where_they_cannot_apply(toy_nodev, tmp_path, capsys):
    """One-line refusals before any work: an optimizer's setting for a run of the other one; --optimizer other than
    the preset's without --lr (the preset's rate is its optimizer's); --cuda-graphs with Adadelta (the capture is
    Adam's); ρ outside [0, 1), ε <= 0; --init-uniform and --init-normal together. A law given replaces the preset's
    other law (paper 000's preset draws U(±0.08): --init-normal 0.04 leaves no uniform)."""
    from dtmt_models.cli import train
    from dtmt_models.training.config import TrainConfig

    base = [*TINY, "--data", toy_nodev]
    cases = [(["--optimizer", "adadelta", "--adam-eps", "1e-8"], "--adam-eps: adam's, and the run's optimizer is "
                                                                  "adadelta"),
             (["--adadelta-rho", "0.9"], "--adadelta-rho: adadelta's, and the run's optimizer is adam"),
             (["--optimizer", "adadelta"], "--optimizer adadelta: the preset's --lr 0.002 is for adam; give the rate "
                                           "for adadelta with --lr"),
             (["--model", "deeplau", "--preset", "paper", "--optimizer", "adam"],
              "--optimizer adam: the preset's --lr 1 is for adadelta"),
             (["--optimizer", "adadelta", "--adadelta-rho", "1"], "--adadelta-rho 1: must be in [0, 1)"),
             (["--optimizer", "adadelta", "--adadelta-eps", "0"], "--adadelta-eps 0: must be a finite number > 0"),
             (["--init-uniform", "0.1", "--init-normal", "0.1"], "--init-uniform 0.1 and --init-normal 0.1: the "
                                                                  "weights are drawn from one law; give one of them")]
    for i, (flags, message) in enumerate(cases):
        out = tmp_path / f"run{i}"
        r = train_here([*base, "--out", str(out), *flags], capsys)
        assert r.returncode == 2 and message in r.stderr, (flags, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and not (out / "last.pt").exists(), r.stderr
    with pytest.raises(ValueError, match="--cuda-graphs: captures Adam's update only; train --optimizer adadelta"):
        train.check_cuda_graphs(TrainConfig(data=".", device="cuda", cuda_graphs=True, optimizer="adadelta"))
    args = train.build_parser().parse_args(["--data", ".", "--model", "dtmt", "--preset", "paper", "--seed", "1",
                                            "--init-normal", "0.04"])
    cfg = train.resolve_config(args)
    assert (cfg.init_normal, cfg.init_uniform) == (0.04, None)
    args = train.build_parser().parse_args(["--data", ".", "--model", "dtmt", "--preset", "paper", "--seed", "1"])
    assert (train.resolve_config(args).init_uniform, train.resolve_config(args).init_normal) == (0.08, None)


def test_a_model_too_large_for_the_machine_is_one_line_not_the_options_fault(toy_nodev, tmp_path):
    """Options that build a model larger than the memory the process may take: the CPU allocator's RuntimeError was
    called the options' fault ("cannot be built with ...") and escaped `dtmt train` as a traceback. Now one line
    saying it does not fit, exit 1, nothing left in --out (under a 6 GB address-space limit, in a child)."""
    import resource

    def limited():
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    out = tmp_path / "huge"
    cmd = [sys.executable, "-m", "dtmt_models.cli", "train", "--data", toy_nodev, "--out", str(out), *TINY,
           "--opt", "embed_dim=16384", "--opt", "hidden_size=16384", "--max-steps", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, preexec_fn=limited,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    err = r.stderr.strip().splitlines()
    assert err[-1].startswith("dtmt train: out of memory: dtmt with {") and "does not fit in this machine's memory" \
        in err[-1] and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert not (out / "last.pt").exists()


def test_a_config_yaml_from_before_the_optimizer_setting_keeps_adam(tmp_path):
    """A run configuration written before --optimizer (Adam's keys, no optimizer) of a preset that now trains with
    Adadelta (deeplau's paper preset) still means Adam: it was refused as "adam's, and the run's optimizer is
    adadelta" (a review's finding)."""
    from dtmt_models.cli import train

    path = tmp_path / "config.yaml"
    path.write_text("model: deeplau\npreset: paper\nlr: 0.0005\nadam_beta2: 0.998\nadam_eps: 1.0e-09\n")
    args = train.build_parser().parse_args([*train.config_arguments(str(path)), "--data", "."])
    explicit = {k for k, v in vars(args).items() if v is not None and k not in ("opt", "config")}
    cfg = train.resolve_config(args)
    assert (cfg.optimizer, cfg.lr, cfg.adam_beta2) == ("adam", 5e-4, 0.998)
    train.check_optimizer(cfg, explicit, get_preset("deeplau", "paper")["train"])   # (no refusal)
    path.write_text("model: deeplau\npreset: paper\n")                              # (no Adam keys: the preset's)
    args = train.build_parser().parse_args([*train.config_arguments(str(path)), "--data", "."])
    assert train.resolve_config(args).optimizer == "adadelta"


def test_two_processes_stay_in_sync(toy_nodev, tmp_path):
    out = str(tmp_path / "ddp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533",
           "-m", "dtmt_models.cli.train", "--data", toy_nodev, "--out", out, "--max-steps", "30", "--log-every", "5",
           *TINY]
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 process(es)" in r.stdout
    assert "schedule rnmt (n = 2)" in r.stdout      # paper 000 eq. 17: n is the number of replicas
    assert "2 processes in sync at step 30" in r.stdout
    assert "bin-bpe60)" in r.stdout and r.stdout.count("building it now") <= 1   # the binarized corpus, built once
    rows = losses(out)
    assert len(rows) == 6 and float(rows[-1][2]) < float(rows[0][2])   # it learns
    from dtmt_models.models.checkpoint import read_checkpoint

    ckpt = read_checkpoint(os.path.join(out, "last.pt"))
    assert len(ckpt["training"]["rng"]) == 2      # both processes' random states, for an exact resume


def test_two_processes_stop_together_and_refuse_different_settings(toy_nodev, tmp_path):
    """--max-time stopped each process by its own clock: one went on to its final validation while the other began
    another update, and both waited for ever in collectives that did not match (3 of 3 runs of a probe); the
    processes now count their mean time. Processes started with another --seed (or --lr, --data, --max-steps) trained
    on silently, or were found at the end, or hung: each now refuses in the same one line before any work."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = str(tmp_path / "timed")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29535",
           "-m", "dtmt_models.cli.train", "--data", toy_nodev, "--out", out, "--max-steps", "100000", "--max-time",
           "3s", "--valid-every", "100000", *TINY]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "stopped: reached --max-time 3s" in r.stdout and " processes in sync at step " in r.stdout, r.stdout
    out = tmp_path / "apart"
    procs = two_processes(toy_nodev, out, 29537, ["--max-steps", "5", *TINY],
                          rank_args=lambda rank: ["--seed", "7"] if rank else [])
    try:
        said = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [2, 2] and said[1][1] == "", said   # (said once, by process 0)
    assert said[0][1] == ("dtmt train: the run's processes were started with different settings: seed (1 in process "
                          "0, 7 in process 1); start every process with the same options and corpus\n"), said
    assert not out.exists()


def test_a_refusal_of_one_process_stops_the_others_at_once(toy_nodev, tmp_path):
    """The processes of a run meet, and tell each other whether their checks passed, before the process group is
    started: a refusal that one process made alone (here process 1's --resume of a folder without last.pt, and
    process 0's mistyped flag) had left the other waiting in init_process_group for torch's 30 minutes, deaf to
    Ctrl-C. Now the other says which process refused, in one line, and both exit 2 within seconds; a refusal every
    process makes is printed once, by process 0."""
    def run(port, rank_args, data=toy_nodev):
        procs = two_processes(data, tmp_path / "out", port, ["--max-steps", "2", *TINY], rank_args)
        try:
            said = [p.communicate(timeout=120) for p in procs]   # (it timed out here before)
        finally:
            for p in procs:
                p.kill()
        return [p.returncode for p in procs], [err for _, err in said]

    codes, errs = run(29555, lambda rank: ["--resume", "--out", str(tmp_path / "none")] if rank else [])
    assert codes == [2, 2] and errs[0] == ("dtmt train: process 0 of 2: not started: process 1 refused the run (its "
                                           "own message says why)\n"), errs
    assert errs[1].startswith("dtmt train: ") and errs[1].count("\n") == 1 and "none" in errs[1], errs
    codes, errs = run(29557, lambda rank: [] if rank else ["--bogus"])
    assert codes == [2, 2] and errs[0] == "dtmt train: unrecognized arguments: --bogus (--help: the options)\n", errs
    assert errs[1] == ("dtmt train: process 1 of 2: not started: process 0 ended before the run started (its own "
                       "message says why)\n"), errs
    codes, errs = run(29559, lambda rank: [], data=str(tmp_path / "nowhere"))
    assert codes == [2, 2] and errs[1] == "" and errs[0].startswith(f"dtmt train: {tmp_path / 'nowhere'}: "), errs
    assert errs[0].count("\n") == 1 and not (tmp_path / "out").exists()


def test_the_launch_variables_are_checked_first(toy_nodev, tmp_path, monkeypatch, capsys):
    """A RANK left in the shell without WORLD_SIZE had made a single process a follower of a main process that did
    not exist: it trained, wrote nothing and exited 0; WORLD_SIZE=0 failed in a traceback after making --out, and
    a variable that is not a number was int()'s message without its name. Each is one line naming it, exit 2, before
    anything is written; torchrun's processes of one machine given one GPU (--device cuda:1) are refused too."""
    from dtmt_models.cli import train
    from dtmt_models.training import distributed

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "out"
    for env, said in [(dict(RANK="1"), "RANK=1 with WORLD_SIZE=1: a rank in [0, 1) is needed (a single process is "
                                       "rank 0: unset RANK, or start the run's processes with torchrun)"),
                      (dict(WORLD_SIZE="0"), "WORLD_SIZE=0: the number of processes is at least 1"),
                      (dict(WORLD_SIZE="2", RANK="2"), "RANK=2 with WORLD_SIZE=2: a rank in [0, 2) is needed"),
                      (dict(RANK="abc"), "RANK=abc: not a whole number (torchrun sets it; unset it to train in one "
                                         "process)"),
                      (dict(LOCAL_RANK="-1"), "LOCAL_RANK=-1: a process's rank on its machine is at least 0")]:
        with monkeypatch.context() as patch:
            for k, v in env.items():
                patch.setenv(k, v)
            capsys.readouterr()
            code = train.main(["--data", toy_nodev, "--out", str(out), "--max-steps", "1", *TINY])
            assert (code, capsys.readouterr().err) == (2, f"dtmt train: {said}\n"), env
            assert not out.exists()
    for k, v in dict(WORLD_SIZE="2", RANK="1", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", TORCHELASTIC_RUN_ID="x").items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=r"^--device cuda:0 with 2 processes a machine: each would take that one "
                                         r"GPU; give --device cuda \(each process takes the GPU of its LOCAL_RANK"):
        distributed.process_device("cuda:0")
    assert distributed.process_device("cpu") == torch.device("cpu")


def test_a_process_waiting_for_the_others_says_whom_it_waits_for(monkeypatch, capsys):
    """A process of a run started by hand before process 0 (or without it) waits for it, saying so every
    NOTE_AFTER_S, and gives up after TIMEOUT_S in one line (torch's own wait was silent and deaf to Ctrl-C); the
    missing variables of a hand launch are named."""
    import socket

    from dtmt_models.training import distributed

    with socket.socket() as s:   # (a port nobody listens on)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):   # (whatever launched the tests)
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ValueError, match=r"^WORLD_SIZE=2: MASTER_ADDR and MASTER_PORT not set; start the run's "):
        distributed.Meeting()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setattr(distributed, "NOTE_AFTER_S", 0.1)
    monkeypatch.setattr(distributed, "TIMEOUT_S", 1.0)
    capsys.readouterr()
    with pytest.raises(ValueError, match=rf"^process 1 of 2: process 0 at 127.0.0.1:{port} did not start in 1 s; "
                                         r"start every process of the run$"):
        distributed.Meeting()
    err = capsys.readouterr().err.splitlines()
    assert len(err) >= 1 and all(line.startswith(f"dtmt train: process 1 of 2: waiting for process 0 at "
                                                 f"127.0.0.1:{port} to start (") for line in err), err
    monkeypatch.setenv("MASTER_ADDR", "no-such-host.invalid")   # (a name that resolves to nothing: said at once)
    with pytest.raises(ValueError, match=r"^MASTER_ADDR=no-such-host.invalid: "):
        distributed.Meeting()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")   # (under torchrun, which ends the others itself: no meeting)
    assert not distributed.by_hand()


def test_a_process_meeting_another_program_s_port_gives_up_in_one_line(monkeypatch):
    """Something that accepts connections at MASTER_ADDR:MASTER_PORT but is no store (another program's port): the
    store's client handshake waited in c10d for half an hour, deaf to Ctrl-C and SIGTERM (a review's probe needed
    kill -9). It is made on a thread this one polls, and given CONNECT_S."""
    import socket
    import threading
    import time

    from dtmt_models.training import distributed

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    accepted = []

    def accept():
        while True:
            try:
                accepted.append(server.accept()[0])
            except OSError:
                return
    threading.Thread(target=accept, daemon=True).start()
    port = server.getsockname()[1]
    for name, value in (("WORLD_SIZE", "2"), ("RANK", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(distributed, "CONNECT_S", 1.0)
    started = time.monotonic()
    try:
        with pytest.raises(ValueError, match=rf"^MASTER_ADDR=127.0.0.1 MASTER_PORT={port}: something accepts "
                                             r"connections there but did not answer as process 0's store in 1 s"):
            distributed.Meeting()
        assert time.monotonic() - started < 30
    finally:   # (the handshake's thread ends when its connection closes)
        server.close()
        for c in accepted:
            c.close()


def test_a_process_interrupted_while_it_waits_to_start_is_not_counted_as_ready(monkeypatch):
    """Ctrl-C (or the time out) in a process waiting for the others' outcomes leaves it said as ended: it had been
    said to have passed, and the others then started the process group without it and waited there for half an
    hour, deaf to Ctrl-C (a review found it)."""
    import socket

    from dtmt_models.training import distributed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in dict(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(distributed, "READ_WAIT_S", 0.2)
    monkeypatch.setenv("RANK", "0")
    first = distributed.Meeting()
    monkeypatch.setenv("RANK", "1")
    second = distributed.Meeting()

    def interrupted(seconds):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:   # (Ctrl-C while process 1 waits for process 0)
        patch.setattr(distributed.time, "sleep", interrupted)
        with pytest.raises(KeyboardInterrupt):
            second.settle(None)
    assert first.settle(None) == ["", distributed.ENDED]
    del second, first   # (their store and its port)
    assert distributed.refusal_line(["", distributed.ENDED], 0) == (
        "process 0 of 2: not started: process 1 ended before the run started (its own message says why)")


def test_ctrl_c_before_the_meeting_is_settled_ends_process_0_at_once(monkeypatch, capsys):
    """Ctrl-C in process 0 before its outcome was said (a race the test below met now and then): it waited on for
    the others, never started, up to the meeting's time out. An interrupted process says it ended and leaves."""
    import socket

    from dtmt_models.cli import train
    from dtmt_models.training import distributed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in dict(WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(distributed, "TIMEOUT_S", 5.0)

    def interrupted(argv, lock, meeting=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "_main", interrupted)
    began = time.monotonic()
    assert train.main([]) == 130 and time.monotonic() - began < 3.0
    assert "interrupted before training started" in capsys.readouterr().err


def test_process_0_says_its_refusal_at_once(toy_nodev, tmp_path):
    """Process 0 refusing says why at once, before it waits for the others (it had said only that it waited for a
    process not started; Ctrl-C then lost the refusal)."""
    import queue
    import threading

    env = dict(os.environ, PYTHONPATH=ROOT, MASTER_ADDR="127.0.0.1", MASTER_PORT="29561", WORLD_SIZE="2", RANK="0",
               LOCAL_RANK="0")
    env.pop("TORCHELASTIC_RUN_ID", None)
    proc = subprocess.Popen([sys.executable, "-m", "dtmt_models.cli.train", "--data", toy_nodev, "--out",
                             str(tmp_path / "none"), "--resume", *TINY], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    try:
        first = lines.get(timeout=120)   # (process 1 is never started)
        assert first.startswith("dtmt train: ") and "none" in first and proc.poll() is None, first
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        proc.kill()


def test_a_lost_peer_before_this_run_saved_does_not_name_an_earlier_run_s_checkpoint(tmp_path, monkeypatch,
                                                                                       capsys):
    """A process that meets a gone peer says whether process 0's last.pt stands: with --overwrite the earlier run's
    last.pt is still there until the run starts, and it was named as this run's."""
    from dtmt_models.cli import train
    from dtmt_models.run_lock import RunLock

    out = tmp_path / "run"
    out.mkdir()
    (out / "last.pt").write_bytes(b"the earlier run's")
    os.utime(out / "last.pt", (time.time() - 3600, time.time() - 3600))

    def lost(argv, lock, meeting=None, saved=False):
        lock.append(RunLock(str(out)).acquire())
        if saved:   # (written since the run began: it stands; dated a second on, past the file system's tick)
            (out / "last.pt").write_bytes(b"this run's")
            os.utime(out / "last.pt", (time.time() + 1, time.time() + 1))
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                           "[127.0.0.1]:29500")

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(train, "meet_the_others", lambda: None)
    monkeypatch.setattr(train, "_main", lost)
    assert train.main([]) == 1
    err = capsys.readouterr().err
    assert err.endswith(f"its own messages say why. No checkpoint of this run was written ({out / 'last.pt'} is as "
                        f"it was before it)\n"), err
    monkeypatch.setattr(train, "_main", lambda *args: lost(*args, saved=True))
    assert train.main([]) == 1
    assert capsys.readouterr().err.endswith(f"its own messages say why. {out / 'last.pt'} stands\n")


def test_refusal_line_says_each_refusal_once():
    from dtmt_models.training.distributed import ENDED, refusal_line

    assert [refusal_line(["", "", ""], r) for r in range(3)] == [None, None, None]
    assert [refusal_line(["x", "x", "y"], r) for r in range(3)] == ["x", None, "y"]
    assert [refusal_line(["", "x"], r) for r in range(2)] == [
        "process 0 of 2: not started: process 1 refused the run (its own message says why)", "x"]
    assert [refusal_line([ENDED, ""], r) for r in range(2)] == [
        None, "process 1 of 2: not started: process 0 ended before the run started (its own message says why)"]


def test_a_process_left_alone_says_so_in_one_line(toy_nodev, tmp_path):
    """A process of a run killed while the run trains: the other's next collective fails, and it printed gloo's
    traceback ("Connection closed by peer ... GLHF!"). It now says so in one line and exits 1, its checkpoint kept.
    (Started without torchrun, which would end the survivor itself, so that it meets the closed connection.)"""
    out = tmp_path / "left"
    procs = two_processes(toy_nodev, out, 29539, ["--max-steps", "100000", "--log-every", "1", "--valid-every",
                                                  "100000", *TINY])
    try:
        seen = until_an_update(procs[0])   # (process 0 logs the updates)
        assert procs[0].poll() is None and procs[1].poll() is None, "".join(seen)
        procs[1].kill()
        rest, err = procs[0].communicate(timeout=120)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[0].returncode == 1, "".join(seen) + rest + err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("dtmt train: process 0 of 2: another process of the run ended ("), err
    assert "by peer" in err and "its own messages say why" in err   # (gloo's "Connection closed / reset by peer")
    assert (out / "train_log.csv").is_file()
    assert err.endswith("No checkpoint was written\n") and not (out / "last.pt").exists(), err   # (it had said
    # "The last checkpoint written stands" of none)


def test_processes_resuming_different_checkpoints_are_refused(toy_nodev, tmp_path):
    """Each process of a run reads the last.pt of its own --out: a process given an older copy trained other updates
    than process 0 in the same all-reduces, and both waited for ever at the end, deaf to SIGTERM (a review found
    it). The checkpoints are compared with the settings: one line in both, exit 2. A process given its own --data
    without the binarized copy, which process 0 builds in its --data only, is told where to get one."""
    def run(out, port, args, rank_args=lambda rank: []):
        procs = two_processes(toy_nodev, out, port, ["--log-every", "1", *TINY, *args], rank_args)
        try:
            said = [p.communicate(timeout=300) for p in procs]
        finally:
            for p in procs:
                p.kill()
        return [(p.returncode, err) for p, (_, err) in zip(procs, said)]

    a, b = tmp_path / "a", tmp_path / "b"
    assert [code for code, _ in run(a, 29547, ["--max-steps", "2"])] == [0, 0]
    shutil.copytree(a, b)
    assert [code for code, _ in run(a, 29549, ["--max-steps", "4", "--resume"])] == [0, 0]
    apart = run(a, 29551, ["--max-steps", "6", "--resume"], lambda rank: ["--out", str(b)] if rank else [])
    assert [code for code, _ in apart] == [2, 2] and apart[1][1] == "", apart   # (said once, by process 0)
    err = apart[0][1]
    assert err.startswith("dtmt train: the run's processes were started with different settings: resumed checkpoint "
                          "('update 4, "), err
    assert "in process 0, 'update 2, " in err and err.count("\n") == 1, err
    assert err.endswith("and the same checkpoint to resume (the same --resume and --out)\n"), err
    assert [r["step"] for r in csv.DictReader(open(a / "train_log.csv", newline=""))][-1] == "4"
    copy = tmp_path / "copy"
    shutil.copytree(toy_nodev, copy, ignore=shutil.ignore_patterns("bin-*"))
    results = run(tmp_path / "c", 29553, ["--max-steps", "1"], lambda rank: ["--data", str(copy)] if rank else [])
    assert results[1][0] == 2 and (f"(process 0 builds one in its own --data only: copy the bin-* folders of "
                                   f"process 0's --data into {copy}, or give every process one --data)"
                                   in results[1][1]), results


def test_a_run_of_more_processes_than_an_epoch_has_batches_is_refused(toy_nodev, tmp_path):
    """Each process takes every other batch of an epoch, the last odd one skipped: an epoch of one batch left none
    to either process, and the run looped over empty epochs without end, deaf to SIGTERM (--max-epochs: exit 0 and
    an untrained last.pt). Now both refuse in one line before anything is written, exit 2."""
    out = tmp_path / "few"
    procs = two_processes(toy_nodev, out, 29541, ["--max-steps", "4", *TINY, "--max-tokens", "100000"])
    try:
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    message = ("dtmt train: an epoch makes 1 batch(es) of --max-tokens 100,000 for 2 processes, which need one each; "
               "lower --max-tokens (or --max-sentences), or train with fewer processes\n")
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 2 and err.endswith(message), err
    assert not (out / "last.pt").exists()


def test_the_first_epoch_s_batches_are_made_once_for_several_processes(monkeypatch):
    """With several processes the trainer makes epoch 1's batches to check that each process gets one; the epoch
    then made them again (6.8 s at 5 M pairs, seen here, before the first update). epoch_batches takes the ones made
    for their epoch, once, and makes every other epoch's (or the same epoch's again) as before."""
    from types import SimpleNamespace

    import numpy as np

    from dtmt_models.data.batching import kept_indices, token_batches
    from dtmt_models.training import trainer as trainer_module

    lengths = np.random.default_rng(0).integers(1, 20, size=(500, 2)).astype(np.int16)
    cfg = SimpleNamespace(max_tokens=120, seed=3, max_len=15, max_sentences=None)
    made = token_batches(lengths, 120, seed=3, epoch=0, keep=kept_indices(lengths, 15))
    stub = SimpleNamespace(lengths=lengths, cfg=cfg, epoch=0, _first_batches=made,
                           dist=SimpleNamespace(world=2, rank=1))
    calls = []
    monkeypatch.setattr(trainer_module, "token_batches", lambda *a, **k: calls.append(k["epoch"]) or made)
    first = trainer_module.Trainer.epoch_batches(stub)
    assert calls == [] and stub._first_batches is None and first.sel is not made.sel   # (rank 1's share of them)
    assert list(first) == list(made[:len(made) - len(made) % 2][1::2])
    monkeypatch.undo()
    assert list(trainer_module.Trainer.epoch_batches(stub)) == list(first)   # (made anew: the same)
    stub.epoch, stub._first_batches = 1, made
    again = trainer_module.Trainer.epoch_batches(stub)
    fresh = token_batches(lengths, 120, seed=3, epoch=1, keep=kept_indices(lengths, 15))
    assert list(again) == list(fresh[:len(fresh) - len(fresh) % 2][1::2]) and list(again) != list(first)


def test_only_a_gone_peer_is_reported_as_one():
    """lost_peer names gloo's closed or reset connection only: a collective's other failures (NCCL's, a timeout,
    this process's own CUDA fault) keep their traceback (the review found every DistError reported as a peer gone)."""
    from dtmt_models.training.distributed import lost_peer

    closed = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                          "[127.0.0.1]:9947. This is typically caused by a remote worker crashing. GLHF!")
    assert lost_peer(closed) == "Connection closed by peer [127.0.0.1]:9947"
    reset = RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:81] Read error [127.0.0.1]:45722: Connection "
                         "reset by peer")
    assert lost_peer(reset) == "Read error [127.0.0.1]:45722: Connection reset by peer"
    for other in (torch.distributed.DistBackendError("NCCL error in: ... unhandled cuda error"),
                  RuntimeError("processes out of sync at step 30: parameter digests ['a', 'b']"),
                  RuntimeError("CUDA error: an illegal memory access was encountered"), ValueError("gloo peer")):
        assert lost_peer(other) is None, other


def test_a_run_of_two_processes_interrupted_says_how_to_resume_it(toy_nodev, tmp_path):
    """Ctrl-C reaching one process of two stops both after the update in progress, and the first process's last line
    is a command that resumes the run: torchrun's with as many processes (it said `dtmt train ... --resume`, which
    a run of two processes refuses, and said nothing where the signal had reached only another process); every
    process exits with the signal's status."""
    out = tmp_path / "stopped"
    procs = two_processes(toy_nodev, out, 29543, ["--max-steps", "100000", "--log-every", "1", "--valid-every",
                                                  "100000", *TINY])
    try:
        seen = until_an_update(procs[0])
        procs[1].send_signal(signal.SIGINT)
        said = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert [p.returncode for p in procs] == [130, 130], said   # (the other's exit 0 had said the run finished)
    stdout = "".join(seen) + said[0][0]
    assert "stopped: interrupted by SIGINT in another process" in stdout, stdout
    hint = [line for line in stdout.splitlines() if "resume with: " in line]
    assert len(hint) == 1 and hint[0].split("resume with: ")[1] == (
        f"torchrun --nproc_per_node 2 -m dtmt_models.cli.train --data {toy_nodev} --model dtmt --out {out} --resume")
    from dtmt_models.models.checkpoint import read_checkpoint

    stopped = read_checkpoint(str(out / "last.pt"))["training"]["step"]
    command = hint[0].split("resume with: ")[1].split()   # run as it says (another port, and a near end)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        "29545", *command[3:], "--max-steps", str(stopped + 2), "--threads", "1"],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"resumed from step {stopped:,}" in r.stdout and "2 processes in sync at step" in r.stdout, r.stdout


def test_refuses_to_overwrite_and_reports_bad_arguments(toy_nodev, tmp_path, capsys):
    out = str(tmp_path / "run")
    assert train_here(["--data", toy_nodev, "--out", out, "--max-steps", "2", *TINY], capsys).returncode == 0
    r = train_here(["--data", toy_nodev, "--out", out, "--max-steps", "2", *TINY], capsys)
    assert r.returncode == 2 and "--resume" in r.stderr and "--overwrite" in r.stderr
    r = train_here(["--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x"), *TINY], capsys)
    assert r.returncode == 2 and "dtmt prepare" in r.stderr
    # one refusal through a process of its own: the exit status the shell sees
    r = run_train(["--data", toy_nodev, "--out", str(tmp_path / "y"), "--max-time", "soon", *TINY])
    assert r.returncode == 2 and "--max-time" in r.stderr
    r = train_here(["--data", toy_nodev, "--out", str(tmp_path / "z"), "--model", "nope"], capsys)
    assert r.returncode == 2 and "unknown model" in r.stderr
    # values the training itself refused only later (a traceback, after --out was made), or that crashed the
    # process (--threads 100000), or overflowed (a seed past int64): one line each before any work, and --out (with
    # the folders made on the way to it) gone again
    for args, message in [(["--warmup", "0"], "--warmup 0: the rnmt schedule needs at least 1 warm-up update"),
                          (["--decay-start", "100", "--decay-end", "50"], "needs 0 <= --decay-start < --decay-end"),
                          (["--schedule", "inverse-sqrt", "--warmup", "0"], "the inverse-sqrt schedule needs"),
                          (["--valid-beam", "2000"], "--valid-beam 2000: must be an integer in [1, 1,024]"),
                          (["--seed", str(10 ** 20)], "must be an integer in [0, 2^63)"),
                          (["--max-len", str(10 ** 20)], "must be an integer in [1, 2,147,483,647]"),
                          (["--threads", "100000"], "--threads 100000: must be an integer in [0, 1,024]"),
                          (["--vocab-size", str(2 ** 31)], "--vocab-size 2147483648: must be an integer in [8, ")]:
        r = train_here(["--data", toy_nodev, "--out", str(tmp_path / "w" / "run"), *TINY, *args], capsys)
        assert r.returncode == 2 and message in r.stderr and len(r.stderr.splitlines()) == 1, (args, r.stderr)
        assert not (tmp_path / "w").exists(), args
    # the largest seed taken trains (a seed past 2.3e15 overflowed manual_seed after the data was read: a traceback)
    r = train_here(["--data", toy_nodev, "--out", str(tmp_path / "s"), "--max-steps", "1", "--seed", str(2 ** 63 - 1),
                    *TINY], capsys)
    assert r.returncode == 0, r.stderr
    r = train_here(["--data", toy_nodev, "--out", "/proc/no/run", *TINY], capsys)   # (not writable even by root)
    assert r.returncode == 2 and r.stderr.startswith("dtmt train: --out /proc/no/run: cannot be written"), r.stderr


def test_a_lock_that_cannot_be_made_leaves_no_folder(tmp_path, monkeypatch):
    """Found by a probe on a full disk: when the lock file of a new --out could not be made or written, the refusal
    left the folders made for it behind (empty); they go, as a run refused later leaves none, and so does the lock
    file. A folder that was there stays."""
    import errno

    from dtmt_models.run_lock import LOCK_NAME, RunLock, RunLocked

    real = os.open

    def full(path, *args, **kwargs):
        if str(path).endswith(LOCK_NAME):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, *args, **kwargs)

    def full_write(fd, data):   # (the lock file made, its writing refused: the usual way of a full disk)
        raise OSError(errno.ENOSPC, "No space left on device")
    for target, fake in ((os, "open"), (os, "write")):
        with monkeypatch.context() as m:
            m.setattr(target, fake, full if fake == "open" else full_write)
            for out in (tmp_path / "runs" / "a", tmp_path):
                with pytest.raises(RunLocked, match="cannot be written \\(No space left on device\\)"):
                    RunLock(str(out)).acquire()
                assert tmp_path.is_dir() and not (tmp_path / "runs").exists(), fake
        assert os.listdir(tmp_path) == [], fake


def test_one_run_per_directory(toy_nodev, tmp_path, capsys):
    """A second dtmt train on a --out that a running one holds is refused in one line naming the first one's
    process, exit 2, with nothing written there (issue 71 item 6); once the first ends, the directory is free. A run
    refused before it wrote anything leaves no directory of its own behind."""
    import subprocess as sp
    import sys
    import textwrap

    from dtmt_models.run_lock import LOCK_NAME

    out = tmp_path / "run"
    # a process that holds the lock, as a running dtmt train does, until told to end
    holder = sp.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from dtmt_models.run_lock import RunLock
        lock = RunLock({str(out)!r}).acquire()
        print("held", flush=True)
        sys.stdin.readline()
        """)], stdin=sp.PIPE, stdout=sp.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        assert holder.stdout.readline().strip() == "held"
        r = train_here(["--data", toy_nodev, "--out", str(out), "--max-steps", "2", *TINY], capsys)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert f"is in use by another dtmt train (process {holder.pid})" in r.stderr
        assert sorted(os.listdir(out)) == [LOCK_NAME]
    finally:
        holder.communicate("\n", timeout=30)
    assert train_here(["--data", toy_nodev, "--out", str(out), "--max-steps", "2", *TINY], capsys).returncode == 0
    assert (out / "last.pt").is_file() and not (out / LOCK_NAME).exists()   # (the lock file goes with its run)
    # refused before training, in a directory it would have made: none is left
    r = train_here(["--data", toy_nodev, "--out", str(tmp_path / "new"), "--model", "dtmt", "--opt", "pad_id=3",
                    *TINY], capsys)
    assert r.returncode == 2 and not (tmp_path / "new").exists(), r.stderr


def test_a_run_folder_s_log_and_best_checkpoint_are_never_lost_on_resume(toy, tmp_path, capsys):
    """--resume keeps the rows of train_log.csv up to the checkpoint's step, cells a spreadsheet added dropped
    (such a row was a traceback after the log had been emptied: every row lost; a byte-order mark is not part of
    the first column's name); a log that cannot be read is one
    line, exit 2, and stays as it was. A last.pt of another model copied into a run folder is refused, exit 2, where
    it trained on and its first validation replaced the folder's own best.pt."""
    import shutil

    from dtmt_models.models.checkpoint import read_checkpoint

    run, other = tmp_path / "run", tmp_path / "other"
    base = ["--data", toy, "--log-every", "1", "--valid-every", "2", *TINY]
    assert train_here(["--out", str(run), "--max-steps", "2", *base], capsys).returncode == 0
    log, best = run / "train_log.csv", run / "best.pt"
    assert best.is_file()
    lines = log.read_bytes().split(b"\r\n")
    assert lines[0].startswith(b"kind,step,") and len(lines) >= 4, lines
    rows = lines[1:-1]
    lines[1] += b",EXTRA,cells"
    log.write_bytes(b"\xef\xbb\xbf" + b"\r\n".join(lines))   # (and a byte-order mark, as Excel's "CSV UTF-8" saves)
    assert train_here(["--resume", str(run), "--max-steps", "3", *base], capsys).returncode == 0
    kept = log.read_bytes().split(b"\r\n")
    assert kept[1:1 + len(rows)] == rows and b"EXTRA" not in log.read_bytes()
    assert any(line.startswith(b"train,3,") for line in kept), kept
    events = sorted(os.listdir(run / "tensorboard"))
    for garbage, message in ((b"\xff\xfe\x00junk", "not a training log"), (b"hello\nworld\n", "no step column"),
                             (b"kind,step\ntrain,four\n", "line 2: step 'four' is not a whole number")):
        log.write_bytes(garbage)
        r = train_here(["--resume", str(run), "--max-steps", "4", *base], capsys)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and message in r.stderr, r.stderr
        assert f"--resume: {log}: " in r.stderr and log.read_bytes() == garbage
        assert sorted(os.listdir(run / "tensorboard")) == events   # (a refused resume added an events file)
    log.unlink()   # (moved aside: the run goes on, its log starting here)
    # a last.pt of another model (another hidden size) in the run folder
    assert train_here(["--out", str(other), "--max-steps", "2", *base, "--opt", "hidden_size=48"],
                      capsys).returncode == 0
    before, own_last = best.read_bytes(), (run / "last.pt").read_bytes()
    shutil.copy(other / "last.pt", run / "last.pt")
    r = train_here(["--resume", str(run), "--data", toy, "--max-steps", "4", "--threads", "1"], capsys)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"not the model of {best} beside it (its model_options differs)" in r.stderr, r.stderr
    assert best.read_bytes() == before
    (run / "last.pt").write_bytes(own_last)   # (its own last.pt; best.pt's options crafted: an option that is a
    crafted = read_checkpoint(str(best))        # tensor, where `!=` had been "Boolean value of Tensor ... ambiguous")
    crafted["model_options"] = dict(crafted["model_options"], depth=torch.tensor([1, 1]))
    torch.save(crafted, best)
    r = train_here(["--resume", str(run), "--data", toy, "--max-steps", "4", "--threads", "1"], capsys)
    assert r.returncode == 2 and f"not the model of {best} beside it" in r.stderr, r.stderr


def test_a_log_removed_under_the_run_is_written_whole_again(tmp_path):
    """The run folder removed while a run trains (its checkpoint writes make the folder again): the log's next row
    made a train_log.csv of the later rows without a header, which --resume then refused ("no step column"). The
    log is written whole again, every row the run wrote, then the new row."""
    import shutil

    from dtmt_models.training.trainer import LOG_FIELDS, CsvLog

    run = tmp_path / "run"
    log = CsvLog(str(run / "train_log.csv"), None)
    log.write(kind="train", step=1, loss=2.5)
    log.write(kind="valid", step=1, dev_loss=3.0)
    shutil.rmtree(run)
    run.mkdir()   # (as the next checkpoint's write makes it)
    log.write(kind="train", step=2, loss=2.25)
    rows = CsvLog._rows_until(str(run / "train_log.csv"), 10)
    assert [(r["kind"], r["step"]) for r in rows] == [("train", "1"), ("valid", "1"), ("train", "2")]
    assert rows[1]["dev_loss"] == "3.0" and list(rows[0]) == list(LOG_FIELDS)


def test_a_run_folder_s_files_are_its_own(toy, tmp_path, capsys, monkeypatch):
    """A new run refuses an --out holding a best.pt (or step_N.pt) without last.pt, as it refuses one with last.pt
    (it replaced a best.pt of someone's own); dtmt average refuses to write a run's last.pt (its training state was
    lost) or a file a running dtmt train writes (its next validation replaced the mean), and writes beside them; a
    corpus that changed between the run's fingerprint and its reads (a dtmt prepare moving another corpus into
    --data as the run started) is refused, not trained on with the other's fingerprint recorded."""
    from dtmt_models.cli.average import main as average
    from dtmt_models.data import binarized
    from dtmt_models.models.checkpoint import read_checkpoint
    from dtmt_models.run_lock import RunLock
    from dtmt_models.training.trainer import step_checkpoints

    run = tmp_path / "run"
    base = ["--data", toy, "--log-every", "1", "--valid-every", "2", *TINY]
    assert train_here(["--out", str(run), "--max-steps", "2", "--keep-last", "1", *base], capsys).returncode == 0
    for name in ("best.pt", "step_0000002.pt"):
        only = tmp_path / f"only-{name}"
        only.mkdir()
        (only / name).write_bytes((run / name).read_bytes())
        r = train_here(["--out", str(only), "--max-steps", "2", *base], capsys)
        # (--resume was offered too, and refused: no last.pt; a run killed between its first best.pt and last.pt)
        assert r.returncode == 2 and (f"already holds a checkpoint ({name}); pass --overwrite to start again (it has "
                                      f"no last.pt to resume)") in r.stderr, r.stderr
        assert sorted(os.listdir(only)) == [name]
    r = train_here(["--out", str(run), "--max-steps", "2", *base], capsys)
    assert r.returncode == 2, r.stderr
    assert "already holds a checkpoint (last.pt); pass --resume to continue it or --overwrite to start again\n" \
        in r.stderr, r.stderr
    last = (run / "last.pt").read_bytes()
    assert average([str(run / "step_0000002.pt"), "-o", str(run / "last.pt")]) == 2
    assert (f"--output {run / 'last.pt'}: the last checkpoint, which --resume continues from, of the run in "
            f"{os.path.realpath(run)}; the mean would replace it") in capsys.readouterr().err
    assert (run / "last.pt").read_bytes() == last
    copy = tmp_path / "copy.pt"   # (a run's last.pt outside its folder: its training state, refused as well)
    copy.write_bytes(last)
    assert average([str(run / "step_0000002.pt"), "-o", str(copy)]) == 2
    assert "a run's checkpoint with its training state" in capsys.readouterr().err
    assert copy.read_bytes() == last
    lock = RunLock(str(run)).acquire()   # (a dtmt train running there)
    try:
        best = (run / "best.pt").read_bytes()
        assert average([str(run / "step_0000002.pt"), "-o", str(run / "best.pt")]) == 2
        assert f"a file of the run in {run}, where a dtmt train runs (process {os.getpid()})" in \
            capsys.readouterr().err
        assert (run / "best.pt").read_bytes() == best
        assert average([str(run / "step_0000002.pt"), "-o", str(run / "avg.pt")]) == 0   # (beside them: fine)
    finally:
        lock.release()
    # a finished run's best.pt or step_N.pt: replaced, exit 0, and the next --run average took the mean in its place
    capsys.readouterr()
    # (and its train_log.csv, config.yaml or learning_curve.png: replaced by a checkpoint, exit 0; the run could not be
    # resumed nor its settings rerun)
    for name, kind, other in (("best.pt", "the best checkpoint", "step_0000002.pt"),
                              ("step_0000002.pt", "the step checkpoint", "best.pt"),
                              ("train_log.csv", "the training log, which --resume reads", "best.pt"),
                              ("config.yaml", "the settings, which --config reruns", "best.pt"),
                              ("learning_curve.png", "the learning curve, of the run", "best.pt")):
        before = (run / name).read_bytes()
        assert average([str(run / other), str(run / "avg.pt"), "-o", str(run / name)]) == 2
        assert f"--output {run / name}: {kind}" in capsys.readouterr().err
        assert (run / name).read_bytes() == before
    # a new step checkpoint's name in a run folder: the next --run average took the mean as the run's own, and a
    # resumed run replaced it (or its --keep-last removed it)
    assert average([str(run / "step_0000002.pt"), "-o", str(run / "step_0000050.pt")]) == 2
    assert (f"--output {run / 'step_0000050.pt'}: the name of a step checkpoint, which --run averages, in the run "
            f"folder {run}") in capsys.readouterr().err
    assert not (run / "step_0000050.pt").exists()
    mine = tmp_path / "mine"   # (a folder of one's own with a config.yaml is no run's: best.pt may be written there)
    mine.mkdir()
    (mine / "config.yaml").write_text("mine: true\n")
    assert average([str(run / "step_0000002.pt"), "-o", str(mine / "best.pt")]) == 0, capsys.readouterr().err
    # --overwrite starts again without the earlier run's step checkpoints (average took them as this run's), nor its
    # last.pt, best.pt and curve: a run stopped before its own replaced them left the earlier run's as its own (a
    # resume refused, translate -c best.pt the old model)
    assert step_checkpoints(str(run)) and (run / "best.pt").is_file() and (run / "learning_curve.png").is_file()
    # (an --overwrite refused before its run started, here for its data, removes nothing)
    kept = {name: (run / name).read_bytes() for name in ("last.pt", "best.pt", "step_0000002.pt")}
    r = train_here(["--out", str(run), "--max-steps", "1", "--overwrite", "--max-len", "1", *base], capsys)
    assert r.returncode == 2 and "removed" not in r.stderr, r.stderr
    assert {name: (run / name).read_bytes() for name in kept} == kept
    r = train_here(["--out", str(run), "--max-steps", "1", "--overwrite", *base], capsys)
    assert r.returncode == 0 and ("--overwrite: removed the earlier run's last.pt, best.pt, learning_curve.png, 1 step "
                                  "checkpoint(s) and ") in r.stderr, r.stderr
    assert step_checkpoints(str(run)) == []
    assert all(read_checkpoint(str(run / name))["step"] == 1 for name in ("last.pt", "best.pt"))   # (this run's)
    real, calls = binarized.fingerprint, []

    def first_of_another_corpus(data):   # (the run's first look: another corpus's; its reads: this one)
        calls.append(data)
        return dict(real(data), train_sha1="0" * 40) if len(calls) == 1 else real(data)
    monkeypatch.setattr(binarized, "fingerprint", first_of_another_corpus)
    r = train_here(["--out", str(tmp_path / "raced"), "--max-steps", "2", *base], capsys)
    assert r.returncode == 2 and f"--data {toy} changed while the run started" in r.stderr, r.stderr
    assert not (tmp_path / "raced").exists()   # (nothing written: the folder made for it goes)


def test_every_setting_of_a_run_has_a_kind_resume_checks():
    """resumed_config checks each TrainConfig field by the kind its annotation names: a field of a kind its table
    lacks would be refused on every resume (or, had it a fallback, never checked)."""
    import dataclasses

    from dtmt_models.cli.train import _KINDS, _kind
    from dtmt_models.training.config import TrainConfig

    assert {f.name: _kind(f)[0] for f in dataclasses.fields(TrainConfig) if _kind(f)[0] not in _KINDS} == {}


def test_corrupt_training_state_is_refused_before_use(toy_nodev, tmp_path, capsys):
    """A last.pt that the weights-only loader takes but whose contents do not fit (issue 71 item 3): an Adam moment
    of the wrong shape (it was a segfault in the fused Adam), NaN moments or weights (they trained on, writing NaN
    weights), a wrong-shaped weight, counters of the wrong type or range, an unreadable vocabulary. Each --resume
    is one line, exit 2, the checkpoint untouched; translate refuses the NaN weights too (it wrote empty lines)."""
    from dtmt_models.models.checkpoint import read_checkpoint, save_checkpoint

    run = tmp_path / "run"
    assert train_here(["--data", toy_nodev, "--out", str(run), "--max-steps", "2", *TINY], capsys).returncode == 0
    good = read_checkpoint(str(run / "last.pt"))
    first = min(good["training"]["optimizer"]["state"])
    name = next(iter(good["model"]))

    def moment(key, change):
        def edit(c):
            c["training"]["optimizer"]["state"][first][key] = change(c["training"]["optimizer"]["state"][first][key])
        return edit

    def counter(key, value):
        def edit(c):
            c["training"][key] = value
        return edit

    def weight(change):
        def edit(c):
            c["model"][name] = change(c["model"][name])
        return edit

    def vocab(c):
        c["src_vocab"] = b"not a sentencepiece model"

    def rng(key, change):
        def edit(c):
            c["training"]["rng"][0][key] = change(c["training"]["rng"][0][key])
        return edit

    def entry(change):
        def edit(c):
            change(c["training"]["optimizer"]["state"][first])
        return edit

    def sched(change):
        def edit(c):
            change(c["training"]["scheduler"])
        return edit

    def group(key, value):   # (found by a probe: maximize=True climbed the loss, exit 0; lr='abc' a traceback)
        def edit(c):
            for g in c["training"]["optimizer"]["param_groups"]:
                if value is KeyError:
                    del g[key]
                else:
                    g[key] = value
        return edit

    def setting(key, value):   # (each was a traceback: a crafted or hand-edited config)
        def edit(c):
            if value is KeyError:
                del c[key]
            elif key in ("config", "training"):
                c[key] = value
            elif key == "model_options" and value is not None:
                c["config"][key] = dict(c["config"][key], **value)
            else:
                c["config"][key] = value
        return edit

    cases = [(moment("exp_avg", lambda t: t.reshape(-1)[:-1].clone()), "the optimizer's exp_avg of parameter"),
             (moment("exp_avg_sq", lambda t: torch.full_like(t, float("nan"))), "NaN or infinite value"),
             (moment("step", lambda t: torch.tensor(-3.0)), "the optimizer's step of parameter"),
             (weight(lambda t: torch.full_like(t, float("nan"))), f"weight {name} holds"),
             (weight(lambda t: t[:-1].clone()), f"weight {name} is torch.float32"),
             (counter("step", "abc"), "its step is 'abc', not a count in [0, "),
             (counter("step", -5), "its step is -5"),
             (counter("step", 2 ** 62), "its step is 4611686018427387904, not a count in [0, 2,147,483,647]"),
             (counter("rng", 5), "its training state is malformed"),
             (setting("training", [1, 2]), "its training state is malformed"),
             (setting("config", KeyError), "it holds no training settings (config)"),
             (setting("config", None), "it holds no training settings (config)"),
             (setting("lr", "abc"), "its setting lr is 'abc', not a float"),
             (setting("patience", True), "its setting patience is True, not an int"),
             (setting("model", "nope"), "its settings: unknown model 'nope'"),
             (setting("model_options", {"hidden_size": -4}), "its settings: "),
             (setting("max_tokens", -5), "its settings: --max-tokens -5: must be an integer in [1, "),
             (setting("config", {}), "it holds no training settings (config) or not all of them"),
             (setting("lr", None), "its settings lack lr"),
             (setting("schedule", "nope"), "its setting schedule is 'nope', not one of rnmt, inverse-sqrt,"),
             (setting("best_by", "nope"), "its setting best_by is 'nope', not one of loss, bleu"),
             (setting("model_options", None), "its setting model_options is None, not a mapping"),
             (setting("max_time_s", float("nan")), "its time budget max_time_s is nan"),
             (counter("elapsed", float("nan")), "its elapsed time is nan"),
             (vocab, "its src_vocab cannot be read"),
             (group("maximize", True), "its optimizer's maximize of group 0 is True, the run's settings give False"),
             (group("weight_decay", 10.0), "its optimizer's weight_decay of group 0 is 10.0, the run's settings "
                                           "give 0"),
             (group("eps", -1e-9), "its optimizer's eps of group 0 is -1e-09, the run's settings give 1e-09"),
             (group("betas", (0.9, 0.5)), "its optimizer's betas of group 0 is (0.9, 0.5)"),
             (group("lr", "abc"), "its optimizer's lr of group 0 is 'abc', not a rate"),
             (group("betas", KeyError), "its optimizer's group 0 has no betas"),   # (a KeyError's traceback)
             (group("weight_decay", KeyError), "its optimizer's group 0 has no weight_decay"),
             (counter("validated_step", "x"), "its validated_step is 'x', not a count up to its step 2"),
             (counter("validated_step", 3), "its validated_step is 3, not a count up to its step 2"),
             (lambda c: c.update(run_id=["x"]), "its run_id is ['x'], not a run's identity (hexadecimal digits)"),
             # a review's crafted states, each a traceback at the resume (some after its files were written), or
             # taken: random states a generator does not take, a moment missing or no tensor, negative sums of
             # squares, a step counter past any run, a scheduler whose fields set the scheduler's attributes
             (rng("torch", lambda t: t[:10].clone()), "its random state of process 0 is not a generator's"),
             (rng("python", lambda t: ()), "its random state of process 0 is not a generator's"),
             (entry(lambda e: e.pop("exp_avg")), f"the optimizer state of parameter {first} has no exp_avg"),
             (entry(lambda e: e.pop("step")), f"the optimizer state of parameter {first} has no step"),
             (entry(lambda e: e.update(exp_avg=[0.0])), f"the optimizer's exp_avg of parameter {first} is a list"),
             (moment("exp_avg_sq", lambda t: torch.full_like(t, -1.0)), "holds negative values (a sum of squares)"),
             (moment("step", lambda t: torch.tensor(1e30)), "the optimizer's step of parameter"),
             (sched(lambda d: d.update(optimizer=5)), "its scheduler state has a field 'optimizer' a scheduler does"),
             (sched(lambda d: d.update(base_lrs=["x"])), "its scheduler's base_lrs is ['x'], the run's settings give"),
             (sched(lambda d: d["lr_lambdas"][0].update(s=1500, e=1500)), "its scheduler's lr_lambdas is"),
             (sched(lambda d: d.update(last_epoch=10 ** 30)), "its scheduler state is malformed"),
             (sched(lambda d: d.update(_last_lr=[float("nan")])), "its scheduler's last rates are [nan]"),
             # another review's, each a traceback at the resume or taken: a moment sparse or on the meta device
             # (inside the checks), numbers past a float's range (an OverflowError once the run used them), a
             # stopped_early_by not a --best-by (found when saving, after best.pt), two moments in one storage
             (moment("exp_avg", lambda t: t.to_sparse()), f"the optimizer's exp_avg of parameter {first} is a "
                                                         f"sparse_coo tensor, not a dense one"),
             (moment("exp_avg", lambda t: torch.empty_like(t, device="meta")), "is a meta tensor, not a dense one"),
             (moment("step", lambda t: torch.empty_like(t, device="meta")), "the optimizer's step of parameter"),
             (counter("log_window", [10 ** 400, 0, 0, 0]), "its log window is [1000000000000"),
             (counter("elapsed", 10 ** 400), "its elapsed time is 1000000000000"),
             (group("lr", 10 ** 400), "its optimizer's lr of group 0 is 1000000000000"),
             (counter("stopped_early_by", 5), "its stopped_early_by is 5, not a --best-by"),
             (entry(lambda e: e.update(exp_avg=e["exp_avg_sq"])), f"the optimizer's exp_avg_sq of parameter {first} "
                                                                  f"shares its storage with its exp_avg of parameter")]
    for i, (edit, message) in enumerate(cases):
        bad = read_checkpoint(str(run / "last.pt"))
        edit(bad)
        folder = tmp_path / f"bad{i}"
        folder.mkdir()
        save_checkpoint(str(folder / "last.pt"), bad)
        before = (folder / "last.pt").read_bytes()
        r = train_here(["--data", toy_nodev, "--resume", str(folder), "--max-steps", "4"], capsys)
        assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, (i, r.stderr)
        assert (folder / "last.pt").read_bytes() == before and os.listdir(folder) == ["last.pt"], os.listdir(folder)
    # decoding a checkpoint with NaN weights: refused in one line, nothing translated
    from dtmt_models import cli

    bad = read_checkpoint(str(run / "last.pt"))
    weight(lambda t: torch.full_like(t, float("nan")))(bad)
    save_checkpoint(str(tmp_path / "nan.pt"), bad)
    capsys.readouterr()
    code = cli.main(["translate", "--checkpoint", str(tmp_path / "nan.pt"), os.path.join(toy_nodev, "train.es"),
                     "--output", str(tmp_path / "out.txt")])
    err = capsys.readouterr().err
    assert code == 2 and "NaN or infinite" in err and not (tmp_path / "out.txt").exists(), err
    # and the good checkpoint still resumes; so does one whose scheduler state another torch wrote (verbose: torch 2.1
    # to 2.6; no _is_initial: before it), which the scheduler check must not take for a crafted field
    older = read_checkpoint(str(run / "last.pt"))
    older["training"]["scheduler"]["verbose"] = False
    older["training"]["scheduler"].pop("_is_initial", None)
    (tmp_path / "older").mkdir()
    save_checkpoint(str(tmp_path / "older" / "last.pt"), older)
    r = train_here(["--data", toy_nodev, "--resume", str(tmp_path / "older"), "--max-steps", "3"], capsys)
    assert r.returncode == 0, r.stderr
    assert train_here(["--data", toy_nodev, "--resume", str(run), "--max-steps", "3"], capsys).returncode == 0


def test_a_corrupt_binarized_corpus_is_refused_before_the_first_update(tmp_path, capsys):
    """The binarized shards checked whole before training (issue 71 item 4): an id beyond the vocabulary in a
    training or a dev pair (the dev one was found only at the first validation, after the updates), offsets that
    decrease (reported as long pairs dropped; or wrap around, seen as none decreasing), an id changed to another
    inside the vocabulary (trained on silently before the shards had checksums), a manifest field of the wrong type
    (a TypeError traceback): one line naming the file (and the pair), exit 2, nothing written."""
    import json
    import shutil

    import numpy as np

    clean = make_toy_corpus(tmp_path / "clean", n_train=200, n_dev=20, n_test=0)
    assert train_here(["--data", clean, "--out", str(tmp_path / "first"), "--max-steps", "1", *TINY],
                      capsys).returncode == 0
    bin_dir = next(n for n in os.listdir(clean) if n.startswith("bin-"))

    def corrupt(name, edit):
        copy = tmp_path / name
        shutil.copytree(clean, copy)
        edit(copy / bin_dir)
        return str(copy)

    def big_id(split, side, pair):
        def edit(d):
            dtype = np.dtype(json.loads((d / "binarized.json").read_text())["dtype"])
            ids = np.fromfile(d / f"{split}.{side}.bin", dtype=dtype)
            at = int(np.fromfile(d / f"{split}.{side}.idx", dtype=np.int64)[pair])
            ids[at] = 60 + 7   # past the 60 subwords of the toy vocabularies
            ids.tofile(d / f"{split}.{side}.bin")
        return edit

    def within_vocabulary(d):   # one id changed to another the vocabulary has: only the checksum sees it
        dtype = np.dtype(json.loads((d / "binarized.json").read_text())["dtype"])
        ids = np.fromfile(d / "train.src.bin", dtype=dtype)
        ids[11] = (int(ids[11]) + 1) % 60
        ids.tofile(d / "train.src.bin")

    def decreasing(d):
        idx = np.fromfile(d / "train.src.idx", dtype=np.int64)
        idx[5], idx[6] = idx[6], idx[5]
        idx.tofile(d / "train.src.idx")

    def wrapping(d):   # steps of 2^62 that wrap around to the true offsets: a difference saw none decrease, and
        idx = np.fromfile(d / "train.src.idx", dtype=np.int64)   # pair 5 was read at negative offsets, mid-training
        idx[5:8] = [2 ** 62, -2 ** 63, -2 ** 62]
        idx.tofile(d / "train.src.idx")

    def pairs_as_text(d):   # (in the corpus' own manifest, corpus.json)
        m = json.loads((d.parent / "corpus.json").read_text())
        m["counts"]["train"] = "200"
        (d.parent / "corpus.json").write_text(json.dumps(m))

    cases = [(big_id("train", "tgt", 37), "train.tgt.bin: pair 37 holds id 67, beyond the tgt vocabulary's 60"),
             (big_id("dev", "src", 3), "dev.src.bin: pair 3 holds id 67"),
             (decreasing, "train.src.idx: the offsets decrease at pair 5"),
             (wrapping, "train.src.idx: the offsets decrease at pair 5"),
             (within_vocabulary, "train.src.bin: its bytes are not those written by `dtmt prepare binarize`"),
             (pairs_as_text, "corpus.json: malformed")]
    for i, (edit, message) in enumerate(cases):
        data = corrupt(f"bad{i}", edit)
        out = tmp_path / f"run{i}"
        r = train_here(["--data", data, "--out", str(out), "--max-steps", "2", *TINY], capsys)
        assert r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1, (i, r.stderr)
        assert not out.exists()


def test_a_diverged_run_stops_in_one_line_without_saving_nan_weights(tmp_path, capsys):
    """--lr 1e30: the first update makes the weights overflow. The run stops at the next loss (training's, or the
    dev loss when a validation comes first) with exit 1 and one line saying so, and writes no checkpoint of the
    non-finite weights; a resumable last.pt of an earlier validation stays as it was. (It trained on in NaN
    and saved them, and translating them gave empty lines.)"""
    import torch

    data = make_toy_corpus(tmp_path / "c", n_train=200, n_dev=20, n_test=0)
    for valid_every, what in (("1", "the dev loss is nan at update 1"), ("5", "the training loss is nan at update 2")):
        out = tmp_path / f"run{valid_every}"
        r = train_here(["--data", data, "--out", str(out), "--max-steps", "6", "--valid-every", valid_every,
                        "--lr", "1e30", *TINY], capsys)
        assert r.returncode == 1 and r.stderr == (
            f"dtmt train: {what}: the run diverged and stops without saving it (nothing was saved); a new run with "
            f"a lower --lr, a longer --warmup or --clip may not\n"), r.stderr
        assert not (out / "last.pt").exists() and not (out / "best.pt").exists()
    # the run's last update overflowing where no validation follows it (no dev split): its loss was taken before the
    # step, finite, and last.pt saved the infinite weights, exit 0
    nodev = make_toy_corpus(tmp_path / "nodev", n_train=200, n_dev=0, n_test=0)
    out = tmp_path / "last_update"
    r = train_here(["--data", nodev, "--out", str(out), "--max-steps", "1", "--lr", "1e39", *TINY], capsys)
    assert r.returncode == 1 and r.stderr == (
        "dtmt train: the weights after update 1 are not finite: the run diverged and stops without saving it "
        "(nothing was saved); a new run with a lower --lr, a longer --warmup or --clip may not\n"), r.stderr
    assert not (out / "last.pt").exists()
    # diverging after a validation: a run resumed from a last.pt whose Adam moments are huge but finite (they pass
    # the resume checks) overflows at its first update; last.pt keeps the update it was saved at, as it was
    out = tmp_path / "later"
    assert train_here(["--data", data, "--out", str(out), "--max-steps", "2", "--valid-every", "2", *TINY],
                      capsys).returncode == 0
    last = torch.load(out / "last.pt", weights_only=True)
    for state in last["training"]["optimizer"]["state"].values():
        state["exp_avg"].fill_(1e30)
    torch.save(last, out / "last.pt")
    before = (out / "last.pt").read_bytes()
    r = train_here(["--data", data, "--resume", str(out), "--max-steps", "6"], capsys)
    assert r.returncode == 1 and r.stderr == (
        f"dtmt train: the training loss is nan at update 4: the run diverged and stops without saving it "
        f"({out / 'last.pt'} keeps update 2); a new run with a lower --lr, a longer --warmup or --clip may not\n"
    ), r.stderr
    assert (out / "last.pt").read_bytes() == before


def test_the_binarized_corpus_is_built_once_reused_and_rebuilt_when_the_text_changes(tmp_path, capsys):
    data = make_toy_corpus(tmp_path / "c", n_train=200, n_dev=0, n_test=0)
    args = ["--max-steps", "2", "--overwrite", *TINY]
    first = train_here(["--data", data, "--out", str(tmp_path / "a"), *args], capsys)
    assert first.returncode == 0, first.stderr
    assert "no binarized corpus for bpe 60" in first.stdout and "building it now" in first.stdout
    again = train_here(["--data", data, "--out", str(tmp_path / "b"), *args], capsys)
    assert again.returncode == 0 and "building it now" not in again.stdout and "bin-bpe60)" in again.stdout
    assert losses(str(tmp_path / "a")) == losses(str(tmp_path / "b"))
    with open(os.path.join(data, "train.en"), "a", encoding="utf-8") as f:
        f.write("the dog\n")
    with open(os.path.join(data, "train.es"), "a", encoding="utf-8") as f:
        f.write("el perro\n")
    changed = train_here(["--data", data, "--out", str(tmp_path / "c"), *args], capsys)
    assert changed.returncode == 0 and "(changed: train.es; train.en)" in changed.stdout
    assert "data: 201 training pairs" in changed.stdout


def test_max_len_filter_is_reported(toy_nodev, tmp_path, capsys):
    r = train_here(["--data", toy_nodev, "--out", str(tmp_path / "r"), "--max-steps", "1", "--max-len", "5", *TINY],
                   capsys)
    assert r.returncode == 0, r.stderr
    import re

    m = re.search(r"data: ([\d,]+) training pairs \(([\d,]+) longer than 5 subwords dropped", r.stdout)
    kept, dropped = (int(g.replace(",", "")) for g in m.groups())
    assert kept + dropped == 600 and dropped > 0


@pytest.mark.parametrize("model", sorted(PRESETS))
def test_presets_build(model):
    assert model in list_models()
    small = get_preset(model, "small")
    m = build_model(model, 100, 120, **small["model"])
    assert sum(p.numel() for p in m.parameters()) > 0
    with torch.device("meta"):                      # the paper sizes, without allocating them
        build_model(model, 30000, 30000, **get_preset(model, "paper")["model"])
    assert {"lr", "schedule", "smoothing", "clip", "max_tokens"} <= set(small["train"])


def test_every_system_has_a_preset():
    assert set(PRESETS) == set(list_models())
    with pytest.raises(ValueError, match="presets"):
        get_preset("dtmt", "huge")


def test_device_cuda_without_index_names_the_current_device(monkeypatch):
    """`--device cuda` (and `auto` on a GPU machine) must become cuda:N before torch.cuda.set_device, which
    refuses a device without an index (seen on the first GPU machine: every `dtmt train --device cuda` failed)."""
    from dtmt_models.training.distributed import Dist

    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(torch.device(d)))
    for arg in ("cuda", "auto"):
        assert Dist(arg).device == torch.device("cuda", 0)
    assert Dist("cuda:0").device == torch.device("cuda", 0)
    assert chosen == [torch.device("cuda", 0)] * 3
    # an ordinal past the machine's GPUs: refused before the processes meet (set_device failed after them)
    with pytest.raises(ValueError, match=r"^--device cuda:1: this machine has 1 CUDA device\(s\)$"):
        Dist("cuda:1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    from dtmt_models.training.distributed import process_device

    with pytest.raises(ValueError, match=r"LOCAL_RANK 1: start at most that many processes on it\)$"):
        process_device("cuda")


def test_full_disk_while_saving_the_checkpoint(toy_nodev, tmp_path, monkeypatch, capsys):
    """The disk fills up as `last.pt` is written: one line naming the file and the reason, exit 1, no
    temporary file left behind (issue 20, item 5)."""
    import errno

    from dtmt_models import atomic
    from dtmt_models.cli import train

    real_fsync = atomic.os.fsync

    def fsync(fd):
        if ".last.pt.tmp" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    out = tmp_path / "run"
    code = train.main(["--data", toy_nodev, "--out", str(out), "--max-steps", "2", *TINY])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err[-1].startswith("dtmt train: cannot write ") and "last.pt: No space left on device" in err[-1], err
    assert not [n for n in os.listdir(out) if ".tmp" in n], os.listdir(out)


def test_full_disk_while_writing_the_log_or_the_tensorboard_events(toy_nodev, tmp_path, monkeypatch, capsys):
    """The disk fills up as a row of train_log.csv, or of the TensorBoard events, is written: one line naming the
    file (or the events' folder) and the reason, exit 1. It was a bare OSError (a traceback; "No space left on
    device" naming no file), with the TensorBoard writer thread's own traceback before it. A part row is cut off:
    the log keeps the rows written whole, which --resume reads."""
    import errno

    from tensorboard.summary.writer import record_writer

    from dtmt_models.cli import train
    from dtmt_models.training import trainer

    def enospc():
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    class Filling:   # the log's file: its fourth row is written in part, then the disk is full
        rows = 0

        def __init__(self, f):
            self.f = f

        def write(self, text):
            Filling.rows += 1
            if Filling.rows == 4:
                self.f.write(text[:7])
                raise enospc()
            return self.f.write(text)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

    def filling_open(path, *args, **kwargs):
        return Filling(open(path, *args, **kwargs))

    for where in ("log", "events"):
        out = tmp_path / where
        with monkeypatch.context() as m:
            if where == "log":
                m.setattr(trainer, "open", filling_open, raising=False)
            else:
                real = record_writer.RecordWriter.write
                writes = [0]

                def write(self, data):   # (in the writer's thread)
                    writes[0] += 1
                    if writes[0] > 20:
                        raise enospc()
                    return real(self, data)
                m.setattr(record_writer.RecordWriter, "write", write)
            code = train.main(["--data", toy_nodev, "--out", str(out), "--max-steps", "30", "--log-every", "1",
                               *TINY])
        err = capsys.readouterr().err
        assert code == 1 and len(err.splitlines()) == 1, err
        if where == "log":
            assert err == f"dtmt train: cannot write {out / 'train_log.csv'}: No space left on device (the log keeps " \
                          f"its rows up to the last one written); {out / 'last.pt'} saved at update 4: resume with " \
                          f"--resume once the log can be written\n"
            rows = list(csv.DictReader(open(out / "train_log.csv")))
            assert [r["step"] for r in rows] == ["1", "2", "3"] and all(r["wall_s"] for r in rows), rows
        else:
            assert err.startswith(f"dtmt train: cannot write the TensorBoard events in {out / 'tensorboard'}: No "
                                  f"space left on device; {out / 'last.pt'} saved at update "), err
        assert not [n for n in os.listdir(out) if ".tmp" in n], os.listdir(out)


@pytest.mark.parametrize("bad, message", [
    (["--opt", "frobnicate=3"], "unknown option 'frobnicate' for dtmt"),
    (["--opt", "hidden_size=abc"], "option hidden_size='abc' for dtmt: expected int"),
    (["--opt", "cell=foo"], "'cell': 'foo', 'heads': 4, 'dropout': 0.2, 'candidate_dropout': 0.1}: dtmt: "
                            "cell must be 'gru', 'lgru' or 'lau', got 'foo'"),
    (["--opt", "hidden_size=-5"], "option hidden_size=-5 for dtmt: expected an int from 1 to 65,536"),
    (["--max-len", "1"], "no training pairs left: 600 longer than --max-len 1 subwords, 0 empty after "
                         "segmentation; raise --max-len"),
    (["--model", "transformer", "--opt", "max_len=8", "--max-len", "8"],
     "--max-len 8: transformer has 8 positions (its max_len option) and a pair of --max-len subwords needs 9 with "
     "BOS; give --max-len 7 or less, or a larger --opt max_len"),
    (["--opt", "pad_id=5"], "--opt pad_id=5: dtmt train pads with the vocabularies' id 0"),
    # (each a traceback: the items were read before the checks' one line)
    (["--opt", "hidden_size"], "--opt expects KEY=VALUE, got 'hidden_size'"),
    (["--opt", "=3"], "--opt expects KEY=VALUE, got '=3'"),
    (["--opt", "hidden_size=" + "1" * 5000], "--opt hidden_size: its value cannot be read (Exceeds the limit"),
    # (a short RNMT+ decay window: 2^1100 overflowed a float at update 0, a traceback after --out was made)
    (["--decay-start", "1100", "--decay-end", "1101", "--max-steps", "1"], None),
    (["--valid-every", "0"], "--valid-every 0: must be an integer in [1, 2,147,483,647]"),
    (["--log-every", "0"], "--log-every 0: must be an integer in [1, 2,147,483,647]"),
    (["--threads", "-3"], "--threads -3: must be an integer in [0, 1,024]"),
    (["--vocab-size", "5"], "--vocab-size 5: must be an integer in [8, 1,000,000]"),
    (["--max-time=-5m"], "--max-time -5m: must be a finite duration > 0"),
    (["--max-time", "nan"], "--max-time nan: must be a finite duration > 0"),
    (["--lr", "0"], "--lr 0: must be a finite number > 0"),
    (["--smoothing", "1"], "--smoothing 1: must be in [0, 1)"),
    (["--adam-beta2", "1"], "--adam-beta2 1: must be in [0, 1)"),
    (["--adam-eps", "0"], "--adam-eps 0: must be a finite number > 0"),
    (["--allow-changed-data"], "--allow-changed-data applies to --resume only"),
    (["--resume", "--overwrite"], "--resume and --overwrite contradict each other"),
    (["--opt", "backend=foo"], "--opt backend=foo: the recurrent kernels are not a model option; use --backend"),
    (["--backend", "foo"], "--backend foo: "),
    (["--device", "foo"], "--device: 'foo' is not a device (use cpu or cuda)"),
    pytest.param(["--backend", "cuda", "--device", "cpu"], "--backend cuda: ",
                 marks=pytest.mark.skipif("cuda" in __import__("dtmt_kernels").available_backends(),
                                          reason="the cuda backend is built here")),
    pytest.param(["--device", "cuda"], "--device cuda: no CUDA device is available here",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")),
])
def test_bad_options_are_refused_before_any_work(toy_nodev, tmp_path, capsys, bad, message):
    """Issue 20, item 3: one line naming the option, the value and what is allowed; exit 2; nothing written."""
    from dtmt_models.cli import train

    out = tmp_path / "run"
    code = train.main(["--data", toy_nodev, "--out", str(out), "--max-steps", "1", *TINY, *bad])
    err = capsys.readouterr().err
    if message is None:   # (not refused: it runs)
        assert code == 0, err
        return
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not out.exists()


def test_dev_pairs_past_the_transformers_positions_leave_the_dev_loss(toy, tmp_path, capsys):
    """A transformer of 8 positions trained with --max-len 7: the dev pairs longer than its positions are left out
    of the dev loss with a note (their loss crashed the run at its first validation), and validation runs on the
    rest."""
    r = train_here(["--data", toy, "--out", str(tmp_path / "run"), "--max-steps", "2", "--valid-every", "2",
                    "--max-len", "7", *TINY, "--model", "transformer", "--opt", "max_len=8", "--opt", "heads=2",
                    "--opt", "encoder_layers=1", "--opt", "decoder_layers=1"], capsys)
    assert r.returncode == 0, r.stderr
    note = re.search(r"note: (\d+) dev pairs longer than transformer's 8 positions are left out of the dev loss",
                     r.stdout)
    assert note and 0 < int(note.group(1)) < 30, r.stdout
    rows = [row for row in csv.DictReader(open(tmp_path / "run" / "train_log.csv")) if row["kind"] == "valid"]
    assert len(rows) == 1 and float(rows[0]["dev_loss"]) > 0, rows


def test_out_that_is_a_file_or_lies_under_one_is_refused(toy_nodev, tmp_path, capsys):
    """contract §6: --out naming a file, or a folder under a file, is one line and exit 2 before any work (it was a
    NotADirectoryError traceback when the log was opened)."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    for out, message in ((afile, f"--out {afile}: exists and is not a directory"),
                         (afile / "sub", f"--out {afile / 'sub'}: {afile} is a file, not a directory")):
        r = train_here(["--data", toy_nodev, "--out", str(out), "--max-steps", "1", *TINY], capsys)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr
    assert afile.read_text() == "x" and sorted(os.listdir(tmp_path)) == ["afile"]
    # inside the corpus' binarized copy, which a rebuild replaces whole (it was refused later, blaming the lock file)
    before = sorted(os.listdir(toy_nodev))
    for out in (os.path.join(toy_nodev, "bin-bpe60"), os.path.join(toy_nodev, "bin-bpe60", "run")):
        r = train_here(["--data", toy_nodev, "--out", out, "--max-steps", "1", *TINY], capsys)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert f"--out {out}: inside --data's binarized copy bin-bpe60, which dtmt prepare rebuilds" in r.stderr
    assert sorted(os.listdir(toy_nodev)) == before


def test_resume_names_a_checkpoint_and_continues_in_its_folder_or_in_out(toy_nodev, tmp_path, capsys, monkeypatch):
    """contract §7: `--resume CHECKPOINT` continues in --out, by default the checkpoint's folder (a run's folder names
    its last.pt), with the run's own device and backend unless others are given; into another --out the run goes
    on there with its log, the original untouched. Refused: an --out holding a checkpoint of its own, another
    checkpoint of a folder whose last.pt it would replace, a checkpoint without training state, another number of
    processes."""
    from dtmt_models.models.checkpoint import read_checkpoint

    def log_steps(run):
        return [int(r["step"]) for r in csv.DictReader(open(run / "train_log.csv")) if r["kind"] == "train"]

    run_a, args = tmp_path / "runA", [*TINY, "--log-every", "1"]
    r = train_here(["--data", toy_nodev, "--out", str(run_a), "--max-steps", "2", "--backend", "reference", *args],
                   capsys)
    assert r.returncode == 0 and "backend reference" in r.stdout, r.stderr
    r = train_here(["--data", toy_nodev, "--resume", str(run_a / "last.pt"), "--max-steps", "3", *args], capsys)
    assert r.returncode == 0 and "resumed from step 2" in r.stdout and "backend reference" in r.stdout, r.stderr
    assert read_checkpoint(str(run_a / "last.pt"))["step"] == 3
    before = (run_a / "last.pt").read_bytes(), (run_a / "train_log.csv").read_bytes()
    run_c = tmp_path / "runC"
    r = train_here(["--data", toy_nodev, "--resume", str(run_a), "--out", str(run_c), "--max-steps", "4",
                    "--backend", "cpp", *args], capsys)
    assert r.returncode == 0 and "resumed from step 3" in r.stdout and "backend cpp" in r.stdout, r.stderr
    assert read_checkpoint(str(run_c / "last.pt"))["step"] == 4 and log_steps(run_c) == [1, 2, 3, 4]
    assert ((run_a / "last.pt").read_bytes(), (run_a / "train_log.csv").read_bytes()) == before
    r = train_here(["--data", toy_nodev, "--resume", str(run_a), "--out", str(run_c), "--max-steps", "5", *args],
                   capsys)
    assert r.returncode == 2 and f"--out {run_c} already holds a checkpoint of its own (last.pt)" in r.stderr, r.stderr
    # a run's folder without its last.pt (another run of the same settings: its best.pt, or a step checkpoint, and
    # its log) is refused alike: it was taken over, its best.pt and log replaced by the resumed run's
    shutil.copyfile(run_c / "last.pt", run_a / "backup.pt")
    held = {"best.pt": b"not this run's", "step_7.pt": b"nor this"}
    (run_c / "last.pt").unlink()
    for name, content in held.items():
        (run_c / name).write_bytes(content)
        log = (run_c / "train_log.csv").read_bytes()
        r = train_here(["--data", toy_nodev, "--resume", str(run_a), "--out", str(run_c), "--max-steps", "5", *args],
                       capsys)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert f"--out {run_c} already holds a checkpoint of its own ({name}); continue {run_a / 'last.pt'} in a new " \
               f"--out" in r.stderr, r.stderr
        assert (run_c / name).read_bytes() == content and (run_c / "train_log.csv").read_bytes() == log
        assert not (run_c / "last.pt").exists()
        if name == "best.pt":
            (run_c / name).unlink()
    r = train_here(["--data", toy_nodev, "--resume", str(run_a / "backup.pt"), "--max-steps", "5", *args], capsys)
    assert r.returncode == 2 and "would replace the run's own last.pt there; give a new --out" in r.stderr, r.stderr
    (tmp_path / "link").symlink_to(run_a)   # (the same folder through a link: its last.pt is as much at stake)
    r = train_here(["--data", toy_nodev, "--resume", str(tmp_path / "link" / "backup.pt"), "--out", str(run_a),
                    "--max-steps", "5", *args], capsys)
    assert r.returncode == 2 and "would replace the run's own last.pt there; give a new --out" in r.stderr, r.stderr
    assert (run_a / "last.pt").read_bytes() == before[0]
    weights_only = tmp_path / "weights.pt"
    ckpt = read_checkpoint(str(run_a / "last.pt"))
    torch.save({k: v for k, v in ckpt.items() if k != "training"}, weights_only)
    r = train_here(["--data", toy_nodev, "--resume", str(weights_only), "--out", str(tmp_path / "runD"),
                    "--max-steps", "5", *args], capsys)
    assert r.returncode == 2 and f"{weights_only} has no training state" in r.stderr, r.stderr
    # ... the same in the run's own folder (an averaged checkpoint beside last.pt): it was first told to take a new
    # --out, where it was refused for this
    shutil.copyfile(weights_only, run_a / "avg.pt")
    r = train_here(["--data", toy_nodev, "--resume", str(run_a / "avg.pt"), "--max-steps", "5", *args], capsys)
    assert r.returncode == 2 and f"{run_a / 'avg.pt'} has no training state" in r.stderr, r.stderr
    (run_a / "avg.pt").unlink()
    monkeypatch.setenv("WORLD_SIZE", "2")
    from dtmt_models.cli import train

    monkeypatch.setattr(train, "meet_the_others", lambda: None)   # (a refusal of this process alone, before it meets)
    r = train_here(["--data", toy_nodev, "--resume", str(run_a), "--out", str(tmp_path / "runD"), "--max-steps", "5",
                    *args], capsys)
    assert r.returncode == 2 and "trained by 1 process(es); continue it with as many (got 2)" in r.stderr, r.stderr
    assert not (tmp_path / "runD").exists() and (run_a / "last.pt").read_bytes() == before[0]


def test_a_run_resumed_into_a_new_folder_keeps_its_best(toy, tmp_path, capsys):
    """The best.pt of a run continued in a new --out comes along (the run's best score does: without it the new
    folder could end with no best.pt while the run reported one)."""
    run_a, run_b = tmp_path / "runA", tmp_path / "runB"
    args = [*TINY, "--valid-every", "1", "--bleu-sentences", "4", "--valid-beam", "1"]
    assert train_here(["--data", toy, "--out", str(run_a), "--max-steps", "2", *args], capsys).returncode == 0
    r = train_here(["--data", toy, "--resume", str(run_a), "--out", str(run_b), "--max-steps", "2", *args], capsys)
    assert r.returncode == 0, r.stderr
    assert (run_b / "best.pt").read_bytes() == (run_a / "best.pt").read_bytes()


def test_progress_none_drops_the_progress_but_keeps_the_run_s_messages(toy_nodev, tmp_path, capsys):
    """--progress none: no bar and no progress lines, but what the run reports (its set-up, how and why it stopped)
    is still printed, as fairseq's --no-progress-bar keeps its log (it printed nothing at all before)."""
    args = [a if a != "lines" else "none" for a in TINY] + ["--log-every", "1"]
    r = train_here(["--data", toy_nodev, "--out", str(tmp_path / "run"), "--max-steps", "2", *args], capsys)
    assert r.returncode == 0, r.stderr
    assert "stopped: reached --max-steps 2" in r.stdout and "model dtmt (small preset)" in r.stdout, r.stdout
    assert "step 1" not in r.stdout and "step 1" not in r.stderr, r.stdout + r.stderr


def test_vocabulary_too_small_for_the_corpus_is_one_line(toy_nodev, tmp_path, capsys):
    from dtmt_models.cli import train

    out = tmp_path / "run"
    args = ["--data", toy_nodev, "--out", str(out), "--max-steps", "1", *TINY, "--vocab-size", "8"]
    assert train.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"dtmt train: --vocab-size 8: too small for the training text of {toy_nodev}: "
                              "SentencePiece needs at least "), err
    assert "--character_coverage" not in err[-1]   # (SentencePiece's advice names an option of its own, not ours)
    assert not (out / "config.yaml").exists()


def test_resume_continues_in_out_and_checks_the_data_and_settings(toy_nodev, tmp_path, monkeypatch, capsys):
    """Issue 20, item 2: a copied run resumes in the copy (the original is untouched), from any working
    directory; another corpus, or a setting given with another value, is refused naming it."""
    import shutil

    run_a = tmp_path / "runA"
    assert train_here(["--data", toy_nodev, "--out", str(run_a), "--max-steps", "2", *TINY], capsys).returncode == 0
    shutil.copytree(run_a, tmp_path / "runB")
    before = (run_a / "last.pt").read_bytes(), (run_a / "train_log.csv").read_bytes()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = subprocess.run([sys.executable, "-m", "dtmt_models.cli.train", "--data", os.path.relpath(toy_nodev, elsewhere),
                        "--out", "../runB", "--resume", "--max-steps", "4", "--model", "dtmt", "--progress", "lines"],
                       cwd=elsewhere, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert r.returncode == 0, r.stderr
    assert "resumed from step 2" in r.stdout
    assert ((run_a / "last.pt").read_bytes(), (run_a / "train_log.csv").read_bytes()) == before
    from dtmt_models.models.checkpoint import read_checkpoint
    assert read_checkpoint(str(tmp_path / "runB" / "last.pt"))["step"] == 4 and not os.listdir(elsewhere)
    # another corpus: refused unless --allow-changed-data
    other = make_toy_corpus(tmp_path / "other", n_train=50, n_dev=0, n_test=0, seed=3)
    r = train_here(["--data", other, "--out", str(tmp_path / "runB"), "--resume", "--max-steps", "5"], capsys)
    assert r.returncode == 2 and "is not the corpus this run was trained on (counts, train_sha1 differ)" in r.stderr
    # a fixed setting given with another value: refused, naming it; the same value is fine
    r = train_here(["--data", toy_nodev, "--out", str(tmp_path / "runB"), "--resume", "--lr", "0.5",
                    "--opt", "hidden_size=64", "--adam-beta2", "0.9", "--max-steps", "5"], capsys)
    assert r.returncode == 2 and "--lr 0.5 (the run's is" in r.stderr and "--opt hidden_size=64" in r.stderr
    assert "--adam-beta2 0.9 (the run's is 0.998)" in r.stderr
    r = train_here(["--data", toy_nodev, "--out", str(tmp_path / "runB"), "--resume", "--opt", "hidden_size=32",
                   "--max-steps", "5", "--progress", "lines"], capsys)
    assert r.returncode == 0, r.stderr
    # the values it ran with where its settings hold none (a model option's default, the processes' replicas): the
    # same values too (they were refused: "the run's is unset", "the run's is None")
    r = train_here(["--data", toy_nodev, "--out", str(tmp_path / "runB"), "--resume", "--opt", "layer_norm=true",
                    "--replicas", "1", "--max-steps", "5"], capsys)
    assert r.returncode == 0, r.stderr
    r = train_here(["--data", toy_nodev, "--out", str(tmp_path / "runB"), "--resume", "--opt", "layer_norm=false",
                    "--replicas", "2", "--max-steps", "5"], capsys)
    assert r.returncode == 2 and "--replicas 2 (the run's is 1)" in r.stderr, r.stderr
    assert "--opt layer_norm=False (the run's is the default, True)" in r.stderr, r.stderr
    r = train_here(["--data", toy_nodev, "--out", str(tmp_path / "runB"), "--resume", "--opt", "hiden_size=32",
                    "--max-steps", "5"], capsys)   # (no option: it had read "the run's is unset")
    assert r.returncode == 2 and "--opt hiden_size=32 (dtmt has no option 'hiden_size' (did you mean " \
        "'hidden_size'?))" in r.stderr, r.stderr
    # ... allowed, it goes on with the run's own vocabularies: the other text encoded with them, not retrained
    r = train_here(["--data", other, "--out", str(tmp_path / "runB"), "--resume", "--max-steps", "6",
                   "--allow-changed-data", "--progress", "lines"], capsys)
    assert r.returncode == 0, r.stderr
    assert "(with this run's vocabularies): building it now" in r.stdout and "the given SentencePiece" in r.stdout
    assert [e for e in os.listdir(other) if e.startswith("bin-")][0].startswith("bin-models-")
    # a position past the other corpus's epoch: the next epoch begins, and the log says so (it went on silently)
    tiny = make_toy_corpus(tmp_path / "tiny", n_train=4, n_dev=0, n_test=0, seed=4)
    r = train_here(["--data", tiny, "--out", str(run_a), "--resume", "--max-steps", "3",   # (runA: step 2, batch 2)
                   "--allow-changed-data", "--progress", "lines"], capsys)
    assert r.returncode == 0, r.stderr
    assert f"the run stopped at batch 2 of epoch 1, past the 1 batches an epoch of {tiny} (--allow-changed-data): " \
           "epoch 2 begins" in r.stdout, r.stdout


def test_average_checkpoints(uninterrupted, tmp_path, capsys):
    from dtmt_models.cli.average import main as average
    from dtmt_models.models.checkpoint import load_model, read_checkpoint, save_checkpoint
    from dtmt_models.training.trainer import step_checkpoints

    (s20, p20), (s24, p24) = step_checkpoints(uninterrupted)
    out = str(tmp_path / "avg.pt")
    assert average(["--run", uninterrupted, "--last", "2", "-o", out]) == 0
    avg, a, b = read_checkpoint(out), read_checkpoint(p20), read_checkpoint(p24)
    assert avg["averaged_from"] == [os.path.basename(p20), os.path.basename(p24)]
    for name, value in avg["model"].items():
        torch.testing.assert_close(value, (a["model"][name].double() + b["model"][name].double()).div(2).float(),
                                   rtol=0, atol=0, msg=name)
    # more than the run holds: refused, nothing written (it averaged the two there were, as if 3 had been)
    capsys.readouterr()
    assert average(["--run", uninterrupted, "--last", "3", "-o", str(tmp_path / "avg3.pt")]) == 2
    assert capsys.readouterr().err == (
        f"dtmt average: --last 3: --run {uninterrupted} holds 2 step_<updates>.pt checkpoints "
        f"({os.path.basename(p20)}, {os.path.basename(p24)}); ask for at most 2\n")
    assert not (tmp_path / "avg3.pt").exists()
    model = load_model(out)[0]                               # an ordinary translation checkpoint
    assert sum(p.numel() for p in model.parameters()) > 0
    crafted = read_checkpoint(p20)   # a config that is no mapping: it was an AttributeError's traceback
    crafted["config"] = "x"
    crafted.pop("run_id")   # (a file written before run ids: its run told by its config's folder and seed)
    save_checkpoint(str(tmp_path / "crafted.pt"), crafted)
    assert average([str(tmp_path / "crafted.pt"), p24, "-o", str(tmp_path / "avg2.pt")]) == 0
    assert "come from different training runs" in capsys.readouterr().err
    # a copy of a checkpoint under another name (a run's best.pt beside the step checkpoint of the same update, as
    # `dtmt average run/best.pt run/step_*.pt` gives): its weights counted twice, without a word; now refused
    same, copy = str(tmp_path / "same.pt"), str(tmp_path / "copy.pt")
    shutil.copyfile(p24, copy)
    capsys.readouterr()
    assert average([p20, p24, copy, "-o", same]) == 2 and not os.path.exists(same)
    assert capsys.readouterr().err == (f"dtmt average: {copy} holds the same weights as {p24} (a copy, or "
                                       f"best.pt or last.pt written at the same update as a step checkpoint); each "
                                       f"checkpoint counts once\n")
    # the same file twice (a slip for another step, most likely), a folder, a missing file: refused, nothing written
    for bad, message in (([p24, p24], "is given twice"), ([uninterrupted], "is a directory"),
                         ([str(tmp_path / "nope.pt")], "no such checkpoint")):
        assert average([*bad, "-o", str(tmp_path / "bad.pt")]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and "average: average" not in err, err
    assert average([p24, "-o", str(tmp_path)]) == 2           # the output is a folder: found before any reading
    assert "is a directory; give a file name" in capsys.readouterr().err
    assert average([p24, "-o", str(tmp_path / "one.pt")]) == 0
    assert "one checkpoint: the output holds its weights as they are" in capsys.readouterr().err
    foreign = dict(a, run_id="f" * 16)   # another run's checkpoint: averaged, with a warning
    foreign.pop("format")
    save_checkpoint(str(tmp_path / "foreign.pt"), foreign)
    assert average([p24, str(tmp_path / "foreign.pt"), "-o", str(tmp_path / "mixed.pt")]) == 0
    assert "come from different training runs" in capsys.readouterr().err
    other = dict(a, model_options={**a["model_options"], "hidden_size": 64})
    other.pop("format")
    save_checkpoint(str(tmp_path / "other.pt"), other)
    capsys.readouterr()
    assert average([p24, str(tmp_path / "other.pt"), "-o", str(tmp_path / "bad.pt")]) == 2
    err = capsys.readouterr().err.strip()
    assert "not the same model" in err and "model_options" in err and "\n" not in err
    assert "(its model_options differs: hidden_size 64 against " in err, err   # (which option, both values)
    assert not os.path.exists(tmp_path / "bad.pt")
    # an existing file that is not a checkpoint (a corpus file, a config: -o mistyped) is refused, kept as it was
    text = tmp_path / "test.en"
    text.write_text("a sentence\n")
    assert average([p20, p24, "-o", str(text)]) == 2 and text.read_text() == "a sentence\n"
    assert capsys.readouterr().err == (f"dtmt average: --output {text}: an existing file that is not a checkpoint, "
                                       f"which the mean would replace; give another name (or remove it first)\n")
    assert average([p20, p24, "-o", out]) == 0   # (an earlier mean is replaced, as before)
    empty = tmp_path / "made-first.pt"   # (an empty file made for the output, as mktemp makes it: replaced)
    empty.write_bytes(b"")
    assert average([p20, p24, "-o", str(empty)]) == 0 and empty.stat().st_size > 0
    # files of two folders are named by their paths; the step and config are the latest file's, in any order
    elsewhere = tmp_path / "b"
    elsewhere.mkdir()
    shutil.copyfile(p20, elsewhere / os.path.basename(p20))
    assert average([p24, str(elsewhere / os.path.basename(p20)), "-o", out]) == 0
    avg = read_checkpoint(out)
    assert avg["averaged_from"] == [p24, str(elsewhere / os.path.basename(p20))] and avg["step"] == s24 == b["step"]
    capsys.readouterr()
    # a checkpoint with a NaN weight: the mean would hold it, and translate refuses such a file (it wrote one)
    name = next(k for k, v in b["model"].items() if v.is_floating_point())
    broken = dict(b, model={**b["model"], name: b["model"][name].clone().fill_(float("nan"))})
    broken.pop("format")
    save_checkpoint(str(tmp_path / "nan.pt"), broken)
    assert average([p24, str(tmp_path / "nan.pt"), "-o", str(tmp_path / "bad.pt")]) == 2
    err = capsys.readouterr().err
    count = b["model"][name].numel()
    assert err == (f"dtmt average: {tmp_path / 'nan.pt'}: weight {name} holds {count:,} NaN or infinite "
                   f"value{'s' if count != 1 else ''}; the checkpoint is corrupt (use an earlier one)\n")
    assert not os.path.exists(tmp_path / "bad.pt")
    # an average beside one of the files it is the mean of (or two averages sharing one): that file's weights had
    # counted more than once (0.25 a + 0.75 b), exit 0; refused, nothing written
    assert average([p20, p24, "-o", out]) == 0
    assert read_checkpoint(out)["averaged_sources"] == sorted(os.path.realpath(p) for p in (p20, p24))
    shutil.copyfile(out, tmp_path / "moved.pt")   # (by real paths: wherever the average is kept)
    for files in ([out, p24], [p20, str(tmp_path / "moved.pt")]):
        capsys.readouterr()
        assert average([*files, "-o", str(tmp_path / "again.pt")]) == 2, files
        err = capsys.readouterr().err
        assert err == (f"dtmt average: {files[1]} and {files[0]} both hold the weights of "
                       f"{os.path.realpath(files[0] if files[1].endswith('moved.pt') else files[1])} (one is an "
                       f"average of it); each checkpoint counts once: average the files themselves\n"), err
        assert not os.path.exists(tmp_path / "again.pt")
    # a config whose output folder or seed is a list or a mapping: a TypeError traceback ("unhashable type")
    listed = dict(a, config={**a["config"], "out": ["x"], "seed": {"a": 1}})
    listed.pop("format")
    listed.pop("run_id")
    save_checkpoint(str(tmp_path / "listed.pt"), listed)
    assert average([str(tmp_path / "listed.pt"), p24, "-o", str(tmp_path / "l.pt")]) == 0
    assert "come from different training runs" in capsys.readouterr().err
    # -o - (translate's stdout) had written a file named "-"; -o RUN/last.pt in a run folder without one had written
    # a mean that --resume then refused ("no training state")
    with pytest.raises(SystemExit):
        average([p20, p24, "-o", "-"])
    assert "give a file name (a checkpoint is written to a file, not to stdout)" in capsys.readouterr().err
    run = tmp_path / "run_without_last"
    run.mkdir()
    for name in ("config.yaml", "train_log.csv"):
        shutil.copyfile(os.path.join(uninterrupted, name), run / name)
    assert average([p20, p24, "-o", str(run / "last.pt")]) == 2 and not (run / "last.pt").exists()
    assert capsys.readouterr().err == (f"dtmt average: --output {run / 'last.pt'}: the name of a last checkpoint, "
                                       f"which --resume continues from, in the run folder {run}, which the run's own "
                                       f"would replace; give another name\n")


def test_a_resumed_run_names_a_changed_dev_set(toy, tmp_path, capsys):
    """The corpus fingerprint holds the dev set's SHA-1 (best.pt is chosen on it): a dev set edited in place, of as
    many lines, is refused on --resume as a changed corpus (it went on silently, comparing scores of two dev sets);
    with --allow-changed-data the log says best.pt was chosen on the other one. A run recorded before the dev set's
    SHA-1 resumes as it did."""
    from dtmt_models.data.corpus import corpus_paths
    from dtmt_models.models.checkpoint import read_checkpoint, save_checkpoint

    run, other = tmp_path / "run", tmp_path / "other"
    base = ["--valid-every", "1", *TINY]
    assert train_here(["--data", toy, "--out", str(run), "--max-steps", "1", *base], capsys).returncode == 0
    shutil.copytree(toy, other)
    tgt = corpus_paths(str(other), "dev")[1]
    with open(tgt, encoding="utf-8") as f:
        lines = f.read().splitlines()
    with open(tgt, "w", encoding="utf-8") as f:
        f.write("\n".join([lines[0] + " x", *lines[1:]]) + "\n")
    r = train_here(["--data", str(other), "--out", str(run), "--resume", "--max-steps", "2", *base], capsys)
    assert r.returncode == 2 and f"--data {other} is not the corpus this run was trained on (dev_sha1 differ)" \
        in r.stderr, r.stderr
    r = train_here(["--data", str(other), "--out", str(run), "--resume", "--max-steps", "2", "--allow-changed-data",
                    *base], capsys)
    assert r.returncode == 0, r.stderr
    assert "warning: the dev set differs from the one this run validated on; best.pt was chosen there (dev loss " \
        in r.stdout, r.stdout
    # the same dev set again (the run now records the edited one's): no warning
    r = train_here(["--data", str(other), "--out", str(run), "--resume", "--max-steps", "3", *base], capsys)
    assert r.returncode == 0 and "dev set differs" not in r.stdout, r.stderr
    # a run recorded before the dev set's SHA-1: the rest compared, as before
    last = read_checkpoint(str(run / "last.pt"))
    last["config"]["data_fingerprint"].pop("dev_sha1")
    last.pop("format")
    save_checkpoint(str(run / "last.pt"), last)
    r = train_here(["--data", str(other), "--out", str(run), "--resume", "--max-steps", "4", *base], capsys)
    assert r.returncode == 0 and "dev set differs" not in r.stdout, r.stderr


def test_average_tells_runs_apart_by_their_run_id(toy, tmp_path, capsys):
    """Every checkpoint of a run carries its run id, which --resume keeps: a run copied to another folder and resumed
    there is one run (its output folder differs: it had been warned of as two), and a run started again with
    --overwrite in the same folder with the same seed is another (it had been averaged with the first's files
    without a word)."""
    import warnings

    from dtmt_models.models.checkpoint import average_checkpoints, read_checkpoint, save_checkpoint

    base = ["--data", toy, "--valid-every", "1", "--keep-last", "4", *TINY]
    a, b = tmp_path / "a", tmp_path / "b"
    assert train_here(["--out", str(a), "--max-steps", "2", *base], capsys).returncode == 0
    shutil.copytree(a, b)
    assert train_here(["--out", str(b), "--resume", "--max-steps", "4", *base], capsys).returncode == 0
    ids = {read_checkpoint(str(f))["run_id"] for f in (a / "step_0000002.pt", b / "last.pt", b / "step_0000004.pt")}
    assert len(ids) == 1 and re.fullmatch(r"[0-9a-f]{16}", ids.pop())
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # (one run: no warning)
        average_checkpoints([str(a / "step_0000002.pt"), str(b / "step_0000004.pt")])
    first = tmp_path / "first.pt"
    shutil.copyfile(a / "step_0000002.pt", first)
    # a file written before run ids beside files of two runs (same folder and seed): the ids of those that have one
    # still tell them apart (one file without an id had turned every comparison to folder and seed)
    older = read_checkpoint(str(a / "step_0000001.pt"))
    older.pop("run_id")
    older.pop("format")
    other = dict(read_checkpoint(str(b / "step_0000004.pt")), run_id="e" * 16)
    other.pop("format")
    save_checkpoint(str(tmp_path / "older.pt"), older)
    save_checkpoint(str(tmp_path / "other.pt"), other)
    with pytest.warns(UserWarning, match=r"come from different training runs \(their run ids differ\)"):
        average_checkpoints([str(tmp_path / "older.pt"), str(a / "step_0000002.pt"), str(tmp_path / "other.pt")])
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # (and the older file with its own run's: one run)
        average_checkpoints([str(tmp_path / "older.pt"), str(a / "step_0000002.pt")])
    # (the same seed: the same weights at update 2, which average refuses as a copy; update 3 is another's)
    assert train_here(["--out", str(a), "--overwrite", "--max-steps", "3", *base], capsys).returncode == 0
    with pytest.warns(UserWarning, match=f"{first} and {a / 'step_0000003.pt'} come from different training runs "
                                         r"\(their run ids differ\)"):
        average_checkpoints([str(first), str(a / "step_0000003.pt")])


def test_average_writes_a_checkpoint_that_loads(uninterrupted, tmp_path, capsys):
    """Found by a probe: average compared the files' model descriptions with ==, so a last file whose options said
    256.0 where the first said 256 (or True for 1) passed, and its options were the ones written: a checkpoint that
    translate refuses, exit 0. The descriptions are compared with their types, and the one written is the first
    file's (checked to build). The status line is on stderr (-o /dev/stdout had it among the checkpoint's bytes),
    "1 checkpoint"; -o through a symbolic link writes its target, as translate -o does, and a link into a run's
    files is refused as the files are; -o "" is a usage error; the API refuses one path given as a string (it was
    read letter by letter)."""
    from dtmt_models.cli.average import main as average
    from dtmt_models.models.checkpoint import average_checkpoints, load_model, read_checkpoint, save_checkpoint
    from dtmt_models.training.trainer import step_checkpoints

    (_, p20), (_, p24) = step_checkpoints(uninterrupted)
    a = read_checkpoint(p20)
    key = next(k for k, v in a["model_options"].items() if type(v) is int and not isinstance(v, bool))
    ones = [k for k, v in a["model_options"].items() if type(v) is int and v == 1]
    assert ones, a["model_options"]   # (True == 1: a bool where the options say 1)
    for key, value in ((key, float(a["model_options"][key])), (ones[0], True)):
        other = dict(a, model_options={**a["model_options"], key: value})
        save_checkpoint(str(tmp_path / "typed.pt"), other)
        for files in ([p24, str(tmp_path / "typed.pt")], [str(tmp_path / "typed.pt"), p24]):
            status = average([*files, "-o", str(tmp_path / "bad.pt")])
            err = capsys.readouterr().err
            if files[0] == p24:   # (the typed file second: refused as another model)
                assert status == 2 and f"(its model_options differs: {key} " in err, err
            else:                 # (first: it is the one checked to build, and refused so)
                assert status == 2 and "its model cannot be built" in err, err
            assert not os.path.exists(tmp_path / "bad.pt")
    # the description written is the first file's, the rest (its config, its step) the last's
    payload = average_checkpoints([p20, p24])
    b = read_checkpoint(p24)
    assert payload["config"] == b["config"] and payload["model_options"] == a["model_options"]
    with pytest.raises(TypeError, match="give a list of checkpoint paths, not one path"):
        average_checkpoints(p24)
    out = tmp_path / "one.pt"
    assert average([p24, "-o", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and f"dtmt average: wrote {out}: the mean of 1 checkpoint (" in captured.err
    load_model(str(out))
    target, link = tmp_path / "shared" / "avg.pt", tmp_path / "avg-link.pt"
    target.parent.mkdir()
    shutil.copyfile(out, target)   # (an earlier mean: replaced through the link)
    link.symlink_to(target)
    assert average([p20, p24, "-o", str(link)]) == 0
    assert link.is_symlink() and load_model(str(target))[0] is not None
    (tmp_path / "best-link.pt").symlink_to(os.path.join(uninterrupted, "best.pt"))
    assert average([p20, p24, "-o", str(tmp_path / "best-link.pt")]) == 2
    assert "the best checkpoint, which translate reads" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        average([p24, "-o", ""])
    assert exit_.value.code == 2 and "--output: an empty value" in capsys.readouterr().err


def test_inference_sees_the_optimizer_steps():
    """Validation after updates runs on the updated weights: the eval-mode paths' weight caches (keyed on the
    parameters' version counters) are refreshed by the optimizer `dtmt train` uses. (torch's fused CPU Adam does
    not bump the counters: with it, every validation after the first saw the first validation's weights.)"""
    from dtmt_models.data.batching import collate
    from dtmt_models.training.trainer import build_optimizer

    torch.manual_seed(0)
    model = build_model("dtmt", 40, 40, embed_dim=16, hidden_size=16, heads=2)
    opt = build_optimizer(model, 1e-2)
    src, lengths, prev, target = collate([([5, 6, 7, 8], [9, 10, 11]), ([12, 13], [14, 15, 16, 17])])
    for _ in range(3):
        model.eval()
        with torch.no_grad():
            seen = model(src, lengths, prev)           # fills the inference caches
        model.train()
        loss, _, n = model(src, lengths, prev, target=target, smoothing=0.1)
        opt.zero_grad()
        (loss / n).backward()
        opt.step()
        fresh = build_model("dtmt", 40, 40, embed_dim=16, hidden_size=16, heads=2)
        fresh.load_state_dict(model.state_dict())
        model.eval()
        fresh.eval()
        with torch.no_grad():
            now, expected = model(src, lengths, prev), fresh(src, lengths, prev)
        assert not torch.equal(now, seen)
        torch.testing.assert_close(now, expected, rtol=0, atol=0)


def step_alike(model, opt, twin, ref, steps: int) -> None:
    """`steps` updates of `model` by `opt` and of `twin` by `ref` with the same random gradients: each of `opt`'s
    steps bumps every parameter's version, and the two models end equal."""
    for _ in range(steps):
        for p, q in zip(model.parameters(), twin.parameters()):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        before = [p._version for p in model.parameters()]
        opt.step()
        ref.step()
        assert all(p._version > v for p, v in zip(model.parameters(), before))
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_the_optimizer_bumps_the_parameters_versions_and_steps_as_torchs_adam():
    """build_optimizer's fused Adam: each step bumps every trained parameter's version counter (autograd's
    in-place check and the unrolled sessions read them) and moves the weights as torch's default Adam does."""
    from dtmt_models.training.trainer import build_optimizer

    torch.manual_seed(0)
    model = build_model("dtmt", 40, 40, embed_dim=16, hidden_size=16, heads=2)
    twin = build_model("dtmt", 40, 40, embed_dim=16, hidden_size=16, heads=2)
    twin.load_state_dict(model.state_dict())
    start = [p.detach().clone() for p in model.parameters()]
    opt = build_optimizer(model, 1e-2)
    ref = torch.optim.Adam(twin.parameters(), lr=1e-2, betas=(0.9, 0.998), eps=1e-9, foreach=False)
    step_alike(model, opt, twin, ref, steps=3)
    assert all(not torch.equal(p, p0) for p, p0 in zip(model.parameters(), start))


def test_resuming_an_unfused_optimizers_state_steps_fused_and_continues_it():
    """A checkpoint written before the fused Adam (torch's per-tensor Adam, `fused` None in its groups): loading
    it keeps build_optimizer's fused step and its version bumps, and the next steps move the weights as the
    checkpoint's own optimizer continued would."""
    from dtmt_models.training.trainer import build_optimizer, load_optimizer_state

    torch.manual_seed(0)
    model = build_model("dtmt", 40, 40, embed_dim=16, hidden_size=16, heads=2)
    twin = build_model("dtmt", 40, 40, embed_dim=16, hidden_size=16, heads=2)
    twin.load_state_dict(model.state_dict())
    old = torch.optim.Adam(twin.parameters(), lr=1e-2, betas=(0.9, 0.998), eps=1e-9, foreach=False)
    for _ in range(2):
        for q in twin.parameters():
            q.grad = torch.randn_like(q)
        old.step()
    assert old.state_dict()["param_groups"][0]["fused"] is None
    model.load_state_dict(twin.state_dict())
    opt = build_optimizer(model, 1e-3)
    load_optimizer_state(opt, copy.deepcopy(old.state_dict()))   # as from torch.load: no tensor shared with `old`
    assert opt.param_groups[0]["fused"] is True and opt.param_groups[0]["lr"] == 1e-2   # the checkpoint's lr
    step_alike(model, opt, twin, old, steps=2)


def test_config_file_flags_override_it_and_the_written_config_reproduces_the_run(toy_nodev, tmp_path, capsys):
    """contract §6: `dtmt train --config run.yaml` with flags overriding it; the run's resolved config.yaml, given back
    as --config, reproduces the run (the same losses at every update)."""
    import yaml

    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text(yaml.safe_dump({"data": toy_nodev, "model": "dtmt", "vocab_size": 60, "max_tokens": 400,
                                        "progress": "lines", "threads": 1, "max_steps": 5, "lr": "2e-3",
                                        "log_every": 1, "opt": {"embed_dim": 32, "hidden_size": 32}}))
    a, b = tmp_path / "a", tmp_path / "b"
    r = train_here(["--config", str(run_yaml), "--out", str(a), "--max-steps", "3", "--opt", "hidden_size=24"], capsys)
    assert r.returncode == 0, r.stderr
    written = yaml.safe_load((a / "config.yaml").read_text())
    assert (written["max_steps"], written["lr"], written["out"], written["data"]) == (3, 0.002, str(a), toy_nodev)
    assert written["opt"]["embed_dim"] == 32 and written["opt"]["hidden_size"] == 24   # the flag won
    assert "config" not in written and "resume" not in written
    assert [s for s, *_ in losses(a)] == [1, 2, 3]
    r = train_here(["--config", str(a / "config.yaml"), "--out", str(b)], capsys)
    assert r.returncode == 0, r.stderr
    assert losses(b) == losses(a)
    # another preset over a run's config.yaml (which holds its preset's every value): refused, nothing written (it
    # trained a mix of the two, labelled with the other)
    r = train_here(["--config", str(a / "config.yaml"), "--out", str(tmp_path / "c"), "--preset", "paper"], capsys)
    assert r.returncode == 2 and r.stderr == (f"dtmt train: --preset paper: --config {a / 'config.yaml'} holds the "
                                              f"settings of preset small, which would override paper's; leave out "
                                              f"--config, or change the file's preset and remove the settings it "
                                              f"should take from it\n"), r.stderr
    assert not (tmp_path / "c").exists()
    # another model likewise (a review: a transformer had trained with the RNN run's learning rate, schedule and
    # widths, logged as the transformer's small preset)
    r = train_here(["--config", str(a / "config.yaml"), "--out", str(tmp_path / "c"), "--model", "transformer"],
                   capsys)
    assert r.returncode == 2 and r.stderr.startswith(
        f"dtmt train: --model transformer: --config {a / 'config.yaml'} holds the settings of a dtmt run (its "
        f"preset's and options), which would override transformer's; leave out --config"), r.stderr
    assert not (tmp_path / "c").exists()


def test_resume_says_where_the_run_s_config_yaml_was_edited(toy_nodev, tmp_path, capsys):
    """--resume reads the run's settings from last.pt: an edit of its config.yaml was neither taken nor mentioned,
    and the file was rewritten without it. Now a warning names each edited setting beside last.pt's, and how to take
    it; without an edit, no warning."""
    import yaml

    out = tmp_path / "run"
    r = train_here(["--data", toy_nodev, "--out", str(out), "--max-steps", "2", *TINY], capsys)
    assert r.returncode == 0, r.stderr
    text = (out / "config.yaml").read_text()
    assert "max_steps: 2\n" in text and "patience: 5\n" in text and "amp: 'off'\n" in text
    (out / "config.yaml").write_text(text.replace("max_steps: 2\n", "max_steps: 5\n").replace("patience: 5\n", "")
                                     .replace("amp: 'off'\n", "amp: bf16\n"))
    r = train_here(["--data", toy_nodev, "--out", str(out), "--resume"], capsys)
    assert r.returncode == 0 and "reached --max-steps 2" in r.stdout, r.stdout
    warning = (f"warning: {out / 'config.yaml'} differs from the settings in last.pt (max_steps: 5 where last.pt has "
               f"2; patience: none where last.pt has 5; amp: bf16 where last.pt has off); --resume continues with "
               f"last.pt's and writes them there: give a change as a flag, or take the file's with --config "
               f"{out / 'config.yaml'} --resume")
    assert warning in r.stdout, r.stdout
    assert yaml.safe_load((out / "config.yaml").read_text())["max_steps"] == 2
    (out / "config.yaml").write_text(text + "max_steps: 5\n")   # (a key twice: not readable)
    r = train_here(["--data", toy_nodev, "--out", str(out), "--resume"], capsys)
    assert r.returncode == 0 and "last.pt (it is not a run configuration that can be read ('max_steps' is given " \
                                 "twice, the second time on line " in r.stdout, r.stdout
    r = train_here(["--data", toy_nodev, "--out", str(out), "--resume", "--max-steps", "3"], capsys)
    assert r.returncode == 0 and "warning" not in r.stdout, r.stdout
    # a value of nested aliases (a few hundred bytes standing for megabytes): said by its kind, not written out
    laughs = "".join(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 7))
    (out / "config.yaml").write_text("a0: &a0 [x]\n" + laughs + text.replace("lr: ", "lr: *a6\nold_lr: "))
    r = train_here(["--data", toy_nodev, "--out", str(out), "--resume", "--max-steps", "3"], capsys)
    line = next(line for line in r.stdout.splitlines() if line.startswith("warning: "))
    assert r.returncode == 0 and "lr: a list where last.pt has " in line and len(line) < 2000, line[:300]
    # the run folder copied with its config.yaml: the file records the original's --out, which --resume continued
    (out / "config.yaml").write_text(text)
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    before = (out / "last.pt").read_bytes()
    r = train_here(["--config", str(copy / "config.yaml"), "--resume", "--max-steps", "4"], capsys)
    assert r.returncode == 2 and r.stderr == (
        f"dtmt train: --config {copy / 'config.yaml'} --resume: the file records the run in {out}, not in {copy} "
        f"where it lies (a copied run folder?); give --out {copy} to resume the run there, or --out {out}\n")
    assert (out / "last.pt").read_bytes() == before
    r = train_here(["--config", str(copy / "config.yaml"), "--resume", "--max-steps", "4", "--out", str(copy)], capsys)
    assert r.returncode == 0 and "reached --max-steps 4" in r.stdout and (out / "last.pt").read_bytes() == before
    # a config.yaml that is a folder: found only when the resumed run wrote it, after its start (a new events file)
    (copy / "config.yaml").unlink()
    (copy / "config.yaml").mkdir()
    events = sorted(os.listdir(copy / "tensorboard")) if (copy / "tensorboard").exists() else None
    r = train_here(["--out", str(copy), "--data", toy_nodev, "--resume", "--max-steps", "5"], capsys)
    assert r.returncode == 2 and r.stderr == (f"dtmt train: --out {copy}: config.yaml there is not a file, and the "
                                              f"run writes its config.yaml there; move it or give another --out\n")
    assert events == (sorted(os.listdir(copy / "tensorboard")) if (copy / "tensorboard").exists() else None)


def test_resume_names_each_setting_it_changes(toy_nodev, tmp_path, capsys):
    """A resume that changed how long to go on or how to report (--max-steps, --valid-every, ...) said nothing of it:
    only the log's rows showed it later. It now names each one, old and new; a resume that changes none, nothing."""
    out = tmp_path / "run"
    r = train_here(["--data", toy_nodev, "--out", str(out), "--max-steps", "2", *TINY], capsys)
    assert r.returncode == 0, r.stderr
    r = train_here(["--data", toy_nodev, "--out", str(out), "--resume", "--max-steps", "3", "--log-every", "1",
                    "--max-time", "1h", "--threads", "1"], capsys)
    assert r.returncode == 0 and ("resumed with changed settings: max_steps 2 -> 3; max_time None -> '1h'; log_every "
                                  "50 -> 1\n") in r.stdout, r.stdout
    r = train_here(["--data", toy_nodev, "--out", str(out), "--resume", "--max-steps", "3"], capsys)
    assert r.returncode == 0 and "changed settings" not in r.stdout and "reached --max-steps 3" in r.stdout, r.stdout


def test_an_inherited_ignored_sigint_stays_ignored_while_training():
    """`dtmt train ... &` from a script starts with SIGINT ignored; the training loop's handler replaced that, so a
    Ctrl-C meant for the script's foreground job stopped the background run. It stays ignored; SIGTERM is handled."""
    import types

    from dtmt_models.signals import give_back
    from dtmt_models.training.trainer import Trainer

    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        old = Trainer._install_signals(types.SimpleNamespace())
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN and list(old) == [signal.SIGTERM]
        assert callable(signal.getsignal(signal.SIGTERM)) and signal.getsignal(signal.SIGTERM) is not old[
            signal.SIGTERM]
        give_back(old)
    finally:
        signal.signal(signal.SIGINT, before)


def test_model_options_read_numbers_as_python_writes_them():
    """--opt dropout=.1 (or 1., +0.1) was text to the JSON reader and refused as "expected float"; 010 is 10."""
    from dtmt_models.cli.train import parse_options

    got = parse_options(["a=.1", "b=1.", "c=+0.1", "d=010", "e=-2", "f=1e-1", "g=true", "h=abc", "i=1.2.3"])
    assert got == {"a": 0.1, "b": 1.0, "c": 0.1, "d": 10, "e": -2, "f": 0.1, "g": True, "h": "abc", "i": "1.2.3"}
    assert type(got["d"]) is int and type(got["b"]) is float


def test_a_step_or_time_budget_lifts_the_epoch_bound_on_resume_and_over_a_config(toy_nodev, tmp_path, capsys):
    """--max-steps / --max-time replace the epoch bound (a preset's or the run's), as --help says: a fresh run did so,
    but a resumed run, or a run from a config.yaml that holds the epoch bound, stopped at it without a word
    ("reached --max-epochs 1" after asking for more steps, exit 0)."""
    import yaml

    a, b = tmp_path / "a", tmp_path / "b"
    r = train_here(["--data", toy_nodev, "--out", str(a), "--max-epochs", "1", "--log-every", "1", *TINY], capsys)
    assert r.returncode == 0 and "reached --max-epochs 1" in r.stdout, r.stdout
    steps = len(losses(a))
    assert yaml.safe_load((a / "config.yaml").read_text())["max_epochs"] == 1
    r = train_here(["--config", str(a / "config.yaml"), "--out", str(b), "--max-steps", str(steps + 2)], capsys)
    assert r.returncode == 0 and f"reached --max-steps {steps + 2}" in r.stdout, r.stdout
    assert [s for s, *_ in losses(b)] == list(range(1, steps + 3))
    r = train_here(["--data", toy_nodev, "--out", str(a), "--resume", "--max-steps", str(steps + 2)], capsys)
    assert r.returncode == 0 and f"reached --max-steps {steps + 2}" in r.stdout, r.stdout
    assert losses(a) == losses(b)   # (the same run, resumed past its epoch)
    r = train_here(["--config", str(a / "config.yaml"), "--out", str(tmp_path / "c"), "--max-steps", "99",
                    "--max-epochs", "1"], capsys)   # both given: the epoch bound holds
    assert r.returncode == 0 and "reached --max-epochs 1" in r.stdout, r.stdout


def test_one_line_cuts_a_long_message_in_the_middle():
    """A message that quotes a value from a file (an option, a line of input) stays short: its two ends kept."""
    from dtmt_models.errors import MAX_MESSAGE, one_line

    text = one_line(ValueError("head " + "x" * 100_000 + "\n tail"))
    assert text.startswith("head xx") and text.endswith("xx | tail") and "(98,012 characters cut)" in text
    assert len(text) < MAX_MESSAGE + 50 and one_line(ValueError("a\n b")) == "a | b"


@pytest.mark.parametrize("text, message", [
    ("depht: 2\n", "unknown option 'depht'"),
    ("lr: abc\n", "argument --lr: invalid float value: 'abc'"),
    ("progress: fancy\n", "argument --progress: invalid choice: 'fancy'"),
    ("- lr\n", "expected a mapping of option: value, got a list"),
    ("opt: 3\n", "opt must be a mapping"),
    ("lr: [1, 2]\n", "lr takes one number or word"),
    ("resume: true\n", "unknown option 'resume'"),
    # a key given twice (the last won without a word) and a key without a value (skipped: the preset's was taken)
    ("lr: 0.1\nlr: 0.001\n", "not valid YAML ('lr' is given twice, the second time on line 2)"),
    ("opt: {depth: 2, depth: 3}\n", "'depth' is given twice"),
    ("max_steps:\n", "max_steps has no value; give one, or leave the key out"),
    # a model option is one value: a list of aliased lists (358 bytes of YAML) expanded to 36 MB of message before
    ("opt: {depth: [&l0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1], &l1 [*l0, *l0, *l0, *l0, *l0, *l0, *l0, *l0, *l0, *l0], "
     "[*l1, *l1, *l1, *l1, *l1, *l1, *l1, *l1, *l1, *l1]]}\n", "opt: depth takes one number, word or true/false, got a "
                                                             "list"),
    ("opt: {depth: {a: 1}}\n", "opt: depth takes one number, word or true/false, got a mapping"),
    ("opt: {depth: 2024-01-01}\n", "opt: depth takes one number, word or true/false, got a date"),   # (a traceback)
    ("max_steps: [&l0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1], &l1 [*l0, *l0, *l0, *l0, *l0, *l0, *l0, *l0, *l0, *l0], "
     "[*l1, *l1, *l1, *l1, *l1, *l1, *l1, *l1, *l1, *l1]]\n", "max_steps takes one number or word, got a list"),
    ("lr: {\n", "not valid YAML"),
    (b"lr: 0.1\n# caf\xe9\n", "not UTF-8 text (byte 13)"),
    (b"lr: 0.1\n" + b"#" * 9000 + b"\xe9\n", "not UTF-8 text (byte 9008)"),   # past the first 8 KiB read
    # a hostile-input probe's (2026-12-02): the parser's RecursionError and Python's 4,300-digit limit were tracebacks
    # or messages naming neither the file nor the key
    ("opt: " + "[" * 2000 + "]" * 2000 + "\n", "nested too deeply to be a run configuration"),
    ("max_steps: " + "9" * 5000 + "\n", "not a run configuration (Exceeds the limit (4300 digits)"),
    ("max_steps: 0x" + "f" * 5000 + "\n", "max_steps: a number of 20,000 bits, past any option's range"),
    ("opt: {depth: 0x" + "f" * 5000 + "}\n", "opt: a number of 20,000 bits"),
])
def test_bad_config_files_are_one_line_errors(toy_nodev, tmp_path, capsys, text, message):
    from dtmt_models.cli import train

    path = tmp_path / "run.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    out = tmp_path / "run"
    assert train.main(["--config", str(path), "--data", toy_nodev, "--out", str(out), *TINY]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"dtmt train: --config {path}: ") and message in err, err
    assert not out.exists()
    assert train.main(["--config", str(tmp_path / "absent.yaml"), "--data", toy_nodev]) == 2
    assert "cannot read it" in capsys.readouterr().err


def test_config_files_read_as_yaml_writers_mean_them(tmp_path, capsys):
    """--config /dev/zero (any endless or huge file) is one line, exit 2: it was read whole until the kernel killed
    the process. A model option written 1e-1 (a string to YAML 1.1, a number to anyone writing it) is the number,
    as --opt dropout=1e-1 is: it was refused as not a float. Two --config files are refused."""
    from dtmt_models.cli import train

    assert train.main(["--config", "/dev/zero", "--data", str(tmp_path)]) == 2
    assert capsys.readouterr().err == ("dtmt train: --config /dev/zero: more than 1,048,576 bytes, not a run "
                                       "configuration\n")
    path = tmp_path / "run.yaml"
    path.write_text("opt: {dropout: 1e-1, embed_dim: 32}\nlr: 1e-3\n")
    argv = train.config_arguments(str(path))
    assert "dropout=0.1" in argv and "embed_dim=32" in argv, argv
    # plain scalars as YAML 1.2 (and a person) reads them: 1.1 read `amp: off` as false (refused: "amp takes one
    # number or word, got False"), `seed: 010` as octal 8, `max_time: 1:30` as 90 (base 60), `.1` in opt as text
    path.write_text("amp: off\nseed: 010\nmax_time: 1:30\nmax_steps: 0x10\nopt: {dropout: .1, layer_norm: no}\n")
    argv = train.config_arguments(str(path))
    assert argv == ["--amp", "off", "--seed", "10", "--max-time", "1:30", "--max-steps", "16", "--opt", "dropout=0.1",
                    "--opt", 'layer_norm="no"'], argv
    # ~ in a path, as the shell expands it in a flag (a folder named ~ had been made in the current one)
    path.write_text("out: ~/runs/x\ndata: ~/corpus\n")
    assert train.config_arguments(str(path)) == ["--out", os.path.expanduser("~/runs/x"), "--data",
                                                 os.path.expanduser("~/corpus")]
    path.write_text("opt: {dropout: 1e-1, embed_dim: 32}\nlr: 1e-3\n")
    # two files: refused (the last was read, the first ignored without a word)
    assert train.main(["--config", str(path), "--config", str(path), "--data", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("dtmt train: --config given 2 times")


def _scalars(run_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(run_dir, "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)] if tag in events.Tags()["scalars"] else []


def test_tensorboard_events_beside_the_csv_and_a_resume_redoes_none(toy, tmp_path, capsys):
    """The CSV's numbers are TensorBoard scalars too ("train/loss", "valid/dev_bleu", ...); a resumed run drops
    the events after its checkpoint's step, as it drops the CSV rows, so no step is there twice."""
    out = str(tmp_path / "run")
    r = train_here(["--data", toy, "--out", out, "--max-steps", "4", "--log-every", "2", "--valid-every", "4", *TINY],
                   capsys)
    assert r.returncode == 0, r.stderr
    csv_loss = [(step, float(loss)) for step, loss, _ in losses(out)]
    assert [s for s, _ in csv_loss] == [2, 4]
    assert [(s, pytest.approx(v, rel=1e-6)) for s, v in _scalars(out, "train/loss")] == csv_loss
    assert [s for s, _ in _scalars(out, "valid/dev_bleu")] == [4]
    r = train_here(["--data", toy, "--out", out, "--resume", "--max-steps", "6"], capsys)
    assert r.returncode == 0, r.stderr
    steps = [s for s, _ in _scalars(out, "train/loss")]
    assert steps == [2, 4, 6] and [s for s, *_ in losses(out)] == steps


def test_train_config_defaults_in_one_place_and_a_checkpoint_round_trip():
    """TrainConfig holds the defaults the command line shows and applies; a checkpoint's plain dict rebuilds it
    (an older checkpoint's extra keys, such as the command's own flags, are left out)."""
    import dataclasses

    from dtmt_models.cli.train import build_parser, resolve_config
    from dtmt_models.training.config import TrainConfig

    defaults = TrainConfig.defaults()
    assert (defaults["patience"], defaults["valid_every"], defaults["log_every"], defaults["seed"]) == (5, 500, 50, 1)
    args = build_parser().parse_args(["--data", "d", "--model", "dtmt", "--preset", "small", "--lr", "0.5",
                                      "--opt", "depth=2"])
    args.vocab_type, args.seed = defaults["vocab_type"], defaults["seed"]
    cfg = resolve_config(args)
    assert isinstance(cfg, TrainConfig)
    assert cfg.lr == 0.5 and cfg.patience == 5 and cfg.model_options["depth"] == 2
    assert cfg.max_tokens == 2000 and cfg.max_epochs == 6          # the small preset's
    help_text = build_parser().format_help()
    for flag, key in (("--valid-every", "valid_every"), ("--log-every", "log_every"), ("--seed", "seed")):
        assert f"default {defaults[key]}" in " ".join(help_text.split(flag, 2)[2].split()[:30]), flag
    d = cfg.to_dict()
    assert TrainConfig.from_dict({**d, "resume": True, "overwrite": False}) == cfg
    assert [f.name for f in dataclasses.fields(TrainConfig)] == list(d)
    # a checkpoint's config from before Adam's settings: the values its run took, not None
    old = TrainConfig.from_dict({k: v for k, v in d.items() if k not in ("adam_beta2", "adam_eps")})
    assert (old.adam_beta2, old.adam_eps) == (0.998, 1e-9)


def test_best_by_compares_the_chosen_dev_score_and_breaks_ties_with_the_other():
    from dtmt_models.training.trainer import is_better

    # (loss, bleu) against best.pt's (3.0, 20.0)
    assert is_better("loss", 2.9, 10.0, 3.0, 20.0) and not is_better("bleu", 2.9, 10.0, 3.0, 20.0)
    assert is_better("bleu", 3.5, 20.5, 3.0, 20.0) and not is_better("loss", 3.5, 20.5, 3.0, 20.0)
    assert is_better("loss", 3.0, 20.5, 3.0, 20.0) and not is_better("loss", 3.0, 19.5, 3.0, 20.0)
    assert is_better("bleu", 2.9, 20.0, 3.0, 20.0) and not is_better("bleu", 3.1, 20.0, 3.0, 20.0)
    assert is_better("loss", 9.0, 0.0, float("inf"), -1.0) and is_better("bleu", 9.0, 0.0, float("inf"), -1.0)


def test_best_by_loss_keeps_the_model_of_the_lowest_dev_loss(toy, tmp_path, capsys):
    """best.pt holds the validation with the lowest logged dev loss; --patience counts validations without a
    lower one (this toy run's loss first rises at a validation before the 40th update), and the log says what
    picked best.pt."""
    from dtmt_models.models.checkpoint import read_checkpoint

    out = str(tmp_path / "by_loss")
    r = train_here(["--data", toy, "--out", out, "--max-steps", "40", "--valid-every", "4", "--best-by", "loss",
                   "--lr", "0.05", "--patience", "1", *TINY], capsys)
    assert r.returncode == 0, r.stderr
    with open(os.path.join(out, "train_log.csv"), newline="") as f:
        valid = [(float(row["dev_loss"]), int(row["step"])) for row in csv.DictReader(f) if row["kind"] == "valid"]
    best_loss, best_step = min(valid)
    assert read_checkpoint(os.path.join(out, "best.pt"))["step"] == best_step
    assert valid[-1][1] < 40 and valid[-1][0] > best_loss and valid[-2] == (best_loss, best_step)
    assert all(a[0] > b[0] for a, b in zip(valid, valid[1:-1]))   # every earlier validation was an improvement
    text = r.stdout + r.stderr
    assert f"best.pt: dev loss {best_loss:.3f}" in text and "picked by dev loss" in text
    assert "no better dev loss in 1 validations" in text


MALLOC_PROBE = r"""
import ctypes, json, sys
from dtmt_models.training.allocator import tune_malloc
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
tuned = tune_malloc()
size = 96 << 20   # what a training update frees and allocates again: above glibc's largest default threshold
p = libc.malloc(size)
ctypes.memset(p, 1, size)
mapped = libc.mallinfo2().hblkhd
libc.free(p)
print(json.dumps({"tuned": tuned, "size": size, "mapped": mapped, "heap_after_free": libc.mallinfo2().arena}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
@pytest.mark.parametrize("env, tuned", [({}, True), ({"DTMT_MALLOC": "default"}, False),
                                        ({"MALLOC_TRIM_THRESHOLD_": "131072"}, False), ({"DTMT_MALLOC": "off"}, True)])
def test_tune_malloc_keeps_freed_update_memory(env, tuned):
    """dtmt train's malloc settings (dtmt_models/training/allocator.py), observed through glibc's own accounting
    (mallinfo2): tuned, a 96 MiB block comes from the heap and the heap keeps it after free (the next update reuses
    the pages); glibc's defaults (DTMT_MALLOC=default, or the user's own MALLOC_* variable) map it and unmap it."""
    from dtmt_models.training import allocator

    libc = allocator._glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        pytest.skip("needs glibc >= 2.33 (mallinfo2)")
    base = {k: v for k, v in os.environ.items() if k not in ("DTMT_MALLOC", *allocator.USER_VARIABLES)}
    out = subprocess.run([sys.executable, "-c", MALLOC_PROBE], env={**base, **env, "PYTHONPATH": ROOT},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["tuned"] is tuned
    # a value that is no setting is said (DTMT_MALLOC=off was taken as unset without a word)
    assert ("DTMT_MALLOC='off' is not a setting" in out.stderr) is (env.get("DTMT_MALLOC") == "off"), out.stderr
    if tuned:
        assert r["mapped"] < r["size"] and r["heap_after_free"] >= r["size"]
    else:
        assert r["mapped"] >= r["size"] and r["heap_after_free"] < r["size"]


def test_what_decoding_dev_warns_is_one_log_line_a_run(tmp_path, capsys):
    """A dev source made of pieces the vocabulary does not know: dev BLEU's decoding warns, and that was Python's
    two-line warning form (file:line, the warn call) amid the training log; now one `warning: dev BLEU:` line, once
    a run however many validations, and no raw warning."""
    import warnings

    data = make_toy_corpus(tmp_path / "toy")
    dev = os.path.join(data, "dev.es")
    with open(dev, encoding="utf-8") as f:
        lines = f.read().splitlines()
    lines[0] = "\u0416\u0417\u0418 \u0419\u041a\u041b \u041c\u041d"   # (Cyrillic: not in the toy vocabulary)
    with open(dev, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    with warnings.catch_warnings(record=True) as raw:
        warnings.simplefilter("always")
        r = train_here(["--data", data, "--out", str(tmp_path / "run"), "--max-steps", "4", "--valid-every", "2",
                        *TINY], capsys)
    assert r.returncode == 0, r.stderr
    said = [line for line in (r.stdout + r.stderr).splitlines() if "unknown to the model" in line]
    assert said == ["warning: dev BLEU: 1 of 30 source sentence(s) are mostly pieces unknown to the model's source "
                    "vocabulary (sentence 1): their translations are guesses, not translations"], said
    assert not [w for w in raw if "unknown" in str(w.message)]


def test_schedule_flags_the_schedule_does_not_read_and_a_rate_of_another_schedule(toy_nodev, tmp_path, capsys):
    """Flags the schedule does not read are refused (the constant schedule's --warmup had been taken without a
    word); a --schedule whose --lr means another thing than the preset's, without an --lr, is refused (an RNN at
    inverse-sqrt with the rnmt rate trained at 1e-7, a transformer at constant 1.0 diverged); --warmup given to the
    rnmt schedule of one replica is warned of (eq. 17 warms up from lr0 to n lr0: not at all at n = 1). All from a
    review; nothing is written for a refusal."""
    out = tmp_path / "run"
    for extra, message in (
            (["--schedule", "constant", "--lr", "1e-3", "--warmup", "10"],
             "--warmup: the constant schedule reads none of them"),
            (["--schedule", "inverse-sqrt", "--lr", "1", "--decay-start", "5", "--decay-end", "9"],
             "--decay-start and --decay-end: the inverse-sqrt schedule reads --warmup and --replicas of them"),
            (["--schedule", "constant", "--lr", "1e-3", "--replicas", "8"],   # (taken, logged as "n = 8", unread)
             "--replicas: the constant schedule reads none of them"),
            (["--schedule", "inverse-sqrt"], "--schedule inverse-sqrt: the preset's --lr 0.002 is for rnmt, where it "
                                             "is the rate itself; give --lr for inverse-sqrt"),
            (["--init-uniform", "3.5e38"], "--init-uniform 3.5e+38: must be a finite number >= 0 and <= 10")):
        r = train_here(["--data", toy_nodev, "--out", str(out), "--max-steps", "1", *TINY, *extra], capsys)
        assert r.returncode == 2 and r.stderr.startswith(f"dtmt train: {message}"), (extra, r.stderr)
        assert not out.exists()
    r = train_here(["--data", toy_nodev, "--out", str(out), "--max-steps", "1", *TINY, "--warmup", "50"], capsys)
    assert r.returncode == 0, r.stderr
    assert "warning: --warmup 50: the rnmt schedule (paper 000 eq. 17) warms up from lr0 to n lr0 with n = " \
           "--replicas, 1 here: there is no warm-up" in r.stdout, r.stdout
    r = train_here(["--data", toy_nodev, "--out", str(tmp_path / "b"), "--max-steps", "1", *TINY,
                    "--schedule", "constant"], capsys)   # (the rate means the same: taken)
    assert r.returncode == 0, r.stderr


def test_a_new_run_refuses_out_files_that_are_no_run_s(toy_nodev, tmp_path, capsys):
    """A new run writes config.yaml and train_log.csv at its start and best.pt at its first validation: a user's own
    config.yaml in --out had been replaced without a word, and a folder named best.pt ended the run at its first
    validation (its updates lost). Each is refused in one line before any work (a review found them); a run's own
    files are taken, its config.yaml given back as --config too."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.yaml").write_text("my: precious\n")
    r = train_here(["--data", toy_nodev, "--out", str(out), "--max-steps", "1", *TINY], capsys)
    assert r.returncode == 2 and "its config.yaml is not a dtmt run's" in r.stderr, r.stderr
    assert (out / "config.yaml").read_text() == "my: precious\n"
    (out / "config.yaml").unlink()
    (out / "train_log.csv").write_text("date,weight\n")
    r = train_here(["--data", toy_nodev, "--out", str(out), "--max-steps", "1", *TINY], capsys)
    assert r.returncode == 2 and "its train_log.csv is not a dtmt run's log" in r.stderr, r.stderr
    (out / "train_log.csv").unlink()
    (out / "best.pt").mkdir()
    r = train_here(["--data", toy_nodev, "--out", str(out), "--max-steps", "1", *TINY], capsys)
    assert r.returncode == 2 and "best.pt there is not a file" in r.stderr, r.stderr
    (out / "best.pt").rmdir()
    run = tmp_path / "run"
    assert train_here(["--data", toy_nodev, "--out", str(run), "--max-steps", "1", *TINY], capsys).returncode == 0
    r = train_here(["--config", str(run / "config.yaml"), "--out", str(run), "--overwrite"], capsys)
    assert r.returncode == 0, r.stderr   # (a run restarted from its own config.yaml: rewritten with its settings)
    (run / "last.pt").unlink()   # (a run's own config.yaml and log, its checkpoint gone: taken again)
    assert train_here(["--data", toy_nodev, "--out", str(run), "--max-steps", "1", *TINY], capsys).returncode == 0


def test_a_run_file_s_settings_are_taken_back_whatever_its_schedule_reads(toy_nodev, tmp_path, capsys):
    """A run's config.yaml holds every schedule setting, read or not: given back as --config (a transformer's, whose
    inverse-sqrt schedule reads no decay), it is taken, without the warning of a --warmup typed for one replica; the
    refusals and the warning are for the flags of the command line itself (the final review found it)."""
    tiny = ["--vocab-size", "60", "--opt", "embed_dim=32", "--opt", "hidden_size=32", "--opt", "heads=2",
            "--max-tokens", "400", "--progress", "lines", "--threads", "1", "--max-steps", "1"]
    a, b = tmp_path / "a", tmp_path / "b"
    r = train_here(["--data", toy_nodev, "--out", str(a), "--model", "transformer", *tiny], capsys)
    assert r.returncode == 0, r.stderr
    r = train_here(["--config", str(a / "config.yaml"), "--out", str(b)], capsys)
    assert r.returncode == 0, r.stderr
    r = train_here(["--config", str(a / "config.yaml"), "--out", str(tmp_path / "c"), "--decay-end", "9"], capsys)
    assert r.returncode == 2 and "--decay-end: the inverse-sqrt schedule reads --warmup" in r.stderr, r.stderr
    d = tmp_path / "d"
    assert train_here(["--data", toy_nodev, "--out", str(d), *TINY, "--max-steps", "1"], capsys).returncode == 0
    r = train_here(["--config", str(d / "config.yaml"), "--out", str(tmp_path / "e")], capsys)
    assert r.returncode == 0 and "no warm-up" not in r.stdout, r.stdout


def test_options_the_structure_given_leaves_unused_are_left_out_where_they_are_not_typed(tmp_path):
    """A preset's or a --config file's option that the structure given with --opt leaves unused is left out (the
    paper preset's encoder_depth with --opt deep_encoder=False had been refused, naming an option the user never
    gave), and one typed with --opt is refused (the final review found it)."""
    from dtmt_models.cli.train import build_parser, resolve_config
    from dtmt_models.models.registry import check_model_options

    def options(argv, typed):
        args = build_parser().parse_args(["--data", str(tmp_path), *argv])
        args.typed_opt = typed
        return resolve_config(args).model_options

    got = options(["--model", "dtmt", "--preset", "paper", "--opt", "deep_encoder=False"], ["deep_encoder"])
    assert got["deep_encoder"] is False and "encoder_depth" not in got
    check_model_options("dtmt", got)
    got = options(["--model", "nematus", "--preset", "small", "--opt", "decoder=shallow"], ["decoder"])
    assert "dec_base_transition_depth" not in got
    check_model_options("nematus", got)
    typed = options(["--model", "nematus", "--preset", "small", "--opt", "decoder=shallow", "--opt",
                     "dec_base_transition_depth=3"], ["decoder", "dec_base_transition_depth"])
    with pytest.raises(ValueError, match="dec_base_transition_depth=3 builds nothing here"):
        check_model_options("nematus", typed)


def test_a_run_holding_an_unused_option_resumes_again_and_again(toy, tmp_path, capsys):
    """A run of before the unused options' refusal may hold one (shallow_cell with every module deep): it resumes,
    built without it, and resumes again, its best.pt compared with last.pt by the options as they are (resumed once,
    they had been stored without it and the second resume was refused; the final review found it)."""
    from dtmt_models.models.checkpoint import read_checkpoint, save_checkpoint

    out = tmp_path / "old"
    args = ["--data", toy, "--out", str(out), "--valid-every", "1", *TINY]
    assert train_here([*args, "--max-steps", "2"], capsys).returncode == 0
    for name in ("last.pt", "best.pt"):   # (as a run of before the refusal wrote them)
        ckpt = read_checkpoint(str(out / name))
        ckpt.pop("format")
        ckpt["model_options"]["shallow_cell"] = "lgru"
        if "config" in ckpt:
            ckpt["config"]["model_options"]["shallow_cell"] = "lgru"
        save_checkpoint(str(out / name), ckpt)
    for steps in ("3", "4"):
        r = train_here(["--data", toy, "--out", str(out), "--resume", "--max-steps", steps], capsys)
        assert r.returncode == 0, (steps, r.stderr)
    assert read_checkpoint(str(out / "last.pt"))["model_options"]["shallow_cell"] == "lgru"


def test_more_threads_than_the_process_may_use_are_warned_of(tmp_path, capsys, monkeypatch):
    """--threads above the CPUs of the process's affinity (1,024 on 2 cores had been taken without a word): one
    warning line, in train's log and on the decoding commands' stderr; the run goes on with them. At or below the
    CPUs, nothing."""
    import torch

    from dtmt_models import errors
    from dtmt_models.cli.common import use_threads

    monkeypatch.setattr(errors, "usable_cpus", lambda: 1)
    data = make_toy_corpus(tmp_path / "c", n_train=60, n_dev=0, n_test=0)
    before = torch.get_num_threads()
    try:
        for threads, warned in (("2", True), ("1", False)):
            r = train_here(["--data", data, "--out", str(tmp_path / f"t{threads}"), "--max-steps", "1", *TINY,
                            "--threads", threads], capsys)   # (after TINY's --threads 1)
            line = (f"warning: --threads {threads} is more than the 1 CPU this process may use: the threads take "
                    f"turns on them (slower, not faster)")
            assert r.returncode == 0 and (line in r.stdout.splitlines()) == warned and "--threads" not in r.stderr, \
                (r.stdout, r.stderr)
        use_threads(3, "dtmt translate")
        assert capsys.readouterr().err == ("dtmt translate: warning: --threads 3 is more than the 1 CPU this process "
                                           "may use: the threads take turns on them (slower, not faster)\n")
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_a_mistyped_preset_is_named_before_the_out_folder_s_refusals(tmp_path, capsys):
    """--preset smal with an --out that holds a run: it had answered "already holds a checkpoint (last.pt)", the
    typo never named; the preset is now checked with the model, before --out."""
    data = make_toy_corpus(tmp_path / "c", n_train=60, n_dev=0, n_test=0)
    out = tmp_path / "run"
    assert train_here(["--data", data, "--out", str(out), "--max-steps", "1", *TINY], capsys).returncode == 0
    before = sorted(os.listdir(out))
    r = train_here(["--data", data, "--out", str(out), "--max-steps", "1", *TINY, "--preset", "smal"], capsys)
    assert r.returncode == 2 and "'smal' (did you mean 'small'?)" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert "already holds" not in r.stderr and sorted(os.listdir(out)) == before


def test_the_learning_curve_skips_cells_edited_by_hand(tmp_path):
    """A train_log.csv cell edited by hand ("abc", a spreadsheet's "8,43") passed --resume's check (the steps only)
    and plot_curve's ValueError ended every resumed run at its first validation, best.pt saved and last.pt not: the
    figure leaves such a cell out. A single training row is drawn as a point (a line of one point drew nothing)."""
    pytest.importorskip("matplotlib")
    from dtmt_models.training.trainer import _points, plot_curve

    rows = [dict(kind="train", step="1", loss="8.4"), dict(kind="train", step="2", loss="abc"),
            dict(kind="train", step="3", loss="8,43"), dict(kind="valid", step="3", dev_loss="7.9", dev_bleu="#N/A"),
            dict(kind="valid", step="x", dev_loss="7.5", dev_bleu="1.0")]
    assert _points(rows, "train", "loss") == [(1, 8.4)]
    assert _points(rows, "valid", "dev_loss") == [(3, 7.9)] and _points(rows, "valid", "dev_bleu") == []
    path = str(tmp_path / "curve.png")
    plot_curve(rows, path, "edited")
    assert os.path.getsize(path) > 0


def test_a_run_whose_stdout_reader_left_saves_its_updates(toy, tmp_path):
    """`dtmt train | tee log` with tee gone: the next progress line met a broken pipe and the run ended in silence
    (exit 141), last.pt a validation interval behind the log. It still ends with 141 (as SIGPIPE would end it), but
    saves last.pt at its update first and says so on stderr."""
    import torch

    out = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "dtmt_models.cli", "train", "--data", toy, "--out", out, "--max-steps", "400",
           "--log-every", "1", "--valid-every", "10000", "--progress", "lines", *TINY]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    for line in proc.stdout:   # (the reader leaves at the third update's line)
        if " step 3 " in line:
            break
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 141, err
    saved = re.search(r"dtmt train: stdout was closed \(its reader left\); .*last\.pt saved at update (\d+): resume "
                      r"with --resume", err)
    assert saved and 3 <= int(saved.group(1)) < 400, err
    assert torch.load(os.path.join(out, "last.pt"), weights_only=True)["step"] == int(saved.group(1))
