"""`dtmt serve`: the command line over dtmt_models.decoding.serve (see its docstring for the API).

    dtmt serve -c runs/dtmt/best.pt [--host 127.0.0.1] [--port 8080]
    curl -s localhost:8080/translate -d '{"sentences": ["En el principio creó Dios los cielos y la tierra."]}'

Prints `dtmt serve: listening on http://HOST:PORT` on stderr once it accepts requests (with --port 0, the port
the system chose); SIGINT or SIGTERM stop it after the requests in flight are answered (a second one at once, with
one line on stderr, however late it comes). Needs aiohttp
(`pip install aiohttp`, in requirements.txt).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import re
import signal
import socket
import sys
from typing import List, Optional

from dtmt_models.cli.common import add_decoding_arguments, build_decoder, check_decoding_arguments, \
    check_device_and_backend, decoding_alpha, load_for_decoding, run_command, use_threads
from dtmt_models.decoding.translate import InputError
from dtmt_models.errors import ArgumentParser, UsageError, check_count, one_line
from dtmt_models.signals import take_signals
from dtmt_models.progress import counted

PROG = "dtmt serve"


def build_parser() -> argparse.ArgumentParser:
    from dtmt_models.decoding.serve import MAX_BATCH_SENTENCES, MAX_CHARS, MAX_REQUEST_CHARS, MAX_SENTENCES, \
        MAX_TIMEOUT, MAX_WAIT_MS, MIN_READ_TIMEOUT, ServeSettings

    d = ServeSettings()
    p = ArgumentParser(prog=PROG, description="Serve translations over HTTP (JSON): POST /translate "
                       "{\"sentences\": [...]}, GET /health, GET /info.")
    p.add_argument("--checkpoint", "-c", required=True, action="append", metavar="CKPT",
                   help="a checkpoint written by `dtmt train`; repeated, an ensemble")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: all)")
    p.add_argument("--port", type=int, default=8080, help="port, 0..65535 (default 8080; 0: any free port)")
    g = p.add_argument_group("requests and batching")
    g.add_argument("--max-sentences", type=int, default=d.max_sentences,
                   help=f"sentences per request, more is refused with 413; 1..{MAX_SENTENCES:,}, and --max-sentences "
                        f"x --max-chars at most {MAX_REQUEST_CHARS:,} (default {d.max_sentences})")
    g.add_argument("--max-chars", type=int, default=d.max_chars,
                   help=f"characters per sentence, more is refused with 413; 1..{MAX_CHARS:,} "
                        f"(default {d.max_chars})")
    g.add_argument("--batch-sentences", type=int, default=d.batch_sentences,
                   help=f"decode as soon as this many sentences wait; 1..{MAX_BATCH_SENTENCES:,} "
                        f"(default {d.batch_sentences})")
    g.add_argument("--max-wait-ms", type=float, default=d.max_wait_ms,
                   help=f"the longest a request waits for others to join its batch; 0..{MAX_WAIT_MS:,g} "
                        f"(default {d.max_wait_ms:g})")
    g.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                   help=f"on shutdown, seconds left to the requests in flight (then answered 503); "
                        f"0..{MAX_TIMEOUT:,g} (a day) (default {d.shutdown_timeout:g})")
    g.add_argument("--read-timeout", type=float, default=d.read_timeout,
                   help=f"seconds a client has to send a request's body (else 408); an idle connection is closed "
                        f"after as long; {MIN_READ_TIMEOUT:g}..{MAX_TIMEOUT:,g} (default {d.read_timeout:g})")
    add_decoding_arguments(p, quiet=False, batch_size=False)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    return run_command(PROG, _run, build_parser().parse_args(argv),
                       smaller="a lower --batch-sentences or --max-tokens, or a narrower --beam")


def check_listening(host: str, port: int) -> None:
    """InputError where the server could not listen on host:port (a port in use, a host of another machine or none):
    a socket bound there and closed, as the server binds it (SO_REUSEADDR, asyncio's default), before anything
    loads (port 0 too: the host is checked, the port any free one). UsageError for a host that is no address or name
    this machine resolves (`localhost:8080`, `http://...`: it had been said after the model loaded, exit 1)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise UsageError(f"--host {host}: not an address or a host name this machine resolves "
                         f"({exc.strerror or exc})") from None
    try:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:   # (as asyncio binds it: IPv6 alone, an IPv4 listener on the port aside)
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            probe.bind(address)
    except OSError as exc:   # (socket.gaierror is one)
        raise cannot_listen(host, port, exc) from None


def cannot_listen(host: str, port: int, exc: OSError) -> InputError:
    """The one line for a server that cannot listen on host:port (before loading, or at the server's own bind)."""
    return InputError(f"cannot listen on {host}:{port} ({exc.strerror or exc})")


def _run(args: argparse.Namespace) -> int:
    from dtmt_models.decoding.serve import Server, ServeSettings, log_http_in_one_line

    check_decoding_arguments(args)
    check_count("--port", args.port, 0, 65535)
    if not args.host.strip():   # (aiohttp takes '' for every interface, said as http://:PORT)
        raise UsageError(f"--host {args.host!r}: give an address (0.0.0.0 or :: for every interface)")
    settings = ServeSettings(beam=args.beam, alpha=decoding_alpha(args), penalty=args.length_penalty,
                             max_tokens=args.max_tokens, max_src_len=args.max_src_len, max_len_a=args.max_len_a,
                             max_len_b=args.max_len_b, early_stop=args.early_stop,
                             max_sentences=args.max_sentences, max_chars=args.max_chars,
                             batch_sentences=args.batch_sentences, max_wait_ms=args.max_wait_ms,
                             shutdown_timeout=args.shutdown_timeout, read_timeout=args.read_timeout)
    try:
        settings.check()
    except ValueError as exc:   # the settings' names, as the options that set them
        names = "|".join(f.name for f in dataclasses.fields(settings))
        raise UsageError(re.sub(rf"\b({names})\b", lambda m: "--" + m.group(1).replace("_", "-"),
                                one_line(exc))) from None
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise InputError("needs aiohttp: pip install aiohttp") from None
    use_threads(args.threads, PROG)
    device = check_device_and_backend(args.device, args.backend)
    check_listening(args.host, args.port)   # (before the models load: a port in use was said after a paper-size load)
    model, src_vocab, tgt_vocab, ckpts = load_for_decoding(args.checkpoint, device, args.backend)
    decoder = build_decoder(model, args.int8, args.amp)
    names = [c.get("model_name") for c in ckpts]
    # (the checkpoints' file names, not their paths: /info answers any client, --host 0.0.0.0 the network's, and
    # the paths had told it the server's folders)
    info = {"checkpoints": [os.path.basename(path) for path in args.checkpoint], "models": names,
            "parameters": sum(p.numel() for p in model.parameters()), "device": str(device),
            "backend": args.backend, "int8": args.int8, "amp": args.amp}

    def log(message: str) -> None:
        print(f"{PROG}: {message}", file=sys.stderr, flush=True)
    log_http_in_one_line(log)

    async def serve() -> None:
        server = Server(model, src_vocab, tgt_vocab, settings, info=info, log=log, decoder=decoder)
        try:
            await server.start(args.host, args.port)
        except OSError as exc:
            raise cannot_listen(args.host, args.port, exc) from None
        loop = asyncio.get_running_loop()
        stopping = []

        def on_signal(signum, frame) -> None:
            """Python-level handlers, not the loop's `add_signal_handler`: its wakeup fd, closed as the loop ends,
            made a second signal a traceback (BrokenPipeError), and once the loop restored the default handlers, a
            KeyboardInterrupt or a kill. These stay until the process ends (a decoding still running when
            --shutdown-timeout is up holds the exit): a second signal always exits at once, with one line."""
            name = signal.Signals(signum).name
            if stopping or loop.is_closed():   # a second signal: stop now, requests in flight or not
                with contextlib.suppress(OSError):   # (a stderr whose reader left: the exit all the same)
                    os.write(2, f"{PROG}: {name} again: exiting without waiting\n".encode())   # (no lock: safe here)
                os._exit(1)
            stopping.append(name)
            loop.call_soon_threadsafe(begin_stopping, name)

        def begin_stopping(name: str) -> None:
            log(f"{name}: finishing the requests in flight, then stopping (again to exit at once)")
            stopping.append(loop.create_task(server.stop()))
        take_signals((signal.SIGINT, signal.SIGTERM), on_signal)   # (not one ignored from the start: `&`)
        host = f"[{args.host}]" if ":" in args.host else args.host   # (an IPv6 address: in brackets, RFC 3986)
        log(f"listening on http://{host}:{server.port} ({'+'.join(map(str, names))}, "
            f"{info['parameters']:,} parameters, beam {settings.beam})")
        await server.wait_stopped()
        c = server.counters
        log(f"stopped: {counted(c.requests, 'request')}, {counted(c.sentences, 'sentence')} in "
            f"{counted(c.batches, 'batch', 'batches')}, {counted(c.errors, 'error')}")

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
