"""Ensembles (dtmt_models.decoding.ensemble; `dtmt translate -c A -c B`, `dtmt evaluate -c A -c B`).

- A model ensembled with itself decodes exactly as the model (the mean of two equal log-probabilities is the
  value itself, bit for bit), in the library and through the command line.
- Beam search over an ensemble of two different systems (dtmt and rnnsearch-atr) with a beam wide enough to
  keep every open hypothesis returns exactly the exhaustive search's ranking, each complete hypothesis scored
  independently of the step interface: by the members' teacher-forced forward passes, their log-probabilities
  averaged per token, divided by the GNMT length penalty.
- Models with different vocabularies are refused with one line.
"""
from __future__ import annotations

import copy
import itertools
import json
import os
import shutil

import pytest
import torch

from conftest import save_model, spread_weights
from dtmt_models import cli
from dtmt_models.data.vocabulary import BOS, EOS, PAD, Vocabulary
from dtmt_models.decoding.beam_search import beam_search
from dtmt_models.decoding.ensemble import Ensemble
from dtmt_models.decoding.translate import translate
from dtmt_models.models.registry import build_model

SRC = ["el perro come pan", "la casa es grande", "el gato duerme en la casa", "yo tengo un libro rojo",
       "ella lee el libro", "nosotros vamos a la playa", "el sol brilla", "la luna es blanca"]
TGT = ["the dog eats bread", "the house is big", "the cat sleeps in the house", "i have a red book",
       "she reads the book", "we go to the beach", "the sun shines", "the moon is white"]
INPUTS = ["el perro come pan", "", "la casa es grande y el gato duerme", "el sol", "ella lee el libro rojo"]


def _spread(model, seed):
    return spread_weights(model, torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two tiny checkpoints of different systems on one vocabulary pair, and one on another vocabulary."""
    d = tmp_path_factory.mktemp("ensemble")
    sv, tv = Vocabulary.train(SRC, vocab_size=50), Vocabulary.train(TGT, vocab_size=50)
    other = Vocabulary.train(TGT + ["a completely different target side"], vocab_size=55)
    specs = {"a": ("dtmt", dict(embed_dim=16, hidden_size=16, depth=1, heads=2, dropout=0.0,
                                candidate_dropout=0.0), sv, tv),
             "b": ("rnnsearch-atr", dict(embed_dim=16, hidden_size=16, dropout=0.0), sv, tv),
             "foreign": ("rnnsearch-atr", dict(embed_dim=16, hidden_size=16, dropout=0.0), sv, other)}
    paths, models = {}, {}
    for i, (key, (name, options, s, t)) in enumerate(specs.items()):
        torch.manual_seed(i)
        model = _spread(build_model(name, len(s), len(t), **options), seed=10 + i)
        paths[key] = save_model(d / f"{key}.pt", name, options, s, t, model)
        models[key] = model
    return paths, models, sv, tv


def test_ensemble_of_a_model_with_itself_is_the_model(checkpoints):
    """Texts and scores exactly those of the model searched in its step's arithmetic (the ensemble averages its
    members' steps; the model's default search reads tables made once, the same search up to rounding, so a near-tie
    of these random models may go the other way: tests/test_beam_search.py, test_search_through_step_tables)."""
    from dtmt_models.engine import EngineOptions
    _, models, sv, tv = checkpoints
    for key in ("a", "b"):
        fast = models[key].inference_decoder()
        plain = fast.variant(options=EngineOptions(step_tables=False))
        alone = translate(models[key], sv, tv, INPUTS, beam=3, nbest=3, decoder=plain)
        doubled = translate(Ensemble([models[key], models[key]]), sv, tv, INPUTS, beam=3, nbest=3)
        assert doubled == alone                   # texts and scores, exactly
        assert len({h[0][0] for h in alone if h[0][0]}) >= 3   # real translations that differ, not empty lines


def test_ensemble_of_two_models_differs_from_each(checkpoints):
    _, models, sv, tv = checkpoints
    both = translate(Ensemble([models["a"], models["b"]]), sv, tv, INPUTS, beam=3)
    assert both != translate(models["a"], sv, tv, INPUTS, beam=3)
    assert both != translate(models["b"], sv, tv, INPUTS, beam=3)


def _exhaustive(members, src, max_len, alpha):
    """Every complete hypothesis of at most max_len tokens (EOS included), scored from the members' teacher-
    forced forward passes; sorted best first as (score, tokens)."""
    V = members[0].tgt_vocab_size
    words = [w for w in range(V) if w not in (EOS, PAD, BOS)]   # (the search never chooses PAD or BOS)
    lengths = torch.tensor([src.shape[1]])
    scored = []
    for n in range(max_len):
        for body in itertools.product(words, repeat=n):
            seq = list(body) + [EOS]
            prev = torch.tensor([[BOS] + seq[:-1]])
            with torch.no_grad():
                per_member = [m(src, lengths, prev)[0] for m in members]            # [T, V] log-probabilities
            log_probs = torch.stack(per_member).double().mean(0)
            log_p = float(log_probs[torch.arange(len(seq)), torch.tensor(seq)].sum())
            scored.append((log_p / ((5 + len(seq)) / 6) ** alpha, list(body)))   # GNMT's lp, written out
    return sorted(scored, key=lambda x: -x[0])


def test_beam_search_over_an_ensemble_matches_exhaustive_search():
    """Target vocabulary of 8 (5 tokens besides EOS, PAD and BOS), at most 3 output tokens: 31 complete hypotheses;
    a beam of 30 holds every candidate of a step (at most 5 x 6: each an open one or, ranked among the beam, a
    finished one), so beam search must return the exhaustive top 25, in order, with their scores."""
    torch.manual_seed(3)
    members = [_spread(build_model("dtmt", 9, 8, embed_dim=8, hidden_size=8, depth=1, heads=2, dropout=0.0,
                                   candidate_dropout=0.0), seed=1),
               _spread(build_model("rnnsearch-atr", 9, 8, embed_dim=8, hidden_size=8, dropout=0.0), seed=2)]
    src = torch.tensor([[5, 7, 4, 8]])
    alpha = 0.6
    expected = _exhaustive(members, src, max_len=3, alpha=alpha)
    assert len(expected) == 1 + 5 + 25
    hyps = beam_search(Ensemble(members), src, torch.tensor([4]), beam=30, nbest=25, alpha=alpha,
                       max_len_a=0.0, max_len_b=3)[0]
    assert [h.tokens for h in hyps] == [tokens for _, tokens in expected[:25]]
    assert [h.score for h in hyps] == pytest.approx([s for s, _ in expected[:25]], rel=1e-5, abs=1e-5)
    # and the members alone rank differently (the average is not one member's ranking)
    alone = [beam_search(m, src, torch.tensor([4]), beam=30, nbest=25, alpha=alpha, max_len_a=0.0,
                         max_len_b=3)[0] for m in members]
    assert all([h.tokens for h in a] != [h.tokens for h in hyps] for a in alone)


def test_ensemble_refuses_different_vocabulary_sizes():
    a = build_model("rnnsearch-atr", 9, 6, embed_dim=8, hidden_size=8)
    b = build_model("rnnsearch-atr", 9, 7, embed_dim=8, hidden_size=8)
    with pytest.raises(ValueError, match="vocabulary sizes differ"):
        Ensemble([a, b])
    with pytest.raises(TypeError, match="decodes only"):
        Ensemble([a])(torch.zeros(1, 1, dtype=torch.long))


def test_vocabularies_of_the_model_s_size_but_not_its_own_are_refused(tmp_path):
    """The library as the command line: translate and Ensemble compared the vocabularies' sizes only, so another
    corpus's vocabularies of the same size (every corpus gets --vocab-size pieces), or the model's two swapped,
    decoded fluent nonsense without a word. load_model's models now record which vocabularies they read and write."""
    from dtmt_models.models.checkpoint import load_model

    s1, t1 = Vocabulary.train(SRC, vocab_size=30), Vocabulary.train(TGT, vocab_size=30)
    t2 = Vocabulary.train([" ".join(w[::-1] for w in line.split()) for line in TGT], vocab_size=30)
    assert len(s1) == len(t1) == len(t2) == 30 and t1.proto != t2.proto
    options = dict(embed_dim=8, hidden_size=8, dropout=0.0)
    loaded = []
    for key, t in (("a", t1), ("b", t2)):
        model = build_model("rnnsearch-atr", 30, 30, **options)
        loaded.append(load_model(save_model(tmp_path / f"{key}.pt", "rnnsearch-atr", options, s1, t, model))[0])
    a, b = loaded
    assert len(translate(a, s1, t1, ["el sol"], beam=2)) == 1
    with pytest.raises(ValueError, match=r"^translate: the target vocabulary is not the model's \(the same size, "
                                         r"other pieces\); pass the vocabularies load_model returned with it$"):
        translate(a, s1, t2, ["el sol"])
    with pytest.raises(ValueError, match=r"^translate: the source vocabulary is not the model's but its target one "
                                         r"\(swapped\)"):
        translate(a, t1, s1, ["el sol"])
    with pytest.raises(ValueError, match=r"^Ensemble: model 2's target vocabulary is not model 1's \(the same size, "
                                         r"other pieces\)"):
        Ensemble([a, b])
    with pytest.raises(ValueError, match="translate: the target vocabulary is not the model's"):
        translate(Ensemble([build_model("rnnsearch-atr", 30, 30, **options), a]), s1, t2, ["el sol"])
    assert len(translate(Ensemble([a, a]), s1, t1, ["el sol"], beam=2)) == 1


def test_cli_translate_ensemble(checkpoints, tmp_path, capsys):
    paths, models, sv, tv = checkpoints
    src = tmp_path / "in.es"
    src.write_text("\n".join(INPUTS) + "\n", encoding="utf-8")
    outputs = {}
    shutil.copyfile(paths["a"], tmp_path / "copy.pt")   # (a copy: a member of its own; the same file is refused)
    for label, flags in (("a", ["-c", paths["a"]]), ("aa", ["-c", paths["a"], "-c", str(tmp_path / "copy.pt")]),
                         ("ab", ["-c", paths["a"], "-c", paths["b"]])):
        out = tmp_path / f"{label}.en"
        assert cli.main(["translate", "--quiet", "--beam", "3", *flags, str(src), "-o", str(out)]) == 0
        outputs[label] = out.read_text(encoding="utf-8").split("\n")[:-1]
    assert outputs["aa"] == outputs["a"]
    expected = translate(Ensemble([models["a"], models["b"]]), sv, tv, INPUTS, beam=3)
    assert outputs["ab"] == [h[0][0] for h in expected]
    capsys.readouterr()
    # a member on another vocabulary: one line, exit 2 (the options cannot work together), nothing written
    out = tmp_path / "foreign.en"
    assert cli.main(["translate", "--quiet", "-c", paths["a"], "-c", paths["foreign"], str(src), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dtmt translate: ensemble: ") and "foreign.pt: its target vocabulary differs" in err
    assert err.count("\n") == 1 and not out.exists()
    # one file given for every member, by its name or a link (a review's: that model decoded twice over, for its own
    # translations): refused; repeated beside another, it weights the average (2/3 a, 1/3 b), and stays
    os.symlink(paths["a"], tmp_path / "link.pt")
    for again in (paths["a"], str(tmp_path / "link.pt")):
        assert cli.main(["translate", "--quiet", "-c", paths["a"], "-c", again, str(src), "-o", str(out)]) == 2
        assert capsys.readouterr().err == (f"dtmt translate: --checkpoint {again} is given twice (as {paths['a']} "
                                           f"too), and no other: an ensemble of one model decodes as that model, 2 "
                                           f"times over; give it once\n") and not out.exists()
    for again in (paths["a"], str(tmp_path / "copy.pt")):   # (the same file twice or a copy: one ensemble)
        assert cli.main(["translate", "--quiet", "-c", paths["a"], "-c", again, "-c", paths["b"], str(src), "-o",
                         str(out)]) == 0
        outputs[again] = out.read_text(encoding="utf-8").split("\n")[:-1]
    assert outputs[paths["a"]] == outputs[str(tmp_path / "copy.pt")] != outputs["ab"]


def test_vocabularies_of_one_size_and_other_pieces_are_said_to_differ():
    """Two vocabularies of the same size but other pieces (es-en against en-es) were named "4000 and 4000
    pieces", which reads as equal; the message says the pieces differ, or the two sizes."""
    from dtmt_models.decoding.ensemble import check_vocabularies

    sv, tv = Vocabulary.train(SRC, vocab_size=50), Vocabulary.train(TGT, vocab_size=50)
    assert len(sv) == len(tv) and sv.proto != tv.proto
    with pytest.raises(ValueError, match=r"^b\.pt: its source vocabulary differs from a\.pt's \(50 pieces each, "
                                         r"not the same ones\); an ensemble needs"):
        check_vocabularies(["a.pt", "b.pt"], [(sv, tv), (tv, sv)])
    other = Vocabulary.train(TGT + ["a completely different target side"], vocab_size=55)
    with pytest.raises(ValueError, match=r"its target vocabulary differs from a\.pt's \(55 pieces against 50\)"):
        check_vocabularies(["a.pt", "b.pt"], [(sv, tv), (sv, other)])


def test_cli_evaluate_ensemble(checkpoints, tmp_path, capsys):
    from dtmt_models.data.corpus import write_manifest

    paths, models, sv, tv = checkpoints
    data = tmp_path / "corpus"
    data.mkdir()
    (data / "test.es").write_text("\n".join(SRC) + "\n", encoding="utf-8")
    (data / "test.en").write_text("\n".join(TGT) + "\n", encoding="utf-8")
    write_manifest(str(data), "es", "en", {"test": len(SRC)}, origin="test")
    assert cli.main(["evaluate", "-c", paths["a"], "-c", paths["b"], "--data", str(data), "--beam", "2",
                     "--quiet"]) == 0
    folder = os.path.dirname(paths["a"])                                   # default: <dir>-<stem>+<dir>-<stem>.<split>
    out_dir = os.path.join(folder, f"{os.path.basename(folder)}-a+{os.path.basename(folder)}-b.test")
    with open(os.path.join(out_dir, "scores.json"), encoding="utf-8") as f:
        report = json.load(f)
    assert report["settings"]["checkpoint"] == [paths["a"], paths["b"]]
    assert report["settings"]["model_name"] == "dtmt+rnnsearch-atr"
    with open(os.path.join(out_dir, "hyp.txt"), encoding="utf-8") as f:
        hyps = f.read().split("\n")[:-1]
    assert hyps == [h[0][0] for h in translate(Ensemble([models["a"], models["b"]]), sv, tv, SRC, beam=2)]


def test_a_decoder_of_another_model_is_refused_by_translate(checkpoints):
    """translate(model, decoder=D) with D built from another model had decoded with that model's weights, its
    vocabularies checked against `model`'s, without a word (a review found it). Each kind of decoder says which
    model it was built from (engine.decoder.built_from): the system's, its variants and int8 copy, 16-bit copies,
    an ensemble's; one of another model is refused in one line, one of its own model decodes as before."""
    from dtmt_models.engine import EngineOptions, as_decoder

    _, models, sv, tv = checkpoints
    a, b = models["a"], models["b"]
    both = Ensemble([a, b])
    own = translate(a, sv, tv, INPUTS, beam=2)
    for decoder in (a.inference_decoder(), a.inference_decoder().variant(options=EngineOptions(step_tables=False))):
        # (the variant without step tables: the same search up to rounding, so the texts are compared)
        assert [h[0][0] for h in translate(a, sv, tv, INPUTS, beam=2, decoder=decoder)] == [h[0][0] for h in own]
    assert translate(a, sv, tv, INPUTS, beam=2, decoder=a.inference_decoder(int8=True))   # (its own: decodes)
    assert translate(a, sv, tv, INPUTS, beam=2, decoder=as_decoder(a, amp="bf16"))
    assert translate(both, sv, tv, INPUTS, beam=2, decoder=both.inference_decoder()) == translate(both, sv, tv,
                                                                                                   INPUTS, beam=2)
    prepared = a.inference_decoder().prepared   # (a prepared copy decoding itself: of the model it came from)
    assert translate(prepared, sv, tv, INPUTS, beam=2, decoder=prepared) == translate(prepared, sv, tv, INPUTS, beam=2)
    assert translate(prepared, sv, tv, INPUTS, beam=2, decoder=a.inference_decoder())
    for decoder, kind in ((b.inference_decoder(), "RNNSearchATR"), (b.inference_decoder(int8=True), "RNNSearchATR"),
                          (as_decoder(b, amp="bf16"), "RNNSearchATR"), (both.inference_decoder(), "Ensemble"),
                          (copy.deepcopy(a).inference_decoder(), "DTMT")):
        with pytest.raises(ValueError) as info:
            translate(a, sv, tv, INPUTS, beam=2, decoder=decoder)
        assert str(info.value) == (f"translate: decoder= was built from another {kind} than the model given; build "
                                   f"it from this one (model.inference_decoder()) or leave it out"), kind
