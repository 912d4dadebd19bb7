"""A translation server: an HTTP JSON API over `translate`, built on aiohttp (`dtmt serve`).

    POST /translate   {"sentences": ["...", ...]}      -> {"translations": ["...", ...], "scores": [...]}
                                                           (and "warnings": ["sentence N: ...", ...] where any)
    GET  /health                                        -> {"status": "ok"}
    GET  /info                                          -> the model, the decoding settings, the limits, counters

Requests that arrive together are decoded together: a batcher takes the sentences of every request waiting,
waits at most `max_wait_ms` for more after the first (or until `batch_sentences` are waiting), decodes them
in one `translate` call on one worker thread (the event loop stays free to take requests meanwhile), and
answers each request with its own sentences' translations, in its order. A request of more sentences than a batch
is decoded a batch at a time, in turn with the requests behind it (it held them all until it was done); when more than
QUEUED_BATCHES batches' sentences (or one largest request's) are waiting, a request is answered 503 with
Retry-After (the queue had no bound: its memory, and every later request's wait). Beam search treats every sentence
independently, so a request's translations do not depend on what it was batched with, up to float rounding: the
padding of a batch changes the order of some sums, so a score may differ in its fifth digit (1.7e-5 was seen), and
a hypothesis that ties another to that digit could be ranked otherwise. Warnings about the sources (a sentence
truncated, mostly unknown pieces) name the request by its number (`/info`'s counter when it came) and its
sentence, and are shown once a minute of each kind, with the count of those not shown; the request's answer
says them of its own sentences, by their place in it ("warnings", absent where there is none).

The body is read as JSON whatever its Content-Type says (`curl -d` sends a form type); a body sent with
`Content-Encoding: gzip` (or `x-gzip`, `deflate`, `identity`) is decompressed first. Errors are JSON `{"error":
"..."}` with a status: 400 for a body that is not JSON or not of that shape (`sentences` must be a list of strings;
no other fields) or not valid data of its Content-Encoding, 413 for more than `max_sentences` sentences or a
sentence longer than `max_chars` characters (or a body too large to read or to decompress), 415 for another
Content-Encoding (`br`, `zstd`, ...), 404 / 405 for other paths and methods, 500 if decoding itself fails (when a
batch fails, each of its requests is decoded again on its own, so only a request whose own sentences fail gets the
500; the server goes on). Bytes that are no HTTP request (a negative Content-Length, a garbled request line) are
answered by aiohttp's parser before any handler, 400 in plain text.
Shutdown (SIGINT / SIGTERM, or `Server.stop`) stops accepting connections, lets the
requests in flight finish (at most `shutdown_timeout` seconds: one not translated by then is answered 503; a body
still being read gets a second more), then ends. The bodies being read (each counted
by the bytes received, until it is parsed) hold at most BODY_BYTES_IN_FLIGHT bytes (or one largest body) together:
a request whose next bytes would pass that is answered 503 with Retry-After, the rest of its body unread (300
clients each sending the largest body took 3.3 GB); a Content-Length past the largest body is answered 413 at once
(before the body, to `Expect: 100-continue`). A body is decompressed and parsed on a thread, the event loop free.
A client gets `read_timeout` seconds to send a request's body
(else 408, and the connection is closed); a connection on which no request has started for as long while none was
in progress (silent since it opened, stalled in its headers, or idle between requests) is
closed: a stalled or silent client holds no connection for longer. A client that leaves before its answer costs no
more decoding: its request is dropped from the batch it waits for, and a decoding whose every client has left stops
at translate's next batch. What the HTTP layer reports (a request that is not HTTP) is one line each
(`log_http_in_one_line`, set by `dtmt serve`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import math
import re
import sys
import time
import traceback
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from dtmt_models.decoding.beam_search import check_search_arguments
from dtmt_models.decoding.hypotheses import MAX_BEAM
from dtmt_models.decoding.translate import input_warnings, translate
from dtmt_models.engine.decoder import as_decoder
from dtmt_models.errors import MAX_COUNT, check_count, check_finite, cut, one_line, refuse


# the largest values the settings take (`check`): beyond them a server would hold memory or a client for no use
MAX_SENTENCES = 10_000            # per request
MAX_CHARS = 100_000               # per sentence
MAX_REQUEST_CHARS = 100_000_000   # max_sentences x max_chars: the largest request's text (its body ~12x as many bytes)
MAX_BATCH_SENTENCES = 10_000
MAX_WAIT_MS = 60_000.0            # a minute
MAX_TIMEOUT = 86_400.0            # a day (shutdown_timeout, read_timeout)
MIN_READ_TIMEOUT = 0.1            # (the idle-connection watchdog wakes every quarter of it)
BODY_BYTES_IN_FLIGHT = 256 << 20  # the bodies of the requests in progress together, at most (or one largest body)
MAX_MEMBERS = 1_000               # gzip members of one body (a client sends one; 300,000 empty ones took 40 s)
DECOMPRESS_PIECE = 64 << 10       # the input given to zlib at a time
QUEUED_BATCHES = 16               # sentences waiting for a batch, at most: this many batches' (or one largest request)


@dataclass
class ServeSettings:
    """What a server decodes with and what it accepts."""
    beam: int = 4
    alpha: float = 0.6
    penalty: str = "gnmt"         # the length penalty: gnmt (with alpha) or average
    max_tokens: int = 2000        # source subwords per decoding batch (translate's batches)
    max_src_len: int = 250
    max_len_a: float = 2.0
    max_len_b: int = 10
    early_stop: bool = False      # beam_search's
    max_sentences: int = 256      # per request, else 413
    max_chars: int = 2000         # per sentence, else 413
    batch_sentences: int = 128    # decode at once when this many are waiting
    max_wait_ms: float = 10.0     # the longest the first waiting request waits for others to join its batch
    shutdown_timeout: float = 60.0
    read_timeout: float = 30.0    # seconds to send a request's body; an idle connection is closed after as long

    def check(self) -> None:
        """ValueError, naming the field, for a value out of its range (every bound is finite: a server that
        accepted `max_wait_ms=1e12` would never answer a lone request)."""
        for name, low, high in (("beam", 1, MAX_BEAM), ("max_tokens", 1, MAX_COUNT), ("max_src_len", 1, MAX_COUNT),
                                ("max_sentences", 1, MAX_SENTENCES), ("max_chars", 1, MAX_CHARS),
                                ("batch_sentences", 1, MAX_BATCH_SENTENCES)):
            check_count(name, getattr(self, name), low, high)
        if self.max_sentences * self.max_chars > MAX_REQUEST_CHARS:
            raise refuse("max_sentences x max_chars", f"{self.max_sentences * self.max_chars:,}",
                         f"at most {MAX_REQUEST_CHARS:,} (the largest request)")
        for name, low, high in (("max_wait_ms", 0, MAX_WAIT_MS), ("shutdown_timeout", 0, MAX_TIMEOUT),
                                ("read_timeout", MIN_READ_TIMEOUT, MAX_TIMEOUT)):
            check_finite(name, getattr(self, name), low, high)
        check_search_arguments(self.beam, 1, self.alpha, self.max_len_a, self.max_len_b, self.penalty, self.early_stop)


class RequestError(Exception):
    """A request the server refuses: the HTTP status and a one-line message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def parse_request(body: bytes, settings: ServeSettings) -> List[str]:
    """The sentences of a /translate body, or RequestError (400 malformed, 413 over the limits)."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise RequestError(400, "the body is not JSON this server reads (nested too deeply)") from None
    except ValueError as exc:   # JSONDecodeError, UnicodeDecodeError, an integer of too many digits
        why = (f"a number of more than {sys.get_int_max_str_digits():,} digits" if "int_max_str_digits" in str(exc)
               else cut(one_line(exc)))
        raise RequestError(400, f"the body is not JSON this server reads ({why})") from None
    if not isinstance(data, dict) or "sentences" not in data:
        raise RequestError(400, 'expected a JSON object {"sentences": ["...", ...]}')
    unknown = sorted(set(data) - {"sentences"})
    if unknown:
        raise RequestError(400, f"unknown field(s) {cut(repr(unknown))}; the only field is \"sentences\"")
    sentences = data["sentences"]
    if not isinstance(sentences, list) or not all(isinstance(s, str) for s in sentences):
        raise RequestError(400, '"sentences" must be a list of strings')
    if len(sentences) > settings.max_sentences:
        raise RequestError(413, f"{len(sentences)} sentences in one request; the limit is {settings.max_sentences}")
    for i, s in enumerate(sentences, start=1):   # (counted from 1, as the answer's warnings count them)
        if len(s) > settings.max_chars:
            raise RequestError(413, f"sentence {i} has {len(s)} characters; the limit is {settings.max_chars}")
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise RequestError(400, f"sentence {i} is not valid Unicode (a lone surrogate)") from None
    return sentences


CONTENT_CODINGS = ("gzip", "x-gzip", "deflate", "identity")   # the Content-Encodings a request's body may have


def decode_body(body: bytes, content_encoding: str, limit: int) -> bytes:
    """`body` with its Content-Encoding undone (`content_encoding` as sent, comma-separated codings undone last
    first; empty: none), or RequestError: 415 for a coding not in CONTENT_CODINGS, 400 for a body that is not
    valid data of its coding, 413 for one that decompresses to more than `limit` bytes (never more is made)."""
    codings = [c.strip().lower() for c in content_encoding.split(",")]
    codings = [c for c in codings if c and c != "identity"]
    for coding in codings:
        if coding not in CONTENT_CODINGS:
            raise RequestError(415, f"Content-Encoding {coding!r} is not supported (supported: "
                                    f"{', '.join(CONTENT_CODINGS)})")
    for coding in reversed(codings):
        body = _decompress(body, "deflate" if coding == "deflate" else "gzip", limit)
    return body


def _decompress(data: bytes, coding: str, limit: int) -> bytes:
    """gzip (one member or several, concatenated: at most MAX_MEMBERS) or deflate (zlib's format, or raw as some
    clients send it). The input is given to zlib DECOMPRESS_PIECE bytes at a time: what follows a member's end is
    never copied whole (a copy per member had made a body of many empty members quadratic in its size)."""
    view, out, size, pos, members = memoryview(data), [], 0, 0, 0
    while True:
        members += 1
        if members > MAX_MEMBERS:
            raise RequestError(400, f"the body is not {coding} data this server reads (more than {MAX_MEMBERS:,} "
                                    f"gzip members)")
        if coding == "gzip":
            wbits = 16 + zlib.MAX_WBITS
        else:   # a zlib header's first byte says method 8 (deflate); else raw deflate
            wbits = zlib.MAX_WBITS if pos < len(view) and view[pos] & 0x0F == 8 else -zlib.MAX_WBITS
        decompressor = zlib.decompressobj(wbits)
        while not decompressor.eof and pos < len(view):
            piece = view[pos:pos + DECOMPRESS_PIECE]
            try:
                chunk = decompressor.decompress(piece, limit + 1 - size)
            except zlib.error as exc:
                raise RequestError(400, f"the body is not valid {coding} data, as its Content-Encoding says "
                                        f"({exc})") from None
            size += len(chunk)
            if size > limit:   # (else the output stopped short of max_length: the piece was read to its end or eof)
                raise RequestError(413, f"the request body is too large (more than {limit:,} bytes decompressed)")
            out.append(chunk)
            pos += len(piece) - len(decompressor.unused_data)
        if not decompressor.eof:
            raise RequestError(400, f"the body is not valid {coding} data, as its Content-Encoding says "
                                    f"(it ends early)")
        if pos == len(view):
            return b"".join(out)
        if coding != "gzip":
            raise RequestError(400, f"the body is not valid {coding} data, as its Content-Encoding says "
                                    f"({len(view) - pos} bytes after its end)")


@dataclass
class _Pending:
    sentences: List[str]
    future: "asyncio.Future"
    transport: Any = None   # the request's connection (None: none to watch)
    number: int = 0         # the request's, as the requests counter had it: what warnings name it by
    taken: int = 0          # its sentences given to batches so far (a request is decoded in pieces of a batch)
    decoded: int = 0        # ... and translated
    results: List[Any] = field(default_factory=list)   # each sentence's translations and notes, once decoded
    notes: List[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.results, self.notes = [None] * len(self.sentences), [None] * len(self.sentences)

    def gone(self) -> bool:
        """The client has left (its connection closed or closing): nobody reads this request's answer. (Read from
        the decoding thread too: a flag, read without a lock, at worst a batch late.)"""
        return self.transport is not None and self.transport.is_closing()


class OneLineLog(logging.Handler):
    """What the HTTP layer reports (aiohttp's and asyncio's loggers), through `log`: a record of the same kind
    (logger, text and exception type) within `quiet_s` seconds of the last one shown is counted, and the count goes
    with the next one shown. What a client can cause (a request that is not HTTP, a client gone, no file descriptors
    left to accept with: `_client_made`) is one line, without its traceback; anything else (a bug of the server's,
    a task that failed) keeps its traceback. (A malformed request wrote ten lines of traceback to stderr; 249
    connections past the descriptor limit, 2,700 such blocks in 2 s.)"""

    MAX_KINDS = 1024   # kinds counted at most (texts that vary, e.g. with an address, do not grow it for ever)

    def __init__(self, log: Callable[[str], None], quiet_s: float = 60.0,
                 kind: Optional[Callable[[logging.LogRecord], Any]] = None):
        super().__init__(logging.WARNING)
        self.say, self.quiet_s, self.kind = log, quiet_s, kind
        self.last: Dict[tuple, Tuple[float, int]] = {}   # kind -> (when last shown, how many since not shown)

    @staticmethod
    def _client_made(exc: BaseException) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        return isinstance(exc, (HttpProcessingError, OSError, asyncio.CancelledError, asyncio.TimeoutError))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            exc = record.exc_info[1] if record.exc_info else None
            key = (self.kind(record) if self.kind is not None else
                   (record.name, record.msg if isinstance(record.msg, str) else type(record.msg), type(exc)))
            now = time.monotonic()
            shown, hidden = self.last.get(key, (-math.inf, 0))
            if now - shown < self.quiet_s:
                self.last[key] = (shown, hidden + 1)
                return
            if key in self.last or len(self.last) < self.MAX_KINDS:
                self.last[key] = (now, 0)
            text = " ".join(record.getMessage().split())
            if exc is not None:
                text += f": {type(exc).__name__}: {one_line(exc)}"
            if hidden:
                text += f" (and {hidden:,} more like it in the last {now - shown:,.0f} s)"
            text = cut(text)
            if exc is not None and not self._client_made(exc):
                text += "\n" + "".join(traceback.format_exception(*record.exc_info)).rstrip()
            self.say(text)
        except Exception:   # noqa: BLE001 - logging's rule: a handler that fails says so and goes on
            self.handleError(record)


HTTP_LOGGERS = ("aiohttp", "asyncio")


def log_http_in_one_line(log: Callable[[str], None]) -> OneLineLog:
    """Sends what HTTP_LOGGERS report to `log`, one line each (OneLineLog), and only there. The application's
    choice (`dtmt serve`), not the Server's: a program that embeds the Server keeps its own logging."""
    handler = OneLineLog(log)
    for name in HTTP_LOGGERS:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if isinstance(h, OneLineLog)]:   # (one set, however often called)
            logger.removeHandler(old)
        logger.addHandler(handler)
        logger.propagate = False
    return handler


def _warning_kind(record: logging.LogRecord) -> str:
    """A warning about the sources without its counts and places: "warning: # source sentence(s) had more than #
    subwords and were truncated to #"."""
    return re.sub(r"\d+", "#", record.msg.split(" (")[0])


class ClientsGone(Exception):
    """Every client of the batch being decoded has left: the decoding stops at its next batch."""


class ShutdownTimeUp(Exception):
    """The server's shutdown_timeout ran out before the request was translated: it is answered 503."""


@dataclass
class Counters:
    requests: int = 0             # /translate requests received
    sentences: int = 0            # sentences decoded
    batches: int = 0              # translate calls
    errors: int = 0               # answers with a 4xx / 5xx status, on any path
    started: float = field(default_factory=time.time)


class Server:
    """The application: `await start(host, port)`, then `await wait_stopped()` (or `stop()`); `port` is the port
    bound (useful with port 0)."""

    def __init__(self, model, src_vocab, tgt_vocab, settings: ServeSettings, info: Optional[Dict[str, Any]] = None,
                 log=None, decoder=None):
        settings.check()
        self.model, self.src_vocab, self.tgt_vocab, self.settings = model, src_vocab, tgt_vocab, settings
        self.info = dict(info or {})
        self.counters = Counters()
        self.port: Optional[int] = None
        self._queue: "asyncio.Queue[_Pending]" = None   # made on the running loop
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dtmt-serve-decode")
        self._runner = None
        self._stopped: Optional[asyncio.Event] = None
        self._watchdog: Optional[asyncio.Task] = None
        self._started: Dict[Any, int] = {}   # connection -> requests started on it
        self._busy: set = set()               # connections with a request in progress
        # warnings about the sources, once a minute of each kind (the text with its numbers left out): they had
        # been shown once per distinct text, which names counts and places, so nearly all, in a growing set
        self._warnings = OneLineLog(lambda text: self.log(text), kind=_warning_kind)
        self._waiting: set = set()   # the futures of the requests waiting for their translations
        self._body_bytes = 0   # what the bodies of the requests in progress may hold: BODY_BYTES_IN_FLIGHT's count
        self._queued = 0   # sentences of the queue's requests not yet given to a batch: QUEUED_BATCHES's count
        # the inference decoder is built once (or by the caller: `decoder`): the weights never change while serving
        model.eval()
        if decoder is None:
            decoder = as_decoder(model)
        self.decoder = decoder
        self.log = log or (lambda message: None)
        # a body larger than the largest acceptable request is refused with 413 once that much is read or
        # decompressed (JSON's \uXXXX escapes: up to 12 bytes a character)
        self.body_limit = settings.max_sentences * (12 * settings.max_chars + 16) + 65536

    # ------------------------------------------------------------------------------------------- app
    def app(self):
        from aiohttp import web

        @web.middleware
        async def json_errors(request, handler):
            return await self._json_errors(request, handler)
        app = web.Application(client_max_size=self.body_limit, middlewares=[json_errors])
        app.router.add_post("/translate", self._translate, expect_handler=self._expect)
        app.router.add_get("/health", self._health)
        app.router.add_get("/info", self._info)
        app.cleanup_ctx.append(self._batcher_context)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 8080) -> None:
        from aiohttp import web

        self._stopped = asyncio.Event()
        # auto_decompress=False: `decode_body` undoes a body's Content-Encoding, its errors answered as JSON (aiohttp's
        # own decompression answers a body that is not gzip with 500, and an unknown coding in plain text);
        # aiohttp's shutdown_timeout is a second more than ours: at ours, `stop` answers the requests still waiting
        # for their translations (aiohttp waits its timeout for a handler, then as long again once it has cancelled
        # the request's body, which a handler waiting for a translation does not read: twice ours, ended without an
        # answer); the second is for a body still being read then
        self._runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=self.settings.shutdown_timeout + 1,
                                     keepalive_timeout=self.settings.read_timeout, auto_decompress=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self._watchdog = asyncio.get_running_loop().create_task(self._close_idle_connections())

    async def _close_idle_connections(self) -> None:
        """Every quarter of read_timeout (at most a second): closes each connection on which no request has started
        for read_timeout seconds while none was in progress (the middleware counts the requests a connection
        starts and marks those in progress)."""
        loop = asyncio.get_running_loop()
        timeout = self.settings.read_timeout
        seen: Dict[Any, Tuple[int, float]] = {}   # connection -> (requests started when last looked, since when)
        while self._runner is not None:
            await asyncio.sleep(min(1.0, timeout / 4))
            now = loop.time()
            live = list(self._runner.server.connections) if self._runner is not None else []
            for conn in live:
                started = self._started.get(conn, 0)
                count, since = seen.get(conn, (started, now))
                if conn in self._busy or count != started:
                    count, since = started, now
                seen[conn] = (count, since)
                if now - since >= timeout:
                    conn.force_close()
            alive = set(live)
            for table in (seen, self._started):
                for conn in [c for c in table if c not in alive]:
                    del table[conn]

    async def stop(self) -> None:
        """Stops accepting connections, finishes the requests in flight (at most `shutdown_timeout` seconds: a
        request still waiting for its translations then is answered 503, a body still being read gets a second more),
        then releases the worker (a decoding still running when time is up finishes in the background)."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            if self._watchdog is not None:
                self._watchdog.cancel()
            time_up = asyncio.get_running_loop().call_later(self.settings.shutdown_timeout, self._time_up)
            try:
                await runner.cleanup()
            finally:
                time_up.cancel()
                self._worker.shutdown(wait=False, cancel_futures=True)
                self._stopped.set()

    def _time_up(self) -> None:
        for future in self._waiting:
            if not future.done():
                future.set_exception(ShutdownTimeUp())

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    # -------------------------------------------------------------------------------------- handlers
    def _error(self, status: int, message: str, headers: Optional[Dict[str, str]] = None):
        from aiohttp import web

        self.counters.errors += 1
        return web.json_response({"error": message}, status=status, headers=headers)

    async def _json_errors(self, request, handler):
        """aiohttp's own errors (404, 405, 413 for a body too large to read) as JSON, like the handlers' own."""
        from aiohttp import web

        conn = request.protocol   # (for the idle-connection watchdog: a request started, one in progress)
        self._started[conn] = self._started.get(conn, 0) + 1
        self._busy.add(conn)
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            message = exc.reason if not exc.text or exc.text.startswith(f"{exc.status}:") else exc.text
            if exc.status == 413:
                message = f"the request body is too large ({message})"
            allow = exc.headers.get("Allow")   # (405: RFC 9110 asks for the methods allowed; it had been dropped)
            if exc.status == 405 and allow is not None:
                message = f"method {request.method} is not allowed on {request.path} (allowed: {allow})"
            return self._error(exc.status, message, None if allow is None else {"Allow": allow})
        finally:
            self._busy.discard(conn)

    async def _translate(self, request):
        from aiohttp import web

        self.counters.requests += 1
        number = self.counters.requests
        too_large = self._too_large(request)   # (said at once, not once read_timeout is up)
        if too_large is not None:
            return too_large
        sentences = await self._read_sentences(request)
        if not isinstance(sentences, list):   # (a response: the body refused)
            return sentences
        if not sentences:
            return web.json_response({"translations": [], "scores": []})
        limit = max(QUEUED_BATCHES * self.settings.batch_sentences, self.settings.max_sentences)
        if self._queued and self._queued + len(sentences) > limit:   # (the queue grew without bound: its memory,
            # and every later request's wait)
            return self._error(503, f"the server has {self._queued:,} sentences waiting to be translated; try again",
                               headers={"Retry-After": "1"})
        future = asyncio.get_running_loop().create_future()
        self._waiting.add(future)
        self._queued += len(sentences)
        await self._queue.put(_Pending(sentences, future, request.transport, number))
        try:
            results, notes = await future
        except ClientsGone:
            return web.Response(status=400)   # (not sent: the connection has closed)
        except ShutdownTimeUp:
            return self._error(503, f"the server stopped before this request was translated (its shutdown timeout of "
                                    f"{self.settings.shutdown_timeout:g} s ran out)")
        except Exception as exc:   # noqa: BLE001 - decoding failed: this request fails, the server goes on
            self.log(f"decoding failed: {type(exc).__name__}: {exc}")
            return self._error(500, f"decoding failed: {type(exc).__name__}: {exc}")
        finally:
            self._waiting.discard(future)
        # (a sentence without a hypothesis: a model that gives every word -inf)
        answer = {"translations": [hyps[0][0] if hyps else "" for hyps in results],
                  "scores": [hyps[0][1] if hyps else None for hyps in results]}
        said = [f"sentence {j + 1}: {note}" for j, own in enumerate(notes) for note in own]
        if said:   # (what the server's log says of its sentences: a source cut, one the model cannot read)
            answer["warnings"] = said
        return web.json_response(answer)

    def _too_large(self, request):
        """A 413 response (the connection closed) where the request's Content-Length is past body_limit, else
        None."""
        if request.content_length is None or request.content_length <= self.body_limit:
            return None
        response = self._error(413, f"the request body is too large (Content-Length {request.content_length:,}; "
                                    f"the limit is {self.body_limit:,} bytes)")
        response.force_close()
        return response

    async def _expect(self, request):
        """`Expect: 100-continue`: a body past body_limit is refused before the client sends it (aiohttp's own
        handler had said "100 Continue" first, and the client sent its body for a 413)."""
        from aiohttp.web_urldispatcher import _default_expect_handler

        too_large = self._too_large(request)
        return too_large if too_large is not None else await _default_expect_handler(request)

    async def _read_sentences(self, request):
        """The request's sentences, its body read, decompressed and parsed; or the response that refuses it. The
        bytes received count against the bodies' budget until it is parsed (the bytes a Content-Length promised had
        counted from the headers on: 44 connections sending headers only turned every client away for read_timeout
        seconds); decompressing and parsing run on a thread, not on the event loop that serves the others."""
        from aiohttp import web

        held = [0]
        try:
            body = await asyncio.wait_for(self._read_body(request, held), self.settings.read_timeout)
            encoding = ", ".join(request.headers.getall("Content-Encoding", []))
            return await asyncio.get_running_loop().run_in_executor(
                None, lambda: parse_request(decode_body(body, encoding, self.body_limit), self.settings))
        except asyncio.TimeoutError:   # a client that stalls in its body: answered, and the connection closed
            response = self._error(408, f"the request's body did not arrive within {self.settings.read_timeout:g} s")
            response.force_close()
            return response
        except ConnectionError:   # the client left in the middle of its body (aiohttp's "Connection lost"): nobody
            return web.Response(status=400)   # to answer, nothing to log (it was a traceback on stderr)
        except RequestError as exc:   # (415: RFC 9110 asks for the codings accepted)
            headers = {"Accept-Encoding": ", ".join(CONTENT_CODINGS)} if exc.status == 415 else None
            if exc.status == 503:
                headers = {"Retry-After": "1"}
            response = self._error(exc.status, str(exc), headers)
            if exc.status in (413, 503):   # (its body unread)
                response.force_close()
            return response
        finally:
            self._body_bytes -= held[0]

    async def _read_body(self, request, held: List[int]) -> bytes:
        """The body as it arrives, each piece counted in `held` and in the bodies' budget: RequestError 413 past
        body_limit, 503 (Retry-After) where the bodies being read would hold more than BODY_BYTES_IN_FLIGHT together
        (or one largest body) with this piece."""
        pieces, cap = [], max(BODY_BYTES_IN_FLIGHT, self.body_limit)
        while True:
            piece = await request.content.readany()
            if not piece:
                return b"".join(pieces)
            if held[0] + len(piece) > self.body_limit:
                raise RequestError(413, f"the request body is too large (more than {self.body_limit:,} bytes)")
            others = self._body_bytes - held[0]
            if others and self._body_bytes + len(piece) > cap:
                raise RequestError(503, f"the server is reading the bodies of other requests ({others:,} bytes); "
                                        f"try again")
            pieces.append(piece)
            held[0] += len(piece)
            self._body_bytes += len(piece)

    async def _health(self, request):
        from aiohttp import web

        return web.json_response({"status": "ok"})

    async def _info(self, request):
        from aiohttp import web

        s = self.settings
        return web.json_response({
            **self.info,
            "source_vocabulary": len(self.src_vocab), "target_vocabulary": len(self.tgt_vocab),
            "decoding": {"beam": s.beam, "alpha": s.alpha if s.penalty == "gnmt" else None,
                         "length_penalty": s.penalty, "max_tokens": s.max_tokens, "max_src_len": s.max_src_len,
                         "max_len_a": s.max_len_a, "max_len_b": s.max_len_b, "early_stop": s.early_stop},
            "limits": {"max_sentences": s.max_sentences, "max_chars": s.max_chars},
            "batching": {"batch_sentences": s.batch_sentences, "max_wait_ms": s.max_wait_ms},
            "counters": {"requests": self.counters.requests, "sentences": self.counters.sentences,
                         "batches": self.counters.batches, "errors": self.counters.errors,
                         "uptime_s": round(time.time() - self.counters.started, 3)},
        })

    # --------------------------------------------------------------------------------------- batcher
    async def _batcher_context(self, app):
        """Runs the batcher for the application's life; it ends after the requests in flight have finished."""
        self._queue, self._queued = asyncio.Queue(), 0
        task = asyncio.get_running_loop().create_task(self._batcher())
        yield
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    def _take(self, item: _Pending, room: int, pieces: List[Tuple[_Pending, int, int]]) -> int:
        """Up to `room` of `item`'s sentences not yet taken, as a piece of the batch being made; the request goes back
        to the end of the queue while it has more (a request larger than a batch is decoded a batch at a time, in
        turn with the requests behind it: it held them all until it was decoded whole). Returns how many."""
        if item.gone() and not item.future.done():   # a client that left: its sentences are not decoded
            item.future.set_exception(ClientsGone())
        if item.future.done():   # (its client gone, or a piece of it failed)
            self._queued -= len(item.sentences) - item.taken
            item.taken = len(item.sentences)
            return 0
        start = item.taken
        item.taken = min(len(item.sentences), start + room)
        self._queued -= item.taken - start
        pieces.append((item, start, item.taken))
        if item.taken < len(item.sentences):
            self._queue.put_nowait(item)
        return item.taken - start

    async def _batcher(self) -> None:
        loop = asyncio.get_running_loop()
        size = self.settings.batch_sentences
        while True:
            pieces: List[Tuple[_Pending, int, int]] = []
            waiting = self._take(await self._queue.get(), size, pieces)
            deadline = loop.time() + self.settings.max_wait_ms / 1000.0
            while waiting < size:
                if not self._queue.empty():
                    waiting += self._take(self._queue.get_nowait(), size - waiting, pieces)
                    continue
                timeout = deadline - loop.time()
                if timeout <= 0:
                    break
                try:
                    item = await asyncio.wait_for(self._queue.get(), timeout)
                except asyncio.TimeoutError:
                    break
                waiting += self._take(item, size - waiting, pieces)
            if pieces:
                await self._decode_batch(pieces)

    async def _decode_batch(self, pieces: List[Tuple[_Pending, int, int]]) -> None:
        """Decodes the batch's pieces (a request's sentences start:end each) in one call, and answers each request
        whose last piece this was; if that call fails and the batch holds several pieces, each is decoded again on
        its own, so that only a failing request fails."""
        loop = asyncio.get_running_loop()
        for item, _, _ in pieces:   # a client that left while its batch was made: its sentences are not decoded
            if item.gone() and not item.future.done():
                item.future.set_exception(ClientsGone())
        pieces = [piece for piece in pieces if not piece[0].future.done()]   # (a client gone, or a piece failed)
        if not pieces:
            return
        sentences = [s for item, start, end in pieces for s in item.sentences[start:end]]
        try:
            results, notes = await loop.run_in_executor(self._worker, self._decode, sentences, pieces)
        except ClientsGone as exc:   # (every client left while its sentences were decoded: the rest not decoded)
            for item, _, _ in pieces:
                if not item.future.done():
                    item.future.set_exception(exc)
            return
        except Exception as exc:   # noqa: BLE001 - handed to the request, or each piece retried alone
            if len(pieces) == 1:
                if not pieces[0][0].future.done():
                    pieces[0][0].future.set_exception(exc)
                return
            for piece in pieces:
                await self._decode_batch([piece])
            return
        self.counters.batches += 1
        self.counters.sentences += len(sentences)
        at = 0
        for item, start, end in pieces:
            item.results[start:end], item.notes[start:end] = results[at:at + end - start], notes[at:at + end - start]
            at += end - start
            item.decoded += end - start
            if item.decoded == len(item.sentences) and not item.future.done():
                item.future.set_result((item.results, item.notes))

    def _decode(self, sentences: List[str], pieces: Sequence[Tuple[_Pending, int, int]] = ()
                ) -> Tuple[List[List[Tuple[str, float]]], List[List[str]]]:
        """The translations of `sentences`, and for each sentence the notes of the warnings about it (its source
        cut, mostly unknown pieces); ClientsGone between two of translate's batches once every request of `pieces`
        (whose sentences these are) has lost its client."""
        def watch(done: int, total: int) -> None:
            if pieces and all(item.gone() for item, _, _ in pieces):
                raise ClientsGone()

        s = self.settings
        places = [(item.number, j + 1) for item, start, end in pieces for j in range(start, end)]
        caught: List[Warning] = []
        results, messages = input_warnings(lambda: translate(
            self.model, self.src_vocab, self.tgt_vocab, sentences, beam=s.beam, alpha=s.alpha, max_tokens=s.max_tokens,
            max_src_len=s.max_src_len, max_len_a=s.max_len_a, max_len_b=s.max_len_b, decoder=self.decoder,
            early_stop=s.early_stop, penalty=s.penalty, progress=watch,
            where=(lambda i: "request {} sentence {}".format(*places[i])) if len(places) == len(sentences) else None),
            caught=caught)
        for message in messages:
            self._warnings.handle(logging.makeLogRecord({"name": "dtmt.serve", "levelno": logging.WARNING,
                                                         "levelname": "WARNING", "msg": f"warning: {message}"}))
        notes: List[List[str]] = [[] for _ in sentences]
        for warning in caught:
            for i in getattr(warning, "positions", ()):
                notes[i].append(warning.note)
        return results, notes
