"""A checkpoint is data, never code (issue 20): a crafted .pt whose unpickling would run a command is refused
by every entry point that reads checkpoints (translate, evaluate, train --resume, the Python API) with a
one-line error, and the command never runs."""
import os
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
