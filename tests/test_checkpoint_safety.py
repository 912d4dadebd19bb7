"""A checkpoint is data, never code (issue 20): a crafted .pt whose unpickling would run a command is refused
by every entry point that reads checkpoints (translate, evaluate, train --resume, the Python API) with a
one-line error, and the command never runs."""
import contextlib
import os
import re
import subprocess
import sys

import pytest
import torch

from test_train import ROOT, make_toy_corpus

from dtmt_models.models.checkpoint import FORMAT, load_model, read_checkpoint


class _RunsCode:
    """Unpickling this calls os.system: what an attacker puts in a shared checkpoint."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def crafted(tmp_path):
    """(path of a crafted checkpoint that looks like a dtmt one, the file its payload would create)."""
    marker = str(tmp_path / "code-ran")
    run = tmp_path / "run"
    run.mkdir()
    path = str(run / "last.pt")
    torch.save({"format": FORMAT, "model_name": "dtmt", "model_options": {}, "src_vocab": b"spm", "tgt_vocab": b"spm",
                "model": {}, "config": _RunsCode(marker)}, path)
    # the payload is real: unpickled without the data-only loader, it runs
    torch.load(path, weights_only=False)
    assert os.path.exists(marker)
    os.remove(marker)
    return path, marker


def _cli(*args, stdin=""):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "dtmt_models.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=300, env=env)


def _refused(r, path):
    assert r.returncode in (1, 2), (r.returncode, r.stdout, r.stderr)   # an input error, not a crash
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "refused" in lines[0] and path in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_python_api_refuses_a_checkpoint_that_runs_code(crafted):
    path, marker = crafted
    for load in (read_checkpoint, load_model):
        with pytest.raises(ValueError, match="refused.*plain data") as info:
            load(path)
        assert "\n" not in str(info.value) and "posix.system" in str(info.value)
    assert not os.path.exists(marker)


def test_command_line_refuses_a_checkpoint_that_runs_code(crafted, tmp_path):
    path, marker = crafted
    data = make_toy_corpus(tmp_path / "data", n_train=20, n_dev=5, n_test=5)
    _refused(_cli("translate", "--checkpoint", path, "--quiet", stdin="hola\n"), path)
    _refused(_cli("evaluate", "--checkpoint", path, "--data", data, "--split", "test", "--out-dir",
                  str(tmp_path / "eval")), path)
    _refused(_cli("train", "--data", data, "--model", "dtmt", "--out", os.path.dirname(path), "--resume"), path)
    assert not os.path.exists(marker)


def test_save_checkpoint_writes_nothing_its_loader_refuses(tmp_path):
    """save_checkpoint wrote a numpy number, a Path or an enum in the payload without a word, and the loader then
    refused the file as one that "could run code": the checkpoint saved was lost. Now each is a ValueError naming
    where it lies and its type, before anything is written; every kind of data it accepts is read back by the
    weights-only loader as it was."""
    import enum
    import pathlib

    import numpy as np

    from dtmt_models.models.checkpoint import save_checkpoint

    class Mode(enum.IntEnum):
        ON = 1

    base = dict(model_name="dtmt", model_options={}, src_vocab=b"s", tgt_vocab=b"t", model={"w": torch.ones(2)})
    path = tmp_path / "c.pt"
    for where, bad, name in ((["config", "bleu"], np.float64(1.5), "numpy.float64"),
                             (["config", "steps"], [1, np.int64(2)], "numpy.int64"),
                             (["out"], pathlib.Path("runs"), "pathlib.PosixPath"),
                             (["config", "mode"], Mode.ON, "Mode"),
                             (["config", "cut"], slice(1, 2), "builtins.slice")):
        payload = {**base, "config": {}}
        node = payload
        for key in where[:-1]:
            node = node[key]
        node[where[-1]] = bad
        at = "payload" + "".join(f"[{k!r}]" for k in where) + ("[1]" if isinstance(bad, list) else "")
        with pytest.raises(ValueError, match=rf"^save_checkpoint: {re.escape(at)} is a \S*{name}, which a "
                                             r"checkpoint cannot hold \(tensors, numbers"):
            save_checkpoint(str(path), payload)
        assert not path.exists() and os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match=r"^save_checkpoint: payload\['config'\] has a key of type "
                                         r"builtins.tuple, which a checkpoint cannot hold"):
        save_checkpoint(str(path), {**base, "config": {(1, 2): 3}})
    # empty bytes: torch pickles them as a call of bytes(), which every reader then refused as code it would run
    with pytest.raises(ValueError, match=r"^save_checkpoint: payload\['src_vocab'\] is empty bytes, which the "
                                         r"weights-only loader cannot read back"):
        save_checkpoint(str(path), {**base, "src_vocab": b""})
    assert not path.exists()
    from collections import OrderedDict
    data = {"a": [1, 2.5, True, None, "x", b"y", (3, 4)], 5: OrderedDict(k=torch.zeros(3, dtype=torch.int64)),
            "p": torch.nn.Parameter(torch.ones(2)), "f": float("inf")}
    save_checkpoint(str(path), {**base, "config": data})
    back = read_checkpoint(str(path))["config"]
    assert back.keys() == data.keys() and back["a"] == data["a"] and back["f"] == float("inf")
    assert torch.equal(back[5]["k"], data[5]["k"]) and torch.equal(back["p"], data["p"])
    # what the weights-only loader takes but a checkpoint never holds, in a crafted file: refused when read, naming
    # the file (dtmt average had said "save_checkpoint: payload['junk'] is a builtins.set" as it wrote its output)
    for junk, name in (({1, 2}, "builtins.set"), (torch.Size([2, 3]), "torch.Size")):
        torch.save({**base, "config": {}, "junk": junk, "format": "dtmt-checkpoint-1"}, path)
        with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: checkpoint\['junk'\] is a {name}, which a "
                                             r"checkpoint cannot hold"):
            read_checkpoint(str(path))


def test_a_checkpoint_write_that_fails_midway_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    """torch.save reports a write that fails midway as a RuntimeError of its zip writer ("unexpected pos 64 vs 0"),
    which `dtmt train` and `dtmt average` printed as a traceback. save_checkpoint turns it into the WriteError they
    report in one line: the file named, nothing written, an earlier version intact. (A full disk's error comes as
    the RuntimeError's context and is said as such: the next test; one without a context, as here, is said by the
    device's free space.)"""
    from dtmt_models.atomic import WriteError
    from dtmt_models.models.checkpoint import save_checkpoint

    path = tmp_path / "last.pt"
    path.write_bytes(b"the earlier checkpoint")

    def failing_save(obj, f):
        f.write(b"PK")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", failing_save)
    payload = dict(model_name="dtmt", model_options={}, src_vocab=[], tgt_vocab=[], model={})
    with pytest.raises(WriteError) as caught:
        save_checkpoint(str(path), payload)
    message = str(caught.value)
    assert message.startswith(f"cannot write {path}: the write stopped with ") and "\n" not in message
    assert "bytes free on its device" in message and "nothing written" in message
    assert path.read_bytes() == b"the earlier checkpoint" and os.listdir(tmp_path) == ["last.pt"]


def test_a_signal_during_a_checkpoint_write_stays_an_interrupt(tmp_path, monkeypatch):
    """A KeyboardInterrupt raised inside torch.save's writes (a second Ctrl-C while `dtmt train` saves) reaches the
    caller as itself, not as the zip writer's RuntimeError that save_checkpoint reports as a failed disk (exit 1,
    "the write stopped with N bytes free" instead of the interrupt's 130). Nothing written, the earlier file kept."""
    from dtmt_models.models import checkpoint

    path = tmp_path / "last.pt"
    path.write_bytes(b"the earlier checkpoint")
    real = checkpoint.atomic_write

    class Interrupted:   # the file torch writes to; the signal arrives at its third write
        def __init__(self, f):
            self.f, self.writes = f, 0

        def write(self, data):
            self.writes += 1
            if self.writes == 3:
                raise KeyboardInterrupt("SIGINT")
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

    @contextlib.contextmanager
    def interrupted_write(*args, **kwargs):
        with real(*args, **kwargs) as f:
            yield Interrupted(f)

    monkeypatch.setattr(checkpoint, "atomic_write", interrupted_write)
    payload = dict(model_name="dtmt", model_options={}, src_vocab=[], tgt_vocab=[],
                   model={"w": torch.zeros(1000), "v": torch.ones(50_000)})
    with pytest.raises(KeyboardInterrupt, match="SIGINT"):
        checkpoint.save_checkpoint(str(path), payload)
    assert path.read_bytes() == b"the earlier checkpoint" and os.listdir(tmp_path) == ["last.pt"]


def test_a_checkpoint_past_the_file_size_limit_is_said_so(tmp_path):
    """Under `ulimit -f` (EFBIG; Python ignores SIGXFSZ) the message said "stopped with 74,163,220,480 bytes free
    ... unexpected pos": the limit is named instead. In a child process, the limit set there."""
    code = """if True:
        import os, resource, sys, torch
        from dtmt_models.models.checkpoint import save_checkpoint
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
        payload = dict(model_name="dtmt", model_options={}, src_vocab=[], tgt_vocab=[], model={"w": torch.ones(50_000)})
        try:
            save_checkpoint(sys.argv[1], payload)
        except OSError as exc:
            print(exc)
    """
    path = tmp_path / "last.pt"
    path.write_bytes(b"the earlier checkpoint")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.stdout == (f"cannot write {path}: the write stopped at this process's file size limit of 100,000 bytes "
                           f"(ulimit -f); the checkpoint needs more (nothing written; any earlier version of the file "
                           f"is intact)\n"), (done.stdout, done.stderr)
    assert path.read_bytes() == b"the earlier checkpoint" and os.listdir(tmp_path) == ["last.pt"]


def test_a_changed_byte_in_a_checkpoint_is_refused(tmp_path):
    """A byte changed inside a checkpoint's weights (a disk or copy error) was read as it was: torch.load does not
    check the CRC-32 that torch.save writes with each record, and the model translated with the changed weight,
    exit 0. read_checkpoint checks every record's, so load_model, translate, evaluate, average and a resume
    refuse the file in one line naming it and the record. The payload's own `format` key cannot stand for the
    file's format."""
    from dtmt_models.models.checkpoint import CheckpointError, damaged_record, save_checkpoint

    path = str(tmp_path / "best.pt")
    weight = torch.arange(4096, dtype=torch.float32)
    save_checkpoint(path, dict(model_name="dtmt", model_options={}, src_vocab=b"spm", tgt_vocab=b"spm",
                               model={"w": weight}, format="dtmt-checkpoint-0"))
    assert read_checkpoint(path)["format"] == FORMAT and damaged_record(path) is None
    data = bytearray(open(path, "rb").read())
    at = bytes(data).index(weight[1000:1002].numpy().tobytes())   # a byte inside the weight's record
    data[at] ^= 0x40
    damaged = str(tmp_path / "damaged.pt")
    open(damaged, "wb").write(bytes(data))
    changed = torch.load(damaged, weights_only=True)["model"]["w"]   # (what was read before: no error)
    assert not torch.equal(changed, weight)
    for load in (read_checkpoint, load_model):
        with pytest.raises(CheckpointError) as info:
            load(damaged)
        assert str(info.value) == (f"{damaged}: damaged: its record {damaged_record(damaged)} does not match the "
                                   f"check sum written with it (a disk or copy error); use another copy or an "
                                   f"earlier checkpoint")
    assert damaged_record(damaged).endswith("data/0")
    assert read_checkpoint(damaged, mmap=True)["model_name"] == "dtmt"   # (settings only: not read, not checked)
    for args in (["translate", "-c", damaged, "--quiet"], ["average", damaged, path, "-o", str(tmp_path / "a.pt")]):
        r = _cli(*args, stdin="hola\n")
        assert r.returncode in (1, 2) and r.stderr.count("\n") == 1 and "damaged: its record" in r.stderr, r.stderr
    assert not os.path.exists(tmp_path / "a.pt")
    # torch told not to compute CRCs (its config) writes 0s: such a file is read unchecked, not called damaged; and
    # save_checkpoint computes them whatever the config says
    from torch.utils.serialization import config

    with config.patch({"save.compute_crc32": False}):
        torch.save({"format": FORMAT, "model": {"w": weight}}, str(tmp_path / "nocrc.pt"))
        save_checkpoint(str(tmp_path / "ours.pt"), dict(model_name="dtmt", model_options={}, src_vocab=b"spm",
                                                         tgt_vocab=b"spm", model={"w": weight}))
    assert torch.equal(read_checkpoint(str(tmp_path / "nocrc.pt"))["model"]["w"], weight)
    data = bytearray(open(tmp_path / "ours.pt", "rb").read())
    data[bytes(data).index(weight[1000:1002].numpy().tobytes())] ^= 0x40
    open(tmp_path / "ours.pt", "wb").write(bytes(data))
    assert damaged_record(str(tmp_path / "ours.pt")).endswith("data/0")
    # a compressed record (torch.save writes none): 1 GiB of zeros in a few MB was decompressed to check its CRC, 5 s
    # in every reader (and minutes for a larger one); refused unread, in one line
    import shutil
    import time
    import zipfile

    bomb = str(tmp_path / "bomb.pt")
    shutil.copyfile(path, bomb)
    with zipfile.ZipFile(bomb, "a", compression=zipfile.ZIP_DEFLATED) as z, \
            z.open("archive/bomb", "w", force_zip64=True) as f:
        for _ in range(64):
            f.write(bytes(1 << 24))
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=r"its record archive/bomb is compressed, which torch.save never writes"):
        read_checkpoint(bomb)
    assert time.perf_counter() - start < 1.0


def test_a_checkpoint_written_to_a_closed_pipe_says_so(tmp_path, monkeypatch):
    """`dtmt average -o /dev/stdout | head` (a reader that stops early): torch's zip writer reports the file's own
    error (a broken pipe) as 'unexpected pos', which was answered with the disk's free space; now with that error."""
    from dtmt_models.atomic import WriteError
    from dtmt_models.models.checkpoint import save_checkpoint

    def failing_save(obj, f):   # (as torch's writer does: the file's OSError the RuntimeError's context)
        try:
            raise BrokenPipeError(32, "Broken pipe")
        except BrokenPipeError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 832 vs 726")

    monkeypatch.setattr(torch, "save", failing_save)
    payload = dict(model_name="dtmt", model_options={}, src_vocab=[], tgt_vocab=[], model={})
    with pytest.raises(WriteError) as caught:
        save_checkpoint(str(tmp_path / "avg.pt"), payload)
    assert str(caught.value) == (f"cannot write {tmp_path / 'avg.pt'}: Broken pipe (nothing written; any earlier "
                                 f"version of the file is intact)")
    assert os.listdir(tmp_path) == []
