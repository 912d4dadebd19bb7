"""Ensembles: several models decoded as one, their log-probabilities averaged at every step.

    ensemble = Ensemble([model_a, model_b])          # any systems with the Seq2Seq decoding interface
    translate(ensemble, src_vocab, tgt_vocab, sentences)

At step t the ensemble scores the next token as the mean of its members' log-probabilities,
log p(y_t | y_<t, x) = (1/M) sum_m log p_m(y_t | y_<t, x) (a log-linear combination: the scores are not
renormalised, as in Marian and Nematus; with one member, or M copies of one model, they are that model's). Every member
encodes the source itself and keeps its own state; beam search reorders the members' states together. The
members must share the source and target vocabularies (`check_vocabularies`), not the architecture: a dtmt and an
rnnsearch-atr model trained on one prepared corpus form an ensemble.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch
from torch import Tensor, nn

from dtmt_models.engine.decoder import as_decoder


class EnsembleDecoder:
    """encode / step / reorder over the members' decoders (what `beam_search` drives). The state is the tuple
    of the members' states."""

    search = None   # (the Decoder protocol's: beam_search's loop drives it)

    def __init__(self, decoders: Sequence):
        self.decoders = [as_decoder(d) for d in decoders]
        pads = {d.pad_id for d in self.decoders}
        if len(pads) > 1:
            raise ValueError(f"Ensemble: the models pad with different ids {sorted(pads)}")
        self.pad_id = pads.pop()   # what beam_search never chooses, with BOS
        steps = [d.max_target_steps for d in self.decoders if d.max_target_steps is not None]
        self.max_target_steps = min(steps) if steps else None   # (a transformer member's positions end there)

    def encode(self, src: Tensor, src_lengths: Tensor) -> Tuple:
        return tuple(d.encode(src, src_lengths) for d in self.decoders)

    def step(self, state: Tuple, prev_tokens: Tensor) -> Tuple[Tensor, Tuple]:
        """(mean of the members' log-probabilities [B, V] in float32 or wider, the new states)."""
        total, states = None, []
        for d, s in zip(self.decoders, state):
            log_probs, s = d.step(s, prev_tokens)
            log_probs = log_probs.float() if log_probs.dtype in (torch.float16, torch.bfloat16) else log_probs
            total = log_probs.clone() if total is None else total.add_(log_probs)
            states.append(s)
        return total.div_(len(self.decoders)), tuple(states)

    def reorder(self, state: Tuple, index: Tensor) -> Tuple:
        return tuple(d.reorder(s, index) for d, s in zip(self.decoders, state))

    def reorder_within(self, state: Tuple, index: Tensor) -> Tuple:
        """beam_search's reorder within sentences: each member's own where it has one."""
        return tuple(d.reorder_within(s, index) for d, s in zip(self.decoders, state))


class Ensemble(nn.Module):
    """Models decoded together (see the module docstring); an nn.Module so that `translate` can switch it to eval
    mode and find its device. `inference_decoder()` builds each member's inference decoder once."""

    def __init__(self, models: Sequence[nn.Module]):
        super().__init__()
        models = list(models)   # (a generator had been used up by the checks: an ensemble of no member)
        if not models:
            raise ValueError("Ensemble: give at least one model")
        odd = next((i for i, m in enumerate(models, start=1) if not isinstance(m, nn.Module)), None)
        if odd is not None:   # (None had failed in sorting the vocabulary sizes: "'<' not supported ...")
            raise TypeError(f"Ensemble: model {odd} is a {type(models[odd - 1]).__name__}, not a model "
                            f"(a torch.nn.Module, e.g. load_model's)")
        vocab_sizes = {(getattr(m, "src_vocab_size", None), getattr(m, "tgt_vocab_size", None)) for m in models}
        if len(vocab_sizes) > 1:
            raise ValueError(f"Ensemble: the models' (source, target) vocabulary sizes differ: {sorted(vocab_sizes)}")
        digests = [getattr(m, "vocab_digests", None) for m in models]   # (load_model's: which vocabularies)
        known = [(i, d) for i, d in enumerate(digests, start=1) if d is not None]
        for i, d in known[1:]:
            if d != known[0][1]:
                side = "source" if d[0] != known[0][1][0] else "target"
                raise ValueError(f"Ensemble: model {i}'s {side} vocabulary is not model {known[0][0]}'s (the same "
                                 f"size, other pieces); an ensemble needs models trained on one prepared corpus")
        self.members = nn.ModuleList(models)
        self.src_vocab_size, self.tgt_vocab_size = next(iter(vocab_sizes))   # (what translate checks)
        self.vocab_digests = known[0][1] if known else None
        bounds = [m.max_source_steps for m in models if getattr(m, "max_source_steps", None) is not None]
        self.max_source_steps = min(bounds) if bounds else None   # (a transformer member's source positions)

    def inference_decoder(self, int8: bool = False) -> EnsembleDecoder:
        """Each member's inference decoder (`int8`: each with int8 weight matrices; ValueError if one cannot)."""
        decoders = []
        for i, m in enumerate(self.members, start=1):
            try:
                decoders.append(as_decoder(m, int8))
            except ValueError as err:   # (the member's own reason: its system, or what int8 decoding needs)
                if not int8:
                    raise
                raise ValueError(f"int8 decoding of an ensemble: member {i}: {err}") from None
        decoder = EnsembleDecoder(decoders)
        decoder.built_from = self   # (engine.decoder.built_from's answer, which translate checks)
        return decoder

    def forward(self, *args, **kwargs):
        raise TypeError("Ensemble decodes only (translate / beam_search); train its members one by one")


def check_vocabularies(names: Sequence[str], vocabularies: Sequence[Tuple]) -> None:
    """ValueError naming the first model whose (source, target) Vocabulary differs from the first model's: an
    ensemble's members must segment the source and number the target pieces identically."""
    first_src, first_tgt = vocabularies[0]
    for name, (src, tgt) in zip(names[1:], vocabularies[1:]):
        for side, a, b in (("source", first_src, src), ("target", first_tgt, tgt)):
            if a.proto != b.proto:
                size = (f"{len(b)} pieces against {len(a)}" if len(a) != len(b) else
                        f"{len(a)} pieces each, not the same ones")   # ("4000 and 4000 pieces" read as equal)
                raise ValueError(f"{name}: its {side} vocabulary differs from {names[0]}'s ({size}); an ensemble "
                                 f"needs models trained on one prepared corpus")
