"""What the decoding commands share (`dtmt translate`, `dtmt evaluate`, `dtmt serve`; `dtmt train` checks its
device and backend with the same rule): the decoding options and their checks, loading checkpoints for decoding
(one model or an ensemble), the device and backend check, running a command's main with contract §6's exit statuses,
and decoding a list of sentences with progress and a summary on stderr."""
from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, List, Optional, Sequence, Set, Tuple, Type, TypeVar

import torch

from dtmt_models.decoding.beam_search import MAX_ALPHA, MAX_BEAM, NonFiniteScores
from dtmt_models.decoding.translate import InputError, InputWarning, input_warnings, translate
from dtmt_models.engine.decoder import AMP_DTYPES, as_decoder
from dtmt_models.errors import (MAX_COUNT, MAX_THREADS, UsageError, check_counts, check_finite, check_input_file,
                                command_line_values, diagnostics_never_fail, one_line, out_of_memory,
                                threads_warning)
from dtmt_models.progress import Progress

T = TypeVar("T")


def check_device_and_backend(device: str, backend: str) -> torch.device:
    """The torch device for `device`, after checking that it and `backend` can run here (UsageError if not)."""
    import dtmt_kernels as dk
    from dtmt_kernels.backends import resolve_backend

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UsageError(f"--device: {device!r} is not a device (use cpu or cuda)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available here (torch.cuda.is_available() is False)")
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"--device: use cpu or cuda, got {device!r}")
    if backend == "auto":   # whatever this device has; a system without fused layers needs none (the layers say)
        return dev
    try:
        resolve_backend(backend, dev)
    except ValueError as exc:
        raise UsageError(f"--backend {backend}: {one_line(exc)} (available: {dk.available_backends()})") from None
    return dev


def load_for_decoding(checkpoints: Sequence[str], device: torch.device, backend: str):
    """(model, source vocabulary, target vocabulary, the checkpoint dicts) for one checkpoint, or for several an
    Ensemble of their models (decoding/ensemble.py; their vocabularies must be the same); a checkpoint that is
    missing, a directory or not a dtmt checkpoint, and models that cannot form an ensemble, are UsageErrors."""
    from dtmt_models.decoding.ensemble import Ensemble, check_vocabularies
    from dtmt_models.models.checkpoint import given_twice, load_model

    # one file given for every member (by its name or a link): that model decoded as many times over, for its own
    # translations; a file repeated beside others weights it in the average (-c a -c a -c b), and stays
    twice = given_twice(checkpoints) if len(checkpoints) > 1 else None
    if twice and all(given_twice([checkpoints[0], c]) for c in checkpoints[1:]):
        raise UsageError(f"--checkpoint {twice[0]} is given twice (as {twice[1]} too), and no other: an ensemble "
                         f"of one model decodes as that model, {len(checkpoints)} times over; give it once")
    loaded = []
    for checkpoint in checkpoints:
        check_input_file(checkpoint, "--checkpoint", "checkpoint file")
        try:
            loaded.append(load_model(checkpoint, str(device), backend))
        except (ValueError, KeyError, RuntimeError, OSError, TypeError) as exc:
            message = one_line(exc)   # read_checkpoint's messages start with the path already
            raise UsageError(f"--checkpoint {message}" if message.startswith(f"{checkpoint}: ") else
                             f"--checkpoint {checkpoint}: cannot load it ({message[:300]})") from None
    models, src_vocabs, tgt_vocabs, ckpts = (list(x) for x in zip(*loaded))
    if len(models) == 1:
        return models[0], src_vocabs[0], tgt_vocabs[0], ckpts
    try:
        check_vocabularies(list(checkpoints), list(zip(src_vocabs, tgt_vocabs)))
        return Ensemble(models), src_vocabs[0], tgt_vocabs[0], ckpts
    except ValueError as exc:
        raise UsageError(f"ensemble: {one_line(exc)}") from None


def decode_with_report(prog: str, quiet: bool, model, src_vocab, tgt_vocab, sentences: Sequence[str], **kwargs
                       ) -> Tuple[List[List[Tuple[str, float]]], float]:
    """`translate` with progress on stderr, the truncation warning shown as one `prog: warning:` line, and a
    closing summary; returns (results, decoding seconds)."""
    # a bar on a terminal; in a log, a line a minute
    progress = Progress("silent" if quiet else "auto", desc=prog, unit="sentence", every=60.0, message_stream=sys.stderr)
    t0 = time.perf_counter()

    def reporter(done: int, total: int) -> None:
        rate = done / max(time.perf_counter() - t0, 1e-9)
        progress.show(done, total, status=f"{rate:.1f} sentences/s",   # the last line: the summary below says it
                      line=f"{prog}: {done:,}/{total:,} sentences ({rate:.1f} sentences/s)" if done < total else None)
    results = reporting_warnings(prog, lambda: translate(model, src_vocab, tgt_vocab, sentences, progress=reporter,
                                                         **kwargs))
    seconds = time.perf_counter() - t0
    noun = "sentence" if len(sentences) == 1 else "sentences"
    progress.close()
    progress.message(f"{prog}: translated {len(sentences):,} {noun} in {seconds:.1f}s "
                     f"({len(sentences) / max(seconds, 1e-9):.1f} sentences/s)")
    return results, seconds


def reporting_warnings(prog: str, call: Callable[[], T], seen: Optional[Set[str]] = None,
                       category: Type[Warning] = InputWarning) -> T:
    """call(), each warning of `category` it raises shown as one `prog: warning:` line on stderr (once per message
    when a `seen` set is kept across calls); other warnings pass on."""
    result, messages = input_warnings(call, category)
    for message in messages:
        if seen is None or message not in seen:
            print(f"{prog}: warning: {message}", file=sys.stderr)
            if seen is not None:
                seen.add(message)
    return result


def add_decoding_arguments(parser: argparse.ArgumentParser, quiet: bool = True, batch_size: bool = True) -> None:
    """The options `dtmt translate`, `dtmt evaluate` and `dtmt serve` share; `quiet`: with --quiet (a server has
    no progress to hide, and its few lines, the address among them, are its log); `batch_size`: with --batch-size
    (a server has its own --batch-sentences)."""
    from dtmt_kernels.backends import BACKEND_NAMES

    g = parser.add_argument_group("decoding")
    g.add_argument("--beam", type=int, default=4, help="beam size (1: greedy; default 4)")
    g.add_argument("--length-penalty", choices=("gnmt", "average"), default="gnmt",
                   help="what hypotheses are ranked by: gnmt, log P / ((5+|y|)/6)^alpha (paper 000's decoding; the "
                        "default), or average, log P / |y| (papers 001, 003 and 004: 'normalized by sentence "
                        "length', with --beam 10)")
    g.add_argument("--alpha", type=float, default=None,
                   help="the gnmt length penalty's exponent (default 0.6; 0: raw log-probability)")
    g.add_argument("--max-tokens", type=int, default=2000,
                   help="source subwords per batch, padding included (default 2000)")
    if batch_size:
        g.add_argument("--batch-size", type=int, default=None, metavar="N",
                       help="at most N sentences per batch as well (default: --max-tokens alone)")
    g.add_argument("--max-src-len", type=int, default=250,
                   help="longer sources are truncated to this many subwords, with a warning (default 250)")
    g.add_argument("--max-len-a", type=float, default=2.0,
                   help="maximum output length in subwords, the end-of-sentence token included = a * source "
                        "length + b, at least 2, at most 16,384 (default a=2.0)")
    g.add_argument("--max-len-b", type=int, default=10, help="see --max-len-a (default b=10)")
    g.add_argument("--early-stop", action="store_true",
                   help="end a sentence once it has --beam finished hypotheses (fairseq's and CTranslate2's rule, "
                        "usually fewer steps), instead of once no open hypothesis can still enter the translations "
                        "written (default: the same translations as a search run to the maximum length)")
    g.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    g.add_argument("--threads", type=int, default=0,
                   help="CPU threads for decoding (default 0: torch's default, OMP_NUM_THREADS or the cores)")
    g.add_argument("--backend", default="auto", choices=list(BACKEND_NAMES),
                   help="recurrent kernel backend (default auto)")
    g.add_argument("--int8", action="store_true",
                   help="decode with the decoder step's matrices in int8, one scale per row, multiplied by its "
                        "activations quantized the same way (int8 dot products); dtmt, shallow-rnmt, rnnsearch-atr, "
                        "mce and one-level nematus on the CPU")
    g.add_argument("--amp", choices=("off", "bf16", "fp16"), default="off",
                   help="16-bit decoding on the GPU: a copy of the model's weights in bfloat16 or float16, run under "
                        "torch.autocast (log-probabilities and scores in float32; --device cuda; default off)")
    if quiet:
        g.add_argument("--quiet", action="store_true", help="no progress or summary on stderr")


def run_command(prog: str, run: Callable[[argparse.Namespace], int], args: argparse.Namespace,
                errors: Tuple[type, ...] = (InputError, NonFiniteScores),
                smaller: str = "a lower --max-tokens or --batch-size, or a narrower --beam") -> int:
    """run(args) as a decoding command's main: an error a user can cause is one `prog: message` line on stderr and
    exit status 2 for an option that cannot work (UsageError, contract §6), 1 for the others (`errors`: what the data
    or the system refused while working; running out of memory, with `smaller`, the options that decode smaller
    batches: a traceback before); Ctrl-C `prog: interrupted` and 130. A stderr that cannot be written costs nothing
    else (errors.diagnostics_never_fail)."""
    with diagnostics_never_fail():
        return _run_command(prog, run, args, errors, smaller)


def _run_command(prog: str, run: Callable[[argparse.Namespace], int], args: argparse.Namespace,
                 errors: Tuple[type, ...], smaller: str) -> int:
    try:
        return run(args)
    except UsageError as exc:
        print(f"{prog}: {one_line(exc)}", file=sys.stderr)
        return 2
    except errors as exc:
        print(f"{prog}: {one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except (MemoryError, RuntimeError) as exc:   # (the CPU allocator's is a RuntimeError; CUDA's OutOfMemoryError one)
        if not out_of_memory(exc):
            raise
        print(f"{prog}: out of memory ({one_line(exc)[:160]}); decode smaller batches: {smaller}", file=sys.stderr)
        return 1


def decoding_options_given(parser: argparse.ArgumentParser, argv: Optional[List[str]]) -> List[str]:
    """The options of the "decoding" group (add_decoding_arguments; --quiet aside) that the command line `argv`
    gives (command_line_values), as `--name value` (a flag as `--name`), in the parser's order."""
    group = next(g for g in parser._action_groups if g.title == "decoding")
    seen = command_line_values(parser, argv)
    given = []
    for action in group._group_actions:
        if action.dest != "quiet" and action.dest in seen:
            value, flag = seen[action.dest], action.option_strings[0]
            given.append(flag if isinstance(value, bool) else f"{flag} {value}")
    return given


def check_decoding_arguments(args: argparse.Namespace) -> None:
    """The decoding options' values (UsageError)."""
    # (--threads 100000 crashed the process; an integer past int64 was a traceback)
    check_counts(args, (("beam", 1, MAX_BEAM), ("max_tokens", 1, MAX_COUNT), ("max_src_len", 1, MAX_COUNT),
                        ("max_len_b", 0, MAX_COUNT), ("threads", 0, MAX_THREADS), ("batch_size", 1, MAX_COUNT)))
    check_finite("--max-len-a", args.max_len_a, 0)
    if args.max_len_a == 0 and args.max_len_b <= 1:   # (1 had been EOS alone: 40 empty lines, exit 0)
        raise UsageError(f"--max-len-a 0 --max-len-b {args.max_len_b}: a bound below its least, 2 (a word and the "
                         f"end-of-sentence token, which the bound counts); give --max-len-b >= 2")
    check_finite("--alpha", args.alpha, -MAX_ALPHA, MAX_ALPHA)
    if args.alpha is not None and args.length_penalty != "gnmt":
        raise UsageError(f"--alpha {args.alpha:g}: the gnmt length penalty's exponent; --length-penalty "
                         f"{args.length_penalty} has none")
    if args.int8 and (args.backend not in ("auto", "cpp") or args.device != "cpu"):
        raise UsageError(f"--int8 decodes with the C++ decoder step on the CPU (--backend auto or cpp, --device cpu), "
                         f"got --backend {args.backend} --device {args.device}")
    if getattr(args, "amp", "off") != "off" and not str(args.device).startswith("cuda"):
        raise UsageError(f"--amp {args.amp} decodes in 16 bits on the GPU (--device cuda), got --device "
                         f"{args.device} (on the CPU: --int8)")
    if getattr(args, "amp", "off") == "bf16" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        raise UsageError(f"--amp bf16: this GPU ({torch.cuda.get_device_name()}) has no bfloat16; use --amp fp16")


def use_threads(threads: int, prog: str) -> None:
    """--threads: decode on this many CPU threads (0 leaves torch's default); more than the process may use is
    warned of, one `prog: warning:` line."""
    if threads:
        warning = threads_warning(threads)
        if warning:
            print(f"{prog}: {warning}", file=sys.stderr)
        torch.set_num_threads(threads)


def build_decoder(model, int8: bool = False, amp: str = "off"):
    """`model`'s inference decoder, built once for the whole run (int8 weight matrices with --int8, a 16-bit copy
    with --amp bf16 / fp16), the errors a user can cause as UsageError. With --amp the model itself is first
    converted to the 16-bit dtype, in place: a command decodes with it and nothing else, so no float32 weights stay
    on the device beside the 16-bit ones (the decoder's copy shares their storage)."""
    model.eval()
    try:
        if amp in AMP_DTYPES and not int8:   # (int8 with amp: as_decoder's refusal, the model untouched)
            model.to(AMP_DTYPES[amp])
        return as_decoder(model, int8, None if amp == "off" else amp)
    except ValueError as exc:
        raise UsageError(f"--{'int8' if int8 else 'amp'}: {one_line(exc)}") from None
    except FloatingPointError:   # a weight the int8 decoder makes from the checkpoint's (a fold) overflowed
        raise InputError("--int8: a weight matrix made from the checkpoint's overflows float32 (a diverged or "
                         "damaged checkpoint?)") from None


DEFAULT_ALPHA = 0.6   # --alpha's default (None on the parser, so that a given one is told from it)


def decoding_alpha(args: argparse.Namespace) -> float:
    """--alpha as given, else its default (with --length-penalty average it is unused)."""
    return DEFAULT_ALPHA if args.alpha is None else args.alpha


def decoding_kwargs(args: argparse.Namespace, device: torch.device) -> dict:
    return dict(beam=args.beam, alpha=decoding_alpha(args), penalty=args.length_penalty, max_tokens=args.max_tokens,
                max_len_a=args.max_len_a, max_len_b=args.max_len_b, device=device, max_src_len=args.max_src_len,
                early_stop=args.early_stop, max_sentences=args.batch_size)
