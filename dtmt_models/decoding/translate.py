"""Translation with a trained checkpoint: the library call the trainer uses for dev BLEU, and `dtmt translate`.

    translate(model, src_vocab, tgt_vocab, sentences, beam=4, ...)   -> per sentence, its n-best (text, score)
    translate_best(model, src_vocab, tgt_vocab, sentences, ...)      -> the one-best strings
    dtmt translate --checkpoint C [FILE ...] [--output F | --output-dir D] [--nbest N]

How a list of sentences is decoded:
  * each line is segmented with the source SentencePiece model; a line with no subwords (empty or only
    whitespace) translates to the empty string without reaching the model (the encoders need >= 1 token);
  * a source longer than `max_src_len` subwords is cut to that length (counted, and reported once with a
    `TruncationWarning`) instead of failing or exhausting memory;
  * the sources are sorted by length (longest first, so an out-of-memory shows up at once) and cut into
    batches whose padded size, sentences x longest source, stays within `max_tokens` (a single longer source
    forms a batch of its own);
  * every batch goes through `beam_search` with the model in eval mode under `torch.no_grad()` (not
    `torch.inference_mode()`: tensors it creates can never re-enter autograd, which custom autograd
    Functions and callers that train afterwards, like the trainer's validation, must not have to care
    about); a model in training mode decodes as an eval copy, its own modules' modes untouched (evaluating);
  * the results are put back in input order and detokenised with the target SentencePiece model.
Beam search treats every sentence of a batch independently, so max_tokens changes the scores only by rounding:
float rounding (float64 gives the same translations in any batches), which with int8 weights can move an
activation across a quantization step (a score ~1e-3 apart, one sentence in some hundreds); in float32 or int8 that
can flip a near tie between two hypotheses (docs/usage.md, "Translating").

The command line reads every input first (so a bad file fails before any decoding), decodes all their lines
together, and writes each output atomically (a temporary file renamed into place). The exception is stdin to
stdout, which streams: the lines that have arrived (up to 1,024) are decoded together and written, flushed, in
input order, while a reader thread takes in the next ones; a bad line then stops it after the lines before it.
Several inputs go to one output (stdout or --output) in input order, or with --output-dir to
`D/<input basename>.out` each. With --nbest N the output is in Moses n-best format, `index ||| translation |||
F0= score ||| score` (the four fields Moses and Marian write), the index counting the lines of each input from 0
and the score the length-normalised log-probability that ranks the beam.
Errors a user can cause are one line on stderr: exit status 2 for what the options name (a missing, foreign or
mismatched checkpoint, a missing input, an unavailable backend or device: contract §6), 1 for what is found while
working (unreadable input, invalid UTF-8 with file:line).
"""
from __future__ import annotations

import collections.abc
import numbers
import warnings
from typing import Callable, List, Optional, Sequence, Tuple, Type, TypeVar

import torch

from dtmt_models.data.batching import length_batches
from dtmt_models.data.vocabulary import UNK, Vocabulary
from dtmt_models.decoding.beam_search import NonFiniteScores, beam_search, check_search_arguments
from dtmt_models.engine.decoder import as_decoder, built_from
from dtmt_models.errors import check_device_present, one_line
from dtmt_models.models.modes import evaluating

PROG = "dtmt translate"
T = TypeVar("T")
Progress = Callable[[int, int], None]


class InputWarning(UserWarning):
    """Something about the sources that the user should know; `dtmt translate` shows it as one line. `positions`:
    the sentences it is about (0-based, in the call's `sentences`); `note`: what it says of each of them, without
    naming it (`dtmt serve` answers a request with the notes of its own sentences)."""

    def __init__(self, message: str, positions: Sequence[int] = (), note: str = ""):
        super().__init__(message)
        self.positions, self.note = tuple(positions), note


class TruncationWarning(InputWarning):
    """Some sources were longer than `max_src_len` subwords and were cut."""


class UnknownPiecesWarning(InputWarning):
    """Some sources are mostly pieces the source vocabulary does not know: the model can only guess at them."""


class InputError(Exception):
    """A problem with the command line's inputs or settings; the message is shown as is, on one line."""


# ------------------------------------------------------------------------------------------- library
_REISSUED: set = set()   # (text, category, file, line) of the other warnings input_warnings has issued again
_MAX_REISSUED = 1024
# The most scores a batch's search step holds, sentences x beam x target vocabulary (256 MB in float32): a batch
# holds no more sentences than keep it there. --max-tokens counts source subwords only, so short lines at a wide beam
# made batches of 1,000 sentences (5 GB at beam 64 and 4k words, against 0.6 GB in batches of 50, decoding as fast).
MAX_STEP_SCORES = 1 << 26


def input_warnings(call: Callable[[], T], category: Type[Warning] = InputWarning,
                   caught: Optional[List[Warning]] = None) -> Tuple[T, List[str]]:
    """(call(), the messages of the warnings of `category` it raised, in order; the warnings themselves appended to
    `caught` where it is given); any other warning it raised is
    issued again, once a process for each text and place, as Python shows it by default (inside catch_warnings
    Python forgets what it has shown: a library's warning came again at every validation of `dtmt train` and every
    request of `dtmt serve`). How `dtmt translate`, `dtmt serve` and training's dev BLEU turn a call's warnings into
    their one-line reports."""
    with warnings.catch_warnings(record=True) as recorded:
        warnings.simplefilter("always", category)
        result = call()
    messages = []
    for w in recorded:
        if issubclass(w.category, category):
            messages.append(str(w.message))
            if caught is not None:
                caught.append(w.message)
            continue
        key = (str(w.message), w.category, w.filename, w.lineno)
        if key not in _REISSUED:
            if len(_REISSUED) < _MAX_REISSUED:   # (texts that vary, e.g. with a number, do not grow it for ever)
                _REISSUED.add(key)
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return result, messages


def _model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _encodes(text: str) -> bool:
    """Whether `text` is valid Unicode (UTF-8 has no lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def translate(model: torch.nn.Module, src_vocab: Vocabulary, tgt_vocab: Vocabulary, sentences: Sequence[str],
              beam: int = 4, alpha: float = 0.6, nbest: int = 1, max_tokens: int = 2000, max_len_a: float = 2.0,
              max_len_b: int = 10, device=None, progress: Optional[Progress] = None,
              max_src_len: Optional[int] = 250, decoder=None, early_stop: bool = False,
              max_sentences: Optional[int] = None, penalty: str = "gnmt",
              where: Optional[Callable[[int], str]] = None) -> List[List[Tuple[str, float]]]:
    """Translates `sentences` (plain text, one sentence each); returns for every sentence, in input order, its
    up to `nbest` best (translation, length-normalised log-probability) pairs, best first.

    An empty or whitespace-only sentence gives [("", 0.0)]. `device` is where the batches go (None: the
    model's device; the model itself is not moved). `progress(done, total)` is called after every batch with
    the number of sentences finished. `max_src_len` (None: no limit) cuts longer sources, with one
    `TruncationWarning` per call, as are sources longer than the model has positions for (`model.max_source_steps`,
    the transformer's `max_len`); sources of which more than half the pieces are unknown to the source
    vocabulary give one `UnknownPiecesWarning` per call (the model would otherwise invent a fluent sentence
    without a word of notice). `decoder`: `model.inference_decoder()` built by a caller that translates many times
    with unchanging weights (a server), of this model (ValueError where it says it was built from another:
    engine.decoder.built_from); None builds it here, once per call. `early_stop`: beam_search's (a
    sentence ends once it has `beam` finished hypotheses). `max_sentences` (None: no bound) caps a batch's
    sentences as `max_tokens` caps its padded source subwords (OpenNMT-py's and fairseq's --batch-size), and a
    batch's search keeps at most MAX_STEP_SCORES scores a step (fewer sentences at a wide beam). A model
    that scores NaN or +inf raises NonFiniteScores naming the sentence (1-based, in `sentences`) and the step.
    `penalty`: the length penalty, "gnmt" (with `alpha`) or "average" (beam_search's). `where(i)` names sentence i
    (0-based) in the warnings and that error, e.g. "file:line" for a command's inputs (None: "sentence i+1")."""
    check_search_arguments(beam, nbest, alpha, max_len_a, max_len_b, penalty, early_stop)
    if device is None and not isinstance(model, torch.nn.Module):   # (a decoder given as the model: an
        # AttributeError on .parameters, where the device is taken from them)
        raise TypeError(f"translate: {type(model).__name__} has no parameters to take the device from: give "
                        f"device=, or pass the model itself (a decoder built from it goes in decoder=)")
    if decoder is not None and isinstance(model, torch.nn.Module):   # (the model's own: of the model it was built
        source = built_from(decoder)                                   # from, where it is itself a prepared copy)
        if source is not None and source is not built_from(model):   # (it decoded with the other's weights, unsaid)
            raise ValueError(f"translate: decoder= was built from another {type(source).__name__} than the model "
                             f"given; build it from this one (model.inference_decoder()) or leave it out")
    for side, vocab, size in (("source", src_vocab, getattr(model, "src_vocab_size", None)),
                              ("target", tgt_vocab, getattr(model, "tgt_vocab_size", None))):
        if size is not None and len(vocab) != size:   # (decoded with another vocabulary: fluent nonsense)
            raise ValueError(f"translate: the {side} vocabulary has {len(vocab)} pieces, the model's {size}")
    digests = getattr(model, "vocab_digests", None)   # (load_model's; a model built otherwise has none)
    if digests is not None:
        for side, vocab, own, other in (("source", src_vocab, *digests), ("target", tgt_vocab, *digests[::-1])):
            if vocab.digest != own:   # (of the same size: another corpus's, or the two swapped)
                raise ValueError(f"translate: the {side} vocabulary is not the model's"
                                 + (f" but its {'target' if side == 'source' else 'source'} one (swapped)"
                                    if vocab.digest == other else " (the same size, other pieces)")
                                 + "; pass the vocabularies load_model returned with it")
    for arg, value, optional in (("max_tokens", max_tokens, False), ("max_sentences", max_sentences, True),
                                 ("max_src_len", max_src_len, True)):
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            # (None or 2.5 failed later as a TypeError of a comparison or a slice; 1.5 passed)
            raise ValueError(f"{arg} must be >= 1{' or None' if optional else ''}, a whole number, got {value!r}")
    if isinstance(sentences, str):
        raise TypeError("translate: `sentences` must be a sequence of strings, not one string")
    if not isinstance(sentences, collections.abc.Sequence):   # (a dict translated its keys, a set in no order; a
        raise TypeError(f"translate: `sentences` must be a sequence of strings (a list), got "   # generator failed
                        f"{type(sentences).__name__}")                                         # once used up)
    odd = next((i for i, text in enumerate(sentences) if not isinstance(text, str)), None)
    if odd is not None:   # (None was an AttributeError on .strip)
        raise TypeError(f"translate: `sentences` must be strings, got {type(sentences[odd]).__name__} at {odd}")
    odd = next((i for i, text in enumerate(sentences) if not text.isascii() and not _encodes(text)), None)
    if odd is not None:   # (SentencePiece's pybind cast failed: "Unable to cast Python instance of type str")
        raise ValueError(f"translate: sentence {odd} (0-based) is not valid Unicode (a lone surrogate)")
    positions = getattr(model, "max_source_steps", None)
    if positions is not None and (max_src_len is None or positions < max_src_len):
        max_src_len = positions   # (the model's own bound: past it, its encoder has no position)
    try:
        device = _model_device(model) if device is None else torch.device(device)
    except (RuntimeError, TypeError) as exc:   # (torch's own: "Expected one of cpu, cuda, ipu, xpu, ... at start")
        raise ValueError(f"translate: device {device!r} is not a device torch knows ({one_line(exc)})") from None
    check_device_present(device, "translate")
    total = len(sentences)
    results: List[List[Tuple[str, float]]] = [[("", 0.0)] for _ in range(total)]
    ids: List[List[int]] = []
    todo: List[int] = []                        # positions of the sentences that reach the model
    truncated: List[int] = []                   # positions of the sources cut
    unknown: List[int] = []                     # positions of the mostly-unknown sources
    boundary = src_vocab.sp.piece_to_id("\u2581")
    for i, text in enumerate(sentences):
        tokens = src_vocab.encode(text, most=max_src_len) if text.strip() else []   # (a head of a long line)
        if not tokens:
            continue
        pieces = [t for t in tokens if t != boundary]  # a bare word boundary says nothing about the words
        if 2 * sum(t == UNK for t in pieces) > len(pieces):
            unknown.append(i)
        if max_src_len is not None and len(tokens) > max_src_len:
            tokens = tokens[:max_src_len]
            truncated.append(i)
        todo.append(i)
        ids.append(tokens)
    name = where if where is not None else (lambda i: f"sentence {i + 1}")
    of_total = "" if where is not None else f" of {total}"   # (a command's call may be one group of its input)

    def shown(positions: List[int]) -> str:
        return ", ".join(name(i) for i in positions[:5]) + (", ..." if len(positions) > 5 else "")

    if truncated:
        warnings.warn(TruncationWarning(
            f"{len(truncated)}{of_total} source sentence(s) had more than {max_src_len} subwords and were truncated "
            f"to {max_src_len} ({shown(truncated)})", truncated,
            f"the source had more than {max_src_len} subwords and was truncated to {max_src_len}"), stacklevel=2)
    if unknown:
        warnings.warn(UnknownPiecesWarning(
            f"{len(unknown)}{of_total} source sentence(s) are mostly pieces unknown to the model's source vocabulary "
            f"({shown(unknown)}): their translations are guesses, not translations", unknown,
            "the source is mostly pieces unknown to the model's source vocabulary: the translation is a guess"),
            stacklevel=2)
    done = total - len(todo)
    if progress is not None:
        progress(done, total)
    with evaluating(model) as model, torch.no_grad():   # (a model in training mode: an eval copy, its modes untouched)
        # built once for every batch (the weights do not change here); a duck-typed model decodes as it is
        if decoder is None:
            decoder = as_decoder(model) if ids else model
        widest = max(1, MAX_STEP_SCORES // (beam * len(tgt_vocab)))   # (sentences whose step scores fit the bound)
        for batch in length_batches([len(t) for t in ids], max_tokens, min(max_sentences or widest, widest)):
            width = max(len(ids[j]) for j in batch)
            # the padded rows as one list (PAD = 0): one tensor made, not one row written at a time
            src = torch.tensor([ids[j] + [0] * (width - len(ids[j])) for j in batch], dtype=torch.long)
            lengths = torch.tensor([len(ids[j]) for j in batch], dtype=torch.long)
            try:
                hyps = beam_search(decoder, src.to(device), lengths.to(device), beam=beam, alpha=alpha, nbest=nbest,
                                   max_len_a=max_len_a, max_len_b=max_len_b, early_stop=early_stop,
                                   penalty=penalty)
            except NonFiniteScores as exc:   # named by its place in `sentences`, not in the batch
                s, n = exc.sentence, int(lengths[exc.sentence])
                member = non_finite_member(decoder, src[s:s + 1, :n].to(device), lengths[s:s + 1].to(device),
                                           beam=beam, alpha=alpha, nbest=nbest, max_len_a=max_len_a,
                                           max_len_b=max_len_b, early_stop=early_stop, penalty=penalty)
                raise NonFiniteScores(exc.score, exc.step, s, name(todo[batch[s]]), member) from None
            for j, sentence_hyps in zip(batch, hyps):
                results[todo[j]] = [(tgt_vocab.decode(h.tokens), float(h.score)) for h in sentence_hyps]
            done += len(batch)
            if progress is not None:
                progress(done, total)
    return results


def non_finite_member(decoder, src: torch.Tensor, lengths: torch.Tensor, **search) -> Optional[int]:
    """The first member (from 1) of an ensemble's `decoder` whose own search of the sentence `src` [1, S] scores a
    candidate NaN or +inf, which an ensemble's error names (the mean of the members' scores had named no member);
    None for a decoder of one model, or where no member alone does (the mean overflowed). The error's path only."""
    for i, member in enumerate(getattr(decoder, "decoders", None) or [], start=1):
        try:
            beam_search(member, src, lengths, **search)
        except NonFiniteScores:
            return i
    return None


def translate_best(model: torch.nn.Module, src_vocab: Vocabulary, tgt_vocab: Vocabulary,
                   sentences: Sequence[str], **kwargs) -> List[str]:
    """The one-best translation of every sentence, in input order (keyword arguments as `translate`, without
    nbest)."""
    if "nbest" in kwargs:
        raise TypeError("translate_best: nbest is always 1")
    return [hyps[0][0] if hyps else "" for hyps in translate(model, src_vocab, tgt_vocab, sentences, **kwargs)]
