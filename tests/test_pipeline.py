"""The main job end to end, as a user runs it: prepare files -> train -> translate -> evaluate (issue 5)."""
import json
import os
import shutil
import subprocess
import sys

from test_train import ROOT, make_toy_corpus

from dtmt_models.decoding.evaluate import corpus_scores


def dtmt(*args, stdin=None, timeout=600):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "dtmt_models.cli", *args], input=stdin, capture_output=True,
                       text=True, timeout=timeout, env=env)
    assert r.returncode == 0, f"dtmt {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}"
    return r


def test_prepare_train_translate_evaluate(tmp_path):
    raw = make_toy_corpus(tmp_path / "raw", n_train=640, n_dev=0, n_test=0)
    data = str(tmp_path / "data")
    dtmt("prepare", "files", "--src", os.path.join(raw, "train.es"), "--tgt", os.path.join(raw, "train.en"),
         "--out", data, "--holdout", "20")
    with open(os.path.join(data, "corpus.json")) as f:
        assert json.load(f)["counts"] == {"train": 600, "dev": 20, "test": 20}
    run = str(tmp_path / "run")
    r = dtmt("train", "--data", data, "--model", "dtmt", "--out", run, "--vocab-size", "60", "--opt", "embed_dim=32",
             "--opt", "hidden_size=64", "--max-tokens", "600", "--lr", "3e-3", "--max-steps", "300",
             "--valid-every", "100", "--log-every", "50", "--progress", "lines")
    assert "dev loss" in r.stdout and "stopped: reached --max-steps 300" in r.stdout
    for name in ("best.pt", "last.pt", "train_log.csv", "config.yaml"):
        assert os.path.isfile(os.path.join(run, name)), name
    # translate: stdin -> stdout, n-best
    src_lines = open(os.path.join(data, "test.es"), encoding="utf-8").read().splitlines()
    r = dtmt("translate", "--checkpoint", os.path.join(run, "best.pt"), "--beam", "3", "--quiet",
             stdin="\n".join(src_lines[:3]) + "\n")
    assert len(r.stdout.splitlines()) == 3
    r = dtmt("translate", "--checkpoint", os.path.join(run, "best.pt"), "--beam", "3", "--nbest", "2", "--quiet",
             stdin=src_lines[0] + "\n")
    assert [line.split(" ||| ")[0] for line in r.stdout.splitlines()] == ["0", "0"]
    # evaluate: the toy task is word for word, so a trained model scores well above chance
    out = str(tmp_path / "eval")
    dtmt("evaluate", "--checkpoint", os.path.join(run, "best.pt"), "--data", data, "--split", "test",
         "--out-dir", out)
    with open(os.path.join(out, "scores.json")) as f:
        scores = json.load(f)
    hyps = open(os.path.join(out, "hyp.txt"), encoding="utf-8").read().splitlines()
    refs = open(os.path.join(data, "test.en"), encoding="utf-8").read().splitlines()
    assert len(hyps) == len(refs) == 20
    assert abs(scores["bleu"] - corpus_scores(hyps, refs)["bleu"]) < 1e-9
    assert scores["bleu"] > 30, scores["bleu"]
    for name in ("bleu_by_length.csv",):
        assert os.path.isfile(os.path.join(out, name))


def test_console_script_is_installed():
    exe = shutil.which("dtmt")
    if exe is None:
        import pytest
        pytest.skip("the dtmt console script is not on PATH (package not installed with pip)")
    r = subprocess.run([exe, "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "prepare" in r.stdout and "translate" in r.stdout
