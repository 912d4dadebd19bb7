"""dtmt against OpenNMT-py at equal training time, side by side on the same prepared data (issue 21).

    python benchmarks/bench_peers.py                              # dtmt vs OpenNMT-py's LSTM, 30 min each, 1 thread each
    python benchmarks/bench_peers.py --budget 2h --systems dtmt rnnsearch-atr onmt-lstm
    python benchmarks/bench_peers.py --setup-only                 # only make the peer environment
    python benchmarks/bench_peers.py --no-train --out DIR         # evaluate and tabulate runs already in DIR

The peer is never a dependency of dtmt: on first use the script makes a virtual environment of its own
(--peer-env, default benchmarks/out/peers/env-onmt) holding OpenNMT-py 3.5.1 (installed without its pin on
torch < 2.3, so that it runs on the same torch as dtmt) and its other requirements.

What it does, in one run:
1. the same subwords for everyone: a SentencePiece model per side trained exactly as `dtmt train` trains it
   (same sentences, `--vocab-size`, BPE), the training pairs filtered as `dtmt train` filters them (longer than
   `--max-len` subwords or empty after segmentation), written as piece files for OpenNMT-py;
2. every system trains at once (one after another with --sequential), each on `--threads` threads
   (`OMP_NUM_THREADS` too), for `--budget` of wall time from its launch: one clock for all, with everything each
   toolkit does inside it (reading and batching its data, validation and a checkpoint every --valid-every
   updates on both sides; dtmt's validation also decodes the dev set greedily for BLEU, as it always does). When
   the budget is spent the script sends SIGTERM, on which both finish the update in progress, write a checkpoint
   and exit (`dtmt train` does so by itself; OpenNMT-py through `benchmarks/peers/onmt_train.py`). dtmt systems
   train with their `small` presets, OpenNMT-py with the same token budget per batch, label smoothing, clipping,
   Adam betas, learning rate and RNMT+ schedule as dtmt's preset (the two toolkits fill a batch of that budget
   differently: the table gives each one's target tokens per update). Each toolkit's preprocessing (dtmt prepare,
   OpenNMT-py's build_vocab) runs before, outside both clocks;
3. each system is evaluated on the same test set with the same sacrebleu settings (`dtmt evaluate --hyp` scores
   OpenNMT-py's output too): beam 4 with the GNMT length penalty α = 0.6 in both toolkits, one at a time on
   `--threads` threads, timing decoding (model loading excluded) for sentences/s; with the same checkpoint
   rules on both sides: the checkpoint of the lowest dev loss (dtmt's best.pt; OpenNMT-py's validated checkpoint
   of the lowest dev cross-entropy) and the last one;
4. the dev curve: dev loss (cross-entropy per target token, no smoothing) at every validation of each system,
   so learning per update is compared apart from speed.

It writes DIR/bench_peers.md (the tables, machine and command), DIR/bench_peers.json and DIR/bench_peers.png
(dev loss against updates and against training time), and with --results appends the tables to
benchmarks/RESULTS.md.

A system whose run --out already holds (its record, checkpoints or log) is not trained again unless --overwrite
says so: without it the script stops before any work, naming the runs.

Budgets longer than one sitting train one system per invocation into the same --out, then tabulate together:

    python benchmarks/bench_peers.py --budget 2h --threads 2 --sequential --systems dtmt --out DIR --no-eval
    python benchmarks/bench_peers.py --budget 2h --threads 2 --sequential --systems onmt-lstm --out DIR --no-eval
    python benchmarks/bench_peers.py --budget 2h --threads 2 --sequential --out DIR --no-train

Each training writes RUN/bench_peers_machine.json (the CPU's identity and instruction sets, cores, torch, the
threads, budget and mode, date and commit, and a speed probe before and after training: `speed_probe`);
tabulating refuses runs whose machines or settings differ, names each run's date and commit where they were
trained apart, and says so when the machine ran more than 5% faster for one run than for another (a VM's speed
moves between sessions on the same CPU). Before training the second system on another day, compare the
machine's speed now with the first run's:

    python benchmarks/bench_peers.py --probe --threads 2 --out DIR

On a GPU (issue 73 item 7; benchmarks/gpu_session.sh's `peers` stage), `--device cuda` trains and decodes every
system there: `--preset paper --onmt-size match --no-decode` compares training speed with an LSTM of dtmt's
parameter count on the same batches of tokens, and `--no-train --device cuda --decode-batch 64s` decodes
checkpoints trained on the CPU. The GPU machine has no network, so `--carry DIR` first gathers, on a machine with
one, what the second needs (the runs' checkpoints and logs, the subwords, OpenNMT-py's wheels):

    python benchmarks/bench_peers.py --carry benchmarks/out/gpu-carry --out benchmarks/out/peers-wall \
        --systems dtmt onmt-lstm --checkpoints best --budget 30m --threads 2 --sequential
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

ONMT_VERSION = "3.5.1"
# OpenNMT-py 3.5.1's requirements but torch (the peer runs on the torch of this environment)
ONMT_REQUIREMENTS = ["configargparse", "ctranslate2>=4,<5", "tensorboard>=2.3", "flask", "waitress",
                     "pyonmttok>=1.37,<2", "pyyaml", "sacrebleu", "rapidfuzz", "pyahocorasick", "fasttext-wheel",
                     "spacy", "six", "sentencepiece"]
PEERS = {"onmt-lstm", "onmt-transformer"}
# What OpenNMT-py needs on a machine without a network whose python has torch, sacrebleu, pyyaml, six and
# tensorboard (the GPU machines' image): wheels for its Python (3.12), gathered by --carry. spacy and fasttext, which
# only the `terminology` and `clean` transforms use (this benchmark uses neither), are stood in for by
# benchmarks/peers/offline (gpu_session.sh's peers stage puts it on PYTHONPATH where they are missing).
OFFLINE_WHEELS = [f"OpenNMT-py=={ONMT_VERSION}", "pyonmttok==1.38.1", "rapidfuzz==3.14.6", "pyahocorasick==2.3.1",
                  "configargparse==1.9.0"]
OFFLINE_PYTHON = "3.12"
CARRY_LIMIT = 60 << 20   # a device call carries 64 MiB with the repository (about 3.5 MB) beside it


def spawn(cmd, log, env=None):
    """Starts `cmd` with its output appended to `log` (after a `$ cmd` line); returns (process, cmd, log)."""
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env), cmd, log


def wait(job) -> None:
    proc, cmd, log = job
    if proc.wait() != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (exit {proc.returncode}); see {log}")


def run(cmd, log, env=None) -> None:
    wait(spawn(cmd, log, env))


def peer_python(env_dir: str) -> str:
    return os.path.join(env_dir, "bin", "python")


def ensure_env(env_dir: str, want: dict, installs, check: str, what: str, log: str) -> str:
    """A peer's virtual environment, made on first use: a venv, then one `pip install` per argument list of
    `installs`, then `check` run by its python; a marker file holding `want` says it is made (another `want`
    remakes it). Returns its python."""
    py = peer_python(env_dir)
    marker = os.path.join(env_dir, "dtmt-peer.json")
    if os.path.isfile(marker):
        with open(marker) as f:
            if json.load(f) == want:
                return py
    print(f"== making the {what} environment in {env_dir} (once; log {log})", flush=True)
    run([sys.executable, "-m", "venv", env_dir], log)
    for args in installs:
        run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", *args], log)
    run([py, "-c", check], log)
    with open(marker, "w") as f:
        json.dump(want, f)
    return py


def ensure_peer_env(env_dir: str, log: str) -> str:
    """The OpenNMT-py environment, made on first use; returns its python."""
    import torch

    torch_pin = f"torch=={torch.__version__.split('+')[0]}"
    return ensure_env(env_dir, {"onmt": ONMT_VERSION, "torch": torch.__version__.split("+")[0]},
                      [[torch_pin], ["--no-deps", f"OpenNMT-py=={ONMT_VERSION}"], ONMT_REQUIREMENTS + [torch_pin]],
                      "import onmt, torch; print('onmt', onmt.__version__, 'torch', torch.__version__)",
                      f"OpenNMT-py {ONMT_VERSION}", log)


# ------------------------------------------------------------------------------------------- the subwords
PIECES = "pieces.json"


def corpus_stamp(data: str) -> str:
    """What names a prepared corpus wherever it lies: the SHA-256 of its corpus.json (languages, counts, origin and
    splits; `dtmt prepare` writes the same one for the same corpus on every machine)."""
    import hashlib

    with open(os.path.join(data, "corpus.json"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def read_pieces(out: str, vocab_size: int, max_len: int, data: str):
    """The subwords `write_pieces` wrote into `out` for this corpus, vocabulary size and length filter, as
    write_pieces returns them (the piece files it has); None where it wrote none, or for another corpus or settings.
    What a folder carried to another machine decodes with: the SentencePiece models its checkpoints were trained
    on, not ones trained again there on another SentencePiece."""
    from dtmt_models.data.vocabulary import Vocabulary

    path = os.path.join(out, PIECES)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        rec = json.load(f)
    if (rec["vocab_size"], rec["max_len"], rec["corpus"]) != (vocab_size, max_len, corpus_stamp(data)):
        return None
    paths = {(split, key): os.path.join(out, name) if key != "n" else name
             for split, key, name in rec["paths"]}
    if not all(os.path.isfile(v) for (_, k), v in paths.items() if k != "n"):
        return None
    vocabs = [Vocabulary.load(os.path.join(out, f"spm.{lang}.model")) for lang in (rec["src_lang"], rec["tgt_lang"])]
    return {"src_lang": rec["src_lang"], "tgt_lang": rec["tgt_lang"], "paths": paths, "vocabs": vocabs}


def pieces_record(data: str, vocab_size: int, max_len: int, src_lang: str, tgt_lang: str, paths: dict) -> dict:
    """pieces.json: the settings and corpus the pieces were made for, each split's count and piece files."""
    return {"vocab_size": vocab_size, "max_len": max_len, "corpus": corpus_stamp(data), "src_lang": src_lang,
            "tgt_lang": tgt_lang, "paths": [[split, key, v if key == "n" else os.path.basename(v)]
                                            for (split, key), v in paths.items()]}


def write_pieces(data: str, out: str, vocab_size: int, max_len: int, log: str, splits=("train", "dev", "test")) -> dict:
    """SentencePiece per side as `dtmt train` trains it; piece files for `splits`; returns paths and counts. Reuses
    what an earlier call wrote into `out` for the same settings (read_pieces)."""
    from dtmt_models.data.corpus import corpus_paths, filter_by_length, read_manifest, read_parallel
    from dtmt_models.data.vocabulary import Vocabulary

    done = read_pieces(out, vocab_size, max_len, data)
    if done is not None and all((split, lang) in done["paths"] for split in splits
                                for lang in (done["src_lang"], done["tgt_lang"])):
        return done
    os.makedirs(out, exist_ok=True)
    manifest = read_manifest(data)
    src_lang, tgt_lang = manifest["src_lang"], manifest["tgt_lang"]
    train = read_parallel(*corpus_paths(data, "train"))
    vocabs = [Vocabulary.train([p[i] for p in train], vocab_size, "bpe") for i in (0, 1)]
    for v, lang in zip(vocabs, (src_lang, tgt_lang)):
        v.save(os.path.join(out, f"spm.{lang}.model"))
    paths = {}
    for split in ("train", "dev", "test"):
        if split not in splits:
            continue
        pairs = read_parallel(*corpus_paths(data, split))
        if split == "train":   # as dtmt train: drop pairs longer than max_len subwords, then empty ones
            ids = [(vocabs[0].encode(s), vocabs[1].encode(t)) for s, t in pairs]
            keep_ids, _dropped = filter_by_length(ids, max_len)
            keep = {(tuple(s), tuple(t)) for s, t in keep_ids if s and t}
            pairs = [(s, t) for (s, t), (si, ti) in zip(pairs, ids) if (tuple(si), tuple(ti)) in keep]
        for side, lang in ((0, src_lang), (1, tgt_lang)):
            path = os.path.join(out, f"{split}.pieces.{lang}")
            with open(path, "w", encoding="utf-8") as f:
                for pair in pairs:
                    f.write(" ".join(vocabs[side].sp.encode(pair[side], out_type=str)) + "\n")
            paths[(split, lang)] = path
        paths[(split, "n")] = len(pairs)
    with open(log, "a") as f:
        f.write("pieces: " + ", ".join(f"{split} {paths[(split, 'n')]:,}" for split in splits) + " pairs (train after "
                "filtering)\n")
    with open(os.path.join(out, PIECES), "w") as f:
        json.dump(pieces_record(data, vocab_size, max_len, src_lang, tgt_lang, paths), f, indent=1)
    return {"src_lang": src_lang, "tgt_lang": tgt_lang, "paths": paths, "vocabs": vocabs}


# ------------------------------------------------------------------------------------------ OpenNMT-py
def onmt_config(out: str, pieces: dict, train_cfg: dict, opts: dict, arch: str = "lstm", device: str = "cpu") -> str:
    """The YAML for an OpenNMT-py model, with the same token budget per batch as dtmt's.
    lstm: 2-layer bi-LSTM encoder, 2-layer input-feeding LSTM decoder with general (Luong) attention; dtmt's training
    settings (Adam, learning rate, clipping, smoothing; the RNMT+ schedule is set by onmt_train.py).
    transformer: the recipe of OpenNMT-py's documentation ("How do I use the Transformer model?": Adam with β2
    0.998, the noam schedule at learning rate 2, Glorot initialisation, no clipping, dropout and attention dropout
    0.1, label smoothing 0.1, tokens normalisation), at `opts`' sizes, with the decoder's embeddings shared with
    its output layer, and warm-up over `opts["warmup"]` updates (the recipe's 8,000 are for updates of about 65,000
    tokens; at 2,000 tokens an update a 30-minute CPU budget ends before them). `device` cuda: on GPU 0."""
    s, t = pieces["src_lang"], pieces["tgt_lang"]
    P = pieces["paths"]
    cfg = {
        "save_data": out, "src_vocab": os.path.join(out, "vocab.src"), "tgt_vocab": os.path.join(out, "vocab.tgt"),
        "src_vocab_size": 32000, "tgt_vocab_size": 32000, "overwrite": "true",
        "save_model": os.path.join(out, "model"), "save_checkpoint_steps": opts["valid_every"],
        "keep_checkpoint": -1, "valid_steps": opts["valid_every"], "train_steps": 10 ** 8, "report_every": 50,
        "seed": train_cfg["seed"], "batch_type": "tokens", "batch_size": train_cfg["max_tokens"],
        "valid_batch_size": train_cfg["max_tokens"], "normalization": "tokens", "accum_count": "[1]",
        "num_workers": 0, "world_size": 1, "gpu_ranks": "[0]" if device == "cuda" else "[]", "bucket_size": 32768,
        "label_smoothing": train_cfg["smoothing"], "optim": "adam", "adam_beta1": 0.9,
        "adam_beta2": train_cfg.get("adam_beta2", 0.998) if arch == "lstm" else 0.998,
    }
    if arch == "lstm":
        cfg.update({
            "encoder_type": "brnn", "decoder_type": "rnn", "rnn_type": "LSTM", "layers": 2,
            "word_vec_size": opts["embed_dim"], "hidden_size": opts["hidden_size"], "global_attention": "general",
            "input_feed": 1, "dropout": f"[{opts['dropout']}]", "learning_rate": train_cfg["lr"],
            "max_grad_norm": train_cfg["clip"]})
    elif arch == "transformer":
        cfg.update({
            "encoder_type": "transformer", "decoder_type": "transformer", "position_encoding": "true",
            "enc_layers": opts["layers"], "dec_layers": opts["layers"], "heads": opts["heads"],
            "hidden_size": opts["hidden_size"], "word_vec_size": opts["hidden_size"],
            "transformer_ff": opts["ff"], "share_decoder_embeddings": "true", "dropout_steps": "[0]",
            "dropout": "[0.1]", "attention_dropout": "[0.1]", "learning_rate": 2, "decay_method": "noam",
            "warmup_steps": opts["warmup"], "max_grad_norm": 0, "param_init": 0, "param_init_glorot": "true"})
    else:
        raise ValueError(f"unknown OpenNMT-py architecture {arch!r}")
    lines = [f"{k}: {v}" for k, v in cfg.items()]
    lines += ["data:", "    corpus_1:", f"        path_src: {P[('train', s)]}", f"        path_tgt: {P[('train', t)]}",
              "    valid:", f"        path_src: {P[('dev', s)]}", f"        path_tgt: {P[('dev', t)]}"]
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "onmt.yaml")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def onmt_lstm_params(embed: int, hidden: int, src_vocab: int, tgt_vocab: int) -> int:
    """The parameters of onmt_config's LSTM (OpenNMT-py 3.5.1): embeddings per side; a 2-layer bidirectional
    encoder of hidden/2 units a direction; a 2-layer decoder whose first layer reads the embedding and the input
    feed; general attention (linear_in H x H and linear_out 2H -> H, neither with a bias); the generator H -> the
    target vocabulary with a bias. torch's LSTM has two bias vectors a layer. OpenNMT-py's vocabularies are its
    vocab files' pieces plus 4 specials, rounded up to a multiple of 8 (onmt_vocab_size)."""
    def lstm(inputs: int, units: int) -> int:
        return 4 * units * (inputs + units) + 8 * units

    half = hidden // 2
    encoder = 2 * lstm(embed, half) + 2 * lstm(hidden, half)
    decoder = lstm(embed + hidden, hidden) + lstm(hidden, hidden)
    return ((src_vocab + tgt_vocab) * embed + encoder + decoder + 3 * hidden * hidden
            + hidden * tgt_vocab + tgt_vocab)


ONMT_SPECIALS = ("<unk>", "<blank>", "<s>", "</s>")


def onmt_vocab_size(vocab_file: str) -> int:
    """OpenNMT-py's vocabulary size for a build_vocab file (one `piece<TAB>count` a line): its pieces and the 4
    specials that are not among them, rounded up to a multiple of 8 (its vocab_size_multiple)."""
    with open(vocab_file, encoding="utf-8") as f:
        pieces = {line.rstrip("\n").split("\t")[0] for line in f if line.strip()}
    n = len(pieces) + sum(1 for sp in ONMT_SPECIALS if sp not in pieces)
    return -(-n // 8) * 8


def matched_lstm_size(params: int, embed: int, src_vocab: int, tgt_vocab: int) -> int:
    """The even hidden size that brings onmt_config's LSTM (embedding `embed`) nearest to `params` parameters."""
    hidden = 2
    while onmt_lstm_params(embed, hidden + 2, src_vocab, tgt_vocab) <= params:
        hidden += 2
    below, above = (onmt_lstm_params(embed, h, src_vocab, tgt_vocab) for h in (hidden, hidden + 2))
    return hidden if params - below <= above - params else hidden + 2


def steady_rate(points, budget_s: float):
    """Target tokens a second over the second half of a budget, from a run's log points [(wall s since launch,
    target tokens trained so far)]: the rate once start-up is behind both toolkits, by the same clock (validation
    and checkpoints inside it alike). None with fewer than two points in that half."""
    late = [(w, t) for w, t in points if w >= budget_s / 2]
    if len(late) < 2 or late[-1][0] <= late[0][0]:
        return None
    return (late[-1][1] - late[0][1]) / (late[-1][0] - late[0][0])


def decode_batch(text: str):
    """--decode-batch: "N" source subwords a batch, or "Ns" sentences; as (N, OpenNMT-py's batch_type)."""
    m = re.fullmatch(r"([1-9][0-9]*)(s?)", text)
    if not m:
        raise ValueError(f"--decode-batch {text!r}: N (source subwords) or Ns (sentences), N >= 1")
    return int(m.group(1)), "sents" if m.group(2) else "tokens"


def strict(device: str) -> list:
    """What a process runs through on `device`: on a GPU, peers/strict_fp32.py (TF32 off for cuBLAS and cuDNN, one
    math mode for dtmt and OpenNMT-py alike); on the CPU, nothing."""
    return [os.path.join(HERE, "peers", "strict_fp32.py")] if device == "cuda" else []


def dtmt_env(threads: int = 0) -> dict:
    """A dtmt process's environment: the repository importable from wherever it starts (a GPU machine builds it in
    place, without installing it), and `threads` OpenMP threads where given."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def onmt_env(threads: int) -> dict:
    # OpenNMT-py 3.5.1 predates torch 2.6's weights-only default and pickles its options (argparse.Namespace)
    # into its checkpoints: allow full unpickling in the peer's processes only, for the files it wrote itself.
    return dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore",
                TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")


def timed(cmd, log, env=None) -> float:
    """Runs `cmd` (as run) and returns its wall time from launch to exit: the one clock of both translators."""
    t0 = time.perf_counter()
    run(cmd, log, env)
    return time.perf_counter() - t0


def detokenise(pieces: str, out: str, vocab) -> int:
    """A peer's output subwords (one sentence a line) as text in `out`, by `vocab`'s SentencePiece; the lines."""
    with open(pieces, encoding="utf-8") as f:
        hyps = [vocab.sp.decode(line.split()) for line in f.read().splitlines()]
    with open(out, "w", encoding="utf-8") as f:
        f.write("\n".join(hyps) + "\n")
    return len(hyps)


def onmt_translate(py: str, model: str, src: str, out: str, beam: int, threads: int, log: str,
                   vocab, batch=(2000, "tokens"), device: str = "cpu") -> dict:
    """OpenNMT-py's own translator (batches of `batch` = (N, "tokens" or "sents"), beam `beam`, GNMT's length penalty
    with α 0.6 as dtmt's; on GPU 0 where `device` is cuda); detokenised output in `out`; returns the process's wall
    time from launch to exit (`seconds`: model loading and everything else inside) and the translator's own report
    of its decoding alone (`decode_seconds`, 0.1 s resolution)."""
    pieces = out + ".pieces"
    tlog = out + ".log"
    if os.path.exists(tlog):
        os.remove(tlog)
    seconds = timed([py, *strict(device), "-m", "onmt.bin.translate", "-model", model, "-src", src, "-output",
                     pieces, "-beam_size", str(beam), "-length_penalty", "wu", "-alpha", "0.6", "-batch_type",
                     batch[1], "-batch_size", str(batch[0]), "-max_length", "250", "-gpu",
                     "0" if device == "cuda" else "-1", "-report_time", "-log_file", tlog], log, env=onmt_env(threads))
    n = detokenise(pieces, out, vocab)
    with open(tlog) as f:
        m = re.search(r"Total translation time \(s\): ([0-9.]+)", f.read())
    return {"seconds": seconds, "decode_seconds": float(m.group(1)) if m else float("nan"), "sentences": n}


def dtmt_translate(ckpt: str, src: str, out: str, beam: int, threads: int, log: str,
                   batch=(2000, "tokens"), extra=(), device: str = "cpu") -> dict:
    """`dtmt translate` of the raw test sources (its own SentencePiece inside), batches of `batch` as onmt_translate's
    (counted in its source subwords), beam `beam`, α 0.6, on `device`; returns the process's wall time from launch
    to exit, as onmt_translate's."""
    size = (["--max-tokens", str(batch[0])] if batch[1] == "tokens" else
            ["--max-tokens", str(10 ** 9), "--batch-size", str(batch[0])])
    seconds = timed([sys.executable, *strict(device), "-m", "dtmt_models.cli", "translate", "-c", ckpt, src, "-o",
                     out, "--beam", str(beam), "--alpha", "0.6", *size, "--threads", str(threads), "--device", device,
                     "--quiet", *extra], log, env=dtmt_env(threads))
    with open(out, encoding="utf-8") as f:
        return {"seconds": seconds, "sentences": len(f.read().splitlines())}


def cpu_vendor() -> str:
    """The CPU's vendor string (/proc/cpuinfo's vendor_id: GenuineIntel, AuthenticAMD; "" where unknown)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def ct2_backends(vendor: str) -> list:
    """CTranslate2's two CPU GEMM backends, as a user would switch between them: its default, which its runtime
    picks by the CPU's vendor (Intel MKL on a GenuineIntel CPU, its own other backend elsewhere), and the other one,
    forced by CT2_USE_MKL (0 on an Intel CPU, 1 elsewhere). [(label, extra environment)], the default first."""
    intel = vendor == "GenuineIntel"
    return [(f"default backend ({'MKL' if intel else 'not MKL'})", {}),
            (f"CT2_USE_MKL={0 if intel else 1}", {"CT2_USE_MKL": "0" if intel else "1"})]


def ct2_translate(py: str, model_dir: str, src: str, out: str, beam: int, threads: int, compute: str, log: str,
                  vocab, batch=(2000, "tokens"), extra_env=None) -> dict:
    """CTranslate2's translator on the test subwords (benchmarks/peers/ct2_run.py: batches of `batch` as
    onmt_translate's, beam `beam`, its length penalty 0.6: scores divided by length^0.6, not GNMT's form),
    detokenised into `out`, with `extra_env` in its environment (ct2_backends'); returns the process's wall time
    from launch to exit (the one clock of every translator)."""
    pieces = out + ".pieces"
    seconds = timed([py, os.path.join(HERE, "peers", "ct2_run.py"), "translate", "--model", model_dir, "--src", src,
                     "--out", pieces, "--beam", str(beam), "--batch", str(batch[0]), "--batch-type",
                     "tokens" if batch[1] == "tokens" else "examples",
                     "--threads", str(threads), "--compute-type", compute], log,
                    env=dict(onmt_env(threads), **(extra_env or {})))
    n = detokenise(pieces, out, vocab)
    return {"seconds": seconds, "sentences": n}


def ct2_version(py: str) -> str:
    return subprocess.run([py, "-c", "import ctranslate2; print(ctranslate2.__version__)"], capture_output=True,
                          text=True, check=True).stdout.strip()


def _scores(hyp: str, out_dir: str, data: str, log: str) -> dict:
    """sacrebleu's BLEU and chrF of `hyp` on the test set (`dtmt evaluate --hyp`)."""
    run([sys.executable, "-m", "dtmt_models.cli", "evaluate", "--hyp", hyp, "--data", data, "--split", "test",
         "--out-dir", out_dir, "--quiet"], log, env=dtmt_env())
    with open(os.path.join(out_dir, "scores.json")) as f:
        return json.load(f)


def read_jsonl(path: str) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ----------------------------------------------------------------------------------------------- main
RECORD = "bench_peers_machine.json"
# What must be equal in every run of one table: the machine (common.machine_record) and the training setting.
SAME = ("machine", "threads", "budget_s", "sequential", "clock")
RECORDS_SAME = SAME + ("device", "preset")   # and between the runs themselves
RECORD_DEFAULTS = {"device": "cpu", "preset": "small"}   # what runs recorded before these keys trained with
CLOCK = "wall time from launch"   # the clock of this script's budgets (runs recorded before it had none)


def earlier_run(run_dir: str) -> bool:
    """Whether `run_dir` holds a run that training a system there would replace: its record (RECORD), a dtmt run's
    checkpoints or log, or OpenNMT-py's checkpoints or log."""
    if not os.path.isdir(run_dir):
        return False
    return any(name in (RECORD, "best.pt", "last.pt", "train_log.csv", "train.jsonl") or name.startswith("model_step_")
               for name in os.listdir(run_dir))


def write_record(run_dir: str, setting: dict) -> None:
    """RUN/bench_peers_machine.json: the machine a run trained on and its setting, date and commit."""
    import datetime

    from common import commit, machine_name, machine_record

    rec = dict(setting, machine=machine_record(), machine_name=machine_name(), commit=commit(),
               date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"))
    with open(os.path.join(run_dir, RECORD), "w") as f:
        json.dump(rec, f, indent=1)


# Per-step GEMM shapes of a dtmt small-preset training update (M = batch rows), timed with their weights coming
# from memory: the rate that moves with the VM (docs/design/training.md, "Speed probes for runs trained apart").
PROBE_SHAPES = ("88x256x1024", "43x256x768", "88x512x1280", "43x1024x256")
PROBE_APART = 0.05   # probes differing by more than this (two runs', or one run's before/after): not equal work


def speed_probe(threads: int, seconds: float = 3.0) -> float:
    """How fast the machine trains now: float32 GFLOP/s of x @ W^T over PROBE_SHAPES, each call taking the next of
    64 MiB of distinct weight matrices (from memory, as a training step's weights come: bench_gemm --cold), over
    `seconds` of wall time on `threads` threads (time the VM takes away counts). A VM's speed on the same CPU
    moves between sessions, mostly in its memory (docs/design/training.md, "Speed probes for runs trained apart"),
    so each training records a probe before and after it and tabulation compares the probes of runs trained
    apart."""
    import time

    import torch

    from bench_gemm import cold_weights

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        work = []
        for shape in PROBE_SHAPES:
            M, K, N = (int(v) for v in shape.split("x"))
            x = torch.randn(M, K, generator=g)
            weights = cold_weights(N, K, (64 << 20) // len(PROBE_SHAPES), generator=g)
            work.append((x, weights, 2.0 * M * K * N * len(weights)))

        def sweep() -> float:
            for x, weights, _ in work:
                for w in weights:
                    x @ w.t()
            return sum(flops for _, _, flops in work)

        sweep()   # first touch of the weights and MKL's buffers
        done, start = 0.0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            done += sweep()
        return round(done / (time.perf_counter() - start) / 1e9, 1)
    finally:
        torch.set_num_threads(before)


def probes_apart(x: float, y: float) -> bool:
    """Whether two speed probes differ by more than PROBE_APART: the machine did not give equal work."""
    return max(x, y) > (1 + PROBE_APART) * min(x, y)


def probe_lines(records: dict) -> list:
    """Table lines with each run's speed probes (before, after training); a line for each run whose own probes
    differ by more than PROBE_APART (the machine changed speed during its training); and, when runs trained apart
    ran at mean speeds more than PROBE_APART apart, how much faster the machine was for one than for another."""
    have = {n: r["probe"] for n, r in records.items() if r and r.get("probe")}
    if not have:
        return []
    runs = "; ".join(f"{n} {p[0]:.1f} → {p[1]:.1f}" for n, p in have.items())
    lines = ["Speed probe (`bench_peers.speed_probe`: GFLOP/s of a training step's GEMMs with their weights from "
             f"memory, on the run's threads), before → after training: {runs}."]
    for n, (before, after) in have.items():
        if probes_apart(before, after):
            lines.append(f"**The machine changed speed during {n}'s training ({before:.1f} → {after:.1f} GFLOP/s, "
                         f"{after / before:.2f}×): its budget was not steady work.**")
    mean = {n: (p[0] + p[1]) / 2 for n, p in have.items()}
    fast, slow = max(mean, key=mean.get), min(mean, key=mean.get)
    if probes_apart(mean[fast], mean[slow]):
        lines.append(f"**The machine ran {mean[fast] / mean[slow]:.2f}× as fast during {fast}'s training as during "
                     f"{slow}'s: the equal budget was not equal work.**")
    unprobed = sorted(n for n, r in records.items() if r and not r.get("probe"))
    if unprobed:
        lines.append(f"Not probed (trained before the probe): {', '.join(unprobed)}.")
    return lines + [""]


def read_record(run_dir: str):
    path = os.path.join(run_dir, RECORD)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def check_records(records: dict):
    """The machine every run trained on (its machine_name line), after checking that the runs' records agree on
    SAME; None when no run has a record (runs made before records were written). A run without a record beside
    runs with one, or two records that differ, stop the script with a one-line message."""
    have = {name: r for name, r in records.items() if r is not None}
    if not have:
        return None
    if len(have) < len(records):
        missing = sorted(set(records) - set(have))
        raise SystemExit(f"bench_peers: {', '.join(missing)} has no {RECORD} (trained before runs recorded their "
                         f"machine): cannot tell whether it trained on the machine of {', '.join(sorted(have))}")
    (first, ref), *others = have.items()
    for name, r in others:
        for key in RECORDS_SAME:
            if r.get(key, RECORD_DEFAULTS.get(key)) != ref.get(key, RECORD_DEFAULTS.get(key)):
                what = "machines" if key == "machine" else f"settings ({key})"
                raise SystemExit(f"bench_peers: {first} and {name} trained on different {what}: "
                                 f"{ref.get(key)} against {r.get(key)}; train them again on one")
    return ref["machine_name"]


def apart_line(records: dict) -> list:
    """A table line naming each run's training date and commit, when the runs were not all trained together."""
    have = {n: r for n, r in records.items() if r}
    if len({(r["date"][:10], r["commit"]) for r in have.values()}) <= 1:
        return []
    return ["Trained separately: " + "; ".join(f"{n} {r['date']} at {r['commit']}" for n, r in have.items()) + ".",
            ""]


def main(argv=None):
    from bench_quality import read_log, start
    from common import machine_name

    import dtmt_models.models.systems  # noqa: F401
    from dtmt_models.models.checkpoint import read_checkpoint
    from dtmt_models.models.presets import PRESETS, get_preset
    from dtmt_models.cli.train import parse_duration

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", nargs="+", default=["dtmt", "onmt-lstm"],
                   help=f"dtmt systems ({', '.join(sorted(PRESETS))}) and peers ({', '.join(sorted(PEERS))})")
    p.add_argument("--data", default=os.path.join(ROOT, "data", "bible"))
    p.add_argument("--budget", default="30m", help="training time per system (e.g. 90s, 30m, 2h)")
    p.add_argument("--threads", type=int, default=1, help="threads per system, in training and decoding")
    p.add_argument("--sequential", action="store_true",
                   help="train the systems one after another (e.g. --threads 2 on 2 cores: the issue's 2-thread "
                        "budgets) instead of all at once")
    p.add_argument("--valid-every", type=int, default=250)
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--onmt-size", default="128,256",
                   help="OpenNMT-py LSTM embedding,hidden sizes (default 128,256: 4.0 M parameters at BPE 4,000; "
                        "128,316: 5.26 M, the size of dtmt's small preset), or `match`: the first dtmt system's "
                        "embedding size and the hidden size that gives the LSTM that system's parameter count")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where every system trains and decodes (cuda: `dtmt train/translate --device cuda`, "
                        "OpenNMT-py on GPU 0; no speed probe, which measures the CPU)")
    p.add_argument("--preset", default="small",
                   help="dtmt's preset for every dtmt system (default small); OpenNMT-py takes its training "
                        "settings: tokens a batch, learning rate and schedule, clipping, smoothing, vocabulary size, "
                        "dropout")
    p.add_argument("--checkpoints", nargs="+", default=["best", "last"], choices=("best", "last"),
                   help="the checkpoints decoded: the lowest dev loss's, the last, or both (default)")
    p.add_argument("--decode-batch", default="2000",
                   help="decoding batches of N source subwords (default 2000), or Ns: N sentences (e.g. 64s)")
    p.add_argument("--no-decode", action="store_true",
                   help="tabulate the training (speed, dev loss) without decoding the test set")
    p.add_argument("--peer-python", default=None,
                   help="run OpenNMT-py with this python instead of making --peer-env (a machine without a network: "
                        "the python that imports the wheels --carry gathered)")
    p.add_argument("--carry", metavar="DIR",
                   help="gather into DIR what decoding the runs of --out on another machine needs, and stop: each "
                        "run's logs and record, its --checkpoints (OpenNMT-py's without their optimizer state), the "
                        "SentencePiece models and test pieces, and OpenNMT-py's wheels for Python 3.12 "
                        "(gpu_session.sh's peers stage decodes it)")
    p.add_argument("--onmt-transformer", default="256,1024,2,4,4000",
                   help="OpenNMT-py Transformer model size, feed-forward size, layers per side, heads and warm-up "
                        "updates (default 256,1024,2,4,4000: 5.7 M parameters at BPE 4,000, about dtmt's small "
                        "preset; its CTranslate2 conversions are decoded too, float32 and int8, each with both of "
                        "CTranslate2's CPU backends, beside `dtmt translate` and `dtmt translate --int8`)")
    p.add_argument("--train-args", default="", help="extra `dtmt train` arguments for every dtmt system")
    p.add_argument("--peer-env", default=os.path.join(HERE, "out", "peers", "env-onmt"))
    p.add_argument("--out", default=os.path.join(HERE, "out", "peers"))
    p.add_argument("--overwrite", action="store_true",
                   help="train again the systems whose runs --out already holds, replacing them (without it such an "
                        "--out is refused before any work)")
    p.add_argument("--setup-only", action="store_true", help="make the peer environment and stop")
    p.add_argument("--no-train", action="store_true", help="evaluate and tabulate the runs already in --out")
    p.add_argument("--no-eval", action="store_true",
                   help="train and stop (another invocation with --no-train tabulates the runs together)")
    p.add_argument("--results", action="store_true", help="append the tables to benchmarks/RESULTS.md")
    p.add_argument("--profile", action="store_true",
                   help="instead of training: time a training update of the runs in --out (dtmt's last.pt, "
                        "OpenNMT-py's last checkpoint) on the same batches, part by part")
    p.add_argument("--probe", action="store_true",
                   help="only measure the machine's speed now (speed_probe) and show the probes of the runs in --out, "
                        "to check before training one system of a pair on another day")
    p.add_argument("--profile-batches", type=int, default=23, help="batches timed by --profile (3 warm up)")
    a = p.parse_args(argv)
    from common import check_options
    from dtmt_models.decoding.hypotheses import MAX_BEAM

    # every option checked before any work (a peer environment installed, a corpus built, a run replaced): --device
    # cuda without a GPU had failed in training, after the install
    check_options(p, a, (("threads", 1), ("valid_every", 1), ("beam", 1, MAX_BEAM), ("profile_batches", 4)),
                  device="device")
    try:
        budget_s = parse_duration(a.budget)
    except ValueError as exc:
        p.error(str(exc).replace("--max-time", "--budget"))
    if not 0 < budget_s < float("inf"):   # (inf trained with --max-steps 10^9, never stopping)
        p.error(f"--budget {a.budget}: must be a finite duration of more than 0 seconds")
    if a.no_train and a.no_eval:
        p.error("--no-train with --no-eval leaves nothing to do")
    try:
        batch = decode_batch(a.decode_batch)
    except ValueError as exc:
        p.error(str(exc))
    if a.onmt_size != "match" and not re.fullmatch(r"[1-9][0-9]*,([1-9][0-9]*[02468]|[2468])", a.onmt_size):
        p.error(f"--onmt-size {a.onmt_size!r}: EMBED,HIDDEN (HIDDEN even: a bidirectional encoder halves it) or match")
    if not re.fullmatch(r"[1-9][0-9]*(,[1-9][0-9]*){3},[0-9]+", a.onmt_transformer):
        p.error(f"--onmt-transformer {a.onmt_transformer!r}: MODEL,FF,LAYERS,HEADS,WARMUP, whole numbers")
    unknown = [s for s in a.systems if s not in PRESETS and s not in PEERS]
    if unknown:
        p.error(f"--systems: unknown {', '.join(unknown)}")
    for system in [s for s in a.systems if s in PRESETS] or ["dtmt"]:   # (the peers take the first one's settings)
        try:
            get_preset(system, a.preset)
        except ValueError as exc:
            p.error(f"--preset {a.preset}: {exc}")
    default_data = os.path.join(ROOT, "data", "bible")
    if not os.path.isfile(os.path.join(a.data, "corpus.json")) and \
            os.path.abspath(a.data) != os.path.abspath(default_data):   # (a mistyped --data got a Bible built there)
        p.error(f"--data {a.data}: no corpus.json; make the corpus with `dtmt prepare` (only the default, "
                f"{default_data}, is prepared here)")
    trains = not (a.no_train or a.carry or a.probe or a.setup_only or a.profile)
    if trains and not a.overwrite:   # (their records were deleted and `dtmt train --overwrite` retrained, unasked)
        held = [system for system in a.systems if earlier_run(os.path.join(a.out, system))]
        if held:
            p.error(f"--out {a.out}: already holds the run of {', '.join(held)}; add --overwrite to replace it, "
                    f"--no-train to evaluate it, or choose another --out")
    os.makedirs(a.out, exist_ok=True)
    log = os.path.join(a.out, "bench_peers.log")
    peers = [s for s in a.systems if s in PEERS]
    ours = [s for s in a.systems if s in PRESETS]
    if a.carry:
        return write_carry(a, log)
    if a.probe:
        print(f"speed probe on {a.threads} thread(s): {speed_probe(a.threads):.1f} GFLOP/s")
        for name in a.systems:
            rec = read_record(os.path.join(a.out, name))
            if rec and rec.get("probe"):
                print(f"  {name} ({rec['date']}): {rec['probe'][0]:.1f} before, {rec['probe'][1]:.1f} after")
        return None
    py = (a.peer_python or ensure_peer_env(a.peer_env, log)) if peers else None
    if a.setup_only:
        print(f"peer environment ready: {py}")
        return None
    if a.profile:
        return profile(a, py, ours, log)
    if not a.sequential and len(a.systems) * a.threads > (os.cpu_count() or 1):
        print(f"warning: {len(a.systems)} systems × {a.threads} thread(s) > {os.cpu_count()} cores: they slow each "
              f"other unevenly", file=sys.stderr)
    if not os.path.isfile(os.path.join(a.data, "corpus.json")):
        run([sys.executable, "-m", "dtmt_models.cli", "prepare", "bible", "--out", a.data], log)
    preset = get_preset(ours[0] if ours else "dtmt", a.preset)   # the first dtmt system's: the peers' settings
    train_cfg = dict(preset["train"], seed=1)
    pieces = write_pieces(a.data, os.path.join(a.out, "pieces"), train_cfg["vocab_size"], train_cfg["max_len"], log)
    s_lang = pieces["src_lang"]
    if a.onmt_size == "match":   # the first dtmt system's size (embeddings at OpenNMT-py's vocabulary sizes)
        if not ours:
            p.error("--onmt-size match: no dtmt system to match")
        emb, hid = preset["model"]["embed_dim"], None
    else:
        emb, hid = (int(x) for x in a.onmt_size.split(","))
    t_dim, t_ff, t_layers, t_heads, t_warmup = (int(x) for x in a.onmt_transformer.split(","))
    peer_opts = {"onmt-lstm": dict(embed_dim=emb, hidden_size=hid, dropout=preset["model"]["dropout"],
                                   valid_every=a.valid_every),
                 "onmt-transformer": dict(hidden_size=t_dim, ff=t_ff, layers=t_layers, heads=t_heads,
                                          warmup=t_warmup, valid_every=a.valid_every)}
    peer_sizes = {"onmt-lstm": a.onmt_size, "onmt-transformer": a.onmt_transformer}
    jobs = []
    setting = dict(threads=a.threads, budget_s=budget_s, sequential=a.sequential, valid_every=a.valid_every,
                   clock=CLOCK)
    probing = a.device == "cpu"   # the probe measures the CPU
    # ---- training: all at once, or one after another (--sequential)
    if not a.no_train:
        probes = {}   # system -> [GFLOP/s before, after] its training (speed_probe)

        def train_probed(name: str, begin):
            """Start `name`'s training (begin() returns its job), probing the machine before it when it is the first
            job or the runs are sequential; with --sequential, stop it when its budget is spent and probe again."""
            if a.sequential or not jobs:
                probes[name] = [speed_probe(a.threads) if probing else None]
            jobs.append((*begin(), time.perf_counter()))
            if a.sequential:
                stop_at_budget(jobs[-1:], budget_s)
                probes[name].append(speed_probe(a.threads) if probing else None)

        for system in a.systems:   # a run being replaced loses its record until it has trained
            stale = os.path.join(a.out, system, RECORD)
            if os.path.isfile(stale):
                os.remove(stale)
        for system in ours:
            run_dir = os.path.join(a.out, system)
            # no time or epoch bound of its own: the budget's SIGTERM stops it
            cmd = ["train", "--data", a.data, "--model", system, "--preset", a.preset, "--out", run_dir, "--overwrite",
                   "--max-steps", str(10 ** 9), "--valid-every", str(a.valid_every), "--patience", "0", "--progress",
                   "lines", "--log-every", "50", "--threads", str(a.threads), "--device", a.device,
                   *a.train_args.split()]
            print(f"== {system}: dtmt train for {a.budget} on {a.threads} thread(s)", flush=True)
            train_probed(system, lambda: start(cmd, os.path.join(a.out, f"train_{system}.log"), strict(a.device)))
        for peer in peers:
            onmt_dir = os.path.join(a.out, peer)
            os.makedirs(onmt_dir, exist_ok=True)
            for name in os.listdir(onmt_dir):
                if name.startswith("model_step_") or name == "train.jsonl":
                    os.remove(os.path.join(onmt_dir, name))
            arch = peer.split("-", 1)[1]
            tlog = os.path.join(a.out, f"train_{peer}.log")
            matching = arch == "lstm" and hid is None   # --onmt-size match: the vocabularies first, then the size
            opts = dict(peer_opts[peer], hidden_size=2) if matching else peer_opts[peer]
            cfg = onmt_config(onmt_dir, pieces, train_cfg, opts, arch, a.device)
            run([py, "-m", "onmt.bin.build_vocab", "-config", cfg, "-n_sample", "-1"], tlog, env=onmt_env(a.threads))
            if matching:   # (the vocabularies do not depend on the model's size: the config is written again)
                vs, vt = (onmt_vocab_size(os.path.join(onmt_dir, f"vocab.{side}")) for side in ("src", "tgt"))
                target = dtmt_params_for(ours[0], a.preset, len(pieces["vocabs"][0]), len(pieces["vocabs"][1]))
                hid = matched_lstm_size(target, emb, vs, vt)
                peer_opts[peer]["hidden_size"] = hid
                print(f"   --onmt-size match: {emb},{hid} ({onmt_lstm_params(emb, hid, vs, vt) / 1e6:.2f} M "
                      f"parameters; {ours[0]} {target / 1e6:.2f} M)", flush=True)
                cfg = onmt_config(onmt_dir, pieces, train_cfg, peer_opts[peer], arch, a.device)
            if arch == "lstm":
                peer_sizes[peer] = f"{emb},{hid}"
            # the LSTM on dtmt's schedule; the Transformer on its recipe's own (noam)
            sched = (["--schedule", f"rnmt:{train_cfg['warmup']}:{train_cfg['decay_start']}:"
                                    f"{train_cfg['decay_end']}:0.05"] if arch == "lstm" else [])
            cmd = [py, *strict(a.device), os.path.join(HERE, "peers", "onmt_train.py"), "--log",
                   os.path.join(onmt_dir, "train.jsonl"),
                   *sched, "-config", cfg]
            print(f"== {peer}: OpenNMT-py {ONMT_VERSION} for {a.budget} on {a.threads} thread(s)", flush=True)
            train_probed(peer, lambda: spawn(cmd, tlog, env=onmt_env(a.threads)))
        try:
            if not a.sequential:   # (one after another: each was stopped as it trained)
                stop_at_budget(jobs, budget_s)
        finally:
            for proc, *_ in jobs:
                if proc.poll() is None:
                    proc.kill()
        if not a.sequential:   # all at once: one probe before and one after, shared
            after = speed_probe(a.threads)
            first = next(iter(probes.values()))[0]
            probes = {name: [first, after] for name in a.systems}
        for system in ours:
            write_record(os.path.join(a.out, system), dict(setting, train_args=a.train_args, preset=a.preset,
                                                           device=a.device, probe=probes[system] if probing else None))
        for peer in peers:
            write_record(os.path.join(a.out, peer), dict(setting, onmt_size=peer_sizes[peer], preset=a.preset,
                                                         device=a.device, probe=probes[peer] if probing else None))
        if a.no_eval:
            print(f"trained {', '.join(a.systems)} into {a.out}; tabulate with --no-train")
            return None
    records = {s: read_record(os.path.join(a.out, s)) for s in a.systems}
    trained_on = check_records(records)
    if trained_on is not None:   # the table states this invocation's setting: it must be the runs'
        ref = next(iter(records.values()))
        if (any(ref[k] != setting[k] for k in SAME if k != "machine")
                or (ref.get("preset") or "small") != a.preset):
            raise SystemExit(f"bench_peers: the runs in {a.out} trained with threads={ref['threads']}, budget_s="
                             f"{ref['budget_s']}, sequential={ref['sequential']}, preset "
                             f"{ref.get('preset') or 'small'}: tabulate them with those options")
    # ---- evaluation, one system at a time
    from dtmt_models.data.corpus import corpus_paths

    rows, curves = [], {}
    test_src = pieces["paths"][("test", s_lang)]
    decoded = [] if a.no_decode else a.checkpoints

    def untrained(trained: dict) -> dict:   # a row without the training figures, but with the parameter count
        return dict(dict.fromkeys(trained), params=trained["params"])

    where_to = dict(beam=a.beam, threads=a.threads, log=log, batch=batch, device=a.device)

    def add_rows(name: str, trained: dict, decodes) -> None:
        """The table's rows of one system: one per decoded checkpoint (`decodes`: (rule, row fields)), the training
        figures on the last checkpoint's row, or on a row of their own where the last is not decoded; the parameter
        count on every row."""
        for which, fields in decodes:
            rows.append(dict(system=name, checkpoint=CHECKPOINT_RULES[which], **fields,
                             **(trained if which == "last" else untrained(trained))))
        if "last" not in [which for which, _ in decodes]:
            rows.append(dict(system=name, checkpoint="trained, not decoded", step=trained["updates"], **trained))

    for system in ours:
        run_dir = os.path.join(a.out, system)
        log_rows = read_log(os.path.join(run_dir, "train_log.csv"))
        tr = [r for r in log_rows if r["kind"] == "train"]
        valid = [r for r in log_rows if r["kind"] == "valid"]
        curves[system] = [(int(r["step"]), float(r["wall_s"]), float(r["dev_loss"])) for r in valid]
        if not tr:
            raise SystemExit(f"{system}: {run_dir}/train_log.csv has no training rows (it logs every 50 updates): "
                             f"--budget {a.budget} is too short to measure")
        tokens, updates = dtmt_trained(run_dir, tr)
        cumulative = [int(r["tokens"]) for r in tr]
        cumulative = [sum(cumulative[:i + 1]) for i in range(len(cumulative))]
        have = [os.path.join(run_dir, f"{w}.pt") for w in ("best", "last")]
        trained = {"params": _dtmt_params(next(c for c in have if os.path.isfile(c))), "tok_s": tokens / budget_s,
                   "steady_tok_s": steady_rate([(float(r["wall_s"]), c) for r, c in zip(tr, cumulative)], budget_s),
                   "updates": updates, "tok_update": tokens / updates}
        decodes = []
        for which in decoded:
            ckpt = os.path.join(run_dir, f"{which}.pt")
            hyp = os.path.join(run_dir, f"test_{which}.hyp")
            speed = dtmt_translate(ckpt, corpus_paths(a.data, "test")[0], hyp, **where_to)
            sc = _scores(hyp, os.path.join(run_dir, f"eval_{which}"), a.data, log)
            step = int(read_checkpoint(ckpt)["step"])
            decodes.append((which, {"step": step, "dev_loss": _dev_loss_at(curves[system], step),
                                    "bleu": sc["bleu"], "chrf": sc["chrf"], "translate_s": speed["seconds"],
                                    "sent_s": speed["sentences"] / speed["seconds"]}))
        add_rows(f"`dtmt train --model {system}`", trained, decodes)
        if "best" in decoded and "onmt-transformer" in peers:   # int8 against CTranslate2's int8, after best
            at = next(i for i in range(len(rows) - 1, -1, -1) if rows[i]["checkpoint"] == CHECKPOINT_RULES["best"])
            hyp = os.path.join(run_dir, "test_best_int8.hyp")
            speed = dtmt_translate(os.path.join(run_dir, "best.pt"), corpus_paths(a.data, "test")[0], hyp,
                                   **where_to, extra=["--int8"])
            sc = _scores(hyp, os.path.join(run_dir, "eval_best_int8"), a.data, log)
            rows.insert(at + 1, dict(rows[at], system=f"`dtmt train --model {system}` → `dtmt translate --int8`",
                                     bleu=sc["bleu"], chrf=sc["chrf"], translate_s=speed["seconds"],
                                     sent_s=speed["sentences"] / speed["seconds"]))
    for peer in peers:
        onmt_dir = os.path.join(a.out, peer)
        jl = read_jsonl(os.path.join(onmt_dir, "train.jsonl"))
        ends = [r for r in jl if r["kind"] == "end"]
        if not ends:
            raise RuntimeError(f"OpenNMT-py did not reach its budget; see {os.path.join(a.out, f'train_{peer}.log')}")
        end = ends[-1]
        curves[peer] = [(r["step"], r["wall_s"], r["dev_loss"]) for r in jl if r["kind"] == "valid"]
        with open(os.path.join(a.out, f"train_{peer}.log")) as f:
            m = re.search(r"Trainable parameters = \{'torch.float32': ([0-9]+)", f.read())
        trained = {"params": int(m.group(1)) if m else None, "tok_s": end["tokens"] / budget_s,
                   "steady_tok_s": steady_rate([(r["wall_s"], r["tokens"]) for r in jl
                                                if r["kind"] in ("train", "end")], budget_s),
                   "updates": end["step"], "tok_update": end["tokens"] / end["step"]}
        kept = [c for c in curves[peer] if os.path.isfile(os.path.join(onmt_dir, f"model_step_{c[0]}.pt"))]
        picks = {"best": min(kept, key=lambda c: c[2])[0] if kept else end["step"], "last": end["step"]}
        rec = records.get(peer) or {}
        name = peer_name(peer, rec.get("onmt_size") or peer_sizes[peer])
        decodes = []
        for which in decoded:
            step = picks[which]
            model = os.path.join(onmt_dir, f"model_step_{step}.pt")
            hyp = os.path.join(onmt_dir, f"test_{which}.hyp")
            speed = onmt_translate(py, model, test_src, hyp, vocab=pieces["vocabs"][1], **where_to)
            sc = _scores(hyp, os.path.join(onmt_dir, f"eval_{which}"), a.data, log)
            decodes.append((which, {"step": step, "dev_loss": _dev_loss_at(curves[peer], step),
                                    "bleu": sc["bleu"], "chrf": sc["chrf"], "translate_s": speed["seconds"],
                                    "sent_s": speed["sentences"] / speed["seconds"],
                                    "own_decode_s": speed["decode_seconds"]}))
        add_rows(name, trained, decodes)
        if peer == "onmt-transformer" and "best" in decoded:   # the engine a CPU user would deploy it with
            if a.device != "cpu":
                print("   (CTranslate2 skipped off the CPU: its wheels are built for CUDA 12)", flush=True)
                continue
            step = picks["best"]
            model = os.path.join(onmt_dir, f"model_step_{step}.pt")
            best = next(v for w, v in decodes if w == "best")
            for compute in ("float32", "int8"):
                ct2_dir = os.path.join(onmt_dir, f"ct2-{compute}")
                run([py, os.path.join(HERE, "peers", "ct2_run.py"), "convert-onmt", "--model", model, "--out",
                     ct2_dir, "--quantization", compute], log, env=onmt_env(a.threads))
                for k, (backend, extra) in enumerate(ct2_backends(cpu_vendor())):   # both, as a user would try
                    tag = compute if k == 0 else f"{compute}_other"
                    hyp = os.path.join(onmt_dir, f"test_best_ct2_{tag}.hyp")
                    speed = ct2_translate(py, ct2_dir, test_src, hyp, a.beam, a.threads, compute, log,
                                          pieces["vocabs"][1], batch, extra)
                    sc = _scores(hyp, os.path.join(onmt_dir, f"eval_best_ct2_{tag}"), a.data, log)
                    rows.append(dict(best, **untrained(trained),
                                     system=f"{name} → CTranslate2 {ct2_version(py)} {compute}, {backend}",
                                     checkpoint=CHECKPOINT_RULES["best"], own_decode_s=None, bleu=sc["bleu"],
                                     chrf=sc["chrf"], translate_s=speed["seconds"],
                                     sent_s=speed["sentences"] / speed["seconds"]))
    # ---- tables
    command = "python benchmarks/bench_peers.py " + " ".join(argv if argv is not None else sys.argv[1:])
    fmt = lambda v, spec: "" if v is None else format(v, spec)  # noqa: E731
    together = "trained one after another" if a.sequential else "all training at once"
    where = machine_name()
    if a.device == "cuda":
        where = f"{machine_name('cuda')}; {where}"
    trained_dev = {(r or {}).get("device", "cpu") for r in records.values()}
    if trained_on is not None and (trained_on not in where or trained_dev != {a.device}):
        where = f"trained on {trained_on} ({', '.join(sorted(trained_dev))}); evaluated on {where}"
    batches = f"{batch[0]:,} source subwords" if batch[1] == "tokens" else f"{batch[0]} sentences"
    math = (" (strict: TF32 off for cuBLAS and cuDNN in every process, peers/strict_fp32.py)" if a.device == "cuda"
            else "")
    lines = [f"Equal wall time against OpenNMT-py ({where}; {a.threads} thread(s) per system, "
             f"{together}); {a.budget} from each launch to its stop, everything inside (data reading and batching, "
             f"validation and a checkpoint every {a.valid_every:,} updates on both sides), on {a.data} (dtmt's "
             f"{a.preset} preset; SentencePiece BPE "
             f"{train_cfg['vocab_size']:,} per side, {pieces['paths'][('train', 'n')]:,} training pairs, batches of "
             f"{train_cfg['max_tokens']:,} tokens, lr {train_cfg['lr']:g} with the RNMT+ schedule); test set "
             f"{pieces['paths'][('test', 'n')]:,} sentences, beam {a.beam}, GNMT's length penalty with α 0.6, "
             f"batches of {batches}, float32 unless a row says int8{math}, sacrebleu via `dtmt evaluate`; "
             f"CTranslate2's length penalty is its own (scores over length^0.6), each conversion decoded with both "
             f"of its CPU backends (its default, which it picks by the CPU's vendor, and the other, forced by "
             f"CT2_USE_MKL); decoding one system at a "
             f"time on {a.threads} thread(s), each translator timed by one clock: its process's wall time from launch "
             f"to exit, model loading and everything inside (`dtmt translate` on the raw sources, its SentencePiece "
             f"inside; `onmt_translate` and CTranslate2 on the subwords). Command: `{command}`", "",
             *apart_line(records), *probe_lines(records),
             "Target tokens/s: every target token trained up to the stop over the budget's wall time; in the second "
             "half: the tokens logged between the first and the last log line in the budget's second half over the "
             "wall time between them (start-up behind every toolkit, the same clock).",
             "",
             "| system | checkpoint | params | target tok/s | in the second half | updates | target tokens / update "
             "| its dev loss | test BLEU | chrF | translate s (launch to exit) | sent/s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['system']} | {r['checkpoint']}, update {r['step']:,} | "
                     f"{fmt(r['params'] and r['params'] / 1e6, '.2f')} M | {fmt(r['tok_s'], ',.0f')} | "
                     f"{fmt(r['steady_tok_s'], ',.0f')} | "
                     f"{fmt(r['updates'], ',')} | {fmt(r['tok_update'], ',.0f')} | {fmt(r.get('dev_loss'), '.3f')} | "
                     f"{fmt(r.get('bleu'), '.2f')} | {fmt(r.get('chrf'), '.2f')} | "
                     f"{fmt(r.get('translate_s'), '.1f')} | "
                     f"{fmt(r.get('sent_s'), '.1f')} |")
    own = [r for r in rows if r.get("own_decode_s")]
    if own:
        lines += ["", "OpenNMT-py's own report of its decoding alone (model loading and start-up outside): " +
                  "; ".join(f"{r['checkpoint']}, {r['own_decode_s']:.1f} s" for r in own) + "."]
    steps = sorted({s for c in curves.values() for s, _, _ in c})
    names = list(curves)
    lines += ["", "Dev loss (cross-entropy per target subword, no smoothing) at equal updates (learning per update):",
              "", "| updates | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    for s in steps:
        cells = []
        for n in names:
            hit = [f"{loss:.3f} ({el / 60:.1f} min)" for st, el, loss in curves[n] if st == s]
            cells.append(hit[0] if hit else "")
        lines.append(f"| {s:,} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    with open(os.path.join(a.out, "bench_peers.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(a.out, "bench_peers.json"), "w") as f:
        json.dump({"rows": rows, "curves": curves, "command": command, "machine": machine_name(),
                   "records": records}, f, indent=1)
    _plot(curves, os.path.join(a.out, "bench_peers.png"), a.budget)
    print("\n" + text)
    if a.results:
        with open(os.path.join(HERE, "RESULTS.md"), "a") as f:
            f.write(f"\n## Against OpenNMT-py at equal time, {a.budget} — `{command}`\n\n{text}\n")
    return rows


def profile(a, py, ours, log) -> dict:
    """Times a training update of each system on the same batches (the first --profile-batches of epoch 1 as
    dtmt batches them), one system at a time on --threads threads; prints and writes DIR/profile.md."""
    import torch

    from common import machine_name
    from peers.update_timer import profile_updates

    from dtmt_models.data.batching import collate, token_batches
    from dtmt_models.models.checkpoint import load_model
    from dtmt_models.data.corpus import read_manifest
    from dtmt_models.models.presets import get_preset
    from dtmt_models.training.config import TrainConfig
    from dtmt_models.training.trainer import run_optimizer

    torch.set_num_threads(a.threads)
    pdir = os.path.join(a.out, "pieces")
    manifest = read_manifest(a.data)
    langs = (manifest["src_lang"], manifest["tgt_lang"])
    sides = []
    for lang in langs:
        with open(os.path.join(pdir, f"train.pieces.{lang}"), encoding="utf-8") as f:
            sides.append([line.split() for line in f.read().splitlines()])
    lengths = [(len(s), len(t)) for s, t in zip(*sides)]
    max_tokens = get_preset("dtmt", "small")["train"]["max_tokens"]    # the batches of the equal-time runs
    batches = [list(b) for b in token_batches(lengths, max_tokens, seed=1, epoch=0)[:a.profile_batches]]
    bfile = os.path.join(a.out, "profile_batches.json")
    with open(bfile, "w") as f:
        json.dump({"src": sides[0], "tgt": sides[1], "batches": batches}, f)
    results = {}
    for system in ours:
        model, sv, tv, ckpt = load_model(os.path.join(a.out, system, "last.pt"))
        cfg = ckpt["config"]
        model.train()
        opt = run_optimizer(model, TrainConfig.from_dict(cfg))   # as dtmt train makes it
        data = []
        for idx in batches:
            pairs = [([sv.sp.piece_to_id(x) for x in sides[0][i]], [tv.sp.piece_to_id(x) for x in sides[1][i]])
                     for i in idx]
            data.append(collate(pairs))

        def update(item, timer, model=model, opt=opt, cfg=cfg):
            src, lengths_, prev, target = item
            loss_sum, _nll, ntok = model(src, lengths_, prev, target=target, smoothing=cfg["smoothing"])
            opt.zero_grad(set_to_none=True)
            with timer.phase("backward"):
                (loss_sum / ntok).backward()
            with timer.phase("clip + optimizer"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
                opt.step()
            return int(ntok)

        named = dict(model.named_children())
        parts = {"encoder": [named[k] for k in ("src_embed", "encoder") if k in named],
                 "decoder recurrence": [m for k, m in named.items() if k not in ("src_embed", "encoder", "readout")],
                 # the readout's own modules: training calls its features and logits, not its forward
                 "output layer": [m for m in named["readout"].modules() if not list(m.children())]
                 if "readout" in named else []}
        results[f"dtmt {system}"] = profile_updates(update, data, parts)
        results[f"dtmt {system}"]["params"] = sum(p.numel() for p in model.parameters())
    if py is not None:
        jl = read_jsonl(os.path.join(a.out, "onmt-lstm", "train.jsonl"))
        step = [r for r in jl if r["kind"] == "end"][-1]["step"]
        out = os.path.join(a.out, "profile_onmt.json")
        run([py, os.path.join(HERE, "peers", "onmt_profile.py"), os.path.join(a.out, "onmt-lstm", f"model_step_{step}.pt"),
             bfile, out, "--threads", str(a.threads)], log, env=onmt_env(a.threads))
        with open(out) as f:
            results["OpenNMT-py LSTM"] = json.load(f)
    names = list(results)
    rows = ["| | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names),
            "| parameters | " + " | ".join(f"{results[n]['params'] / 1e6:.2f} M" for n in names) + " |",
            "| target tokens per update | " + " | ".join(f"{results[n]['tokens_per_update']:,.0f}" for n in names) + " |",
            "| **ms per update** | " + " | ".join(f"**{results[n]['ms_per_update']:.0f}**" for n in names) + " |",
            "| target tokens/s | " + " | ".join(f"{results[n]['tokens_per_s']:,.0f}" for n in names) + " |"]
    for n in names:
        r = results[n]
        r["parts_ms"]["loss and the rest of the forward"] = (
            r["ms_per_update"] - sum(r["parts_ms"].values()))
    keys = ["encoder", "decoder recurrence", "output layer", "loss and the rest of the forward", "backward",
            "clip + optimizer"]
    for k in keys:
        rows.append(f"| {k} | " + " | ".join(f"{results[n]['parts_ms'].get(k, float('nan')):.1f}" for n in names) + " |")
    rows.append("| ATen operator calls per update (one update) | " + " | ".join(f"{results[n]['aten_calls']:,}" for n in names) + " |")
    text = [f"Time of one training update on the same {a.profile_batches - 3} batches (after 3 warm-up), "
            f"{machine_name()}, {a.threads} thread(s); ms per update. Command: `python benchmarks/bench_peers.py "
            f"--profile --out {a.out} --threads {a.threads}`. Parts are forward times (forward hooks): encoder = "
            f"source embeddings and encoder; decoder recurrence = target embeddings, initial state and every step's "
            f"recurrent cells and attention (dtmt: query transition, attention, decoder transition; OpenNMT-py: its "
            f"decoder module, 2 LSTM layers with input feeding and global attention); output layer = dtmt's readout "
            f"(features, projection and log-softmax) / OpenNMT-py's generator (projection only, its log-softmax is "
            f"in the loss); loss and the rest = what the forward spends outside them (loss, batch bookkeeping).",
            "", *rows]
    for n in names:
        text += ["", f"Top operators by self time, one update, {n} (name, calls, ms):", ""]
        text += [f"- `{k}` × {c}: {ms:.1f}" for k, c, ms in results[n]["top_ops"]]
    text = "\n".join(text)
    with open(os.path.join(a.out, "profile.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    return results


CHECKPOINT_RULES = {"best": "lowest dev loss", "last": "last"}


TRAINED = "trained.json"   # dtmt_trained's answer, where a carried run has no last.pt


def dtmt_trained(run_dir: str, train_rows: list):
    """(target tokens, updates) a `dtmt train` run trained up to its stop: its log's train rows (`train_rows`, read
    from its train_log.csv), and the window of updates since the last row, which a stop by signal leaves out of the
    log (it stays in last.pt; a folder --carry wrote keeps the two numbers in RUN/trained.json instead)."""
    from dtmt_models.models.checkpoint import read_checkpoint

    path = os.path.join(run_dir, "last.pt")
    if not os.path.isfile(path) and os.path.isfile(os.path.join(run_dir, TRAINED)):
        with open(os.path.join(run_dir, TRAINED)) as f:
            rec = json.load(f)
        return rec["tokens"], rec["updates"]
    last = read_checkpoint(path)
    return sum(int(r["tokens"]) for r in train_rows) + int(last["training"]["log_window"][2]), int(last["step"])


def write_carry(a, log: str, wheels: bool = True) -> dict:
    """--carry DIR: what decoding the runs of --out on a machine without a network needs, in DIR: DIR/peers/ is a
    --out of its own (each run's log, record and --checkpoints, OpenNMT-py's without their optimizer state, a dtmt
    run's trained tokens and updates in trained.json since last.pt stays behind unless asked for; the SentencePiece
    models with the test pieces) and DIR/wheels/ holds OFFLINE_WHEELS for Python OFFLINE_PYTHON (`wheels`: fetch
    them, by pip). Returns {path: bytes} of what it wrote; says so where the whole is over CARRY_LIMIT."""
    import shutil

    import torch

    from bench_quality import read_log

    src, dst = a.out, os.path.join(a.carry, "peers")
    if os.path.realpath(src) == os.path.realpath(a.carry) or os.path.realpath(dst) == os.path.realpath(src):
        raise SystemExit("bench_peers --carry: DIR must not be --out")
    shutil.rmtree(dst, ignore_errors=True)
    os.makedirs(dst)
    small = {"train_log.csv", "config.yaml", RECORD, "train.jsonl", "onmt.yaml", "vocab.src", "vocab.tgt"}
    for system in a.systems:
        run_dir, out = os.path.join(src, system), os.path.join(dst, system)
        if not os.path.isdir(run_dir):
            raise SystemExit(f"bench_peers --carry: no run {run_dir}")
        os.makedirs(out)
        for name in sorted(os.listdir(run_dir)):
            if name in small:
                shutil.copy2(os.path.join(run_dir, name), out)
        tlog = os.path.join(src, f"train_{system}.log")
        if os.path.isfile(tlog):
            shutil.copy2(tlog, dst)
        if system in PEERS:
            jl = read_jsonl(os.path.join(run_dir, "train.jsonl"))
            curve = [(r["step"], r["dev_loss"]) for r in jl if r["kind"] == "valid"
                     and os.path.isfile(os.path.join(run_dir, f"model_step_{r['step']}.pt"))]
            end = [r for r in jl if r["kind"] == "end"][-1]
            steps = {"best": min(curve, key=lambda c: c[1])[0] if curve else end["step"], "last": end["step"]}
            for which in a.checkpoints:
                name = f"model_step_{steps[which]}.pt"
                # OpenNMT-py's own file (argparse options pickled inside): its model without the optimizer
                ck = torch.load(os.path.join(run_dir, name), map_location="cpu", weights_only=False)
                ck.pop("optim", None)
                torch.save(ck, os.path.join(out, name))
        else:
            tokens, updates = dtmt_trained(run_dir, [r for r in read_log(os.path.join(run_dir, "train_log.csv"))
                                                     if r["kind"] == "train"])
            with open(os.path.join(out, TRAINED), "w") as f:
                json.dump({"tokens": tokens, "updates": updates}, f)
            for which in a.checkpoints:
                shutil.copy2(os.path.join(run_dir, f"{which}.pt"), out)
    pdir = os.path.join(src, "pieces")
    if os.path.isfile(os.path.join(pdir, PIECES)):
        with open(os.path.join(pdir, PIECES)) as f:
            rec = json.load(f)
    else:   # pieces written before pieces.json was: described from their files, for the corpus and preset given
        from dtmt_models.data.corpus import read_manifest
        from dtmt_models.models.presets import get_preset

        manifest = read_manifest(a.data)
        cfg = get_preset(next((s for s in a.systems if s not in PEERS), "dtmt"), a.preset)["train"]
        paths = {}
        for split in ("train", "dev", "test"):
            for lang in (manifest["src_lang"], manifest["tgt_lang"]):
                paths[(split, lang)] = os.path.join(pdir, f"{split}.pieces.{lang}")
            with open(paths[(split, manifest["src_lang"])], encoding="utf-8") as f:
                paths[(split, "n")] = sum(1 for _ in f)
        rec = pieces_record(a.data, cfg["vocab_size"], cfg["max_len"], manifest["src_lang"], manifest["tgt_lang"],
                            paths)
    os.makedirs(os.path.join(dst, "pieces"))
    rec["paths"] = [[split, key, v] for split, key, v in rec["paths"] if key == "n" or split == "test"]
    for split, key, v in rec["paths"]:
        if key != "n":
            shutil.copy2(os.path.join(pdir, v), os.path.join(dst, "pieces"))
    for lang in (rec["src_lang"], rec["tgt_lang"]):
        shutil.copy2(os.path.join(pdir, f"spm.{lang}.model"), os.path.join(dst, "pieces"))
    with open(os.path.join(dst, "pieces", PIECES), "w") as f:
        json.dump(rec, f, indent=1)
    if wheels:
        wdir = os.path.join(a.carry, "wheels")
        shutil.rmtree(wdir, ignore_errors=True)
        platforms = [x for tag in ("manylinux_2_28", "manylinux_2_27", "manylinux_2_17", "manylinux2014")
                     for x in ("--platform", f"{tag}_x86_64")]
        run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
             "--only-binary=:all:", "--python-version", OFFLINE_PYTHON, "--implementation", "cp", *platforms,
             "-d", wdir, *OFFLINE_WHEELS], log)
    sizes = {os.path.join(d, n): os.path.getsize(os.path.join(d, n))
             for d, _, names in os.walk(a.carry) for n in names}
    total = sum(sizes.values())
    print(f"carry {a.carry}: {len(sizes)} files, {total / 2 ** 20:.1f} MiB"
          + (f" (over the {CARRY_LIMIT >> 20} MiB a device call carries beside the repository)"
             if total > CARRY_LIMIT else ""))
    return sizes


def dtmt_params_for(system: str, preset: str, src_vocab: int, tgt_vocab: int) -> int:
    """The parameter count of `dtmt train --model SYSTEM --preset PRESET` at these vocabulary sizes (the model built
    on torch's meta device: no memory, no initialisation)."""
    import torch

    import dtmt_models.models.systems  # noqa: F401
    from dtmt_models.models.presets import get_preset
    from dtmt_models.models.registry import build_model

    with torch.device("meta"):
        model = build_model(system, src_vocab, tgt_vocab, **get_preset(system, preset)["model"])
    return sum(p.numel() for p in model.parameters())


def peer_name(peer: str, size: str) -> str:
    """A peer's row name from its size option (onmt_size as trained: EMBED,HIDDEN; the Transformer's five numbers)."""
    if peer == "onmt-lstm":
        dims = "/".join(size.split(",")) if size != "match" else "of the first dtmt system's size"
        return f"OpenNMT-py {ONMT_VERSION} LSTM {dims}, 2+2 layers, input feeding"
    dim, ff, layers, heads, _warmup = size.split(",")
    return f"OpenNMT-py {ONMT_VERSION} Transformer {dim}/{ff}, {layers}+{layers} layers, {heads} heads"


def _dev_loss_at(curve, step: int):
    """The dev loss a curve [(step, wall_s, dev loss)] has at `step` (None where the step was not validated)."""
    return next((loss for s, _, loss in curve if s == step), None)


def stop_at_budget(jobs, budget_s: float) -> None:
    """Sends SIGTERM to each job [(process, command, log, started)] once `budget_s` of wall time has passed since it
    started, and waits for all: both toolkits then finish their update, write a checkpoint and exit (dtmt with
    status 143, the runner of OpenNMT-py with 0). A job that ends before its budget, or with another status, failed."""
    import signal

    signalled = set()
    pending = list(jobs)
    while pending:
        for job in list(pending):
            proc, cmd, log, started = job
            code = proc.poll()
            if code is not None:
                if id(job) not in signalled or code not in (0, 143):
                    raise RuntimeError(f"{' '.join(map(str, cmd[:4]))} ... ended "
                                       f"{'after its stop signal' if id(job) in signalled else 'before its budget'}"
                                       f" (exit {code}); see {log}")
                pending.remove(job)
            elif id(job) not in signalled and time.perf_counter() - started >= budget_s:
                proc.send_signal(signal.SIGTERM)
                signalled.add(id(job))
        time.sleep(0.1)


def _dtmt_params(ckpt: str) -> int:
    from dtmt_models.models.checkpoint import load_model

    return sum(p.numel() for p in load_model(ckpt)[0].parameters())


def _plot(curves: dict, path: str, budget: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, c in curves.items():
        if c:
            steps, secs, losses = zip(*c)
            axes[0].plot(steps, losses, "o-", ms=3, label=name)
            axes[1].plot([x / 60 for x in secs], losses, "o-", ms=3, label=name)
    axes[0].set_xlabel("updates")
    axes[1].set_xlabel("wall time from launch (min)")
    for ax in axes:
        ax.set_ylabel("dev loss (nats per subword)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"dev loss, {budget} each", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
