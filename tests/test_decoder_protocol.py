"""The Decoder protocol (dtmt_models/engine/decoder.py; issue 75 item 1): every registered system's inference
decoder implements it without adaptation, an ensemble's does, an object with only encode / step / reorder is adapted
and searched as the system it wraps, and what is no decoder is refused in one line."""
import pytest
import torch

import dtmt_models as dm
from conftest import RecordOps
from dtmt_models.data.vocabulary import PAD
from dtmt_models.decoding.beam_search import beam_search
from dtmt_models.decoding.ensemble import Ensemble, EnsembleDecoder
from dtmt_models.engine import AdaptedDecoder, Decoder, as_decoder
from dtmt_models.models.registry import list_models

V = 40


def _model(system, seed=0):
    torch.manual_seed(seed)
    options = dict(embed_dim=16, hidden_size=16) if system != "transformer" else dict(embed_dim=16, hidden_size=32)
    return dm.build_model(system, V, V, **options).eval()


def _batch():
    g = torch.Generator().manual_seed(3)
    src = torch.randint(4, V, (3, 6), generator=g)
    lengths = torch.tensor([6, 4, 2])
    return src.masked_fill(torch.arange(6) >= lengths[:, None], PAD), lengths


@pytest.mark.parametrize("system", list_models())
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_every_system_decodes_through_the_protocol(system, mode):
    """Its inference decoder (eval: the inference form, FusedRNMTDecoder where it applies; train: the model) has
    every member, natively: the padding id, the target bound (the transformer's positions), a one-call search or
    None, and a step from `encode`'s state gives log-probabilities over the vocabulary; reorder_within equals reorder
    for an index within the sentences."""
    model = _model(system)
    model.train(mode == "train")
    decoder = as_decoder(model)
    assert isinstance(decoder, Decoder) and not isinstance(decoder, AdaptedDecoder)
    assert decoder.pad_id == model.pad_id == PAD
    if system == "transformer":
        assert decoder.max_target_steps == model.max_target_steps > 0
    else:
        assert decoder.max_target_steps is None
    assert decoder.search is None or callable(decoder.search)
    with torch.no_grad():
        src, lengths = _batch()
        state = decoder.encode(src, lengths)
        rows = torch.arange(3).repeat_interleave(2)
        state = decoder.reorder(state, rows)
        log_probs, state = decoder.step(state, torch.full((6,), 1))
        assert log_probs.shape == (6, V) and torch.isfinite(log_probs).all()
        within = torch.tensor([1, 0, 2, 3, 5, 4])
        a, b = decoder.reorder(state, within), decoder.reorder_within(state, within)
        assert type(a) is type(b)
        if isinstance(a, dict):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_object_with_encode_step_reorder_is_adapted_and_searched_as_the_system():
    """A decoder of one's own (only encode / step / reorder) gets the defaults (pad_id PAD, no bound, no search,
    reorder_within = reorder) and beam search finds what it finds with the system itself."""
    model = _model("rnnsearch-atr")

    class Own:
        def __init__(self, inner):
            self.encode, self.step, self.reorder = inner.encode, inner.step, inner.reorder

    own = as_decoder(Own(model.inference_decoder()))
    assert isinstance(own, AdaptedDecoder) and isinstance(own, Decoder)
    assert (own.pad_id, own.max_target_steps, own.search) == (PAD, None, None)
    src, lengths = _batch()
    expected = beam_search(model, src, lengths, beam=3, fused=False)
    assert beam_search(own, src, lengths, beam=3) == expected


def test_a_compiled_model_is_decoded_as_the_model_with_a_warning():
    """beam_search(torch.compile(model)): torch.compile compiles forward, which a search never calls; its encode and
    step are the model's, uncompiled. Said in one warning (it had decoded without a word, as if compiled), and the
    hypotheses are the model's own."""
    model = _model("rnnsearch-atr")
    src, lengths = _batch()
    expected = beam_search(model, src, lengths, beam=3)
    with pytest.warns(UserWarning, match="decoding the RNNSearchATR that torch.compile wraps, uncompiled"):
        got = beam_search(torch.compile(model), src, lengths, beam=3)
    assert got == expected


def test_an_ensemble_is_a_decoder_of_decoders():
    ensemble = Ensemble([_model("dtmt"), _model("transformer", seed=1)])
    decoder = as_decoder(ensemble)
    assert isinstance(decoder, EnsembleDecoder) and isinstance(decoder, Decoder) and decoder.search is None
    assert all(isinstance(d, Decoder) for d in decoder.decoders)
    assert decoder.max_target_steps == ensemble.members[1].max_target_steps


def test_what_is_no_decoder_is_refused():
    with pytest.raises(TypeError, match=r"^object is not a decoder: it has no encode, step, reorder "):
        as_decoder(object())

    class StepsOnly:
        def encode(self, src, lengths):
            return {}

        def step(self, state, prev):
            return None, state

    with pytest.raises(TypeError, match="StepsOnly is not a decoder: it has no reorder"):
        as_decoder(StepsOnly())
    with pytest.raises(ValueError, match="int8 decoding: StepsOnly has no inference decoder"):
        as_decoder(StepsOnly(), int8=True)
    with pytest.raises(ValueError, match="int8"):   # the transformer has no int8 weight matrices
        as_decoder(_model("transformer"), int8=True)
    # a model in DataParallel: the model it wraps is named (what to decode instead)
    with pytest.raises(TypeError, match=r"^DataParallel is not a decoder: it has no encode, step, reorder "
                                        r"\(dtmt_models.engine.decoder.Decoder\); it wraps a DTMT: decode its "
                                        r"\.module$"):
        beam_search(torch.nn.DataParallel(_model("dtmt")), *_batch())


# what each system class states (Seq2Seq.fused_step): FusedRNMTDecoder for these, with or without its parts
STATED = {"dtmt": (True, True), "shallow-rnmt": (True, True), "rnnsearch-atr": (True, True), "mce": (True, False),
          "nematus": (True, False)}   # system: (one-call search, source tables)


@pytest.mark.parametrize("system", list_models())
def test_the_fused_step_is_what_the_class_states(system):
    """The export takes the engine's one-call step exactly where the class states it (no method compared), with the
    one-call search and the source tables as stated: mce redefines encode_source (no tables), Nematus encodes on
    its own and embeds without positions."""
    from dtmt_models.engine.rnmt import FusedRNMTDecoder

    model = _model(system)
    decoder = as_decoder(model)
    assert isinstance(decoder, FusedRNMTDecoder) == (system in STATED)
    assert (type(model).fused_step is not None) == (system in STATED)
    if system in STATED:
        search, tables = STATED[system]
        assert (decoder.search is not None, decoder.source_table is not None) == (search, tables)
        assert decoder.layered == (system == "nematus")


def _stepped(model, src, lengths, tokens):
    """log-probabilities [B, T, V] of `model`'s own steps (its modules) over `tokens` [B, T]."""
    with torch.no_grad():
        state, out = model.encode(src, lengths), []
        for t in range(tokens.shape[1]):
            lp, state = model.step(state, tokens[:, t])
            out.append(lp)
    return torch.stack(out, 1)


def test_a_subclass_that_redefines_the_step_loses_the_fused_step():
    """A subclass that redefines a method of the step (in its body or through a mixin), without stating
    `fused_step`, decodes with its own methods (not the fused op, which would compute its base's step); one that
    states it again keeps it; one that redefines an encode method keeps the step without the source tables, and
    decodes as its modules do."""
    from dtmt_models.engine.rnmt import FusedRNMTDecoder, FusedStep
    from dtmt_models.models.systems.dtmt import DTMT

    class Halved(DTMT):
        def transition(self, state, y, keep_attention=True):
            (s, c), state = super().transition(state, 0.5 * y, keep_attention)
            return (s, c), state

    class Stated(Halved):
        fused_step = FusedStep()   # (wrongly, for the test: the statement is taken as given)

    class Doubled(DTMT):
        def encode_source(self, src, src_lengths):
            return 2.0 * super().encode_source(src, src_lengths)

    class HalvedMixin:   # the same step change from a mixin ahead of the system in the class's order
        def transition(self, state, y, keep_attention=True):
            return super().transition(state, 0.5 * y, keep_attention)

    class Mixed(HalvedMixin, DTMT):
        pass

    assert Halved.fused_step is None and Stated.fused_step == FusedStep() and DTMT.fused_step is not None
    assert Mixed.fused_step is None
    assert Doubled.fused_step is not None and not Doubled.fused_step.tabled_encoder
    src, lengths = _batch()
    tokens = torch.randint(4, V, (3, 4), generator=torch.Generator().manual_seed(1))
    for cls, fused in ((Halved, False), (Mixed, False), (Stated, True), (Doubled, True)):
        torch.manual_seed(0)
        model = cls(V, V, embed_dim=16, hidden_size=16).double().eval()
        decoder = as_decoder(model)
        assert isinstance(decoder, FusedRNMTDecoder) == fused
        if cls is Stated:
            continue
        if fused:
            assert decoder.source_table is None
        reference = cls(V, V, embed_dim=16, hidden_size=16).double().eval()
        reference.load_state_dict(model.state_dict())
        reference.set_backend("reference")
        torch.testing.assert_close(_stepped(decoder, src, lengths, tokens), _stepped(reference, src, lengths, tokens),
                                   rtol=1e-10, atol=1e-10)


def test_teacher_forcing_steps_through_a_redefined_decoder_step():
    """Teacher forcing runs `transition` batched over the steps, or, for a class whose `decoder_step` is not
    Seq2Seq's (here from a mixin; stated at class creation: stepwise_teacher_forcing), that method step by step:
    its log-probabilities are its own steps'."""
    from dtmt_models.models.systems.dtmt import DTMT

    class ShiftedMixin:
        def decoder_step(self, state, prev_tokens):
            features, state = super().decoder_step(state, prev_tokens)
            return features + 0.25, state

    class Shifted(ShiftedMixin, DTMT):
        pass

    assert Shifted.stepwise_teacher_forcing and not DTMT.stepwise_teacher_forcing
    torch.manual_seed(0)
    model = Shifted(V, V, embed_dim=16, hidden_size=16).double().eval()
    src, lengths = _batch()
    tokens = torch.randint(4, V, (3, 4), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        forced = model(src, lengths, tokens)
    torch.testing.assert_close(forced, _stepped(model, src, lengths, tokens), rtol=1e-12, atol=1e-12)
    plain = DTMT(V, V, embed_dim=16, hidden_size=16).double().eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert not torch.allclose(plain(src, lengths, tokens), forced)


@pytest.mark.parametrize("system", list_models())
def test_16_bit_decoding_runs_a_copy_under_autocast(system):
    """as_decoder(model, amp="bf16"): an AutocastDecoder of a bfloat16 copy (the model's own weights untouched, still
    float32), whose steps multiply in bfloat16 and return float32 log-probabilities near the float32 decoder's (bf16
    rounding of weights and activations: within 0.1 at these sizes), searched by the loops as any decoder. (On the
    CPU here: the same code `dtmt translate --amp bf16 --device cuda` runs.)"""
    model = _model(system)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    decoder = as_decoder(model, amp="bf16")
    assert isinstance(decoder, Decoder) and decoder.search is None
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    copied = dict(decoder.model.named_parameters())
    assert copied.keys() == dict(model.named_parameters()).keys()
    assert all(p.dtype == torch.bfloat16 for p in copied.values())
    if system == "nematus":   # its target embedding and output layer are one matrix: in the copy too
        assert decoder.model.readout.output.proj.weight is decoder.model.tgt_embed.weight
    full = as_decoder(model)
    src, lengths = _batch()
    with torch.no_grad():
        with RecordOps() as record:
            low, _ = decoder.step(decoder.encode(src, lengths), torch.full((3,), 1))
        ops = record.dispatched
        high, _ = full.step(full.encode(src, lengths), torch.full((3,), 1))
    assert low.dtype == torch.float32 and torch.isfinite(low).all()
    assert any(dtype == torch.bfloat16 for name, dtype in ops if name in ("aten.mm", "aten.addmm", "aten.bmm",
                                                                          "aten.linear", "dtmt.transition_forward"))
    torch.testing.assert_close(low, high, rtol=0, atol=0.1)
    assert not torch.equal(low, high)   # (16-bit rounding shows: not the float32 decoder's numbers)
    hyps = beam_search(decoder, src, lengths, beam=2, max_len_b=4)
    assert len(hyps) == 3 and all(h and torch.isfinite(torch.tensor(float(h[0].score))) for h in hyps)


def test_16_bit_decoding_refusals():
    model = _model("dtmt")
    with pytest.raises(ValueError, match="amp must be one of bf16, fp16, got 'fp8'"):
        as_decoder(model, amp="fp8")
    with pytest.raises(ValueError, match="int8 and 16-bit decoding exclude each other"):
        as_decoder(model, int8=True, amp="bf16")
    # the model's weights changed after its 16-bit copy was made: refused, as a fused or int8 decoder's change is
    # (the copy had decoded the old weights without a word)
    decoder = as_decoder(model, amp="bf16")
    src, lengths = _batch()
    beam_search(decoder, src, lengths, beam=2, max_len_b=3)
    with torch.no_grad():
        next(model.parameters()).mul_(0.5)
    with pytest.raises(RuntimeError, match=r"^AutocastDecoder: its model.s weights changed \(an optimizer step"):
        beam_search(decoder, src, lengths, beam=2, max_len_b=3)


@pytest.mark.parametrize("system", ["dtmt", "nematus"])
def test_the_commands_16_bit_decoder_keeps_no_float32_weights(system):
    """`dtmt translate / evaluate / serve --amp bf16` (cli.common.build_decoder): the loaded model is converted in
    place, so the decoder's 16-bit copy shares its storage and no float32 weights stay on the device beside it; the
    decoder's log-probabilities are those of as_decoder's copy of the float32 model (the same bf16 rounding)."""
    from dtmt_models.cli.common import build_decoder

    model = _model(system)
    reference = as_decoder(model, amp="bf16")       # a copy; the model stays float32
    decoder = build_decoder(model, amp="bf16")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(b.dtype == torch.bfloat16 for b in model.buffers() if b.is_floating_point())
    ours = dict(model.named_parameters())
    assert {n: p.data_ptr() for n, p in decoder.model.named_parameters()} == {n: p.data_ptr() for n, p in ours.items()}
    src, lengths = _batch()
    with torch.no_grad():
        low, _ = decoder.step(decoder.encode(src, lengths), torch.full((3,), 1))
        ref, _ = reference.step(reference.encode(src, lengths), torch.full((3,), 1))
    assert low.dtype == torch.float32
    torch.testing.assert_close(low, ref, rtol=0, atol=0)
    plain = _model(system)
    build_decoder(plain)                             # --amp off: the model stays float32
    assert all(p.dtype == torch.float32 for p in plain.parameters())


def test_the_engine_s_forms_decode_without_dropout_whatever_their_source_s_mode():
    """A form (inference_form) answers what it lacks from the layer it stands for: a layer training again made the
    form's candidate-dropout masks, and its outputs random (a review found it). A form draws none; inference_copy of
    a model in training mode, whose copy would share its dropout, is refused in one line."""
    import dtmt_kernels as dk
    from dtmt_models.engine.forms import inference_copy, inference_form

    torch.manual_seed(0)
    layer = dk.nn.DeepTransitionGRU(8, 6, depth=1, candidate_dropout=0.5).eval()
    cell = dk.nn.DeepTransitionGRUCell(8, 6, depth=1, candidate_dropout=0.5).eval()
    x = torch.randn(3, 2, 8)
    forms = inference_form(layer), inference_form(cell)
    want = layer(x)[0], cell(x[0])
    layer.train(), cell.train()
    for _ in range(2):
        torch.testing.assert_close(forms[0](x)[0], want[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(forms[1](x[0]), want[1], rtol=1e-6, atol=1e-6)
    model = dm.build_model("dtmt", V, V, embed_dim=16, hidden_size=16, dropout=0.5, candidate_dropout=0.5)
    with pytest.raises(ValueError, match=r"^inference_copy: DTMT is in training mode .* pass an eval copy"):
        inference_copy(model.train())


def test_a_decoder_s_own_search_refuses_a_max_len_past_the_bound_before_building_anything():
    """FusedRNMTDecoder.search (a member of the protocol) with max_len 10^9 built a position table of that many rows
    before the op's bound was checked: the process was killed for memory (a review found it)."""
    decoder = _model("dtmt").inference_decoder()
    src, lengths = _batch()
    state = decoder.encode(src, lengths)
    with pytest.raises(ValueError, match=r"^FusedRNMTDecoder.search: max_len must be in \[1, 16,384\], got "
                                         r"1000000000$"):
        decoder.search(state, 2, 0.6, torch.tensor([10 ** 9, 6, 6]))


def test_a_fused_decoder_is_neither_copied_nor_pickled():
    """A copy of a fused decoder read parameters other than its model's and was then refused as if the weights had
    changed in place (a review found it): copying or pickling one says what to do instead."""
    import copy
    import pickle

    decoder = _model("dtmt").inference_decoder()
    for attempt in (copy.deepcopy, copy.copy, pickle.dumps):
        with pytest.raises(TypeError, match=r"^FusedRNMTDecoder: a decoder holds weights .* copy or send the model, "
                                            r"then build its decoder"):
            attempt(decoder)


def test_an_inference_copy_of_forms_is_copied_and_pickled_as_a_decoder_of_its_own():
    """A deep copy or an unpickled copy of a model's inference copy (deeplau's: its cells' forms gathered weights)
    was refused at its first search as if its weights had changed in place (the record named the original's
    tensors). It now decodes as the original does, and an optimizer step on the original leaves it valid; a copy of
    an inference copy whose weights changed is refused, not copied as a fresh one."""
    import copy
    import io

    model = _model("deeplau")
    decoder = model.inference_decoder()
    assert decoder is not model and decoder.__dict__.get("_built_as") is not None
    src, lengths = _batch()
    want = beam_search(decoder, src, lengths, beam=2, nbest=2)
    buffer = io.BytesIO()
    torch.save(decoder, buffer)
    copies = [copy.deepcopy(decoder), torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)   # (the original's weights move: its own decoder is stale, the copies are not)
    for copied in copies:
        got = beam_search(copied, src, lengths, beam=2, nbest=2)
        assert [[(h.tokens, h.score) for h in hyps] for hyps in got] == \
            [[(h.tokens, h.score) for h in hyps] for hyps in want]
    with pytest.raises(RuntimeError, match="weights changed in place"):
        beam_search(decoder, src, lengths, beam=2)
    with pytest.raises(RuntimeError, match="weights changed in place"):
        copy.deepcopy(decoder)
