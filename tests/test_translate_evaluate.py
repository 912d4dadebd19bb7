"""Translation (library and `dtmt translate`) and scoring (library and `dtmt evaluate`) on a tiny checkpoint.

The model is a randomly initialised 16-wide `dtmt` (weights spread out and EOS made less likely so that the
translations are long and differ between sentences); the tests check bookkeeping (order, empty lines,
batching, n-best, files, exit codes) and that every score equals sacrebleu called directly.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import threading

import pytest
import torch
from sacrebleu.metrics import BLEU, CHRF

from conftest import save_model, spread_weights
from dtmt_models import cli
from dtmt_models.models.checkpoint import load_model
from dtmt_models.data.corpus import write_manifest
from dtmt_models.decoding.evaluate import (LengthBucket, bleu_by_length, bucket_labels, corpus_scores,
                                  plot_bleu_by_length)
from dtmt_models.models.registry import build_model
from dtmt_models.data.batching import length_batches
from dtmt_models.decoding.translate import InputError, TruncationWarning, translate, translate_best
from dtmt_models.data.vocabulary import Vocabulary

SRC = ["el perro come pan", "la casa es grande", "el gato duerme en la casa", "yo tengo un libro rojo",
       "ella lee el libro", "nosotros vamos a la playa", "el sol brilla", "la luna es blanca",
       "mi hermano bebe agua", "el niño juega con el perro", "la mujer canta una canción", "el hombre camina",
       "los pájaros vuelan alto", "tu madre cocina arroz", "el tren llega tarde", "hace frío hoy",
       "la puerta está abierta", "el coche es nuevo", "me gusta el café", "ellos trabajan mucho",
       "la ciudad es bonita", "el río es largo", "compramos pan y leche", "la flor es roja",
       "el maestro escribe", "los niños duermen", "abro la ventana", "el perro ladra", "la casa es vieja",
       "tengo un gato negro"]
TGT = ["the dog eats bread", "the house is big", "the cat sleeps in the house", "i have a red book",
       "she reads the book", "we go to the beach", "the sun shines", "the moon is white",
       "my brother drinks water", "the boy plays with the dog", "the woman sings a song", "the man walks",
       "the birds fly high", "your mother cooks rice", "the train arrives late", "it is cold today",
       "the door is open", "the car is new", "i like coffee", "they work a lot", "the city is pretty",
       "the river is long", "we buy bread and milk", "the flower is red", "the teacher writes",
       "the children sleep", "i open the window", "the dog barks", "the house is old", "i have a black cat"]

# translated in most tests: varied lengths, an empty and a blank line, a repeated sentence
INPUTS = ["el perro come pan", "", "la casa es grande y el gato duerme en la casa con el perro", "   ",
          "hace frío", "el perro come pan", "yo tengo un libro rojo y ella lee el libro", "sol"]


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    """(model, src vocab, tgt vocab, checkpoint path)."""
    src_vocab = Vocabulary.train(SRC, vocab_size=60)
    tgt_vocab = Vocabulary.train(TGT, vocab_size=60)
    options = dict(embed_dim=16, hidden_size=16, depth=1, heads=2, dropout=0.0, candidate_dropout=0.0)
    torch.manual_seed(0)
    model = spread_weights(build_model("dtmt", len(src_vocab), len(tgt_vocab), **options))
    path = save_model(tmp_path_factory.mktemp("ckpt") / "tiny.pt", "dtmt", options, src_vocab, tgt_vocab, model)
    return model, src_vocab, tgt_vocab, path


@pytest.fixture(scope="module")
def reference(system):
    """Each input translated on its own (batch of one): what any batching must reproduce."""
    model, sv, tv, _ = system
    return [translate(model, sv, tv, [s], beam=3, nbest=2)[0] for s in INPUTS]


def write(path, text):
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return str(path)


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


# ------------------------------------------------------------------------------------------- translate
def test_length_batches_respect_budget():
    lengths = [3, 9, 1, 4, 4, 12, 2]
    batches = length_batches(lengths, max_tokens=10)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 10
    assert batches[0] == [5]                                # longest first, alone (12 > 10)
    assert [len(b) for b in length_batches(lengths, 1)] == [1] * len(lengths)
    assert length_batches(lengths, 100) == [[5, 1, 3, 4, 0, 6, 2]]
    # --batch-size: at most that many sentences as well, longest first still
    assert length_batches(lengths, 100, max_sentences=3) == [[5, 1, 3], [4, 0, 6], [2]]
    assert length_batches(lengths, 10, max_sentences=2) == [[5], [1], [3, 4], [0, 6], [2]]
    with pytest.raises(ValueError, match="max_sentences must be an integer >= 1 or None, got 0"):
        length_batches(lengths, 100, max_sentences=0)


def test_translate_order_empty_lines_and_batching(system, reference):
    model, sv, tv, _ = system
    batched = translate(model, sv, tv, INPUTS, beam=3, nbest=2)
    tiny = translate(model, sv, tv, INPUTS, beam=3, nbest=2, max_tokens=1)
    pairs = translate(model, sv, tv, INPUTS, beam=3, nbest=2, max_sentences=2)
    assert len(batched) == len(tiny) == len(pairs) == len(INPUTS)
    for got_all, got_tiny, got_pairs, want in zip(batched, tiny, pairs, reference):
        for got in (got_all, got_tiny, got_pairs):
            assert [t for t, _ in got] == [t for t, _ in want]
            assert [s for _, s in got] == pytest.approx([s for _, s in want], abs=2e-5)
    assert batched[1] == [("", 0.0)] and batched[3] == [("", 0.0)]
    # the same sentence twice in one batch: same hypotheses; scores equal up to rounding (rows of a batched
    # GEMM may go through different micro-kernels, so bit-equality is not promised)
    assert [t for t, _ in batched[0]] == [t for t, _ in batched[5]]
    assert [s for _, s in batched[0]] == pytest.approx([s for _, s in batched[5]], abs=2e-5)
    nonempty = [batched[i][0][0] for i in (0, 2, 4, 6, 7)]
    assert all(nonempty) and len(set(nonempty)) >= 3        # real, varied translations


def test_translate_best_nbest_and_model_mode(system):
    model, sv, tv, _ = system
    three = translate(model, sv, tv, INPUTS, beam=4, nbest=3)
    for text, hyps in zip(INPUTS, three):
        if text.strip():
            assert len(hyps) == 3
            scores = [s for _, s in hyps]
            assert scores == sorted(scores, reverse=True) and all(s < 0 for s in scores)
    model.train()                                            # the trainer validates a model in training mode
    try:
        best = translate_best(model, sv, tv, INPUTS, beam=4)
        assert model.training
    finally:
        model.eval()
    assert best == [h[0][0] for h in three]
    # one submodule in training mode (dropout on inside an eval model) is found and decoded in eval mode too, and
    # left in training mode after it
    from dtmt_models.models.modes import any_training

    inner = [m for m in model.modules() if m is not model and len(list(m.parameters()))][-1]
    assert not any_training(model)
    inner.train()
    assert any_training(model) and not model.training
    try:
        assert translate_best(model, sv, tv, INPUTS, beam=4) == best
        assert inner.training and not model.training
    finally:
        model.eval()
    with pytest.raises(ValueError):
        translate(model, sv, tv, INPUTS, beam=2, nbest=3)


def test_decoding_leaves_each_module_in_its_mode_and_searches_in_eval_mode(system):
    """An Ensemble is a fresh nn.Module (training mode) over eval-mode members: translate put every member into
    training mode when it restored the ensemble's (dropout on in later decoding). beam_search on a model in
    training mode decoded with dropout on (a different result each call); now it decodes in eval mode and leaves
    the model as it was."""
    from dtmt_models.decoding.beam_search import beam_search
    from dtmt_models.decoding.ensemble import Ensemble

    model, sv, tv, _ = system
    options = dict(embed_dim=16, hidden_size=16, depth=1, heads=2, dropout=0.5, candidate_dropout=0.5)
    torch.manual_seed(1)
    noisy = spread_weights(build_model("dtmt", len(sv), len(tv), **options)).eval()
    ensemble = Ensemble([model, noisy])
    assert ensemble.training and not model.training and not noisy.training
    want = translate(ensemble, sv, tv, INPUTS[:3], beam=2)
    assert ensemble.training and not model.training and not noisy.training
    assert translate(ensemble, sv, tv, INPUTS[:3], beam=2) == want
    src = torch.tensor([sv.encode("el perro come pan y la casa es grande")])
    lengths = torch.tensor([src.shape[1]])
    evaluated = beam_search(noisy, src, lengths, beam=3, nbest=3, fused=False)
    noisy.train()
    try:
        for _ in range(3):
            got = beam_search(noisy, src, lengths, beam=3, nbest=3, fused=False)
            assert [h.tokens for h in got[0]] == [h.tokens for h in evaluated[0]]
            assert [h.score for h in got[0]] == pytest.approx([h.score for h in evaluated[0]], abs=1e-6)
            assert noisy.training
    finally:
        noisy.eval()


@pytest.mark.parametrize("kwargs, message", [
    (dict(alpha=float("nan")), "alpha must be a finite number"),
    (dict(alpha=float("inf")), "alpha must be a finite number"),
    # past 50 the penalty overflowed float64: the fused search scored all -0.0, the loop raised OverflowError
    (dict(alpha=1000.0), r"alpha must be within \[-50, 50\] \(larger powers overflow float64 at long searches\), "
                         r"got 1000.0"),
    (dict(alpha=-60), r"alpha must be within \[-50, 50\]"),
    (dict(max_len_a=float("inf")), "max_len_a must be a finite number >= 0"),
    (dict(max_len_a=float("nan")), "max_len_a must be a finite number >= 0"),
    (dict(max_len_a=-1.0), "max_len_a must be a finite number >= 0"),
    (dict(max_len_b=-5), "max_len_b must be an integer >= 0"),
    (dict(max_len_b=2.5), "max_len_b must be an integer >= 0"),
    # past int64 it was an OverflowError of the lengths' arithmetic (2^63 - 1 is bounded to the search's steps)
    (dict(max_len_b=2 ** 64), r"max_len_b must be below 2\^63 \(a search takes at most 16,384 steps\), got "
                              "18446744073709551616"),
    (dict(beam=2.5), "beam and nbest must be integers"),
    (dict(beam=True), "beam and nbest must be integers"),   # (it was taken as beam 1)
    (dict(beam=2, nbest=3), "need 1 <= beam <= 1024 and 1 <= nbest <= beam"),
    (dict(beam=1025), "need 1 <= beam <= 1024 "),
    (dict(penalty="wu"), "penalty must be one of gnmt, average, got 'wu'"),
])
def test_search_arguments_are_checked(system, kwargs, message):
    """NaN / inf alpha ranked by NaN scores; an infinite max_len_a overflowed to a negative bound and returned EOS
    only; a fractional beam was a schema error deep in the C++ op."""
    from dtmt_models.decoding.beam_search import beam_search

    model, sv, _, _ = system
    src = torch.tensor([sv.encode("el perro come pan")])
    with pytest.raises(ValueError, match=message):
        beam_search(model, src, torch.tensor([src.shape[1]]), **kwargs)
    with pytest.raises(ValueError, match=message):
        translate(model, sv, sv, ["el perro come pan"], **kwargs)


def test_an_unknown_piece_shows_in_the_translation(system):
    """An UNK the search chooses (only PAD and BOS are banned) shows in the text as SentencePiece writes it
    (" \u2047 ", as fairseq and OpenNMT-py show theirs); PAD, BOS and EOS do not. It was dropped: a translation of
    UNKs came out as an empty line, and n-best entries that differ only in UNKs as the same text."""
    import copy

    from dtmt_models.data.vocabulary import BOS, EOS, PAD, UNK

    model, sv, tv, _ = system
    dog = tv.encode("the dog")
    assert tv.decode([PAD, BOS] + dog + [EOS]) == "the dog"
    assert tv.decode([UNK] + dog) == "\u2047 the dog" and tv.decode(dog + [UNK]) == "the dog \u2047"
    biased = copy.deepcopy(model)
    with torch.no_grad():   # (UNK the likeliest word at every step)
        dict(biased.named_modules())["readout.output.proj"].bias[UNK] += 50.0
    text = translate_best(biased, sv, tv, ["el perro come pan"], beam=2)[0]
    assert text.startswith("\u2047") and set(text.split()) == {"\u2047"}, text


def test_vocabularies_of_another_size_than_the_model_s_are_refused(system):
    """Decoding with a vocabulary the model was not trained with gave fluent nonsense (a target vocabulary of
    another size) or an error deep in the encoder (a source one)."""
    from dtmt_models.decoding.ensemble import Ensemble

    model, sv, tv, _ = system
    other = Vocabulary.train(TGT, vocab_size=45)
    assert len(other) != len(tv) and len(other) != len(sv)
    for m in (model, Ensemble([model, model])):
        with pytest.raises(ValueError, match=f"the target vocabulary has {len(other)} pieces, the model's {len(tv)}"):
            translate(m, sv, other, INPUTS)
        with pytest.raises(ValueError, match=f"the source vocabulary has {len(other)} pieces, the model's {len(sv)}"):
            translate(m, other, tv, INPUTS)


def test_load_model_names_the_file_when_the_weights_or_vocabularies_do_not_fit(system, tmp_path):
    """A checkpoint whose weights are not those of the model its name and options describe is refused in one line
    naming the file, before the model is built. Before, load_state_dict cast a bool, integer or complex weight to
    float32 without a word and the model translated garbage (exit 0), a float64 one silently; a sparse, nested or meta
    weight gave torch's 14 KB dispatch error; options asking for a huge model (hidden_size 50,000 beside weights of
    12) allocated it first (40 GB) and only then found the weights did not fit; weights of the huge model's shapes
    that are expanded views of one value (a 380 KB file) passed the shape checks, took 72 s of finiteness checks and
    then built the 15 GB model (a hostile-input probe, 2026-12-02)."""
    from dtmt_models.models.checkpoint import read_checkpoint

    _, sv, tv, path = system
    ckpt = read_checkpoint(path)
    name = "src_embed.embed.weight"
    w = ckpt["model"][name]

    def weight(value):
        return dict(ckpt, model={**ckpt["model"], name: value})

    with torch.device("meta"):   # (a 3.8-billion-parameter model's weights, each one expanded value: 400 KB a file)
        huge = build_model("dtmt", len(sv), len(tv), **dict(ckpt["model_options"], embed_dim=4096,
                                                            hidden_size=8192)).state_dict()

    cases = {"wrong_weights": (dict(ckpt, model={k: v for k, v in list(ckpt["model"].items())[1:]}),
                               f"(1 weights missing, e.g. ['{next(iter(ckpt['model']))}']; 0 unknown"),
             "unknown_weight": (dict(ckpt, model={**ckpt["model"], 5: torch.zeros(1)}),
                                "(0 weights missing, e.g. []; 1 unknown, e.g. [5])"),
             "wrong_size": (dict(ckpt, model_options=dict(ckpt["model_options"], hidden_size=24)),
                            "its weights do not fit a dtmt model with its options (weight "),
             "huge_options": (dict(ckpt, model_options=dict(ckpt["model_options"], hidden_size=50000)),
                              "its weights do not fit a dtmt model with its options (weight "),
             "bool": (weight(w > 0), f"(weight {name} is torch.bool {list(w.shape)}, the model's torch.float32"),
             "int64": (weight(torch.full(w.shape, 2 ** 62)), f"(weight {name} is torch.int64"),
             "complex": (weight(w.to(torch.complex64)), f"(weight {name} is torch.complex64"),
             "float64": (weight(w.double()), f"(weight {name} is torch.float64"),
             "sparse": (weight(w.to_sparse()), f"(weight {name} is a sparse_coo tensor, not a dense one)"),
             "nested": (weight(torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])),
                        f"(weight {name} is a nested tensor, not a dense one)"),
             "meta": (weight(torch.empty(w.shape, device="meta")), f"(weight {name} is a meta tensor"),
             "expanded": (weight(torch.zeros(1).expand(w.shape)),
                          f"(weight {name} does not hold its elements (4 bytes stored for {w.numel():,} of 4 "
                          f"bytes: strides [0, 0]))"),
             "gaps": (weight(torch.zeros(w.shape[0], 2 * w.shape[1])[:, ::2]), None),   # (a view with gaps: whole)
             "huge_expanded": (dict(ckpt, model_options=dict(ckpt["model_options"], embed_dim=4096, hidden_size=8192),
                                    model={k: torch.zeros(1, dtype=t.dtype).expand(t.shape) for k, t in
                                           huge.items()}), "does not hold its elements ("),
             "not_a_tensor": (weight([1.0, 2.0]), f"(weight {name} is not a tensor (a Python list))"),
             "weights_a_list": (dict(ckpt, model=[w]), "(a list where the weights should be)"),
             "options_a_list": (dict(ckpt, model_options=[1, 2]), "its model cannot be built (its options are a list)"),
             "no_vocab": ({k: v for k, v in ckpt.items() if k != "src_vocab"},
                          "not a translation checkpoint (it has no src_vocab)"),
             "bad_vocab": (dict(ckpt, src_vocab=b"not a sentencepiece model"), "its vocabularies cannot be read"),
             # (it was "Boolean value of Tensor with more than one value is ambiguous", and for None "the
             # SentencePiece model must use pad=0, ...")
             "tensor_vocab": (dict(ckpt, src_vocab=torch.zeros(3)), "its vocabularies cannot be read (Vocabulary: "
                                                                    "expected a SentencePiece model's bytes, got "
                                                                    "Tensor)"),
             "none_vocab": (dict(ckpt, tgt_vocab=None), "got NoneType)"),
             # (a review's: a pad_id other than the vocabularies' was a traceback for a sentence holding that id as
             # a word, never written otherwise; tie_embeddings turned on kept the output matrix of the file's two)
             "pad_id": (dict(ckpt, model_options=dict(ckpt["model_options"], pad_id=4)),
                        "its model's pad_id is 4, but its vocabularies pad with id 0; the file is inconsistent"),
             "tied": (dict(ckpt, model_options=dict(ckpt["model_options"], tie_embeddings=True)),
                      "are one tied weight of the model, but differ in the file)")}
    for case, (payload, message) in cases.items():
        bad = str(tmp_path / f"{case}.pt")
        torch.save(payload, bad)   # (save_checkpoint refuses a payload without its keys)
        if message is None:
            load_model(bad)
            continue
        with pytest.raises(ValueError) as caught:
            load_model(bad)
        text = str(caught.value)
        assert text.startswith(f"{bad}: ") and message in text and "\n" not in text and len(text) < 600, (case, text)


def test_average_refuses_crafted_checkpoints_in_one_line(system, tmp_path, capsys):
    """dtmt average on a payload without weights, weights that are a list or hold a non-tensor gave a KeyError or
    AttributeError traceback; a complex weight was called "the integer tensor ... differs". Each file's weights are
    now checked against the first file's model (the checks load_model makes), in one line naming the file."""
    from dtmt_models.cli.average import main as average
    from dtmt_models.models.checkpoint import read_checkpoint

    _, sv, tv, path = system
    ckpt = read_checkpoint(path)
    name = "src_embed.embed.weight"
    cases = {"no_model": ({k: v for k, v in ckpt.items() if k != "model"}, "not a translation checkpoint (it has no "
                                                                            "model)"),
             "model_list": (dict(ckpt, model=[ckpt["model"][name]]), "(a list where the weights should be)"),
             "non_tensor": (dict(ckpt, model={**ckpt["model"], name: 3}),
                            f"(weight {name} is not a tensor (a Python int))"),
             "complex": (dict(ckpt, model={**ckpt["model"], name: ckpt["model"][name].to(torch.complex64)}),
                         f"(weight {name} is torch.complex64")}
    out = str(tmp_path / "avg.pt")
    for case, (payload, message) in cases.items():
        bad = str(tmp_path / f"{case}.pt")
        torch.save(payload, bad)
        for files in ([path, bad], [bad, path]):
            assert average([*files, "-o", out]) == 2, case
            err = capsys.readouterr().err
            assert err.startswith(f"dtmt average: {bad}: ") and message in err and err.count("\n") == 1, (case, err)
            assert not os.path.exists(out)
    # the same file under another name, a hard link (was "the mean of 2 checkpoints"), counts once
    os.link(path, str(tmp_path / "hard.pt"))
    assert average([path, str(tmp_path / "hard.pt"), "-o", out]) == 2
    assert "is given twice" in capsys.readouterr().err and not os.path.exists(out)
    # a file cut short is not a checkpoint, whatever the reader's error (a 5,000-byte cut was "Invalid argument")
    data = open(path, "rb").read()
    for size in (5000, len(data) // 2, 100):
        cut = tmp_path / f"cut{size}.pt"
        cut.write_bytes(data[:size])
        assert average([path, str(cut), "-o", out]) == 2
        err = capsys.readouterr().err
        assert f"{cut}: not a dtmt checkpoint (not a file torch.save wrote, or a truncated one" in err, err


def test_a_checkpoint_loads_and_translates_in_a_fresh_process(system):
    """load_model builds the checkpoint's model on the meta device first (to compare its weights before anything is
    allocated). A module first imported inside that build made its module-level tensors there: the engine's empty
    tensor for absent arguments became a meta tensor, and every later translation in the process failed; and
    dtmt_kernels' first call of MKL's vector math, made on import so that it runs on one thread (docs/design/
    decoding.md), ran on the meta device, that is not at all. Here, in a process that imports nothing first, a
    checkpoint loads and translates as in this one, that first call runs on the CPU, and no module of the package,
    imported under the meta device, keeps a tensor of that device. The meta build imports no torch._dynamo (a
    normal_ initialisation on the meta device did: 1.3 s and 140 MiB more for every translate, evaluate, serve and
    train process, found by a before / after check of `dtmt translate`'s wall time); nor does check_model_options."""
    _, _, _, path = system
    code = ("import sys, pkgutil, importlib, torch\n"
            "first, exp = [], torch.exp\n"
            "torch.exp = lambda t, *a, **k: first.append(t.device.type) or exp(t, *a, **k)\n"
            "from dtmt_models.models.checkpoint import load_model\n"
            "from dtmt_models.decoding.translate import translate_best\n"
            "m, sv, tv, _ = load_model(sys.argv[1])\n"
            "from dtmt_models.models.registry import check_model_options\n"
            "check_model_options('dtmt', {'embed_dim': 64, 'hidden_size': 64})\n"
            "print(sorted(k for k in sys.modules if k.startswith('torch._dynamo'))[:1])\n"
            "torch.exp = exp\n"
            "print(first[:1])\n"
            "print(translate_best(m, sv, tv, ['el perro come pan'], beam=2)[0])\n"
            "import dtmt_models, dtmt_kernels\n"
            "with torch.device('meta'):\n"
            "    for pkg in (dtmt_models, dtmt_kernels):\n"
            "        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
            "            if not info.name.endswith('__main__'):\n"
            "                importlib.import_module(info.name)\n"
            "print([f'{n}.{k}' for n, mod in list(sys.modules.items()) if n.startswith('dtmt')\n"
            "       for k, v in vars(mod).items() if isinstance(v, torch.Tensor) and v.is_meta])\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # (the package need not be installed)
    done = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert done.returncode == 0, done.stderr[-2000:]
    model, sv, tv, _ = system
    expected = translate_best(model, sv, tv, ["el perro come pan"], beam=2)[0]
    assert done.stdout.splitlines() == ["[]", "['cpu']", expected, "[]"], done.stdout


def test_empty_inputs_never_reach_the_model(system):
    _, sv, tv, _ = system

    class Exploding(torch.nn.Module):
        def encode(self, *args):
            raise AssertionError("the model was called")

    assert translate(Exploding(), sv, tv, ["", "  ", "\t"]) == [[("", 0.0)]] * 3
    assert translate(Exploding(), sv, tv, []) == []


def test_long_source_is_truncated_with_a_warning(system):
    model, sv, tv, _ = system
    long = " ".join(SRC)
    assert len(sv.encode(long)) > 20
    with pytest.warns(TruncationWarning, match="1 of 2"):
        out = translate_best(model, sv, tv, [long, "el sol"], beam=2, max_src_len=20)
    assert len(out) == 2 and out[0]
    with pytest.warns(TruncationWarning):
        again = translate_best(model, sv, tv, [long], beam=2, max_src_len=20, max_tokens=5)
    assert again == out[:1]


def test_input_warnings_reports_its_category_and_shows_other_warnings_once():
    """input_warnings gives back its category's messages, every call, and issues any other warning again once for
    each text and place, as Python shows it outside catch_warnings (where every call showed it again: a library's
    warning at every validation of a training run)."""
    import uuid
    import warnings
    from dtmt_models.decoding.translate import InputWarning, input_warnings

    text = f"a library's note {uuid.uuid4()}"   # (new to this process: what was shown is kept for the process)

    def call():
        warnings.warn("a source was cut", InputWarning)
        warnings.warn(text, UserWarning)
        return 7

    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")
        for _ in range(3):
            assert input_warnings(call) == (7, ["a source was cut"])
    assert [str(w.message) for w in shown] == [text] and shown[0].filename == __file__


def test_source_past_the_transformers_positions_is_truncated_with_a_warning(system):
    """A transformer has positions up to its max_len: a longer source was a ValueError that lost the whole job
    (and an HTTP 500 in serve); it is cut there, with the truncation warning, as max_src_len cuts, alone and in an
    ensemble, and the cut source translates as the same source cut by hand."""
    from dtmt_models.decoding.ensemble import Ensemble

    _, sv, tv, _ = system
    torch.manual_seed(0)
    model = build_model("transformer", len(sv), len(tv), embed_dim=16, hidden_size=32, heads=2, encoder_layers=1,
                        decoder_layers=1, dropout=0.0, max_len=12).eval()
    long = " ".join(SRC)
    assert len(sv.encode(long)) > 12 and model.max_source_steps == 12
    cut = sv.decode(sv.encode(long)[:12])
    assert sv.encode(cut) == sv.encode(long)[:12]
    for decoded in (model, Ensemble([model])):
        with pytest.warns(TruncationWarning, match="1 of 2 source sentence.* truncated to 12"):
            out = translate(decoded, sv, tv, [long, "el sol"], beam=2, nbest=2)
        assert out == translate(decoded, sv, tv, [cut, "el sol"], beam=2, nbest=2)   # (the same scores)
    with pytest.warns(TruncationWarning, match="truncated to 10"):   # (a smaller max_src_len is kept)
        translate_best(model, sv, tv, [long], beam=2, max_src_len=10)


def test_progress_callback(system):
    model, sv, tv, _ = system
    calls = []
    translate(model, sv, tv, INPUTS, beam=2, max_tokens=8, progress=lambda d, t: calls.append((d, t)))
    assert calls[0] == (2, len(INPUTS))                      # the two empty lines are done at once
    assert calls[-1] == (len(INPUTS), len(INPUTS))
    assert [d for d, _ in calls] == sorted(d for d, _ in calls) and len(calls) > 2


def test_cli_translate_files_and_output_dir(system, reference, tmp_path):
    _, _, _, ckpt = system
    a = write(tmp_path / "a.es", "\n".join(INPUTS[:4]) + "\n")
    b = write(tmp_path / "b.es", "\r\n".join(INPUTS[4:]) + "\r\n")       # CRLF line ends
    out = tmp_path / "sub" / "out.en"
    assert cli.main(["translate", "--checkpoint", ckpt, "--beam", "3", "--quiet", a, b, "--output", str(out)]) == 0
    assert read(out) == "".join(r[0][0] + "\n" for r in reference)
    assert not [n for n in os.listdir(out.parent) if ".tmp" in n]
    d = tmp_path / "outs"
    assert cli.main(["translate", "-c", ckpt, "--beam", "3", "--quiet", a, b, "--output-dir", str(d)]) == 0
    assert read(d / "a.es.out") == "".join(r[0][0] + "\n" for r in reference[:4])
    assert read(d / "b.es.out") == "".join(r[0][0] + "\n" for r in reference[4:])


def test_cli_early_stop_reaches_the_search(system, tmp_path, monkeypatch):
    """--early-stop is passed down to beam_search, and only with the flag."""
    import dtmt_models.decoding.translate as translate_module
    _, _, _, ckpt = system
    seen = []
    real = translate_module.beam_search
    monkeypatch.setattr(translate_module, "beam_search", lambda *a, **k: seen.append(k["early_stop"]) or real(*a, **k))
    a = write(tmp_path / "a.es", "\n".join(INPUTS) + "\n")
    for flag in ([], ["--early-stop"]):
        seen.clear()
        out = tmp_path / f"out{len(flag)}.en"
        assert cli.main(["translate", "-c", ckpt, "--beam", "3", "--quiet", *flag, a, "--output", str(out)]) == 0
        assert seen and set(seen) == {bool(flag)}
        assert len(read(out).splitlines()) == len(INPUTS)


def _translate_process(ckpt, *flags):
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "dtmt_models.cli", "translate", "-c", ckpt, "--beam", "3",
                             *flags], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def _line_queue(stream):
    """A queue that a thread fills with the stream's lines as they come, then None at its end."""
    import queue
    import threading

    q = queue.Queue()

    def pump():
        for line in iter(stream.readline, b""):
            q.put(line)
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return q


def test_cli_translate_streams_stdin(system, reference):
    """Reading stdin, a line is translated and written while stdin is still open (not at its end); later lines
    follow in input order; --nbest indices go on counting stdin's lines across the groups."""
    _, _, _, ckpt = system
    proc = _translate_process(ckpt, "--quiet", "--nbest", "2")
    try:
        lines = _line_queue(proc.stdout)
        proc.stdin.write((INPUTS[0] + "\n").encode())
        proc.stdin.flush()
        out = [lines.get(timeout=120) for _ in reference[0]]     # its n-best, before any more input
        proc.stdin.write(("\n".join(INPUTS[1:]) + "\n").encode())
        proc.stdin.close()
        out += iter(lambda: lines.get(timeout=120), None)
        assert proc.wait(timeout=120) == 0, proc.stderr.read().decode()
        assert proc.stderr.read() == b""   # (piped: no prompt for typed lines)
    finally:
        proc.kill()
    lines = [line.split(" ||| ") for line in b"".join(out).decode().splitlines()]
    expected = []
    for i, hyps in enumerate(reference):
        wanted = hyps if INPUTS[i].strip() else [("", 0.0)]
        expected += [(str(i), text) for text, _ in wanted]
    assert [(p[0], p[1]) for p in lines] == expected


def test_cli_translate_asks_a_terminal_for_sentences(system, reference, tmp_path):
    """stdin a terminal: the command says it waits for typed lines (it waited without a word, as if it hung;
    fairseq-interactive asks too), then answers each line; Ctrl-D ends it. Piped stdin gets no such line. With -o
    FILE the lines are translated once Ctrl-D ends them, and it says so (it had waited without a word there)."""
    import subprocess

    _, _, _, ckpt = system
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for flags, said in (([], "type a sentence a line (Ctrl-D ends)"),
                        (["-o", str(tmp_path / "out.en")], "type the sentences, a line each (Ctrl-D ends; they are "
                                                           "translated then)")):
        main_end, typed_end = os.openpty()
        proc = subprocess.Popen([sys.executable, "-m", "dtmt_models.cli", "translate", "-c", ckpt, "--beam", "3",
                                 "--quiet", *flags], stdin=typed_end, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env)
        os.close(typed_end)
        try:
            os.write(main_end, (INPUTS[0] + "\n").encode() + b"\x04")
            out, err = proc.communicate(timeout=120)
        finally:
            proc.kill()
            os.close(main_end)
        if flags:
            out = (tmp_path / "out.en").read_bytes()
        assert proc.returncode == 0 and out.decode() == reference[0][0][0] + "\n", (out, err)
        assert err.decode() == f"dtmt translate: {said}\n"


def test_cli_translate_stream_stops_at_a_bad_line_after_the_lines_before_it(system, reference):
    _, _, _, ckpt = system
    proc = _translate_process(ckpt, "--quiet")
    out, err = proc.communicate((INPUTS[0] + "\n").encode() + b"caf\xe9 ok\n" + b"el gato\n", timeout=120)
    assert proc.returncode == 1
    assert out.decode() == reference[0][0][0] + "\n"
    assert err.decode().strip().startswith("dtmt translate: <stdin>:2: invalid UTF-8")


def test_cli_translate_stdin_and_nbest(system, reference, tmp_path, monkeypatch, capsys):
    _, _, _, ckpt = system
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(INPUTS) + "\n"))
    assert cli.main(["translate", "--checkpoint", ckpt, "--beam", "3", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "".join(r[0][0] + "\n" for r in reference)
    assert captured.err == ""
    # -o - is stdout, as - is stdin (it wrote a file named '-')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(INPUTS) + "\n"))
    assert cli.main(["translate", "--checkpoint", ckpt, "--beam", "3", "--quiet", "-o", "-"]) == 0
    assert capsys.readouterr().out == "".join(r[0][0] + "\n" for r in reference)
    assert not (tmp_path / "-").exists()

    a = write(tmp_path / "a.es", "\n".join(INPUTS[:3]) + "\n")
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(INPUTS[3:]) + "\n"))
    assert cli.main(["translate", "-c", ckpt, "--beam", "3", "--nbest", "2", a, "-"]) == 0
    captured = capsys.readouterr()
    lines = [line.split(" ||| ") for line in captured.out.splitlines()]
    assert all(len(parts) == 4 and parts[2] == f"F0= {parts[3]}" for parts in lines)   # (Moses' four fields)
    expected = []
    # the index counts the output's lines: on from the first input to the second, as one stream (it had restarted
    # at 0 at each input: a merged n-best file named every index twice)
    for offset, chunk in ((0, reference[:3]), (3, reference[3:])):
        for i, hyps in enumerate(chunk):
            wanted = hyps if INPUTS[offset + i].strip() else [("", 0.0)]
            expected += [(str(offset + i), text) for text, _ in wanted]
    assert [(p[0], p[1]) for p in lines] == expected
    b = write(tmp_path / "b.es", "\n".join(INPUTS[3:]) + "\n")   # with --output-dir, each file's from 0
    assert cli.main(["translate", "-c", ckpt, "--beam", "3", "--nbest", "2", "--quiet", "--output-dir",
                     str(tmp_path / "each"), a, b]) == 0
    capsys.readouterr()
    for name, count in (("a.es", 3), ("b.es", len(INPUTS) - 3)):
        found = sorted(os.listdir(tmp_path / "each"))
        written = [f for f in found if f.startswith(name.split(".")[0])]
        assert len(written) == 1, found
        indices = [line.split(" ||| ")[0] for line in read(tmp_path / "each" / written[0]).splitlines()]
        assert sorted(set(indices), key=int) == [str(i) for i in range(count)], (name, indices)
    flat = [h for i, hyps in enumerate(reference) for h in (hyps if INPUTS[i].strip() else [("", 0.0)])]
    assert [float(p[3]) for p in lines] == pytest.approx([s for _, s in flat], abs=1e-4)
    assert "translated 8 sentences" in captured.err                     # summary unless --quiet


def test_cli_translate_ranks_by_the_average_with_length_penalty_average(system, tmp_path, capsys):
    """--length-penalty average (papers 001, 003 and 004: scores "normalized by sentence length"): every hypothesis'
    score is its log-probability per word, EOS counted, and the CLI writes the n-best of beam_search ranked so, in
    that order (the fused search's; its loop is checked against the fused search in test_beam_search.py)."""
    from dtmt_models.decoding.beam_search import beam_search

    model, sv, tv, ckpt = system
    sentences = [s for s in INPUTS if s.strip()]
    expected = []
    for sentence in sentences:
        src = torch.tensor([sv.encode(sentence)])
        hyps = beam_search(model, src, torch.tensor([src.shape[1]]), beam=3, nbest=2, penalty="average")[0]
        assert len(hyps) == 2 and hyps[0].score >= hyps[1].score
        for h in hyps:
            assert h.score == pytest.approx(h.log_prob / (len(h.tokens) + 1), rel=1e-12)
        expected += [(tv.decode(h.tokens), h.score) for h in hyps]
    a = write(tmp_path / "a.es", "\n".join(sentences) + "\n")
    assert cli.main(["translate", "-c", ckpt, "--beam", "3", "--nbest", "2", "--length-penalty", "average",
                     "--quiet", a]) == 0
    lines = [line.split(" ||| ") for line in capsys.readouterr().out.splitlines()]
    assert [p[1] for p in lines] == [text for text, _ in expected]
    assert [float(p[3]) for p in lines] == pytest.approx([score for _, score in expected], abs=1e-4)


def test_dtmt_without_a_command_is_a_usage_error(capsys):
    """`dtmt` alone prints the commands on stderr and exits 2 (argparse's status for a missing argument); asked for
    with --help, on stdout with 0."""
    assert cli.main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "usage: dtmt <command>" in captured.err and "translate" in captured.err
    assert cli.main(["--help"]) == 0 and "usage: dtmt <command>" in capsys.readouterr().out
    # an unknown command: one line, as every other error (the whole usage followed it: 13 lines), with the closest
    assert cli.main(["model"]) == 2
    assert capsys.readouterr().err == ("dtmt: unknown command 'model' (did you mean 'models'?); the commands: prepare, "
                                       "train, translate, evaluate, average, serve, bench, models (dtmt --help)\n")
    assert cli.main(["zzz", "--x"]) == 2 and "(did you mean" not in capsys.readouterr().err


def test_an_input_line_is_refused_only_past_the_limit_its_line_end_not_counted(monkeypatch):
    """MAX_LINE_BYTES bounds a line's text: a line of exactly the limit is read with or without its line end (\\n,
    \\r\\n), one byte more is refused, with file and line."""
    import io

    from dtmt_models.cli import translate as cli_translate

    monkeypatch.setattr(cli_translate, "MAX_LINE_BYTES", 8)
    read = lambda data: list(cli_translate._decoded_lines(io.BytesIO(data), "f"))   # noqa: E731
    assert read(b"12345678\n1234567\r\n12345678\r\n\n12345678") == ["12345678", "1234567", "12345678", "",
                                                                   "12345678"]
    for data in (b"123456789\n", b"ok\n123456789", b"ok\n123456789\r\n", b"ok\n" + b"x" * 50):
        with pytest.raises(InputError, match=r"f:\d: a line of more than 8 bytes; is it a text file\?"):
            read(data)


def test_a_reader_gone_or_stdin_closed_is_one_line_not_a_traceback(system):
    """`dtmt models | head` where head has left: no traceback (BrokenPipeError), nothing on stderr, the status of a
    writer whose reader left (128 + SIGPIPE); `dtmt translate` started with stdin closed and no file: one line,
    exit 2 (it was an AttributeError on None.readline). With stdout closed (`>&-`), `dtmt models` and `dtmt
    translate` without -o say so, exit 2 (the list went nowhere, exit 0; translate decoded all, then an
    AttributeError's traceback); stdout on a full disk is one line, exit 1 (a traceback)."""
    import signal
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    read_end, write_end = os.pipe()
    os.close(read_end)   # (the reader gone before the first write: EPIPE every time, not by timing)
    try:
        r = subprocess.run([sys.executable, "-m", "dtmt_models.cli", "models"], stdout=write_end,
                           stderr=subprocess.PIPE, text=True, env=env, timeout=300)
    finally:
        os.close(write_end)
    assert r.returncode == 128 + signal.SIGPIPE and r.stderr == "", r.stderr
    r = subprocess.run([sys.executable, "-m", "dtmt_models.cli", "models"], stdout=subprocess.DEVNULL,
                       preexec_fn=lambda: os.close(1), stderr=subprocess.PIPE, text=True, env=env, timeout=300)
    assert r.returncode == 2 and r.stderr == "dtmt models: stdout is closed; nowhere to print the list\n", r.stderr
    r = subprocess.run([sys.executable, "-m", "dtmt_models.cli", "--version"], stdout=subprocess.DEVNULL,
                       preexec_fn=lambda: os.close(1), stderr=subprocess.PIPE, text=True, env=env, timeout=300)
    assert r.returncode == 2 and r.stderr == "dtmt --version: stdout is closed; nowhere to print\n", r.stderr
    r = subprocess.run([sys.executable, "-m", "dtmt_models.cli", "translate", "-c", system[3], "-"],
                       input="a b\n", stdout=subprocess.DEVNULL, preexec_fn=lambda: os.close(1),
                       stderr=subprocess.PIPE, text=True, env=env, timeout=300)
    assert r.returncode == 2 and r.stderr == ("dtmt translate: no --output given and stdout is closed; name a file "
                                              "to write with -o\n"), r.stderr
    if os.path.exists("/dev/full"):
        with open("/dev/full", "w") as full:
            r = subprocess.run([sys.executable, "-m", "dtmt_models.cli", "models"], stdout=full,
                               stderr=subprocess.PIPE, text=True, env=env, timeout=300)
        assert r.returncode == 1 and r.stderr == "dtmt models: No space left on device\n", r.stderr
    r = subprocess.run([sys.executable, "-m", "dtmt_models.cli", "translate", "-c", system[3]], stdin=None,
                       preexec_fn=lambda: os.close(0), capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and r.stderr == ("dtmt translate: no input file given and stdin is closed; name the "
                                              "files to translate\n"), r.stderr


def test_streaming_ends_in_one_line_on_ctrl_c_and_quietly_when_the_reader_leaves(system, tmp_path):
    """Stdin to stdout with stdin still open: Ctrl-C is `interrupted`, exit 130, and a reader of stdout gone is
    quiet with a writer's status (128 + SIGPIPE). The first aborted the interpreter at its exit ("Fatal Python error:
    _enter_buffered_busy", exit 134: the reader thread held stdin's lock), the second said "cannot write the output
    (stdout: Broken pipe)", exit 1. A file translated to a reader that leaves part-way (`| head -c 10`) ended with
    status 0, the rest of the output dropped unsaid."""
    import signal

    for leave in ("interrupt", "reader"):
        proc = _translate_process(system[3])
        try:
            proc.stdin.write((INPUTS[0] + "\n").encode())
            proc.stdin.flush()
            assert proc.stdout.readline()   # its translation, stdin still open
            if leave == "interrupt":
                proc.send_signal(signal.SIGINT)
                status = proc.wait(timeout=120)
                assert (status, proc.stderr.read().decode()) == (130, "dtmt translate: interrupted\n")
            else:
                proc.stdout.close()
                proc.stdin.write((INPUTS[2] + "\n").encode())
                proc.stdin.flush()
                status = proc.wait(timeout=120)
                assert (status, proc.stderr.read().decode()) == (128 + signal.SIGPIPE, "")
        finally:
            proc.kill()
    many = tmp_path / "many.es"
    write(many, "\n".join(INPUTS * 300) + "\n")   # some 250 KB of 3-best lines: past a pipe's 64 KiB
    proc = _translate_process(system[3], "--quiet", "--nbest", "3", str(many))
    proc.stdin.close()
    assert len(proc.stdout.read(10)) == 10
    proc.stdout.close()
    try:
        assert (proc.wait(timeout=300), proc.stderr.read().decode()) == (128 + signal.SIGPIPE, "")
    finally:
        proc.kill()


def test_version_is_the_installed_one(capsys):
    """`dtmt --version` (and -V) says the installed distribution's version, pyproject.toml's (it was 'unknown
    command'); the usage names it."""
    import re as regex
    from importlib import metadata

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), encoding="utf-8") as f:
        declared = regex.search(r'^version = "([^"]+)"', f.read(), regex.M).group(1)
    for flag in ("--version", "-V"):
        assert cli.main([flag]) == 0
        assert capsys.readouterr().out == f"dtmt {metadata.version('dtmt')}\n" == f"dtmt {declared}\n"
    assert cli.main(["--help"]) == 0 and "dtmt --version" in capsys.readouterr().out


def test_an_output_folder_that_cannot_be_written_is_refused_before_decoding(system, tmp_path, capsys, monkeypatch):
    """`translate -o D/out.txt` where D cannot be written (no permission, a read-only file system) decoded the whole
    input and failed only at the write; now it is refused first, one line, exit 2, nothing decoded (errors.
    check_output_file / check_output_dir ask os.access of the nearest existing folder). /dev/null stays writable."""
    import dtmt_models.errors as errors

    _, _, _, ckpt = system
    good = write(tmp_path / "good.es", "\n".join(INPUTS) + "\n")
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(errors.os, "access", lambda p, mode: real_access(p, mode) and os.fspath(p) != str(locked))
    for args, option in ((["-o", str(locked / "out.txt")], "--output"), (["-o", str(locked / "new" / "out.txt")],
                                                                        "--output"),
                         (["--output-dir", str(locked / "outs")], "--output-dir")):
        assert cli.main(["translate", "--checkpoint", ckpt, good, *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"dtmt translate: {option} {args[1]}: {locked} cannot be written"), err
        assert err.count("\n") == 1 and "translated" not in err
    assert cli.main(["translate", "--checkpoint", ckpt, "--quiet", good, "-o", os.devnull]) == 0
    capsys.readouterr()
    # a link is written through: the folder that must be writable is its target's (a link into a locked folder
    # passed the check, then failed after decoding)
    (tmp_path / "link.txt").symlink_to(locked / "out.txt")
    assert cli.main(["translate", "--checkpoint", ckpt, good, "-o", str(tmp_path / "link.txt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dtmt translate: --output {tmp_path / 'link.txt'}: {locked} cannot be written"), err
    # a FIFO is written in place, its reader reading as it comes (the checkpoint check opened it to read: a hang)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, encoding="utf-8").read()), daemon=True)
    reader.start()
    assert cli.main(["translate", "--checkpoint", ckpt, "--quiet", good, "-o", str(fifo)]) == 0
    reader.join(timeout=60)
    assert len(got[0].splitlines()) == len(INPUTS)


@pytest.mark.parametrize("argv,message", [
    (["train", "--data", "d", "--lr", "abc"], "dtmt train: argument --lr: invalid float value: 'abc'"),
    (["translate", "--beam", "abc"], "dtmt translate: argument --beam: invalid int value: 'abc'"),
    (["evaluate", "--max-len-a"], "dtmt evaluate: argument --max-len-a: expected one argument"),
    (["average", "--last", "x"], "dtmt average: argument --last: invalid int value: 'x'"),
    (["models", "--table", "foo"], "dtmt models: argument --table: invalid choice: 'foo'"),
    (["train", "--data", "d", "--no-such-flag"], "dtmt train: unrecognized arguments: --no-such-flag"),
    (["prepare", "files", "--vocab-size", "x"], "dtmt prepare files: argument --vocab-size: invalid int value"),
    (["prepare", "nothing"], "dtmt prepare: argument {bible,files,binarize}: invalid choice: 'nothing'"),
    (["serve", "-c", "x.pt", "--port", "http"], "dtmt serve: argument --port: invalid int value: 'http'"),
    # an empty value (an unset variable's "$OUT"): train's --out "" had written runs/dtmt; prepare failed "writing "
    (["train", "--data", "d", "--out", ""], "dtmt train: --out: an empty value (an unset variable?)"),
    (["prepare", "files", "--src", "a", "--tgt", "b", "--out", ""],
     "dtmt prepare files: --out: an empty value (an unset variable?)"),
    (["translate", "-c", "m.pt", "a.txt", ""], "dtmt translate: FILE: an empty value (an unset variable?)"),
    (["evaluate", "-c", ""], "dtmt evaluate: --checkpoint: an empty value"),
    (["average", "a.pt", "-o", ""], "dtmt average: --output: an empty value")])
def test_a_malformed_command_line_is_one_line(argv, message, capsys):
    """What argparse itself refuses (a value of the wrong type, a missing value, an unknown option or subcommand)
    is one line, `dtmt <command>: message`, exit status 2, as the commands' own checks are (contract §6; it printed
    argparse's usage text first, 10-18 lines); --help still prints the usage."""
    def status(args):
        try:
            return cli.main(args)
        except SystemExit as ended:   # (argparse's exit; prepare returns the status itself)
            return ended.code

    assert status(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(message), captured.err
    assert captured.err.endswith("(--help: the options)\n") and captured.err.count("\n") == 1
    assert status([argv[0], "--help"]) == 0 and capsys.readouterr().out.startswith(f"usage: dtmt {argv[0]}")


@pytest.mark.parametrize("command", ["translate", "train", "evaluate", "average", "serve"])
def test_a_command_s_help_on_a_full_disk_says_so(command, monkeypatch, capsys):
    """`dtmt translate --help > /dev/full` exited 0 with nothing written (argparse's exit passed the flush that
    `dtmt --help > /dev/full` goes through): one line, exit 1."""
    with open("/dev/full", "w") as full:
        monkeypatch.setattr(sys, "stdout", full)
        assert cli.main([command, "--help"]) == 1
        monkeypatch.undo()
    assert capsys.readouterr().err == f"dtmt {command}: No space left on device\n"


def test_cli_translate_reads_a_pipe(system, tmp_path, capsys):
    """An input that is a named pipe (as `<(zcat x.gz)` gives) is read like a file: the checks made before any
    work refuse folders and missing paths only."""
    import threading

    _, _, _, ckpt = system
    fifo = str(tmp_path / "pipe")
    os.mkfifo(fifo)

    def feed():
        with open(fifo, "w") as f:   # (blocks until the command opens the pipe: a refusal would leave it waiting)
            f.write("el sol\n")
    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    assert cli.main(["translate", "--quiet", "-c", ckpt, fifo]) == 0, capsys.readouterr().err
    writer.join(timeout=60)
    piped = capsys.readouterr().out
    assert cli.main(["translate", "--quiet", "-c", ckpt, write(tmp_path / "file.es", "el sol\n")]) == 0
    assert piped == capsys.readouterr().out and piped.count("\n") == 1


def test_the_python_api_refuses_what_the_command_refuses(system):
    """translate() and load_model() as the command line: a sentence that is not a string (None was an
    AttributeError on .strip) or not valid Unicode, early_stop not a bool (a multi-line error from the op's schema),
    max_len_a = max_len_b = 0 (every translation "", score -6.35, where the command refuses it), batch bounds that
    are not whole numbers, an unknown device (torch's message after the whole checkpoint was read); each one line
    naming the argument."""
    from dtmt_models.models.checkpoint import load_model

    model, sv, tv, ckpt = system
    for kwargs, error, message in (
            (dict(sentences=["el sol", None]), TypeError, "must be strings, got NoneType at 1"),
            (dict(sentences=["el sol"], early_stop="no"), TypeError, "early_stop must be True or False, got 'no'"),
            (dict(sentences=["el sol"], max_len_a=0, max_len_b=0), ValueError, "a bound below its least, 2"),
            # (the bound counts EOS: 1 had been EOS alone, every translation empty, without a word)
            (dict(sentences=["el sol"], max_len_a=0, max_len_b=1), ValueError,
             r"max_len_a = 0, max_len_b = 1: a bound below its least, 2 \(a word and the end-of-sentence token"),
            # a lone surrogate: SentencePiece's "Unable to cast Python instance of type str" (the server refused it)
            (dict(sentences=["el sol", "el \ud800 perro"]), ValueError,
             r"sentence 1 \(0-based\) is not valid Unicode"),
            # batch bounds not whole numbers: a TypeError of a comparison or a slice, or 1.5 / 2.5 taken
            (dict(sentences=["el sol"], max_tokens=None), ValueError, "max_tokens must be >= 1, a whole number, got N"),
            (dict(sentences=["el sol"], max_tokens=1.5), ValueError, "max_tokens must be >= 1, a whole number, got 1."),
            (dict(sentences=["el sol"], max_sentences=2.5), ValueError, "max_sentences must be >= 1 or None, a whole"),
            (dict(sentences=["el sol"], max_src_len=2.5), ValueError, "max_src_len must be >= 1 or None, a whole"),
            (dict(sentences=["el sol"], max_tokens=True), ValueError, "max_tokens must be >= 1, a whole number"),
            # sentences not in a sequence: a dict translated its keys, a set in no order; a generator failed on len()
            # once used up, None was "'NoneType' object is not iterable"
            *[(dict(sentences=bad), TypeError, rf"^translate: `sentences` must be a sequence of strings \(a list\), "
               rf"got {type(bad).__name__}$") for bad in ({"el sol": 1}, {"el sol"}, (s for s in ["el sol"]), None)]):
        with pytest.raises(error, match=message) as info:
            translate(model, sv, tv, **kwargs)
        assert "\n" not in str(info.value)
    from dtmt_models.decoding.ensemble import Ensemble

    # an ensemble of a generator had used it up in its checks (no member: a KeyError at the search); a member that is
    # no model failed in sorting the vocabulary sizes
    assert len(Ensemble(m for m in [model, model]).members) == 2
    with pytest.raises(TypeError, match=r"^Ensemble: model 2 is a NoneType, not a model \(a torch.nn.Module"):
        Ensemble([model, None])
    # a decoder given as the model (beam_search takes one): an AttributeError on .parameters before
    with pytest.raises(TypeError, match=r"^translate: FusedRNMTDecoder has no parameters to take the device from: "
                                        r"give device=, or pass the model itself"):
        translate(model.inference_decoder(), sv, tv, ["el sol"])
    assert translate(model.inference_decoder(), sv, tv, ["el sol"], device="cpu") == translate(model, sv, tv,
                                                                                               ["el sol"])
    with pytest.raises(ValueError, match="load_model: device 'foo' is not a device torch knows"):
        load_model(ckpt, device="foo")
    with pytest.raises(ValueError, match="^translate: device 'bogus' is not a device torch knows"):   # (torch's
        translate(model, sv, tv, ["el sol"], device="bogus")                                      # own error)
    # switches and numbers given as what they are not: a string was truthy (int8="no" built an int8 decoder, fused="no"
    # searched fused), a bool was taken as 1
    from dtmt_models.decoding.beam_search import beam_search
    from dtmt_models.engine.decoder import as_decoder

    with pytest.raises(TypeError, match=r"^as_decoder: int8 must be True or False, got 'no'$"):
        as_decoder(model, int8="no")
    with pytest.raises(TypeError, match=r"\.inference_decoder\(\): int8 must be True or False, got 'no'$"):
        model.inference_decoder(int8="no")
    src, lengths = torch.tensor([[5, 6]]), torch.tensor([2])
    with pytest.raises(TypeError, match=r"^fused must be True or False and on_device True, False or None, got "
                                        r"fused='no', on_device=None$"):
        beam_search(model, src, lengths, fused="no")
    for bad in (dict(alpha=True), dict(max_len_a=True), dict(max_len_b=True)):
        with pytest.raises(ValueError, match=f"^{next(iter(bad))} must be"):
            translate(model, sv, tv, ["el sol"], **bad)
    for device in ("mps", "xla"):   # (torch's RuntimeError "not linked with support", not a ValueError)
        with pytest.raises(ValueError, match=f"^translate: device '{device}': dtmt runs on the CPU or a CUDA device"):
            translate(model, sv, tv, ["el sol"], device=device)
        with pytest.raises(ValueError, match=f"^load_model: device '{device}': dtmt runs on the CPU or a CUDA"):
            load_model(ckpt, device=device)
    import dtmt_kernels as dk
    missing = next((b for b in ("cuda", "triton") if b not in dk.available_backends()), None)
    if missing is not None:   # (accepted, and the first translation said it cannot run)
        with pytest.raises(ValueError, match=f"^load_model: backend '{missing}' is not available: "):
            load_model(ckpt, backend=missing)
        with pytest.raises(ValueError, match=f"^backend '{missing}' is not available: "):   # (taken, and the
            model.set_backend(missing)                                                  # first translation refused)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0   # (a device past this machine's: before
    with pytest.raises(ValueError, match=rf"load_model: device 'cuda:{count}': this machine has "):   # the file)
        load_model(os.devnull, device=f"cuda:{count}")
    with pytest.raises(ValueError, match=rf"^translate: device 'cuda:{count}': this machine has "):   # (torch's
        translate(model, sv, tv, ["el sol"], device=f"cuda:{count}")          # AssertionError on a CPU-only torch)
    assert translate(model, sv, tv, ["el sol"], max_len_a=0, max_len_b=2)[0][0][0] is not None


def test_a_wide_beam_decodes_fewer_sentences_a_batch_and_memory_runs_out_in_one_line(system, tmp_path, capsys,
                                                                                       monkeypatch):
    """--max-tokens counts source subwords only: short lines at a wide beam made batches of 1,000 sentences whose
    step scores took 5 GB (a review measured it). A batch holds no more sentences than keep sentences x beam x
    target words within MAX_STEP_SCORES, and the translations are the same; running out of memory is one line
    naming the options that make batches smaller (the CPU allocator's traceback before)."""
    from dtmt_models.decoding import translate as tr

    model, sv, tv, ckpt = system
    sentences = ["el sol", "la casa", "el perro", "un libro", "la luna"] * 3
    whole = translate(model, sv, tv, sentences, beam=3)
    seen = []
    search = tr.beam_search
    monkeypatch.setattr(tr, "beam_search", lambda decoder, src, *a, **k: seen.append(len(src)) or search(
        decoder, src, *a, **k))
    monkeypatch.setattr(tr, "MAX_STEP_SCORES", 4 * 3 * len(tv))   # (room for 4 sentences at beam 3)
    def same(results):   # (the texts; the scores up to the rounding of other batch shapes)
        return all([t for t, _ in a] == [t for t, _ in b] and all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a, b))
                   for a, b in zip(results, whole))

    assert same(translate(model, sv, tv, sentences, beam=3)) and max(seen) == 4 and sum(seen) == 15
    seen.clear()
    assert same(translate(model, sv, tv, sentences, beam=3, max_sentences=2)) and max(seen) == 2

    def no_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 5368709120 bytes")

    monkeypatch.setattr(tr, "beam_search", no_memory)
    src = write(tmp_path / "in.es", "\n".join(sentences) + "\n")
    capsys.readouterr()
    assert cli.main(["translate", "-c", ckpt, src, "-o", str(tmp_path / "out.en")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dtmt translate: out of memory ([enforce fail at alloc_cpu.cpp:127] ") and err.endswith(
        "; decode smaller batches: a lower --max-tokens or --batch-size, or a narrower --beam\n"), err
    assert err.count("\n") == 1 and not (tmp_path / "out.en").exists()


def test_cli_translate_errors(system, tmp_path, capsys):
    from dtmt_models.errors import check_output_file

    _, _, _, ckpt = system
    good = write(tmp_path / "good.es", "el sol\n")
    bad = tmp_path / "bad.es"
    bad.write_bytes(b"el sol\nla \xff luna\n")
    utf16 = tmp_path / "utf16.es"   # (translated into three lines for its two, exit 0: a NUL byte is refused)
    utf16.write_bytes("el sol\nla luna\n".encode("utf-16-le"))
    foreign = write(tmp_path / "foreign.pt", "not a checkpoint\n")
    before = good_text = open(good).read()
    os.makedirs(tmp_path / "od")
    named_out = str(tmp_path / "od" / "good.es.out")   # a checkpoint where --output-dir would write good.es's lines
    shutil.copyfile(ckpt, named_out)
    other_run = str(tmp_path / "run" / "last.pt")   # a checkpoint translate does not read
    os.makedirs(os.path.dirname(other_run))
    shutil.copyfile(ckpt, other_run)
    checkpoint_bytes = open(ckpt, "rb").read()
    # (arguments, exit status: 2 an option that cannot work (contract §6), 1 what the data refused; message)
    cases = [
        (["--checkpoint", str(tmp_path / "missing.pt"), good], 2, "--checkpoint " + str(tmp_path / "missing.pt") +
         ": no such checkpoint file"),
        (["--checkpoint", str(tmp_path), good], 2, "is a directory, not a checkpoint file"),
        (["--checkpoint", os.devnull, good], 2, f"--checkpoint {os.devnull}: not a regular file, not a checkpoint"),
        (["--checkpoint", foreign, good], 2, "foreign.pt: not a dtmt checkpoint (not a file torch.save wrote"),
        (["--checkpoint", ckpt, str(bad)], 1, "bad.es:2: invalid UTF-8"),
        (["--checkpoint", ckpt, str(utf16)], 1, "utf16.es:1: a NUL byte at byte 1 of the line; is it a text file in "
                                                "UTF-8 (not UTF-16)?"),
        (["--checkpoint", ckpt, str(tmp_path / "nope.es")], 2, "nope.es: no such input file"),
        (["--checkpoint", ckpt, str(tmp_path)], 2, "is a directory, not an input file"),
        (["--checkpoint", ckpt, "--beam", "2", "--nbest", "3", good], 2, "--nbest"),
        (["--checkpoint", ckpt, "--max-tokens", "0", good], 2, "--max-tokens"),
        (["--checkpoint", ckpt, "--batch-size", "0", good], 2,
         "--batch-size 0: must be an integer in [1, 2,147,483,647]"),
        (["--checkpoint", ckpt, "--max-len-a", "nan", good], 2, "--max-len-a nan: must be a finite number >= 0"),
        (["--checkpoint", ckpt, "--max-len-a", "inf", good], 2, "--max-len-a inf: must be a finite number >= 0"),
        (["--checkpoint", ckpt, "--max-len-a", "0", "--max-len-b", "0", good], 2, "a bound below its least, 2"),
        (["--checkpoint", ckpt, "--max-len-a", "0", "--max-len-b", "1", good], 2,
         "--max-len-a 0 --max-len-b 1: a bound below its least, 2 (a word and the end-of-sentence token, which the "
         "bound counts); give --max-len-b >= 2"),
        (["--checkpoint", ckpt, "--alpha", "nan", good], 2, "--alpha nan: must be a finite number"),
        # (the library's bound: a traceback from translate(), exit 1, before the command checked it)
        (["--checkpoint", ckpt, "--alpha", "100", good], 2, "--alpha 100: must be a finite number >= -50 and <= 50"),
        (["--checkpoint", ckpt, "--length-penalty", "average", "--alpha", "0.6", good], 2,
         "--alpha 0.6: the gnmt length penalty's exponent; --length-penalty average has none"),
        (["--checkpoint", ckpt, "--threads", "-1", good], 2, "--threads -1: must be an integer in [0, 1,024]"),
        # (--threads 100000 crashed the process; an integer past int64 was a traceback)
        (["--checkpoint", ckpt, "--threads", "100000", good], 2,
         "--threads 100000: must be an integer in [0, 1,024]"),
        (["--checkpoint", ckpt, "--max-len-b", str(10 ** 20), good], 2,
         f"--max-len-b {10 ** 20}: must be an integer in [0, 2,147,483,647]"),
        (["--checkpoint", ckpt, "--max-src-len", str(2 ** 31), good], 2,
         "--max-src-len 2147483648: must be an integer in [1, 2,147,483,647]"),
        (["--checkpoint", ckpt, "--int8", "--backend", "reference", good], 2, "--int8 decodes with the C++ decoder"),
        (["--checkpoint", ckpt, "--amp", "bf16", good], 2, "--amp bf16 decodes in 16 bits on the GPU (--device cuda)"),
        (["--checkpoint", ckpt, good, good, "--output-dir", str(tmp_path / "o")], 2, "good.es.out"),
        (["--checkpoint", ckpt, good, "--output-dir", good], 2, "--output-dir " + good + ": exists and is not a dir"),
        (["--checkpoint", ckpt, good, "-o", str(tmp_path)], 2, "is a directory; give a file name"),
        (["--checkpoint", ckpt, good, "-o", good], 2, "is also an input (" + good + "); the output would "
                                                      "overwrite it"),
        (["--checkpoint", ckpt, good, "-o", os.path.join(good, "x.txt")], 2, good + " is a file, not a directory"),
        # (the checkpoint read is an input too: -o over it wrote the translation there, exit 0)
        (["--checkpoint", ckpt, good, "-o", ckpt], 2, "is also an input (" + ckpt + "); the output would overwrite"),
        (["--checkpoint", named_out, good, "--output-dir", os.path.dirname(named_out)], 2,
         f"is also an input ({named_out}); the output would overwrite it"),
        # (nor any other checkpoint: -o over another run's last.pt replaced its training state with text, exit 0)
        (["--checkpoint", ckpt, good, "-o", other_run], 2, f"--output {other_run}: is a checkpoint (a zip archive); "
                                                           "the text output would replace it"),
        (["--checkpoint", ckpt, good, "--output-dir", os.path.dirname(named_out)], 2,
         f"{named_out}: is a checkpoint (a zip archive)"),
        (["--checkpoint", ckpt, good, "--output-dir", str(tmp_path / "taken")], 2,
         f"--output-dir {tmp_path / 'taken'}: {tmp_path / 'taken' / 'good.es.out'}, where the translation of {good} "
         "would go, is a directory"),
    ]
    if os.path.exists("/dev/zero"):   # (a stream without line ends was read without end: 8.7 GB in 7 s)
        cases.append((["--checkpoint", ckpt, "/dev/zero"], 1, "/dev/zero:1: a line of more than 16,777,216 bytes; is "
                                                              "it a text file?"))
    os.makedirs(tmp_path / "taken" / "good.es.out")
    for args, status, message in cases:
        assert cli.main(["translate", "--quiet"] + args) == status, args
        err = capsys.readouterr().err
        assert err.startswith("dtmt translate: ") and message in err, (args, err)
        assert err.count("\n") == 1 and "Traceback" not in err and "translated" not in err
    # standard input redirected from the output's file (`translate -o f < f`, with "-" or no input named) is an input
    # too: the translations replaced the source text, exit 0
    saved = os.dup(0)
    try:
        with open(good, "rb") as f:
            os.dup2(f.fileno(), 0)
        for named in ([], ["-"]):
            assert cli.main(["translate", "--quiet", "--checkpoint", ckpt, *named, "-o", good]) == 2
            err = capsys.readouterr().err
            assert err == (f"dtmt translate: --output {good}: is also the input (standard input reads it); the output "
                           f"would overwrite it\n"), err
        read_end, write_end = os.pipe()   # (stdin a pipe, or /dev/null: no file of its own, nothing refused)
        for source in (read_end, os.open(os.devnull, os.O_RDONLY)):
            os.dup2(source, 0)
            os.close(source)
            check_output_file(good, "--output", ["-"])
        os.close(write_end)
    finally:
        os.dup2(saved, 0)
        os.close(saved)
    assert not (tmp_path / "o").exists() and open(good).read() == before == good_text
    assert open(ckpt, "rb").read() == checkpoint_bytes == open(named_out, "rb").read() == open(other_run, "rb").read()
    assert cli.main(["translate", good]) == 2   # argparse's usage error, status 2 (its exit taken as the status)
    capsys.readouterr()
    for command in (["translate", good], ["evaluate", "--src", good, "--ref", good]):   # -c twice: an ensemble
        assert cli.main(command + ["--quiet", "-c", ckpt, "-c", foreign]) == 2         # of both, not "the last"
        err = capsys.readouterr().err
        assert err.startswith(f"dtmt {command[0]}: ") and "foreign.pt" in err and err.count("\n") == 1, err


def test_mostly_unknown_source_is_flagged(system, capsys, tmp_path):
    """A source the vocabulary does not know gets a warning (the model would still emit a fluent sentence)."""
    from dtmt_models.cli.common import decode_with_report
    from dtmt_models.decoding.translate import UnknownPiecesWarning

    model, sv, tv, ckpt = system
    alien = "\u0416\u0417\u0418 \u0419\u041a\u041b \u041c\u041d"      # Cyrillic: not in the toy vocabulary
    assert sum(t == 1 for t in sv.encode(alien)) == 3                 # three unknown pieces, three word boundaries
    with pytest.warns(UnknownPiecesWarning, match=r"1 of 2 .*\(sentence 2\)"):
        translate_best(model, sv, tv, ["el sol", alien], beam=2)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownPiecesWarning)           # a known sentence: no warning
        translate_best(model, sv, tv, ["el sol"], beam=2)
    decode_with_report("dtmt translate", True, model, sv, tv, [alien], beam=2)
    assert capsys.readouterr().err.startswith("dtmt translate: warning: 1 of 1 source sentence(s) are mostly")
    # the command names each by file and line, counted in its own file (they were counted over all the inputs)
    # and, reading stdin, from stdin's first line (they were counted in the group of lines decoded together)
    first, second = tmp_path / "first.es", tmp_path / "second.es"
    first.write_text("el sol\nla casa\n", encoding="utf-8")
    second.write_text(f"el sol\n{alien}\n", encoding="utf-8")
    assert cli.main(["translate", "-c", ckpt, "--quiet", "--beam", "2", str(first), str(second)]) == 0
    assert (f"dtmt translate: warning: 1 source sentence(s) are mostly pieces unknown to the model's source "
            f"vocabulary ({second}:2): their") in capsys.readouterr().err
    proc = _translate_process(ckpt, "--quiet")
    out, err = proc.communicate(("el sol\n" * 3 + alien + "\n").encode(), timeout=120)
    assert proc.returncode == 0 and len(out.splitlines()) == 4
    assert "(<stdin>:4): their translations are guesses" in err.decode(), err


# -------------------------------------------------------------------------------------------- scores
HYPS = ["the dog eats the bread", "a house is big", "the cat sleeps in a house", "i have one red book",
        "she reads the book", "we went to the beach today"]
REFS = ["the dog eats bread", "the house is big", "the cat sleeps in the house", "i have a red book",
        "she reads the book", "we go to the beach"]


def test_corpus_scores_match_sacrebleu():
    scores = corpus_scores(HYPS, REFS)
    bleu, chrf = BLEU(), CHRF()
    assert scores["bleu"] == pytest.approx(bleu.corpus_score(HYPS, [REFS]).score)
    assert scores["chrf"] == pytest.approx(chrf.corpus_score(HYPS, [REFS]).score)
    assert 0 < scores["bleu"] < 100 and 0 < scores["chrf"] < 100
    assert scores["bleu_signature"] == str(bleu.get_signature()) and "tok:13a" in scores["bleu_signature"]
    assert scores["chrf_signature"] == str(chrf.get_signature())
    assert scores["sentences"] == 6 and scores["bleu_detail"]["ref_len"] == sum(len(r.split()) for r in REFS)
    same = corpus_scores(REFS, REFS)
    assert same["bleu"] == pytest.approx(100.0) and same["chrf"] == pytest.approx(100.0)
    assert corpus_scores(["x y z"], ["a b c"])["bleu"] == pytest.approx(0.0)
    with pytest.raises(ValueError):
        corpus_scores(HYPS, REFS[:-1])
    with pytest.raises(ValueError):
        corpus_scores([], [])


def test_bleu_is_tokenised_for_the_target_language():
    """BLEU of Chinese, Japanese or Korean text takes sacrebleu's tokenizer for the language, as `sacrebleu -l
    xx-zh` does: 13a read a Chinese sentence as one word (BLEU 0 where sacrebleu gives about 80), for dev BLEU and
    --best-by bleu too. Without the Japanese tokenizer's extras, characters, said in a warning and the signature."""
    import warnings

    hyps, refs = ["我们今天去公园散步。", "他喜欢读书。"], ["我们今天去公园散步了。", "他很喜欢读书。"]
    zh = corpus_scores(hyps, refs, "zh")
    assert zh["bleu"] == pytest.approx(BLEU(trg_lang="zh").corpus_score(hyps, [refs]).score) and zh["bleu"] > 30
    assert "tok:zh" in zh["bleu_signature"] and corpus_scores(hyps, refs)["bleu"] < 1   # (13a: one word each)
    assert corpus_scores(HYPS, REFS, "en") == corpus_scores(HYPS, REFS)
    rows = bleu_by_length(["a b", "c"], hyps, refs, tgt_lang="zh-Hans")
    assert rows[0].bleu == pytest.approx(zh["bleu"])
    try:
        BLEU(trg_lang="ja")
        pytest.skip("sacrebleu's Japanese extras are installed here")
    except RuntimeError:
        pass
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        ja = corpus_scores(["今日は公園に行きました"], ["今日は公園に行った"], "ja")
    assert "tok:char" in ja["bleu_signature"] and ja["bleu"] > 0
    assert [str(w.message) for w in said] == ["BLEU of ja text: sacrebleu's ja-mecab tokenizer needs `pip install "
                                              "sacrebleu[ja]`; scored with character tokenisation (tok:char) instead"]


def test_bleu_by_length_buckets():
    words = lambda n: " ".join(f"w{i}" for i in range(n))         # noqa: E731
    lengths = [3, 10, 11, 20, 25, 60, 1]
    sources = [words(n) for n in lengths]
    refs = ["the dog eats bread", "the house is big", "the cat sleeps in the house", "i have a red book",
            "she reads the book", "we go to the beach", "it is cold today"]
    hyps = ["the dog eats bread", "a house is big", "the cat sleeps in a house", "i have one red book",
            "she reads a book", "we go to the beach now", "it is cold"]
    rows = bleu_by_length(sources, hyps, refs)
    assert [r.label for r in rows] == ["1-10", "11-20", "21-30", "31-40", "41-50", "51+"]
    assert [r.sentences for r in rows] == [3, 2, 1, 0, 0, 1]
    members = [[0, 1, 6], [2, 3], [4], [], [], [5]]
    for row, idx in zip(rows, members):
        if idx:
            want = BLEU().corpus_score([hyps[i] for i in idx], [[refs[i] for i in idx]]).score
            assert row.bleu == pytest.approx(want)
        else:
            assert row.bleu is None
    assert rows[-1].bleu == pytest.approx(BLEU().corpus_score([hyps[5]], [[refs[5]]]).score)
    # explicit lengths (e.g. subwords) override the word counts
    by_tokens = bleu_by_length(sources, hyps, refs, bounds=(5, 15), src_tokens=[1, 6, 6, 16, 16, 16, 5])
    assert [(r.label, r.sentences) for r in by_tokens] == [("1-5", 2), ("6-15", 2), ("16+", 3)]
    assert bucket_labels((1, 2, 10)) == ["1", "2", "3-10", "11+"]
    with pytest.raises(ValueError):
        bleu_by_length(sources, hyps, refs, bounds=(10, 10))


def test_plot_bleu_by_length(tmp_path):
    rows = [LengthBucket("1-10", 3, 25.0), LengthBucket("11-20", 0, None), LengthBucket("21+", 2, 12.5)]
    path = plot_bleu_by_length(rows, str(tmp_path / "plot.png"), "tiny")
    assert path == str(tmp_path / "plot.png")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(tmp_path) == ["plot.png"]


# ------------------------------------------------------------------------------------------ evaluate
@pytest.fixture()
def corpus(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    src, ref = SRC[:10], TGT[:10]
    write(d / "test.es", "\n".join(src) + "\n")
    write(d / "test.en", "\n".join(ref) + "\n")
    write_manifest(str(d), "es", "en", {"test": len(src)}, origin="test")
    return str(d), src, ref


def test_cli_evaluate_refuses_a_model_of_another_language_pair(system, corpus, tmp_path, capsys):
    """A checkpoint that `dtmt train` wrote records its corpus' languages ("langs"); `evaluate --data` of another
    pair (en to es scored with an es-to-en model) is refused in one line, exit 2, nothing decoded or written (it
    scored it, exit 0). A checkpoint of the same pair, or one without the record or with a record that is no pair
    (a crafted 5 was a TypeError's traceback), is scored as before."""
    from dtmt_models.models.checkpoint import read_checkpoint, save_checkpoint

    data, _, _ = corpus
    for langs, status in ((("en", "es"), 2), (("es", "en"), 0), (5, 0)):
        ckpt = read_checkpoint(system[3])
        name = "-".join(langs) if isinstance(langs, tuple) else str(langs)
        path = str(tmp_path / f"{name}.pt")
        save_checkpoint(path, {**ckpt, "langs": langs})
        out_dir = tmp_path / f"scored-{name}"
        assert cli.main(["evaluate", "-c", path, "--data", data, "--beam", "1", "--quiet", "--out-dir",
                         str(out_dir)]) == status
        err = capsys.readouterr().err
        if status == 2:
            assert err == f"dtmt evaluate: --checkpoint {path} translates en to es, but --data {data} is es to en\n"
            assert not out_dir.exists()
        else:
            assert (out_dir / "scores.json").is_file()


def test_cli_evaluate_writes_everything(system, corpus, tmp_path, capsys):
    model, sv, tv, ckpt = system
    data, src, ref = corpus
    assert cli.main(["evaluate", "--checkpoint", ckpt, "--data", data, "--beam", "2", "--quiet"]) == 0
    out_dir = os.path.join(os.path.dirname(ckpt), "tiny.test")          # default: <ckpt stem>.<split>
    assert sorted(os.listdir(out_dir)) == ["bleu_by_length.csv", "bleu_by_length.png", "hyp.txt", "scores.json"]
    hyps = read(os.path.join(out_dir, "hyp.txt")).split("\n")[:-1]
    assert hyps == translate_best(model, sv, tv, src, beam=2)
    report = json.loads(read(os.path.join(out_dir, "scores.json")))
    expected = corpus_scores(hyps, ref)
    for key in ("bleu", "chrf", "bleu_signature", "chrf_signature", "sentences"):
        assert report[key] == pytest.approx(expected[key]) if isinstance(expected[key], float) else \
            report[key] == expected[key]
    rows = bleu_by_length(src, hyps, ref)
    assert report["by_length"] == [r._asdict() for r in rows]
    assert report["settings"]["beam"] == 2 and report["settings"]["split"] == "test"
    assert report["decode"]["seconds"] >= 0 and report["decode"]["sentences_per_s"] > 0
    csv_lines = read(os.path.join(out_dir, "bleu_by_length.csv")).splitlines()
    assert csv_lines[0] == "bucket,sentences,bleu" and csv_lines[1].startswith("1-10,10,")
    assert csv_lines[2] == "11-20,0,"
    stdout = capsys.readouterr().out
    assert f"BLEU {expected['bleu']:.2f}" in stdout and "1-10" in stdout


def test_cli_evaluate_writes_its_results_as_one_set(corpus, tmp_path, capsys, monkeypatch):
    """The results are renamed into place only once all are written: a failure midway (a full disk) had left one
    run's files beside another's (this hyp.txt, the last run's scores.json), and a rerun without matplotlib left
    the last run's plot beside new scores; a file name of bytes that are not UTF-8 was a traceback at scores.json,
    after hyp.txt had been replaced."""
    import errno

    from dtmt_models.cli import evaluate as cli_evaluate

    data, src, ref = corpus
    hyps = list(ref)
    hyps[0] = "the dog"
    hyp_file = write(tmp_path / "system.out", "\n".join(hyps) + "\n")
    out = tmp_path / "scored"
    assert cli.main(["evaluate", "--hyp", hyp_file, "--data", data, "--out-dir", str(out)]) == 0
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    assert sorted(before) == ["bleu_by_length.csv", "bleu_by_length.png", "scores.json"]
    write(tmp_path / "system.out", "\n".join(ref) + "\n")   # (another translation, scored again)

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cli_evaluate, "plot_bleu_by_length", full_disk)
    capsys.readouterr()
    assert cli.main(["evaluate", "--hyp", hyp_file, "--data", data, "--out-dir", str(out)]) == 1
    assert "No space left on device" in capsys.readouterr().err
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before   # (nothing new, nothing stray)
    monkeypatch.setattr(cli_evaluate, "plot_bleu_by_length", lambda *args: None)   # (as without matplotlib)
    assert cli.main(["evaluate", "--hyp", hyp_file, "--data", data, "--out-dir", str(out)]) == 0
    assert sorted(os.listdir(out)) == ["bleu_by_length.csv", "scores.json"]
    assert json.loads(read(out / "scores.json"))["bleu"] == pytest.approx(100.0)
    odd = os.fsdecode(os.path.join(os.fsencode(str(tmp_path)), b"\xfd.out"))   # (a name that is not UTF-8)
    shutil.copyfile(hyp_file, odd)
    monkeypatch.undo()   # (the plot drawn again: its title names the file)
    capsys.readouterr()
    assert cli.main(["evaluate", "--hyp", odd, "--data", data]) == 0   # (its default folder is named after it)
    folder = odd[:-len(".out")] + ".test"
    assert json.loads(read(os.path.join(folder, "scores.json")))["settings"]["hyp"] == os.path.join(str(tmp_path),
                                                                                                   "\ufffd.out")
    assert capsys.readouterr().out.endswith(f"wrote {tmp_path}{os.sep}\ufffd.test{os.sep}{{scores.json,"
                                            f"bleu_by_length.csv,bleu_by_length.png}}\n")


def test_cli_evaluate_scores_a_test_set_with_empty_lines(system, corpus, tmp_path, capsys, monkeypatch):
    """An empty line is a sentence, translated as an empty line (dtmt translate) and scored as one (sacrebleu, the
    other toolkits): a --src / --ref pair holding one was refused ("empty line", exit 1), with and without --hyp."""
    model, sv, tv, ckpt = system
    _, src, ref = corpus
    src, ref = [src[0], "", *src[1:4]], [ref[0], "", *ref[1:4]]
    s, r = write(tmp_path / "e.es", "\n".join(src) + "\n"), write(tmp_path / "e.en", "\n".join(ref) + "\n")
    out = tmp_path / "scored"
    assert cli.main(["evaluate", "-c", ckpt, "--src", s, "--ref", r, "--beam", "2", "--quiet", "--out-dir",
                     str(out)]) == 0, capsys.readouterr().err
    hyps = read(out / "hyp.txt").split("\n")[:-1]
    assert hyps == translate_best(model, sv, tv, src, beam=2) and hyps[1] == ""
    report = json.loads(read(out / "scores.json"))
    assert report["bleu"] == pytest.approx(corpus_scores(hyps, ref)["bleu"]) and report["settings"]["tgt_lang"] is None
    from dtmt_models.models.checkpoint import read_checkpoint, save_checkpoint   # (a checkpoint that names its
    save_checkpoint(str(tmp_path / "zh.pt"), {**read_checkpoint(ckpt), "langs": ["es", "zh"]})   # languages)
    assert cli.main(["evaluate", "-c", str(tmp_path / "zh.pt"), "--src", s, "--ref", r, "--beam", "2", "--quiet",
                     "--out-dir", str(tmp_path / "zh")]) == 0, capsys.readouterr().err
    report = json.loads(read(tmp_path / "zh" / "scores.json"))
    assert report["settings"]["tgt_lang"] == "zh" and "tok:zh" in report["bleu_signature"]
    # files named by language the other way round from the checkpoint's (e.es, e.en against es -> zh): said
    assert (f"dtmt evaluate: warning: --checkpoint {tmp_path / 'zh.pt'} translates es to zh, but --src and --ref end "
            f"in .es and .en; do they hold its languages?") in capsys.readouterr().err
    # ... but not of files named otherwise (.src / .ref are no languages)
    shutil.copyfile(s, tmp_path / "e.src")
    shutil.copyfile(r, tmp_path / "e.ref")
    assert cli.main(["evaluate", "-c", str(tmp_path / "zh.pt"), "--src", str(tmp_path / "e.src"), "--ref",
                     str(tmp_path / "e.ref"), "--beam", "2", "--quiet", "--out-dir", str(tmp_path / "named")]) == 0
    assert "warning" not in capsys.readouterr().err
    assert cli.main(["evaluate", "--hyp", str(out / "hyp.txt"), "--src", s, "--ref", r, "--out-dir",
                     str(tmp_path / "again")]) == 0
    assert json.loads(read(tmp_path / "again" / "scores.json"))["bleu"] == pytest.approx(
        corpus_scores(hyps, ref)["bleu"])
    # --hyp into the folder of a checkpoint's run: refused before anything is written, the run's hyp.txt and scores
    # kept (its scores would have stood beside another file's scores; then that hyp.txt was removed, the run's
    # translations lost: a review's, a hyp.txt post-processed into another file and scored into the same folder); a
    # hyp.txt no model's run wrote, or that is an input, stays (--ref D/hyp.txt --out-dir D had deleted the reference)
    write(tmp_path / "mine.txt", "".join(line + "\n" for line in ref))
    shutil.copytree(out, tmp_path / "scored_copy")
    shutil.copytree(out, tmp_path / "moved")   # (a run's results folder moved: its scores.json names the old place)
    for folder in (tmp_path / "moved", out):
        kept = {name: (folder / name).read_bytes() for name in os.listdir(folder)}
        capsys.readouterr()
        assert cli.main(["evaluate", "--hyp", str(tmp_path / "mine.txt"), "--src", s, "--ref", r, "--out-dir",
                         str(folder)]) == 2
        assert (f"--out-dir {folder} holds hyp.txt, the translations a model's run scored there; the scores of --hyp "
                f"{tmp_path / 'mine.txt'} would replace theirs beside it: give another --out-dir (or move "
                f"{folder / 'hyp.txt'} away first)") in capsys.readouterr().err
        assert {name: (folder / name).read_bytes() for name in os.listdir(folder)} == kept
    out = tmp_path / "scored_copy"   # (its hyp.txt scored in place: it stays, and is the user's from then on)
    assert cli.main(["evaluate", "--hyp", str(out / "hyp.txt"), "--src", s, "--ref", r, "--out-dir", str(out)]) == 0
    assert cli.main(["evaluate", "--hyp", str(tmp_path / "mine.txt"), "--src", s, "--ref", r, "--out-dir",
                     str(out)]) == 0
    assert read(out / "hyp.txt").split("\n")[:-1] == hyps
    users = tmp_path / "users"
    users.mkdir()
    write(users / "hyp.txt", read(r))   # the reference, as the folder's hyp.txt
    assert cli.main(["evaluate", "--hyp", str(tmp_path / "mine.txt"), "--src", s, "--ref", str(users / "hyp.txt"),
                     "--out-dir", str(users)]) == 0
    assert read(users / "hyp.txt") == read(r)
    capsys.readouterr()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"one line\n")))
    assert cli.main(["evaluate", "--hyp", "-", "--src", s, "--ref", r, "--out-dir", str(tmp_path / "stdin")]) == 1
    assert capsys.readouterr().err == (f"dtmt evaluate: stdin has 1 lines but {r} has {len(ref)}; they must be "
                                       f"aligned\n")
    # started with stdin or stdout closed (`<&-`, `>&-`): AttributeError tracebacks, the second after the results
    # were written; one line, exit 2, nothing written
    for stream, message in (("stdin", "--hyp - reads stdin, which is closed; name the file of translations"),
                            ("stdout", "stdout is closed; the scores are printed there (run with > FILE to keep "
                                       "them)")):
        with monkeypatch.context() as m:
            m.setattr(sys, stream, None)
            assert cli.main(["evaluate", "--hyp", "-", "--src", s, "--ref", r, "--out-dir",
                             str(tmp_path / "closed")]) == 2
        assert capsys.readouterr().err == f"dtmt evaluate: {message}\n" and not (tmp_path / "closed").exists()
    # --ref as a pipe: "parallel corpus: 1 problem(s)", exit 1, naming no option; now a usage error naming it
    read_end, write_end = os.pipe()
    try:
        fifo = f"/dev/fd/{read_end}"
        assert cli.main(["evaluate", "--hyp", str(tmp_path / "mine.txt"), "--src", s, "--ref", fifo, "--out-dir",
                         str(tmp_path / "pipe")]) == 2
    finally:
        os.close(read_end)
        os.close(write_end)
    assert capsys.readouterr().err == (f"dtmt evaluate: --ref {fifo}: not a regular file (a pipe or a device); give a "
                                       f"file (--hyp alone may be a pipe)\n")


def test_cli_decoding_threads(system, corpus, tmp_path, capsys):
    """--threads sets the threads decoding runs on (translate, evaluate), and scores.json records them."""
    _, _, _, ckpt = system
    data, src, _ = corpus
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert cli.main(["evaluate", "-c", ckpt, "--data", data, "--threads", "1", "--quiet",
                         "--out-dir", str(tmp_path / "e")]) == 0
        assert torch.get_num_threads() == 1
        assert json.loads(read(tmp_path / "e" / "scores.json"))["settings"]["threads"] == 1
        source = write(tmp_path / "in.es", src[0] + "\n")
        torch.set_num_threads(2)
        assert cli.main(["translate", "-c", ckpt, "--threads", "1", "--quiet", source,
                         "--output", str(tmp_path / "out.en")]) == 0
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        assert cli.main(["translate", "-c", ckpt, "--quiet", source, "--output", str(tmp_path / "out.en")]) == 0
        assert torch.get_num_threads() == 2                              # 0 (the default) leaves them alone
    finally:
        torch.set_num_threads(before)
    capsys.readouterr()


def test_cli_evaluate_hyp_mode(corpus, tmp_path, capsys, monkeypatch):
    data, src, ref = corpus
    hyps = list(ref)
    hyps[0], hyps[3] = "the dog eats", ""
    hyp_file = write(tmp_path / "system.out", "\n".join(hyps) + "\n")
    s, r = write(tmp_path / "x.es", "\n".join(src) + "\n"), write(tmp_path / "x.en", "\n".join(ref) + "\n")
    out_dir = tmp_path / "scored"
    assert cli.main(["evaluate", "--hyp", hyp_file, "--src", s, "--ref", r, "--out-dir", str(out_dir)]) == 0
    assert sorted(os.listdir(out_dir)) == ["bleu_by_length.csv", "bleu_by_length.png", "scores.json"]
    report = json.loads(read(out_dir / "scores.json"))
    assert report["bleu"] == pytest.approx(corpus_scores(hyps, ref)["bleu"]) and report["bleu"] < 100
    assert report["decode"] is None and report["settings"]["hyp"] == hyp_file
    # default directory next to the hypothesis file, named after the split
    assert cli.main(["evaluate", "--hyp", hyp_file, "--data", data]) == 0
    assert os.path.isfile(tmp_path / "system.test" / "scores.json")
    assert "warning" not in capsys.readouterr().err
    # a corpus whose manifest no longer counts its files (edited by hand): scored on the files, said so
    write_manifest(data, "es", "en", {"test": 99999}, origin="test")
    assert cli.main(["evaluate", "--hyp", hyp_file, "--data", data, "--out-dir", str(tmp_path / "edited")]) == 0
    assert (f"dtmt evaluate: warning: {data}: its corpus.json lists 99,999 test pairs, its files hold 10; scored on "
            f"the files") in capsys.readouterr().err
    # --hyp - reads standard input (sacrebleu's way: `... | dtmt evaluate --hyp -`), line by line; it needs --out-dir
    import io

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(("\n".join(hyps) + "\n").encode())))
    assert cli.main(["evaluate", "--hyp", "-", "--src", s, "--ref", r, "--out-dir", str(tmp_path / "piped")]) == 0
    piped = json.loads(read(tmp_path / "piped" / "scores.json"))
    assert piped["bleu"] == report["bleu"] and piped["hyp_file"] == "<stdin>"
    assert cli.main(["evaluate", "--hyp", "-", "--src", s, "--ref", r]) == 2
    assert capsys.readouterr().err.endswith("--hyp - reads standard input, which has no folder for the results: give "
                                            "--out-dir\n")
    assert cli.main(["evaluate", "--hyp", "/dev/stdin", "--src", s, "--ref", r]) == 2   # (it wrote /dev/stdin.s/)
    assert "--hyp /dev/stdin reads a pipe or a device, which has no folder" in capsys.readouterr().err
    # the references' language: --tgt-lang, else the corpus's (en here: 13a)
    assert json.loads(read(tmp_path / "edited" / "scores.json"))["settings"]["tgt_lang"] == "en"
    assert cli.main(["evaluate", "--hyp", hyp_file, "--src", s, "--ref", r, "--out-dir", str(tmp_path / "zh"),
                     "--tgt-lang", "zh"]) == 0
    report = json.loads(read(tmp_path / "zh" / "scores.json"))
    assert "tok:zh" in report["bleu_signature"] and report["settings"]["tgt_lang"] == "zh"


def test_cli_evaluate_errors(system, corpus, tmp_path, capsys):
    _, _, _, ckpt = system
    data, src, ref = corpus
    short = write(tmp_path / "short.out", "one line\n")
    cases = [   # (arguments, exit status: 2 an option that cannot work, 1 what the data refused; message)
        (["--data", data], 2, "--checkpoint"),
        (["--checkpoint", ckpt], 2, "--data"),
        (["--hyp", short, "--data", data], 1, "short.out has 1 lines"),
        (["--checkpoint", ckpt, "--data", data, "--split", "dev"], 2, "--split dev: "),
        (["--checkpoint", ckpt, "--data", str(tmp_path)], 2, "corpus.json"),
        (["--checkpoint", str(tmp_path / "none.pt"), "--data", data], 2, "none.pt: no such checkpoint file"),
        (["--hyp", short, "--src", short, "--ref", str(tmp_path / "nope.en")], 2, "--ref " + str(tmp_path) +
         "/nope.en: no such file"),
        (["--hyp", str(tmp_path / "nope.out"), "--data", data], 2, "--hyp " + str(tmp_path / "nope.out")),
        # with --hyp nothing is decoded: an option of the decoding is refused, not taken and ignored (--amp on the
        # CPU was refused as needing a GPU for a decoding that does not happen)
        (["--hyp", short, "--data", data, "--amp", "bf16", "--beam", "5", "--int8"], 2,
         "--hyp scores a translation already made, and nothing is decoded: leave out --beam 5, --int8, --amp bf16"),
        # ... a default's value as well (--beam 4, --device cpu, --amp off were taken and ignored)
        (["--hyp", short, "--data", data, "--beam", "4", "--device", "cpu", "--amp", "off"], 2,
         "nothing is decoded: leave out --beam 4, --device cpu, --amp off"),
        (["--hyp", short, "--data", data, "--max-len-a=2"], 2, "nothing is decoded: leave out --max-len-a 2.0"),
        (["--hyp", short], 2, "--src F --ref G (--hyp needs the source beside it"),
        # one of --src and --ref: the other named (the general advice had not said which was missing)
        (["--hyp", short, "--ref", short], 2, "--ref needs --src beside it (or give --data DIR [--split test] "
         "instead)"),
        (["--checkpoint", ckpt, "--src", short], 2, "--src needs --ref beside it"),
        # a checkpoint beside --hyp was not used, but its results folder took the scores as its model's
        (["--hyp", short, "--data", data, "--checkpoint", ckpt], 2, "--hyp scores a translation already made, and "
         f"no model is used: leave out --checkpoint {ckpt} (name the results folder with --out-dir)"),
        (["--checkpoint", ckpt, "--data", data, "--threads", "-2"], 2,
         "--threads -2: must be an integer in [0, 1,024]"),
        (["--checkpoint", ckpt, "--data", data, "--bounds", "10,5"], 2, "--bounds: expected increasing"),
        (["--checkpoint", ckpt, "--data", data, "--out-dir", short], 2, "--out-dir " + short + ": exists and is not"),
        # --split with --src and --ref (it was ignored); a results folder of a name longer than a file name may be
        # (it decoded everything, then could not write)
        (["--hyp", short, "--src", short, "--ref", short, "--split", "dev"], 2, "--split dev: a split of --data"),
        (["--hyp", short, "--src", short, "--ref", short, "--out-dir", str(tmp_path / ("d" * 300))], 2,
         "is longer than the 255 bytes a name may have here"),
        # the default folder (next to --hyp, named after it and the split) is the --hyp file itself
        (["--hyp", str(tmp_path / "clash.test"), "--data", data], 2, "the results folder (default; set it with "
                                                                       "--out-dir)"),
    ]
    # a result file that is an input: the source as D/hyp.txt with --out-dir D (it was replaced by its translation)
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    as_hyp = write(inputs / "hyp.txt", "\n".join(src) + "\n")
    refs = write(inputs / "ref.en", "\n".join(ref) + "\n")
    cases.append((["--checkpoint", ckpt, "--src", as_hyp, "--ref", refs, "--out-dir", str(inputs)], 2,
                  f"--out-dir {as_hyp}: is also an input ({as_hyp}); the output would overwrite it"))
    cases.append((["--hyp", as_hyp, "--src", as_hyp, "--ref", refs, "--out-dir", str(tmp_path / "fine")], 0, ""))
    # a split's file missing, either side: the option and the file named, exit 2 (a missing reference was
    # "parallel corpus: 1 problem(s)", exit 1)
    for side in ("es", "en"):
        partial = tmp_path / f"no-test-{side}"
        shutil.copytree(data, partial)
        os.remove(partial / f"test.{side}")
        cases.append((["--checkpoint", ckpt, "--data", str(partial)], 2,
                      f"--data {partial} --split test: {partial / f'test.{side}'}: no such file (the corpus lists a "
                      f"test split)"))
    write(tmp_path / "clash.test", "one line\n")
    for args, status, message in cases:
        assert cli.main(["evaluate", "--quiet"] + args) == status, args
        err = capsys.readouterr().err
        if status == 0:
            continue
        assert err.startswith("dtmt evaluate: ") and message in err, (args, err)
        assert err.count("\n") == 1 and "translated" not in err   # (nothing decoded before the refusal)
    assert read(as_hyp) == "\n".join(src) + "\n"


def test_checkpoint_roundtrip_gives_same_translations(system):
    model, sv, tv, ckpt = system
    loaded, lsv, ltv, _ = load_model(ckpt)
    assert translate_best(loaded, lsv, ltv, INPUTS, beam=2) == translate_best(model, sv, tv, INPUTS, beam=2)


def test_a_model_that_overflows_is_an_error_not_empty_lines(system, tmp_path, capsys):
    """Finite weights that overflow float32 in the sums (a source word's embedding row x 1e38: every sentence with
    that word scores NaN; the others are fine) stop decoding with NonFiniteScores naming the input sentence and
    the step, in the fused C++ search, the Python loop, the int8 decoder and an ensemble; `dtmt translate` and
    `dtmt evaluate` say so in one line with exit status 1 and write nothing. (Before issue 71 the NaN candidates
    were ranked: translations empty or arbitrary, exit 0, BLEU without a word.)"""
    import copy

    from dtmt_models.decoding.beam_search import NonFiniteScores, beam_search
    from dtmt_models.decoding.ensemble import Ensemble

    model, sv, tv, _ = system
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.src_embed.embed.weight[sv.encode("sol")[-1]] *= 1e38
    assert all(bool(p.isfinite().all()) for p in broken.parameters())   # (what load_model checks passes)
    sentences = ["el perro come pan", "hace frío", "el sol brilla", "la casa"]
    good = translate(model, sv, tv, sentences, beam=2)
    assert all(hyps[0][0] for hyps in good)
    # (an ensemble's error names the member that scores it so alone: it had named none)
    cases = [(broken, None, ""), (broken, broken.inference_decoder(int8=True), ""),
             (Ensemble([broken, model]), None, "member 1 of the ensemble scores it so alone: "),
             (Ensemble([model, broken]), None, "member 2 of the ensemble scores it so alone: ")]
    for decoded, decoder, whose in cases:
        with pytest.raises(NonFiniteScores, match=r"non-finite score \(nan\) at step 0 of sentence 3: "
                                                  + whose + "its weights"):
            translate(decoded, sv, tv, sentences, beam=2, decoder=decoder)
    # the Python loop and the C++ search stop at the same step and sentence of a batch
    rows = [sv.encode("el perro"), sv.encode("el sol")]
    width = max(map(len, rows))
    src = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    lengths = torch.tensor([len(r) for r in rows])
    where = []
    for fused in (True, False):
        with pytest.raises(NonFiniteScores) as exc:
            beam_search(broken, src, lengths, beam=3, fused=fused)
        where.append((exc.value.step, exc.value.sentence))
    assert where == [(0, 1), (0, 1)]
    # the command line: one line, exit 1, nothing written
    options = dict(embed_dim=16, hidden_size=16, depth=1, heads=2, dropout=0.0, candidate_dropout=0.0)
    ckpt = save_model(tmp_path / "broken.pt", "dtmt", options, sv, tv, broken)
    (tmp_path / "in.es").write_text("\n".join(sentences) + "\n", encoding="utf-8")
    (tmp_path / "ref.en").write_text("\n".join(["the dog eats bread"] * 4) + "\n", encoding="utf-8")
    for command in (["translate", str(tmp_path / "in.es"), "-o", str(tmp_path / "out.en")],
                    ["evaluate", "--src", str(tmp_path / "in.es"), "--ref", str(tmp_path / "ref.en"), "--out-dir",
                     str(tmp_path / "scores")]):
        assert cli.main(command + ["-c", ckpt, "--quiet"]) == 1, command
        err = capsys.readouterr().err   # (the sentence by file and line, as the input errors name it)
        assert err == (f"dtmt {command[0]}: the model gave a non-finite score (nan) at step 0 of {tmp_path}/in.es:3: "
                       f"its weights or activations overflow float32 (a diverged or damaged checkpoint?)\n"), err
    assert not (tmp_path / "out.en").exists()
    assert not (tmp_path / "scores").exists() or not os.listdir(tmp_path / "scores")
    # every weight finite but huge: the int8 decoder's folded weights overflow, which is the checkpoint's fault
    # (exit 1), not a usage error (it was exit 2, "--int8: quantize_rows: the weight has non-finite entries")
    huge = copy.deepcopy(model)
    with torch.no_grad():
        for p in huge.parameters():
            p.mul_(1e30)
    assert all(bool(p.isfinite().all()) for p in huge.parameters())
    ckpt = save_model(tmp_path / "huge.pt", "dtmt", options, sv, tv, huge)
    assert cli.main(["translate", str(tmp_path / "in.es"), "-c", ckpt, "--quiet", "--int8"]) == 1
    assert capsys.readouterr().err == ("dtmt translate: --int8: a weight matrix made from the checkpoint's overflows "
                                       "float32 (a diverged or damaged checkpoint?)\n")


def _dtmt(args, **kwargs):
    """`python -m dtmt_models.cli ARGS` in a child process (its own stdin, stdout and stderr)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""), **kwargs.pop("env", {}))
    return subprocess.run([sys.executable, "-m", "dtmt_models.cli", *args], env=env, timeout=300, **kwargs)


def test_translate_s_outputs_survive_a_stderr_that_cannot_be_written(system, tmp_path):
    """A review found a finished translation thrown away when stderr could not be written (2>/dev/full, a log pipe
    whose reader left): the closing summary is printed before the output is written, and its failure ended the
    command (exit 1 or 141, nothing written). Diagnostics that cannot be written are dropped; the output is
    written and the status is 0."""
    model, sv, tv, path = system
    source = write(tmp_path / "in.es", "\n".join(SRC[:4]) + "\n")
    expected = "".join(h[0][0] + "\n" for h in translate(model, sv, tv, SRC[:4], beam=4))
    with open("/dev/full", "w") as full:
        done = _dtmt(["translate", "-c", path, source, "-o", str(tmp_path / "out.en"), "--threads", "1"],
                     stderr=full)
        assert done.returncode == 0
        assert (tmp_path / "out.en").read_text(encoding="utf-8") == expected
        done = _dtmt(["translate", "-c", path, source, "--threads", "1"], stderr=full, stdout=subprocess.PIPE)
        assert done.returncode == 0 and done.stdout.decode("utf-8") == expected


def test_translate_writes_utf8_to_a_stdout_of_another_encoding(monkeypatch):
    """PYTHONIOENCODING=ascii (or a C locale): the first non-ASCII piece ('⁇', an accent) was UnicodeEncodeError's
    traceback, nothing written; stdout gets UTF-8, as the files -o writes."""
    from dtmt_models.cli.translate import write_stdout

    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="ascii")
    monkeypatch.setattr(sys, "stdout", out)
    print("first", end=" ", file=out)   # (text written before: it goes first)
    write_stdout("¿qué tal? ⁇\n" * 3, piece=7)   # (pieces that cut a character's bytes: whole in the end)
    assert raw.getvalue().decode("utf-8") == "first " + "¿qué tal? ⁇\n" * 3


def test_stdin_under_another_name_beside_dash_is_refused(system, tmp_path):
    """`cat in | dtmt translate -c C - /dev/stdin`: the second read of the pipe was empty, exit 0 with its output
    empty; refused as '- -' is. A regular file redirected with < is read anew by each name: translated twice."""
    path = system[3]
    source = write(tmp_path / "in.es", "\n".join(SRC[:2]) + "\n")
    for names in (["-", "/dev/stdin"], ["/dev/stdin", "/dev/fd/0"]):
        done = _dtmt(["translate", "-c", path, *names, "--output-dir", str(tmp_path / "od")], input=b"el perro\n",
                     capture_output=True)
        assert done.returncode == 2 and done.stderr.decode() == "dtmt translate: stdin ('-') can be read only once\n"
    with open(source, "rb") as f:
        done = _dtmt(["translate", "-c", path, "-", "/dev/stdin", "--threads", "1"], stdin=f, capture_output=True)
    assert done.returncode == 0 and len(done.stdout.decode().splitlines()) == 4, done.stderr


def test_output_dir_files_are_written_as_one_set(system, tmp_path):
    """Under `ulimit -f` the first input's output was written, then the second's failed with '(nothing written ...)':
    a partial set, said as none. Now each is renamed into place only once all are written: none is, and the
    message says so."""
    import resource

    from dtmt_models.cli.translate import write_output_set

    path = system[3]
    small = write(tmp_path / "a.es", "el perro\n")
    large = write(tmp_path / "b.es", "la casa es grande\n" * 300)
    limit = 2000   # (a.es's translation fits it, b.es's does not)
    for order in ([small, large], [large, small]):   # (either order: a review found the large one first left the other)
        done = _dtmt(["translate", "-c", path, *order, "--output-dir", str(tmp_path / "od"), "--threads", "1"],
                     capture_output=True, text=True,
                     preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY)))
        assert done.returncode == 1, done.stderr
        last = done.stderr.splitlines()[-1]   # (after the closing summary)
        assert last.startswith(f"dtmt translate: cannot write {tmp_path / 'od' / 'b.es.out'}: "), last
        assert last.endswith("(none of --output-dir's files was written; any earlier versions are intact)"), last
        assert os.listdir(tmp_path / "od") == []
    # FIFOs among the outputs are written in place, one after the other (all held open together, a reader of the two
    # in turn waited for ever), after the files; the files as one set beside them
    fifos = [str(tmp_path / "f1"), str(tmp_path / "f2")]
    for fifo in fifos:
        os.mkfifo(fifo)
    read = []
    reader = threading.Thread(target=lambda: read.extend(open(f, encoding="utf-8").read() for f in fifos), daemon=True)
    reader.start()
    write_output_set([(fifos[0], "uno\n"), (str(tmp_path / "file.out"), "dos\n"), (fifos[1], "tres\n")])
    reader.join(timeout=30)
    assert read == ["uno\n", "tres\n"] and (tmp_path / "file.out").read_text() == "dos\n"


def test_out_of_memory_is_told_by_one_rule():
    """errors.out_of_memory, what run_command and build_model read as memory running out (they had two lists of
    texts, and build_model knew only the CPU allocator's): MemoryError, torch's OutOfMemoryError, an allocator's
    RuntimeError; another RuntimeError, or a ValueError naming memory, is not."""
    from dtmt_models.errors import out_of_memory

    said = [MemoryError(), torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
            RuntimeError("[enforce fail at alloc_cpu.cpp:127] data. DefaultCPUAllocator: can't allocate memory"),
            RuntimeError("mmap: Cannot allocate memory"), RuntimeError("CUDA error: out of memory")]
    assert all(out_of_memory(exc) for exc in said)
    assert not any(out_of_memory(exc) for exc in (RuntimeError("shape mismatch"), ValueError("can't allocate memory")))
