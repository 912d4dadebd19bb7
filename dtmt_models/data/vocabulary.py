"""Subword vocabularies: SentencePiece (BPE or unigram), trained on the training side only and saved with
the model (the serialized model travels inside checkpoints). Ids: pad 0, unk 1, bos 2, eos 3."""
from __future__ import annotations

import io
import numbers
from typing import Iterable, List, Mapping, Optional

PAD, UNK, BOS, EOS = 0, 1, 2, 3
_PIECE_CHARS = 16   # SentencePiece's longest piece (max_sentencepiece_length), as dtmt trains them


def never_output(pad_id: int = PAD) -> List[int]:
    """The ids a translation never holds, which beam search never chooses: the model's padding id and BOS."""
    return sorted({pad_id, BOS} - {EOS})


class Vocabulary:
    def __init__(self, model_proto: bytes):
        """model_proto: a SentencePiece model's serialized bytes (as in a checkpoint, or a .model file). TypeError
        for anything else, ValueError for none (0 bytes: SentencePiece read it as an empty model, refused for its
        special ids), each in one line (SentencePiece's own was its binding's list of signatures)."""
        import sentencepiece as spm

        if not isinstance(model_proto, bytes):
            raise TypeError(f"Vocabulary: expected a SentencePiece model's bytes, got {type(model_proto).__name__}")
        if not model_proto:
            raise ValueError("Vocabulary: the SentencePiece model is empty (0 bytes)")
        self.proto = model_proto
        try:
            self.sp = spm.SentencePieceProcessor(model_proto=model_proto)
        except RuntimeError:   # (SentencePiece's "INTERNAL ... ParseFromArray" and the C++ source line)
            raise ValueError(f"Vocabulary: {len(model_proto):,} bytes that are not a SentencePiece model") from None
        if (self.sp.pad_id(), self.sp.unk_id(), self.sp.bos_id(), self.sp.eos_id()) != (PAD, UNK, BOS, EOS):
            raise ValueError("Vocabulary: the SentencePiece model must use pad=0, unk=1, bos=2, eos=3")

    @property
    def digest(self) -> str:
        """The SHA-1 of the serialized model: which vocabulary this is (two of one size may number other pieces)."""
        if getattr(self, "_digest", None) is None:
            import hashlib

            self._digest = hashlib.sha1(self.proto).hexdigest()
        return self._digest

    @classmethod
    def train(cls, sentences: Iterable[str], vocab_size: int = 8000, model_type: str = "bpe",
              character_coverage: float = 1.0) -> "Vocabulary":
        """Trains on `sentences` (the training side only). vocab_size is capped by what the text supports.
        One training thread, so the same sentences always give the same model."""
        if model_type not in ("bpe", "unigram"):
            raise ValueError(f"model_type must be 'bpe' or 'unigram', got {model_type!r}")
        if isinstance(sentences, (str, bytes)):   # (a string was trained on as its characters, one a sentence)
            raise TypeError("Vocabulary.train: give the sentences as a list of strings, not one string")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral) or vocab_size < EOS + 2:
            raise ValueError(f"Vocabulary.train: vocab_size must be an int >= {EOS + 2} (pad, unk, bos, eos and a "
                             f"piece), got {vocab_size!r}")
        sentences = list(sentences)
        if not any(isinstance(t, str) and t.strip() for t in sentences):
            raise ValueError(f"Vocabulary.train: no text to train on ({len(sentences)} sentences, none with a "
                             f"word)")
        try:
            return cls(_train_proto(iter(sentences), int(vocab_size), model_type, character_coverage))
        except RuntimeError as exc:   # (SentencePiece's INTERNAL errors: a size below the characters the text needs)
            said = str(exc).strip().splitlines()[-1]
            said = said.rsplit("] ", 1)[-1]   # (its source file and the failed condition)
            raise ValueError(f"Vocabulary.train: SentencePiece refused it: {said[:200]}") from None

    @classmethod
    def train_bpe_on_word_counts(cls, counts: Mapping[str, int], vocab_size: int = 8000,
                                 character_coverage: float = 1.0) -> "Vocabulary":
        """The BPE model `train(sentences, vocab_size, "bpe")` gives, from the sentences' word counts: `counts`
        maps each space-separated word (tabs and carriage returns count as spaces, as SentencePiece normalises
        them) to its number of occurrences. SentencePiece's BPE trainer itself reduces the sentences to these
        counts before it merges, so the pieces and scores are the same (tests/test_data.py compares the models
        byte for byte); counting in Python skips its normalisation of every sentence, the slow part of training
        on a large sample. Unigram has no such form: its seed pieces count substrings of whole sentences."""
        lines = (f"{word}\t{n}" for word, n in counts.items() if word)
        return cls(_as_trained_on_sentences(_train_proto(lines, vocab_size, "bpe", character_coverage,
                                                         input_format="tsv")))

    @classmethod
    def load(cls, path: str) -> "Vocabulary":
        with open(path, "rb") as f:
            return cls(f.read())

    def save(self, path: str) -> None:
        with open(path, "wb") as f:
            f.write(self.proto)

    def __len__(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, text: str, most: Optional[int] = None) -> List[int]:
        """text's subword ids. With `most`, a text of more than `most` pieces may give only a head of them: more than
        `most`, the first `most` being the whole text's (for a caller that cuts sources at `most`: a 16 MB line took
        11 s and 700 MB to encode whole for its first 250 pieces). The head is a prefix of the text cut before a
        space; where no piece holds a word boundary inside it (dtmt's models: SentencePiece splits at whitespace),
        the words before a space are segmented as in the whole text; other models encode the whole text."""
        if most is None or len(text) <= _PIECE_CHARS * (most + 2) or not self._words_apart():
            return self.sp.encode(text, out_type=int)
        reach = _PIECE_CHARS * (most + 2)   # (a piece covers at most _PIECE_CHARS characters, or whitespace)
        while reach < len(text):   # (the reach grows fourfold where whitespace or unknown runs fill the head)
            cut = text.rfind(" ", 0, reach)
            if cut > 0:
                head = self.sp.encode(text[:cut], out_type=int)
                if len(head) > most:
                    return head
            reach *= 4
        return self.sp.encode(text, out_type=int)

    def _words_apart(self) -> bool:
        """Whether no piece holds a word boundary after its first character (pieces never span a space)."""
        if getattr(self, "_apart", None) is None:
            self._apart = not any("\u2581" in self.sp.id_to_piece(i)[1:] for i in range(len(self)))
        return self._apart

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids` (a list, a tensor or an array; ValueError for an id outside the vocabulary) without PAD,
        BOS and EOS. An UNK shows as SentencePiece's mark "\u2047", one space
        either side within the text, as fairseq and OpenNMT-py show theirs: not dropped, so a translation of
        unknown pieces is not an empty line."""
        # (a tensor or an array: a model's output, as HF and fairseq users pass it; it was a TypeError)
        if hasattr(ids, "tolist") and getattr(ids, "ndim", 1) != 1:   # (a batch flattened into one sentence)
            raise ValueError(f"Vocabulary.decode: one sentence's ids, 1-D; got {ids.ndim}-D")
        ids = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
        size = len(self)
        bad = next((i for i in ids if not 0 <= i < size), None)
        if bad is not None:   # (a negative id was dropped without a word)
            raise ValueError(f"Vocabulary.decode: ids must be in [0, {size}), got {bad}")
        kept = [i for i in ids if i == UNK or i > EOS]
        text = self.sp.decode(kept)
        # (SentencePiece writes an UNK as " \u2047 ", beside the word boundary of the piece after it)
        return " ".join(filter(None, text.split(" "))) if UNK in kept else text


def _train_proto(lines: Iterable[str], vocab_size: int, model_type: str, character_coverage: float,
                 **options) -> bytes:
    """The serialized SentencePiece model trained on `lines` with dtmt's settings: the ids above, vocab_size capped
    by what the text supports, one training thread (the same input always gives the same model)."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=lines, model_writer=buf, vocab_size=vocab_size, model_type=model_type,
        character_coverage=character_coverage, pad_id=PAD, unk_id=UNK, bos_id=BOS, eos_id=EOS,
        hard_vocab_limit=False, num_threads=1, minloglevel=2, **options)
    return buf.getvalue()


def _as_trained_on_sentences(proto: bytes) -> bytes:
    """A model trained on word counts with its training record's input format cleared: then it is the same
    bytes as the model trained on the sentences, so checkpoints and binarized copies of either compare equal.
    (The record is SentencePiece's protobuf; protobuf comes with tensorboard. Without it the bytes differ in that
    one field only, and the model is the same.)"""
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError:
        return proto
    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(proto)
    model.trainer_spec.ClearField("input_format")
    return model.SerializeToString()
