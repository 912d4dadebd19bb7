"""The NMT systems: every registered name and option combination builds and trains; padding, incremental
decoding and backends do not change the function; each system can overfit a tiny corpus."""
import copy
import re
import threading
import types

import pytest
import torch

import dtmt_kernels as dk
import dtmt_models as dm

V_SRC, V_TGT = 23, 19
SMALL = dict(embed_dim=16, hidden_size=16)

# (name, options): every system and the options that change its structure
CONFIGS = [
    ("dtmt", {}),
    ("dtmt", dict(depth=2, cell="gru", positional_encoding=False)),
    ("dtmt", dict(depth=2, cell="lau", deep_encoder=False)),
    ("dtmt", dict(depth=1, deep_query=False, shallow_cell="lgru")),
    ("dtmt", dict(depth=1, deep_query=False, deep_decoder=False, tie_embeddings=True, layer_norm=False)),
    ("dtmt", dict(encoder_depth=3, query_depth=0, decoder_depth=2, heads=2)),
    ("shallow-rnmt", {}),
    ("shallow-rnmt", dict(cell="lgru")),
    ("deeplau", {}),
    ("deeplau", dict(encoder_layers=3, decoder_layers=1, layer_norm=True)),
    ("deeplau", dict(encoder_layers=2, decoder_layers=2, cell="gru")),
    ("nematus", {}),
    ("nematus", dict(encoder="deep-transition", decoder="deep-transition", enc_transition_depth=3)),
    ("nematus", dict(encoder="alternating", decoder="gru", enc_depth=3, output_depth=2)),
    ("nematus", dict(encoder="biunidirectional", decoder="rgru", layer_norm=False, tie_embeddings=False)),
    ("nematus", dict(encoder="alternating", decoder="cgru", dec_depth=3)),
    ("nematus", dict(encoder="bideep", decoder="crgru")),
    ("nematus", dict(encoder="bideep", decoder="bideep", dec_high_cell="cgru", dec_base_transition_depth=3)),
    ("nematus", dict(encoder="bideep", decoder="bideep", enc_depth=3, dec_depth=3)),
    ("mce", {}),
    ("mce", dict(annotation="rnn", backward_input="embeddings")),
    ("mce", dict(annotation="ntm")),
    ("mce", dict(annotation="emb", embed_dim=12)),
    ("mce", dict(annotation="ntm-emb")),
    ("mce", dict(annotation="ntm-rnn")),
    ("mce", dict(annotation="rnn-emb", tie_embeddings=True)),
    ("rnnsearch-atr", {}),
    ("rnnsearch-atr", dict(encoder="ca", layer_norm=True)),
    ("rnnsearch-atr", dict(cell="lgru")),
    ("gnmt-atr", {}),
    ("gnmt-atr", dict(encoder_layers=3, decoder_layers=3, cell="gru")),
    ("gnmt-atr", dict(encoder_layers=2, decoder_layers=2, layer_norm=True, tie_embeddings=True)),
    ("transformer", dict(heads=2, encoder_layers=1, decoder_layers=1, hidden_size=32)),
]
IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in o.items()) or 'default'}" for n, o in CONFIGS]


def build(name, **options):
    torch.manual_seed(0)
    opts = dict(SMALL)
    opts.update(options)
    return dm.build_model(name, V_SRC, V_TGT, **opts)


def toy_batch(B=3, S=7, T=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    src_lengths = torch.tensor([S] + [int(x) for x in torch.randint(1, S + 1, (B - 1,), generator=g)])
    tgt_lengths = torch.tensor([T] + [int(x) for x in torch.randint(1, T + 1, (B - 1,), generator=g)])
    src = torch.randint(3, V_SRC, (B, S), generator=g)
    tgt = torch.randint(3, V_TGT, (B, T), generator=g)
    src[torch.arange(S) >= src_lengths.unsqueeze(1)] = 0
    tgt[torch.arange(T) >= tgt_lengths.unsqueeze(1)] = 0
    prev = torch.cat([torch.full((B, 1), 1), tgt[:, :-1]], 1)   # BOS = 1
    prev[tgt == 0] = 0
    return src, src_lengths, prev, tgt


def test_registry():
    names = dm.list_models()
    for name in {n for n, _ in CONFIGS}:
        assert name in names
    with pytest.raises(ValueError, match="unknown model"):
        dm.build_model("no-such-model", 10, 10)
    with pytest.raises(ValueError, match=r"unknown model \['dtmt'\]"):
        dm.build_model(["dtmt"], 10, 10)
    with pytest.raises(ValueError, match="src_vocab_size"):
        dm.build_model("dtmt", 1, 10)


@pytest.mark.parametrize("name, options, message", [
    ("dtmt", dict(hiden_size=8), r"unknown option 'hiden_size' for dtmt \(did you mean 'hidden_size'\?\); its "
                                 r"options are: "),
    ("dtmt", dict(embed_dim="8"), "option embed_dim='8' for dtmt: expected int"),
    ("dtmt", dict(heads=0), "option heads=0 for dtmt: expected an int from 1 to 1,024"),
    ("mce", dict(hidden_size=-3), "option hidden_size=-3 for mce: expected an int from 1 to 65,536"),
    ("transformer", dict(hidden_size=0), "option hidden_size=0 for transformer: expected an int from 1 to 65,536"),
    ("transformer", dict(encoder_layers=10 ** 6), "option encoder_layers=1000000 for transformer: expected an int "
                                                  "from 1 to 256"),
    ("dtmt", dict(depth=10 ** 6), r"dtmt cannot be built with \{'depth': 1000000\}: .*depth must be an int from 0 "
                                  "to 256"),
    ("dtmt", dict(embed_dim=[8] * 1000), r"option embed_dim=\[8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8"
                                         r"\.\.\. \(3,000 characters\) for dtmt: expected int"),
    ("dtmt", dict(pad_id=-1), "option pad_id=-1 for dtmt: expected an int >= 0"),
    ("dtmt", dict(pad_id=V_TGT), rf"option pad_id={V_TGT} for dtmt: expected an id of both vocabularies, in \[0, "
                                 rf"{V_TGT}\)"),
    # padding is masked out of the loss: with pad_id = EOS a model never learnt to end a sentence, and nothing said so
    ("rnnsearch-atr", dict(pad_id=3), "option pad_id=3 for rnnsearch-atr: 3 is EOS, with which every search ends a "
                                      "sentence; padding needs an id of its own"),
    ("nematus", dict(pad_id=2), "option pad_id=2 for nematus: 2 is BOS, with which every search starts a sentence"),
    ("dtmt", dict(hidden_size=10, heads=4), r"dtmt cannot be built with \{'hidden_size': 10, 'heads': 4\}: .*"
                                            "divisible by heads=4"),
    # an option whose default is None took any value: readout_layer_norm='False' turned the layer norm on
    ("dtmt", dict(readout_layer_norm="False"), "option readout_layer_norm='False' for dtmt: expected bool or None "
                                               r"\(default None\)"),
    ("dtmt", dict(encoder_depth=2.0), "option encoder_depth=2.0 for dtmt: expected int or None"),
    # a rate of NaN passed every range check and failed at the first training forward
    ("dtmt", dict(dropout=float("nan")), "option dropout=nan for dtmt: expected a finite number"),
    ("transformer", dict(dropout=float("-inf")), "option dropout=-inf for transformer: expected a finite"),
    # a rate of 1 (nn.Dropout takes it) zeroed every embedding and readout feature in training, without a word
    ("mce", dict(dropout=1.0), r"option dropout=1.0 for mce: expected a probability in \[0, 1\)"),
    ("transformer", dict(dropout=1), r"option dropout=1 for transformer: expected a probability in \[0, 1\)"),
    ("dtmt", dict(dropout=-0.1), r"option dropout=-0.1 for dtmt: expected a probability in \[0, 1\)"),
    ("shallow-rnmt", dict(candidate_dropout=1.0), r"option candidate_dropout=1.0 for shallow-rnmt: expected a "
                                                  r"probability in \[0, 1\)"),
    # what the deep_* switches leave unused was not checked: cell='zzz' and depth=-5 built a shallow dtmt silently
    ("dtmt", dict(deep_encoder=False, deep_query=False, deep_decoder=False, cell="zzz", depth=1),
     "dtmt: cell must be 'gru', 'lgru' or 'lau', got 'zzz'"),
    ("dtmt", dict(deep_encoder=False, deep_query=False, deep_decoder=False, depth=-5),
     "dtmt: depth must be an int from 0 to 256, got -5"),
    ("dtmt", dict(deep_encoder=False, encoder_depth=10 ** 9), "dtmt: encoder_depth must be an int from 0 to 256"),
    ("shallow-rnmt", dict(shallow_cell="zzz"), "shallow-rnmt: shallow_cell must be 'gru', 'lgru' or 'lau', got "
                                               "'zzz'"),
    # nematus' transition depths had no upper bound where encoder / decoder leave them unused
    ("nematus", dict(enc_transition_depth=10 ** 9), "nematus: enc_transition_depth must be at most 257 "
                                                    r"\(256 T-GRUs\), got 1000000000"),
    ("nematus", dict(decoder="gru", dec_base_transition_depth=259), "nematus: dec_base_transition_depth must be "
                                                                    "at most 258"),
    ("nematus", dict(dec_high_transition_depth=10 ** 9), "nematus: dec_high_transition_depth must be at most 258"),
])
def test_bad_options_are_value_errors(name, options, message):
    """build_model refuses what cannot build the system in one ValueError naming the option (before, a misspelt
    option was a TypeError, heads=0 a ZeroDivisionError, pad_id=-1 silently padded with the last token)."""
    with pytest.raises(ValueError, match=message) as info:
        dm.build_model(name, V_SRC, V_TGT, **options)
    assert "\n" not in str(info.value)
    from dtmt_models.models.registry import check_model_options

    if options.get("pad_id") != V_TGT:   # (check_model_options knows no vocabulary: the next test)
        with pytest.raises(ValueError, match=message):
            check_model_options(name, options)


@pytest.mark.parametrize("name, options, message", [
    ("nematus", dict(enc_depth=4), "the shallow encoder has one level"),
    ("nematus", dict(encoder="deep-transition", enc_depth=4), "the deep-transition encoder has one level"),
    ("nematus", dict(enc_transition_depth=3, encoder="alternating"), "only the deep-transition and bideep encoders"),
    ("nematus", dict(dec_depth=4, decoder="deep-transition"), "the deep-transition decoder has one level"),
    ("nematus", dict(decoder="rgru", dec_base_transition_depth=8), "only the deep-transition and bideep decoders"),
    ("nematus", dict(dec_high_cell="cgru", decoder="cgru"), "only the bideep decoder reads it"),
    ("nematus", dict(dec_high_transition_depth=5), "only the bideep decoder reads it"),
    ("dtmt", dict(deep_encoder=False, encoder_depth=4), "deep_encoder=False: the encoder is one shallow_cell"),
    ("dtmt", dict(deep_encoder=False, deep_query=False, deep_decoder=False, cell="lau"), "no module is deep"),
    ("dtmt", dict(shallow_cell="lau"), "every module is deep"),
    ("dtmt", dict(depth=2, encoder_depth=1, query_depth=2, decoder_depth=3), "every deep module has its own depth"),
    ("mce", dict(annotation="emb", backward_input="embeddings"), "annotation='emb' has no backward encoder")])
def test_an_option_the_structure_leaves_unused_is_refused(name, options, message, tmp_path):
    """An option given a value other than its default that the structure chosen builds nothing from (a review found
    them): it had been taken without a word, its parameter count unchanged, and recorded in config.yaml as if the
    model had it. Its default given is taken (a run's options may hold it), and a checkpoint written before the
    refusal, holding such an option, loads as the model it is."""
    from conftest import save_model
    from dtmt_models.data.vocabulary import Vocabulary
    from dtmt_models.models.checkpoint import load_model
    from dtmt_models.models.registry import check_model_options, option_defaults, unused_options

    option = next(k for k in unused_options(name, options))
    for build in (lambda o: dm.build_model(name, V_SRC, V_TGT, embed_dim=8, hidden_size=8, **o),
                  lambda o: check_model_options(name, o)):
        with pytest.raises(ValueError, match=rf"^{name}: {option}=\S+ builds nothing here \(.*{message}.*\); "
                                             rf"leave it out$"):
            build(options)
    as_default = {**options, option: option_defaults(name)[option]}
    model = dm.build_model(name, V_SRC, V_TGT, embed_dim=8, hidden_size=8, **as_default)
    without = {k: v for k, v in options.items() if k != option}
    assert sum(p.numel() for p in model.parameters()) == sum(
        p.numel() for p in dm.build_model(name, V_SRC, V_TGT, embed_dim=8, hidden_size=8, **without).parameters())
    vocab = Vocabulary.train(["el perro come la manzana", "la casa es grande"] * 20, vocab_size=V_SRC)
    old = dm.build_model(name, len(vocab), len(vocab), embed_dim=8, hidden_size=8, **without)
    path = save_model(tmp_path / "old.pt", name, dict(options, embed_dim=8, hidden_size=8), vocab, vocab, old)
    loaded = load_model(path)[0]
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), old.state_dict().values()))


def test_a_target_vocabulary_holds_bos_and_eos():
    """A target vocabulary of 2 or 3 ids built and failed only when decoded (BOS 2 and EOS 3 are no words of it); a
    source vocabulary of 2 is enough (padding and one word)."""
    for size in (2, 3):
        with pytest.raises(ValueError, match=rf"tgt_vocab_size must be an int >= 4 \(BOS 2 and EOS 3 are target "
                                             rf"words\), got {size}"):
            dm.build_model("dtmt", V_SRC, size)
    with pytest.raises(ValueError, match="src_vocab_size must be an int >= 2, got 1"):
        dm.build_model("dtmt", 1, V_TGT)
    model = dm.build_model("rnnsearch-atr", 2, 4, embed_dim=4, hidden_size=4)
    assert model.tgt_vocab_size == 4 and model.src_vocab_size == 2


def test_numpy_numbers_are_options_like_python_ones():
    """A sweep's numpy numbers build the same system as the Python numbers (the layers take Python ints)."""
    import numpy as np

    torch.manual_seed(0)
    a = dm.build_model("dtmt", V_SRC, V_TGT, embed_dim=np.int64(8), hidden_size=np.int32(8), heads=np.int64(2),
                       dropout=np.float32(0.25), layer_norm=np.bool_(False))
    torch.manual_seed(0)
    b = dm.build_model("dtmt", V_SRC, V_TGT, embed_dim=8, hidden_size=8, heads=2, dropout=0.25, layer_norm=False)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    with pytest.raises(ValueError, match="option hidden_size=True for dtmt: expected int"):
        dm.build_model("dtmt", V_SRC, V_TGT, hidden_size=True)
    c = dm.build_model("dtmt", np.int64(V_SRC), np.int32(V_TGT), embed_dim=8, hidden_size=8)   # the vocabularies
    assert (c.src_vocab_size, c.tgt_vocab_size) == (V_SRC, V_TGT) and type(c.src_vocab_size) is int   # too


def test_an_optional_option_is_typed_by_its_annotation_however_spelt():
    import typing

    from dtmt_models.models.registry import _optional_type

    for spelling in ("Optional[bool]", "typing.Optional[bool]", "Union[bool, None]", "None | bool", "bool | None",
                     typing.Optional[bool]):
        assert _optional_type(spelling) is bool, spelling
    assert _optional_type("Optional[int]") is int and _optional_type("Optional[List[int]]") is None
    assert _optional_type("bool") is None


def test_check_model_options_takes_a_pad_id_of_a_vocabulary_not_yet_built():
    """dtmt train checks options before the vocabularies exist: a pad_id past a toy size is not refused there."""
    from dtmt_models.models.registry import check_model_options

    check_model_options("dtmt", dict(pad_id=100, hidden_size=8, embed_dim=8))


@pytest.mark.parametrize("name,options", CONFIGS[::4], ids=IDS[::4])
def test_bad_batches_and_step_tokens_are_value_errors(name, options):
    """check_batch and step: wrong types, dtypes, shapes and devices name the argument (before: a TypeError for an
    empty target prefix, a RuntimeError for step tokens of another batch size, a misleading shape for a list)."""
    model = build(name, **options).eval()
    src, src_lengths, prev, _ = toy_batch()
    with pytest.raises(ValueError, match=r"src_lengths must be a LongTensor \[B=3\], got list"):
        model(src, src_lengths.tolist(), prev)
    with pytest.raises(ValueError, match="src_lengths must hold integers, got dtype torch.float32"):
        model(src, src_lengths.float(), prev)
    with torch.no_grad():   # (lengths on the meta device: torch's NotImplementedError from the copy of their values)
        for decoder in (model, model.inference_decoder()):
            with pytest.raises(ValueError, match=r"src_lengths must hold values \(a CPU or CUDA tensor\), got a meta"):
                decoder.encode(src, src_lengths.to("meta"))
    with pytest.raises(ValueError, match=r"prev_tokens must be a LongTensor \[B=3, T\] with T >= 1"):
        model(src, src_lengths, prev[:, :0])
    # a target of another layout with as many ids (time-major, flat) was flattened against other positions'
    # scores: a silently wrong loss (a probe's finding)
    tgt = prev.roll(-1, 1)
    for bad in (tgt.t(), tgt.reshape(-1), tgt.int()):
        with pytest.raises(ValueError, match=rf"^{type(model).__name__}: target must be a LongTensor \[3, 6\] \(the "
                                             rf"logits' shape without the vocabulary: \[B, T\], as prev_tokens"):
            model.loss(src, src_lengths, prev, bad)
    model.loss(src, src_lengths, prev, tgt)
    for empty in (src[:0], src[:, :0]):   # no sentence, or none of a token
        with pytest.raises(ValueError, match=rf"src must hold at least one sentence of at least one token, got "
                                             rf"\[{empty.shape[0]}, {empty.shape[1]}\]"):
            model(empty, src_lengths[:empty.shape[0]], prev[:empty.shape[0]])
    with torch.no_grad():
        for decoder in (model, model.inference_decoder()):
            state = decoder.encode(src, src_lengths)
            for bad in (prev[:2, 0], prev[:, :1], prev[:, 0].tolist(), prev[:, 0].float()):
                with pytest.raises(ValueError, match=r"\.step: prev_tokens must be a LongTensor \[B=3\]"):
                    decoder.step(state, bad)
            assert decoder.step(state, prev[:, 0])[0].shape == (3, V_TGT)
            # a state reordered to no rows: some systems went on ([0, V]), others failed inside a layer or in
            # torch's max(); one ValueError in each
            empty = decoder.reorder(state, torch.empty(0, dtype=torch.long))
            with pytest.raises(ValueError, match=r"\.step: the state has no rows \(reordered to an empty index\)"):
                decoder.step(empty, prev[:0, 0])


@pytest.mark.parametrize("name", sorted(dm.list_models()))
def test_ids_outside_the_vocabularies_are_an_index_error_naming_them(name):
    """A source id past the vocabulary (or negative) was torch's "index out of range in self" from deep inside
    F.embedding, or the tables' own message; now one IndexError (nn.Embedding's type) naming the argument."""
    model = build(name).eval()
    src, src_lengths, prev, _ = toy_batch()
    for bad, arg, vocab in ((V_SRC, "src", "source"), (-1, "src", "source")):
        wrong = src.clone()
        wrong[1, 0] = bad
        with pytest.raises(IndexError, match=rf"{arg} holds the id {bad}, outside the {vocab} vocabulary's"):
            model(wrong, src_lengths, prev)
        with pytest.raises(IndexError, match=rf"{arg} holds the id {bad}"):
            model.inference_decoder().encode(wrong, src_lengths)
    wrong = prev.clone()
    wrong[0, 2] = V_TGT
    with pytest.raises(IndexError, match=rf"prev_tokens holds the id {V_TGT}, outside the target vocabulary's 19"):
        model(src, src_lengths, wrong)
    # one step and a reorder (the decoding interface, the model's and its inference decoder's): the ids and rows
    # they take were torch's "index out of range in self" too
    with torch.no_grad():
        for decoder in (model, model.inference_decoder()):
            state = decoder.encode(src, src_lengths)
            for bad in (V_TGT, -1):
                with pytest.raises(IndexError, match=rf"\.step: prev_tokens holds the id {bad}, outside the target "
                                                     rf"vocabulary's {V_TGT} ids"):
                    decoder.step(state, torch.full((3,), bad))
            for bad in (3, -1):
                with pytest.raises(IndexError, match=rf"\.reorder: index holds the row {bad}, outside the state's 3"):
                    decoder.reorder(state, torch.tensor([0, bad]))
            assert decoder.reorder(state, torch.tensor([2, 2, 0]))[next(iter(state))].shape[0] == 3


@pytest.mark.parametrize("name,options", CONFIGS, ids=IDS)
def test_every_configuration_decodes_through_its_inference_decoder(name, options):
    """The inference decoder's steps (the fused inference forms) give the model's own steps' log-probabilities
    (float64), and beam search returns every sentence's hypotheses, for every configuration (nematus with a deep
    output could not decode at all: the fused readout-features op wanted the output layer, which it does not use
    and which a readout with deep layers does not give it)."""
    from dtmt_models.decoding.beam_search import beam_search

    model = build(name, **options).double().eval()
    src, src_lengths, prev, _ = toy_batch()
    decoder = model.inference_decoder()
    with torch.no_grad():
        ours, theirs = model.encode(src, src_lengths), decoder.encode(src, src_lengths)
        for t in range(prev.shape[1]):
            want, ours = model.step(ours, prev[:, t])
            got, theirs = decoder.step(theirs, prev[:, t])
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert all(len(s) == 2 for s in beam_search(model, src, src_lengths, beam=2, nbest=2))


@pytest.mark.parametrize("name", ["dtmt", "deeplau", "gnmt-atr"])
def test_inference_decoder_runs_with_autograd_on(name):
    """The inference decoder is inference only: called without no_grad it decodes as under it (its ops write into
    buffers, which autograd refused with a RuntimeError: dtmt's fused decoder, and the prepared copies of deeplau
    and gnmt-atr, whose inference layers have no autograd, on a padded batch)."""
    model = build(name).eval()
    decoder = model.inference_decoder()
    src, src_lengths, prev, _ = toy_batch()
    assert len(set(src_lengths.tolist())) > 1   # (padded)
    state = decoder.encode(src, src_lengths)
    log_probs, state = decoder.step(state, prev[:, 0])
    state = decoder.reorder(state, torch.tensor([1, 0, 2]))
    with torch.no_grad():
        expected, _ = decoder.step(decoder.encode(src, src_lengths), prev[:, 0])
    if name == "dtmt":   # the fused decoder's ops make no graph at all: the same arithmetic
        assert not log_probs.requires_grad and torch.equal(log_probs, expected)
    else:   # (with autograd on, the readout's products take F.linear, not the small-row kernel: rounding)
        torch.testing.assert_close(log_probs.detach(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name,options", CONFIGS, ids=IDS)
def test_forward_backward_finite_and_summary(name, options, capsys):
    model = build(name, **options)
    text = dm.summary(model)
    assert "total" in text and str(sum(p.numel() for p in model.parameters())) in text.replace(",", "")
    rows = [int(line.split()[1].replace(",", "")) for line in text.splitlines()[1:]]
    assert sum(rows[:-1]) == rows[-1], text   # (a tied embedding had been counted in two rows: a review found it)
    src, src_lengths, prev, tgt = toy_batch()
    log_probs = model(src, src_lengths, prev)
    assert log_probs.shape == (3, 6, V_TGT)
    loss, nll, ntok = model.loss(src, src_lengths, prev, tgt, smoothing=0.1)
    assert ntok == int((tgt != 0).sum()) and torch.isfinite(loss)
    loss.backward()
    for n, p in model.named_parameters():   # every parameter is used: nothing built that the options do not run
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{n} has no gradient"
        assert torch.isfinite(p.grad).all(), n


@pytest.mark.parametrize("name,options", CONFIGS, ids=IDS)
def test_padding_does_not_change_real_tokens(name, options):
    model = build(name, **options).double().eval()
    src, src_lengths, prev, tgt = toy_batch()
    lp = model(src, src_lengths, prev)
    for b in range(src.shape[0]):
        S, T = int(src_lengths[b]), int((tgt[b] != 0).sum())
        alone = model(src[b:b + 1, :S], src_lengths[b:b + 1], prev[b:b + 1, :T])
        torch.testing.assert_close(alone[0], lp[b, :T], rtol=1e-12, atol=1e-12)   # float64: padding adds nothing


@pytest.mark.parametrize("name,options", CONFIGS, ids=IDS)
def test_incremental_decoding_matches_teacher_forcing(name, options):
    model = build(name, **options).double().eval()
    src, src_lengths, prev, _ = toy_batch()
    teacher = model(src, src_lengths, prev)
    state = model.encode(src, src_lengths)
    # reorder with a permutation and back: beam bookkeeping must keep every entry aligned
    perm = torch.tensor([2, 0, 1])
    state = model.reorder(model.reorder(state, perm), torch.argsort(perm))
    steps = []
    for t in range(prev.shape[1]):
        lp, state = model.step(state, prev[:, t])
        steps.append(lp)
    torch.testing.assert_close(torch.stack(steps, 1), teacher, rtol=1e-12, atol=1e-12)


def _has_fused_layers(model):
    return any(hasattr(m, "direction_weights") for m in model.modules())


@pytest.mark.parametrize("name,options", CONFIGS, ids=IDS)
def test_cpp_and_reference_backends_agree(name, options):
    model = build(name, **options).double()
    if not _has_fused_layers(model):
        pytest.skip("no fused recurrent layer in this system")
    src, src_lengths, prev, tgt = toy_batch()
    results = []
    for backend in ("reference", "cpp"):
        model.set_backend(backend)
        model.zero_grad()
        torch.manual_seed(5)   # same dropout masks on both backends
        loss, _, _ = model.loss(src, src_lengths, prev, tgt, smoothing=0.1)
        loss.backward()
        results.append({"loss": loss, **{n: p.grad.clone() for n, p in model.named_parameters()
                                          if p.grad is not None}})
    assert results[0].keys() == results[1].keys()   # the same parameters get gradients on both backends
    for name in results[0]:
        torch.testing.assert_close(results[1][name], results[0][name], rtol=1e-10, atol=1e-10,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("name", ["dtmt", "nematus", "mce", "rnnsearch-atr", "gnmt-atr", "deeplau"])
def test_threads_training_one_model_get_the_gradients_of_their_own_batches(name):
    """Three threads take the training loss and its gradients of one model at once (a barrier at each decoder
    step interleaves them): each thread's gradients are those of its batch alone. Before, the step cells'
    `unrolled` sessions were shared by the threads and the gradients came out wrong or missing."""
    model = build(name).double().eval()   # (eval: no dropout; autograd still records)
    if not _has_fused_layers(model):
        pytest.skip("no fused recurrent layer in this system")
    model.set_backend("cpp")
    batches = [toy_batch(seed=s) for s in range(3)]
    params = [p for p in model.parameters() if p.requires_grad]

    def gradients(batch):
        loss, _, _ = model.loss(*batch, smoothing=0.1)
        return torch.autograd.grad(loss, params, allow_unused=True)

    alone = [gradients(b) for b in batches]
    barrier = threading.Barrier(len(batches), timeout=60)
    stepper = next(m for m in model.modules() if isinstance(m, dk.nn.Unrollable))   # runs at every decoder step

    def meet(*_):   # (returns None: a pre-hook's result would replace the module's inputs)
        barrier.wait()

    hook = stepper.register_forward_pre_hook(meet)
    got = [None] * len(batches)

    def run(i):
        try:
            got[i] = gradients(batches[i])
        except BaseException:
            barrier.abort()
            raise

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(batches))]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        hook.remove()
    for i, (g_alone, g_threads) in enumerate(zip(alone, got)):
        assert g_threads is not None, f"thread {i} failed"
        for p_name, a, b in zip([n for n, p in model.named_parameters() if p.requires_grad], g_threads, g_alone):
            assert (a is None) == (b is None), p_name
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m: f"{p_name}: {m}")


def _noisy(name):
    """A system with dropout (and dtmt's candidate dropout) on, in training mode, as built."""
    return build(name, dropout=0.3, **(dict(candidate_dropout=0.3) if name == "dtmt" else {}))


def _tokens(hyps):
    return [[h.tokens for h in sentence] for sentence in hyps]


@pytest.mark.parametrize("name", sorted({n for n, _ in CONFIGS}))
def test_decoding_a_model_in_training_mode_never_switches_its_modes(name):
    """beam_search on a model in training mode decodes an eval copy that shares its parameters (the results of the
    model in eval mode): the model's own modules stay in training mode all through the search (read at every
    module call by a hook the copy shares), so a thread training the model meanwhile keeps its dropout. Before,
    the search switched the shared model to eval mode for the call: a helper's probe saw 178 of 180 updates of a
    training thread run without dropout, and two searches at once leave modules in eval mode after both or decode
    with dropout on."""
    from dtmt_models.decoding.beam_search import beam_search

    model = _noisy(name)
    src, src_lengths, _, _ = toy_batch()
    want = beam_search(copy.deepcopy(model).eval(), src, src_lengths, beam=2, nbest=2, fused=False)
    seen = []
    hooks = [m.register_forward_pre_hook(lambda *_: seen.append(all(m.training for m in model.modules())))
             for m in model.modules()]
    try:
        got = beam_search(model, src, src_lengths, beam=2, nbest=2, fused=False)
    finally:
        for h in hooks:
            h.remove()
    assert seen and all(seen)
    assert all(m.training for m in model.modules())
    assert _tokens(got) == _tokens(want)


@pytest.mark.parametrize("name", sorted({n for n, _ in CONFIGS}))
def test_the_inference_decoder_of_a_model_in_training_mode_decodes_in_eval_mode(name):
    """inference_decoder() of a model in training mode is the decoder of an eval copy (contract §4): it had returned
    the model itself, so a step loop of one's own (a custom validation) decoded with dropout on, each call other
    scores. The model stays in training mode."""
    model = _noisy(name)
    src, src_lengths, _, _ = toy_batch()
    decoder = model.inference_decoder()
    assert decoder is not model and all(m.training for m in model.modules())
    first = torch.full((src.shape[0],), 2, dtype=torch.long)   # (BOS)
    steps = [decoder.step(decoder.encode(src, src_lengths), first)[0] for _ in range(2)]
    want = copy.deepcopy(model).eval()
    torch.testing.assert_close(steps[0], steps[1], rtol=0, atol=0)
    torch.testing.assert_close(steps[0], want.step(want.encode(src, src_lengths), first)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("patch", ["wrapped", "bound"])
def test_a_model_with_a_method_replaced_on_it_still_decodes_in_eval_mode(patch):
    """A method set on the instance (a profiling wrapper, torch.compile of model.step) holds the model itself, which a
    copy would run in training mode: such a model is switched to eval mode for the search and its modes restored
    after (a review found the copy decoding with dropout on); a method bound to the module itself is rebound to the
    copy, which leaves the model's modes alone."""
    from dtmt_models.decoding.beam_search import beam_search

    model = build("transformer", heads=2, encoder_layers=1, decoder_layers=1, hidden_size=32, dropout=0.5)
    src, src_lengths, _, _ = toy_batch()
    want = _tokens(beam_search(copy.deepcopy(model).eval(), src, src_lengths, beam=2, nbest=2))
    calls, step = [], model.step
    if patch == "wrapped":
        model.step = lambda state, prev: calls.append(model.training) or step(state, prev)
    else:
        model.step = types.MethodType(lambda self, state, prev: calls.append(self.training) or step.__func__(
            self, state, prev), model)
    for _ in range(3):
        assert _tokens(beam_search(model, src, src_lengths, beam=2, nbest=2)) == want
        assert all(m.training for m in model.modules())
    assert calls and not any(calls)   # (each step ran in eval mode: the model's own or the copy's)


@pytest.mark.parametrize("name", sorted({n for n, _ in CONFIGS}))
def test_a_decoder_keeps_eval_mode_when_its_model_trains_again(name):
    """A decoder built from a model in eval mode (inference_decoder, as a validation or a server builds it once)
    decodes the same after model.train(): its modules are an eval copy's. Before, the forms answered dropout from
    the model's cells and unreplaced modules were the model's own: after model.train() nematus translated
    otherwise and dtmt refused its state's candidate-dropout masks."""
    from dtmt_models.decoding.beam_search import beam_search

    model = _noisy(name).eval()
    decoder = model.inference_decoder()
    src, src_lengths, _, _ = toy_batch()
    want = beam_search(decoder, src, src_lengths, beam=2, nbest=2, fused=False)
    model.train()
    torch.manual_seed(3)
    assert _tokens(beam_search(decoder, src, src_lengths, beam=2, nbest=2, fused=False)) == _tokens(want)
    assert all(m.training for m in model.modules())


def test_a_batch_checked_is_the_calling_thread_s_and_no_copy_s():
    """checked_batch marks its batch checked for the encode inside the block, and only there: another thread running
    the model on the same tensors checks them, and so does a copy of the model made in the block, after it. Before,
    the mark was the tensors' ids in the model's __dict__: copies kept it (a decoder made while another thread
    trained skipped the check of a later batch whose tensors reused the ids) and other threads' checks were
    skipped."""
    from dtmt_models.models.seq2seq import checked_batch

    model = build("mce")
    src, src_lengths, _, _ = toy_batch()
    errors = []

    def check(m):
        try:
            m.check_batch(src, src_lengths)
        except ValueError as exc:
            errors.append(str(exc))

    with checked_batch(model, src, src_lengths):
        copied = copy.deepcopy(model)
        src_lengths[1] = 0   # (made wrong after the block's check: whoever checks again refuses it)
        check(model)         # this thread, this model, these tensors: taken as checked
        assert errors == []
        other = threading.Thread(target=check, args=(model,))
        other.start()
        other.join()
    check(copied)
    check(model)
    assert len(errors) == 3 and all("src_lengths must be in [1, S=7]" in e for e in errors), errors


def test_vmap_over_stacked_systems_gives_each_its_own_loss_and_gradients():
    """torch.func.vmap of functional_call over two stacked dtmt systems (an ensemble trained at once), cpp backend:
    each loss and its gradients are those of the system alone. Before, the forward's unrolled block put its session's
    Function under vmap, which failed with torch's message about setup_context (a probe of torch's machinery)."""
    from torch.func import functional_call, stack_module_state, vmap

    batch = toy_batch(B=2, S=4, T=3)
    models = []
    for seed in range(2):
        torch.manual_seed(seed)
        models.append(dm.build_model("dtmt", V_SRC, V_TGT, **SMALL).double().eval().set_backend("cpp"))
    params, buffers = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    losses = vmap(lambda p, b: functional_call(base, (p, b), batch)[0])(params, buffers)
    grads = torch.autograd.grad(losses.sum(), list(params.values()))
    for i, model in enumerate(models):
        loss = model.loss(*batch)[0]
        torch.testing.assert_close(losses[i], loss, rtol=1e-10, atol=1e-12)
        alone = dict(zip([n for n, _ in model.named_parameters()], torch.autograd.grad(loss, list(model.parameters()))))
        for (name, _), g in zip(params.items(), grads):
            torch.testing.assert_close(g[i], alone[name], rtol=1e-9, atol=1e-11, msg=lambda m: f"{name}: {m}")


OVERFIT = sorted({n for n, _ in CONFIGS})


@pytest.mark.parametrize("name", OVERFIT)
def test_overfits_sixteen_pairs(name):
    """Loss on 16 sentence pairs falls by >= 90% within a bounded number of Adam steps."""
    options = dict(dropout=0.0)
    if name in ("dtmt", "shallow-rnmt"):
        options["candidate_dropout"] = 0.0
    if name == "transformer":
        options.update(heads=2, encoder_layers=1, decoder_layers=1, hidden_size=64)
    model = build(name, **{**dict(embed_dim=32, hidden_size=32), **options})
    src, src_lengths, prev, tgt = toy_batch(B=16, S=6, T=6, seed=3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    first = None
    for step in range(400):
        opt.zero_grad()
        loss, _, ntok = model.loss(src, src_lengths, prev, tgt)
        (loss / ntok).backward()
        opt.step()
        value = loss.item() / ntok
        first = first if first is not None else value
        if value <= 0.1 * first:
            break
    assert value <= 0.1 * first, f"{name}: loss {first:.3f} -> {value:.3f} after {step + 1} steps"


def zipf_pairs(n_pairs=16, vocab=1000, min_len=20, max_len=30, seed=1):
    """Pairs with a realistic shape: Zipf-distributed tokens (a few very frequent, like "the" and ","),
    20-30 tokens a sentence, the target a word-for-word relabelling of the source."""
    g = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, vocab - 3, dtype=torch.float) ** 1.1
    pairs = []
    for _ in range(n_pairs):
        n = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        s = (torch.multinomial(weights, n, True, generator=g) + 4).tolist()
        pairs.append((s, [(x * 7) % (vocab - 4) + 4 for x in s]))
    return pairs


@pytest.mark.parametrize("name", ["dtmt", "shallow-rnmt"])
def test_leaves_the_unigram_plateau_at_realistic_sizes(name):
    """Regression test for the readout saturation: at vocab 1000, embed 64, hidden 128 and Adam 1e-3 the plain
    readout tanh(W1 y + W2 s + W3 c) of these systems saturates within ~30 steps and the NLL stays at the
    unigram entropy of the targets (4.25 nats here, 4.3 after 100 steps); with the layer-normalised readout it
    keeps falling (about 2.3 after 100 steps)."""
    import math
    from collections import Counter

    from dtmt_models.data.batching import collate
    from dtmt_models.models.loss import label_smoothed_nll

    src, src_lengths, prev, tgt = collate(zipf_pairs())
    counts = Counter(tgt[tgt != 0].tolist())
    total = sum(counts.values())
    unigram_entropy = -sum(c / total * math.log(c / total) for c in counts.values())
    torch.manual_seed(0)
    model = dm.build_model(name, 1000, 1000, embed_dim=64, hidden_size=128)
    opt = torch.optim.Adam(model.parameters(), 1e-3, betas=(0.9, 0.998), eps=1e-9)
    for _ in range(100):
        _, nll, ntok = label_smoothed_nll(model(src, src_lengths, prev), tgt, 0.0)
        opt.zero_grad()
        (nll / ntok).backward()
        opt.step()
    value = float(nll.detach()) / ntok
    assert value < 0.75 * unigram_entropy, (
        f"{name}: NLL {value:.2f} after 100 steps, unigram entropy {unigram_entropy:.2f} (stuck at the plateau)")


@pytest.mark.parametrize("name", ["dtmt", "transformer"])
def test_log_probs_keep_the_model_precision(name):
    """float64 models give float64 log-probabilities (a float32 softmax would cap every check at 1e-7), float32
    models float32, and half-precision models float32 (the softmax is never computed in 16 bits)."""
    src, src_lengths, prev, _ = toy_batch()
    opts = dict(heads=2, encoder_layers=1, decoder_layers=1, hidden_size=32) if name == "transformer" else {}
    for dtype, expected in ((torch.float64, torch.float64), (torch.float32, torch.float32),
                            (torch.bfloat16, torch.float32)):
        model = build(name, **opts).to(dtype).eval()
        if dtype == torch.bfloat16 and hasattr(model, "set_backend"):
            model.set_backend("reference")
        assert model(src, src_lengths, prev).dtype == expected, dtype


def test_positional_encoding_is_the_formula_without_torch_transcendentals(monkeypatch):
    """The PE table (DTMT's x + PE / sqrt(d), the transformer's buffer) against numpy's sin and cos of
    pos / 10000^(2i/d), and the same table from the compiled path's per-position rows; it is built without
    torch's sin, cos and pow, whose float64 CPU versions (MKL's, on two threads) came out an ulp apart in some
    processes on their first call and made translations differ between runs (docs/design/decoding.md, "The first
    call of MKL's vector math")."""
    import numpy as np

    from dtmt_models.models.embeddings import TokenEmbedding, sinusoidal_at, sinusoidal_positions

    for dim in (1, 2, 7, 128):
        pos = np.arange(300, dtype=np.float64)[:, None]
        angle = pos / np.power(10000.0, np.arange(0, dim, 2, dtype=np.float64) / dim)
        expected = np.zeros((300, dim))
        expected[:, 0::2], expected[:, 1::2] = np.sin(angle), np.cos(angle[:, : dim // 2])
        table = sinusoidal_positions(300, dim, dtype=torch.float64)
        np.testing.assert_allclose(table.numpy(), expected, rtol=0, atol=1e-12)
        assert torch.allclose(sinusoidal_at(torch.arange(300), dim), table, rtol=0, atol=1e-12)
    emb = TokenEmbedding(11, 8, positional=True).eval()
    tokens = torch.randint(1, 11, (2, 70))
    plain = emb.embed.weight[tokens]
    with monkeypatch.context() as m:
        for name in ("sin", "cos", "pow"):
            m.setattr(torch, name, lambda *a, **k: pytest.fail("the PE table used torch's transcendentals"))
        got = emb(tokens)
    want = plain + (sinusoidal_positions(70, 8, dtype=torch.float64) / 8 ** 0.5).float()
    assert torch.allclose(got, want, rtol=0, atol=1e-6)
    assert torch.equal(got, plain + emb._table[:70])
    # on the meta device (a model built for its shapes, as loading a checkpoint does) nothing is computed: a
    # transformer of max_len 10^6 took minutes of Python's sin and cos before its weights were even compared
    for meta in (sinusoidal_positions(10 ** 6, 512, device="meta"), _meta_table(10 ** 6, 512)):
        assert meta.is_meta and tuple(meta.shape) == (10 ** 6, 512)


def _meta_table(length, dim):
    from dtmt_models.models.embeddings import sinusoidal_positions

    with torch.device("meta"):
        return sinusoidal_positions(length, dim)


def test_a_decoder_steps_positions_off_the_cpu_are_not_read_on_the_host(monkeypatch):
    """A decoder step's positional encoding on a device other than the CPU reads no position on the host: sizing
    the table by the largest position (the CPU's way) would synchronise a GPU every step, and the device search's
    steps must not (tests/test_gpu_systems.py; its first GPU run, 2026-11-30, counted one per step). On the meta
    device no value can be read, so the step's forward passing there shows it; on the CPU the rows of that path are
    the table's, to the bit."""
    import copy

    import dtmt_kernels as dk
    from dtmt_models.models.embeddings import TokenEmbedding

    emb = TokenEmbedding(11, 8, positional=True).eval()
    tokens, positions = torch.tensor([3, 4, 5]), torch.tensor([0, 7, 300])
    out = copy.deepcopy(emb).to("meta")(tokens.to("meta"), positions=positions.to("meta"))
    assert out.shape == (3, 8) and out.device.type == "meta"
    table = emb(tokens, positions=positions)   # (the CPU's way)
    monkeypatch.setattr(dk.functional, "host_reads_allowed", lambda: False)   # (the way off the CPU)
    assert torch.equal(emb(tokens, positions=positions), table)   # rounded, then scaled, as the table


def test_a_mistyped_name_is_answered_with_the_closest_one():
    """A mistyped model, option, preset or paper row is named with the closest right one (difflib's), and a row's
    name mistyped without --model says so rather than that the default model, dtmt, has no such preset (a review
    found both). A system registered by its user takes only 'small' and 'paper' as preset names (any other had given
    the defaults without a word)."""
    from dtmt_models.models.presets import get_preset, presets_of
    from dtmt_models.models.registered import MODELS, register_model

    with pytest.raises(ValueError, match=r"^unknown model 'DTMTT' \(did you mean 'dtmt'\?\); choose one of "):
        dm.build_model("DTMTT", V_SRC, V_TGT)
    with pytest.raises(ValueError, match=r"^unknown option 'hiden_size' for dtmt \(did you mean 'hidden_size'\?\); "):
        dm.build_model("dtmt", V_SRC, V_TGT, hiden_size=8)
    with pytest.raises(ValueError, match=r"^no paper table row '002-T4-bideep-4x3' \(did you mean "
                                         r"'002-T4-bideep-4x2'\?\) \(`dtmt models` lists them\)$"):
        get_preset("dtmt", "002-T4-bideep-4x3")
    with pytest.raises(ValueError, match=r"; not 'smal' \(did you mean 'small'\?\)$"):
        get_preset("nematus", "smal")
    with pytest.raises(ValueError, match=r"; not 'zzz'$"):   # (nothing close: no guess)
        get_preset("nematus", "zzz")

    @register_model("test-user-system")
    class Mine(torch.nn.Module):
        def __init__(self, src_vocab_size, tgt_vocab_size, width: int = 4):
            super().__init__()
    try:
        assert get_preset("test-user-system", "paper") == get_preset("test-user-system", "small")
        assert presets_of("test-user-system") == ["paper", "small"]
        with pytest.raises(ValueError, match=r"^model 'test-user-system' has no presets of its own: 'small' and "
                                             r"'paper' both give its own defaults and dtmt train's; not 'zzz-typo'$"):
            get_preset("test-user-system", "zzz-typo")
    finally:
        del MODELS["test-user-system"]
    for bad in (5, "", None):   # (5 was taken, and every later list_models() failed in sorting the names)
        with pytest.raises(ValueError, match=re.escape(f"register_model: the name must be a non-empty str, got "
                                                       f"{bad!r}")):
            register_model(bad)


@pytest.mark.parametrize("name", ["dtmt", "transformer"])
def test_a_left_padded_batch_is_refused(name):
    """The padding id inside a sentence's length (a left-padded batch, as some toolkits make them) is a ValueError
    naming it: it had been read with its padding as words and its last words cut, without a word. The same check
    under a capture (no host reads) is a device assertion; a right-padded batch passes both."""
    from dtmt_kernels.ops import _host_reads

    model = build(name).eval()
    src, src_lengths, _, _ = toy_batch()
    model.encode(src, src_lengths)
    shift = torch.stack([torch.roll(row, int(src.shape[1] - n)) for row, n in zip(src, src_lengths)])
    assert not torch.equal(shift, src)   # (some sentence shorter than the batch: its padding now comes first)
    with pytest.raises(ValueError, match=rf"^{type(model).__name__}: src holds the padding id 0 inside a sentence's "
                                         r"length \(src_lengths\): a batch is padded on the right"):
        model.encode(shift, src_lengths)
    with _host_reads.as_captured():
        model.encode(src, src_lengths)
        with pytest.raises(RuntimeError, match="padding id 0 inside a sentence's length"):
            model.encode(shift, src_lengths)


@pytest.mark.parametrize("name", ["transformer", "dtmt", "nematus"])
def test_a_model_built_on_the_meta_device_then_loaded_is_the_model(name):
    """A review's: the transformer built on the meta device (to read its shapes, or to load without a first
    initialisation), then to_empty() and load_state_dict, gave NaN outputs (its positional table, a buffer not saved,
    left uninitialised), and load_state_dict(assign=True) a device error (the table left on the meta device). Both
    ways give the model's outputs, as the RNN systems' do; the table follows a conversion (.double(): float64)."""
    torch.manual_seed(0)
    kw = dict(embed_dim=8, hidden_size=16, heads=2, encoder_layers=1, decoder_layers=1) \
        if name == "transformer" else dict(embed_dim=8, hidden_size=8)
    model = dm.build_model(name, 11, 13, **kw).eval()
    src, lengths = torch.tensor([[4, 5, 6], [7, 8, 0]]), torch.tensor([3, 2])
    prev = torch.tensor([[2, 4, 5], [2, 6, 0]])
    want = model(src, lengths, prev)
    for assign in (False, True):
        with torch.device("meta"):
            built = dm.build_model(name, 11, 13, **kw)
        if not assign:
            built = built.to_empty(device="cpu")
        built.load_state_dict(model.state_dict(), assign=assign)
        torch.testing.assert_close(built.eval()(src, lengths, prev), want, rtol=0, atol=0)
    if name == "transformer":
        from dtmt_models.models.embeddings import sinusoidal_positions
        table = model.pe
        assert model.float().to("cpu").pe is table   # (a conversion that leaves it in place keeps it: a graph's)
        assert torch.equal(model.double().pe, sinusoidal_positions(model.pe.shape[0], 8, dtype=torch.float64))
