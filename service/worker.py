"""gunicorn's gthread worker, except that a request reaches a thread only once all of it has arrived.

gunicorn's own ThreadWorker hands a connection to a thread as soon as it is readable, and the thread then
blocks reading the headers and the body: a client that sends a few bytes and stops holds that thread, and a
handful of them leave nothing to answer /healthz. Here the worker's main loop reads every request itself, without
blocking, beside all the others: the headers, then the body (by Content-Length, or chunk by chunk), at most
1 MiB of it. Only a whole request goes to the thread pool, where gunicorn's parser reads it from memory. A
request that has not all arrived within TRAINMEDIC_REQUEST_DEADLINE seconds gets 408 and its connection is
closed; a body over 1 MiB gets 413 as soon as that is known.
"""
from __future__ import annotations

import errno
import json
import selectors
import socket
import time
from functools import partial
from typing import Any

from gunicorn import http  # type: ignore[import-untyped]  # gunicorn ships no type hints
from gunicorn.workers.gthread import TConn, ThreadWorker  # type: ignore[import-untyped]

from .errors import MAX_BODY
from .settings import ServiceSettings

WAIT, READY, BAD, TOO_LARGE, HEAD_TOO_LARGE = range(5)
# gunicorn's own limits are per line (8190 bytes) and per count (100 fields); a whole header block or
# trailer section past this is refused before its end is looked for any further.
MAX_HEAD = 64 * 1024
MAX_CHUNK_LINE = 8190
# Chunk-size lines count towards what is read but not towards the body: a body cut into tiny chunks may take
# this much on the wire before it is refused as too large.
MAX_CHUNKED_WIRE = 2 * MAX_BODY
RECV_SIZE = 64 * 1024
# How long a connection that is being closed still takes (and discards) what the client sends, so that the
# client reads the answer before its socket is reset.
LINGER = 2.0
_HEX = frozenset(b"0123456789abcdefABCDEF")
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def _answer(status: str, message: str) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, with the service's JSON error body."""
    body = json.dumps({"error": message}).encode() + b"\n"
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body


TOO_LARGE_ANSWER = _answer("413 Content Too Large", f"the body is larger than {MAX_BODY // 1024} KiB")
HEAD_TOO_LARGE_ANSWER = _answer("431 Request Header Fields Too Large",
                                f"the request's headers are larger than {MAX_HEAD // 1024} KiB")


class Framing:
    """Where one HTTP/1.1 request ends in the bytes received so far; each call reads only what is new."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Ready for the next request on the connection."""
        self.searched = 0  # how far the end of the headers has been looked for
        self.head_end = -1
        self.chunked = False
        self.end = 0  # with a Content-Length: where the request ends
        self.pos = 0  # chunked: the first byte not yet read
        self.left = 0  # chunked: bytes of the current chunk (and its CRLF) still to come
        self.in_trailers = False
        self.body = 0
        self.expect_continue = False
        self.continue_sent = False

    def feed(self, buf: bytearray) -> tuple[int, int]:
        """(WAIT, 0), (READY, end of the request), (BAD, 0), (TOO_LARGE, 0) or (HEAD_TOO_LARGE, 0)."""
        if self.head_end < 0:
            status = self._head(buf)
            if status != READY:
                return status, 0
        if not self.chunked:
            return (READY, self.end) if len(buf) >= self.end else (WAIT, 0)
        status, end = self._chunks(buf)
        if status == WAIT and len(buf) - self.head_end > MAX_CHUNKED_WIRE:
            return TOO_LARGE, 0
        return status, end

    def _head(self, buf: bytearray) -> int:
        if not self.searched:
            # RFC 9112 section 2.2: empty lines before a request line are ignored (some clients send one after
            # a body).
            while buf[:2] == b"\r\n":
                del buf[:2]
        idx = buf.find(b"\r\n\r\n", max(0, self.searched - 3))
        if idx < 0:
            self.searched = len(buf)
            return HEAD_TOO_LARGE if len(buf) > MAX_HEAD else WAIT
        if idx > MAX_HEAD:
            return HEAD_TOO_LARGE
        self.head_end = idx + 4
        lines = bytes(buf[:idx]).split(b"\r\n")
        http11 = lines[0].endswith(b" HTTP/1.1")
        lengths: list[bytes] = []
        codings: list[bytes] = []
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.lower()
            if name == b"content-length":
                lengths.append(value.strip(b" \t"))
            elif name == b"transfer-encoding":
                codings.extend(v.strip(b" \t").lower() for v in value.split(b","))
            elif name == b"expect":
                self.expect_continue = http11 and value.strip(b" \t").lower() == b"100-continue"
        # Whatever framing gunicorn's parser would refuse goes to it as it is, so that it answers 400 (and the
        # connection closes): the two must never disagree on where a request ends.
        if codings:
            if codings[-1] != b"chunked" or lengths or not http11:
                return BAD
            self.chunked = True
            self.pos = self.head_end
            return READY
        if not lengths:
            self.end = self.head_end
            return READY
        if len(lengths) > 1 or not lengths[0].isdigit():
            return BAD
        # int() of thousands of digits is slow (and refused past 4300): this many is past the limit anyway.
        if len(lengths[0].lstrip(b"0")) > 12 or int(lengths[0]) > MAX_BODY:
            return TOO_LARGE
        length = int(lengths[0])
        self.end = self.head_end + length
        return READY

    def _chunks(self, buf: bytearray) -> tuple[int, int]:
        while True:
            if self.in_trailers:
                if len(buf) - self.pos < 2:
                    return WAIT, 0
                if buf[self.pos:self.pos + 2] == b"\r\n":
                    return READY, self.pos + 2
                idx = buf.find(b"\r\n\r\n", self.pos)
                if idx >= 0:
                    return READY, idx + 4
                return (BAD, 0) if len(buf) - self.pos > MAX_HEAD else (WAIT, 0)
            if self.left:
                have = len(buf) - self.pos
                if have < self.left:
                    self.pos, self.left = len(buf), self.left - have
                    return WAIT, 0
                self.pos, self.left = self.pos + self.left, 0
                if buf[self.pos - 2:self.pos] != b"\r\n":
                    return BAD, 0
                continue
            idx = buf.find(b"\r\n", self.pos)
            if idx < 0:
                return (BAD, 0) if len(buf) - self.pos > MAX_CHUNK_LINE else (WAIT, 0)
            text = bytes(buf[self.pos:idx]).split(b";", 1)[0].rstrip(b" \t")
            if not text or not _HEX.issuperset(text):
                return BAD, 0
            if len(text.lstrip(b"0")) > 12:
                return TOO_LARGE, 0
            size = int(text, 16)
            self.pos = idx + 2
            if size == 0:
                self.in_trailers = True
                continue
            self.body += size
            if self.body > MAX_BODY:
                return TOO_LARGE, 0
            self.left = size + 2


class Conn(TConn):
    """A client connection and what it has sent that no thread has taken yet."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.buf = bytearray()
        self.framing = Framing()
        self.request = b""
        self.must_close = False


class WholeRequestWorker(ThreadWorker):
    """gthread, with each request read whole by the main loop (within a deadline) before a thread serves it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.deadline = ServiceSettings.from_env().request_deadline
        # Connections by the time they must be closed; both dicts hold them in that order, as every entry in
        # one dict gets the same delay from the time it was added.
        self.reading: dict[Conn, None] = {}
        self.lingering: dict[Conn, None] = {}
        self.timeout_answer = _answer(
            "408 Request Timeout", f"the request did not arrive within {self.deadline:g} seconds")

    @classmethod
    def check_config(cls, cfg: Any, log: Any) -> None:
        """Refuse what this worker does not read: TLS and the uwsgi protocol (a proxy in front does both)."""
        super().check_config(cfg, log)
        if cfg.is_ssl or getattr(cfg, "protocol", "http") != "http":
            raise RuntimeError("trainmedic's worker serves plain HTTP/1.1 only: terminate TLS in a proxy in front")

    # The main loop (one thread): accept, read, frame, hand over, close.

    def accept(self, listener: socket.socket) -> None:
        try:
            sock, addr = listener.accept()
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.ECONNABORTED, errno.EWOULDBLOCK):
                raise
            return
        self.nr_conns += 1
        conn = Conn(self.cfg, sock, addr, listener.getsockname())  # non-blocking from here
        self._start_reading(conn)
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_readable, conn))

    def _start_reading(self, conn: Conn) -> None:
        conn.timeout = time.monotonic() + self.deadline
        self.reading[conn] = None

    def _on_readable(self, conn: Conn, _sock: Any) -> None:
        try:
            data = conn.sock.recv(RECV_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client went away before its request was whole: nothing to answer
            self.poller.unregister(conn.sock)
            self.reading.pop(conn, None)
            self._close(conn)
            return
        conn.buf += data
        self._advance(conn)

    def _advance(self, conn: Conn) -> None:
        status, end = conn.framing.feed(conn.buf)
        if status == WAIT:
            if conn.framing.expect_continue and not conn.framing.continue_sent and conn.framing.head_end > 0:
                conn.framing.continue_sent = True
                self._send(conn, _CONTINUE)
            return
        self.poller.unregister(conn.sock)
        self.reading.pop(conn, None)
        if status == TOO_LARGE:
            self._refuse(conn, TOO_LARGE_ANSWER)
        elif status == HEAD_TOO_LARGE:
            self._refuse(conn, HEAD_TOO_LARGE_ANSWER)
        else:
            end = end if status == READY else len(conn.buf)
            conn.request = bytes(conn.buf[:end])
            del conn.buf[:end]
            conn.must_close = status == BAD
            conn.framing.reset()
            self.enqueue_req(conn)

    def _send(self, conn: Conn, data: bytes) -> None:
        # A few hundred bytes into an empty send buffer; a client whose buffer is full gets less (or nothing).
        try:
            conn.sock.send(data)
        except OSError:
            pass

    def _refuse(self, conn: Conn, answer: bytes) -> None:
        self._send(conn, answer)
        self._linger(conn)

    def _linger(self, conn: Conn) -> None:
        """Half-close, then discard what the client still sends until it closes too (or LINGER passes)."""
        try:
            conn.sock.setblocking(False)
            conn.sock.shutdown(socket.SHUT_WR)
            self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_lingering, conn))
        except (OSError, ValueError, KeyError):
            self._close(conn)
            return
        conn.timeout = time.monotonic() + LINGER
        self.lingering[conn] = None

    def _on_lingering(self, conn: Conn, _sock: Any) -> None:
        try:
            if conn.sock.recv(RECV_SIZE):
                return
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            pass
        self.poller.unregister(conn.sock)
        self.lingering.pop(conn, None)
        self._close(conn)

    def _close(self, conn: Conn) -> None:
        self.nr_conns -= 1
        conn.close()

    def murder_pending(self) -> None:
        """Close what is past its time: requests still arriving (with a 408), and lingering connections."""
        now = time.monotonic()
        while self.reading:
            conn = next(iter(self.reading))
            if conn.timeout > now:
                break
            del self.reading[conn]
            self.poller.unregister(conn.sock)
            if conn.buf:
                self._refuse(conn, self.timeout_answer)
            else:  # nothing of a request yet: nobody is waiting for an answer
                self._close(conn)
        while self.lingering:
            conn = next(iter(self.lingering))
            if conn.timeout > now:
                break
            del self.lingering[conn]
            self.poller.unregister(conn.sock)
            self._close(conn)

    def on_client_socket_readable(self, conn: Conn, client: Any) -> None:
        """A kept-alive connection's next request has begun: it has the deadline from now."""
        self.keepalived_conns.remove(conn)
        self.poller.modify(conn.sock, selectors.EVENT_READ, partial(self._on_readable, conn))
        self._start_reading(conn)
        self._on_readable(conn, client)

    def finish_request(self, conn: Conn, fs: Any) -> None:
        """Back from a thread: keep the connection for the next request, or close it."""
        try:
            keep = not fs.cancelled() and bool(fs.result())
            if keep:
                conn.sock.setblocking(False)
        except Exception:
            keep = False
        if not keep:
            self._linger(conn)
            return
        if conn.buf:  # the client sent its next request without waiting for this answer
            self._start_reading(conn)
            self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_readable, conn))
            self._advance(conn)
            return
        conn.set_timeout()
        if not self.alive:
            conn.timeout = min(conn.timeout, time.monotonic() + 2.0)
        self.keepalived_conns.append(conn)
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self.on_client_socket_readable, conn))

    # A thread: serve one whole request from memory.

    def handle(self, conn: Conn) -> bool:
        """Serve conn.request; whether the connection may carry another request."""
        req = None
        try:
            # Blocking again, for the answer; a client that does not read it is dropped after gunicorn's timeout.
            conn.sock.settimeout(self.cfg.timeout or None)
            conn.parser = http.get_parser(self.cfg, [conn.request], conn.client)
            req = next(conn.parser)
            # The whole body is here: a 100 Continue (if one was due) went out while it was arriving.
            req._expected_100_continue = False
            if not self.handle_request(req, conn) or conn.must_close:
                return False
            if not conn.parser.finish_body():
                return False
            # Bytes framed as this request that gunicorn's parser did not read: the two disagree on where it
            # ends, so nothing after it can be trusted.
            return not conn.parser.unreader.read()
        except http.errors.NoMoreData as e:
            self.log.debug("Incomplete request: %s", e)
        except StopIteration as e:
            self.log.debug("Closing connection: %s", e)
        except OSError as e:
            if isinstance(e, TimeoutError) or e.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN):
                self.log.debug("Client gone or not reading: %s", e)
            else:
                self.log.exception("Socket error processing request.")
        except Exception as e:
            self.handle_error(req, conn.sock, conn.client, e)
        return False
