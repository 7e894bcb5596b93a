"""gunicorn's gthread worker, except that a request reaches a thread only once all of it has arrived.

gunicorn's own ThreadWorker hands a connection to a thread as soon as it is readable, and the thread then
blocks reading the headers and the body: a client that sends a few bytes and stops holds that thread, and a
handful of them leave nothing to answer /healthz. Here the worker's main loop reads every request itself, without
blocking, beside all the others: the headers, then the body (by Content-Length, or chunk by chunk, see
framing.py), at most 1 MiB of it. Only a whole request goes to the thread pool, where gunicorn's parser reads it
from memory. A request that has not all arrived within TRAINMEDIC_REQUEST_DEADLINE seconds gets 408 and its
connection is closed; a body over 1 MiB gets 413 as soon as that is known. The worker holds at most
TRAINMEDIC_WORKER_BUFFER of requests not yet answered, each counted from its headers on at the length they
announce: a new request that does not fit gets 503 (Alertmanager retries), while those taken in are read to
their end, and a request that arrives whole is served.
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
from .framing import BAD, HEAD_TOO_LARGE, MAX_HEAD, TOO_LARGE, WAIT, Framing
from .settings import ServiceSettings

RECV_SIZE = 64 * 1024
# How long a connection that is being closed still takes (and discards) what the client sends, so that the
# client reads the answer before its socket is reset.
LINGER = 2.0
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def _answer(status: str, message: str, extra: str = "") -> bytes:
    """A whole HTTP/1.1 response that closes the connection, with the service's JSON error body."""
    body = json.dumps({"error": message}).encode() + b"\n"
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"{extra}Connection: close\r\n\r\n").encode() + body


TOO_LARGE_ANSWER = _answer("413 Content Too Large", f"the body is larger than {MAX_BODY // 1024} KiB")
HEAD_TOO_LARGE_ANSWER = _answer("431 Request Header Fields Too Large",
                                f"the request's headers are larger than {MAX_HEAD // 1024} KiB")
BUSY_ANSWER = _answer("503 Service Unavailable", "the service is reading too many requests at once; try again",
                      "Retry-After: 1\r\n")


class Conn(TConn):
    """A client connection and what it has sent that no thread has taken yet."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.buf = bytearray()
        self.framing = Framing()
        self.request = b""
        self.must_close = False
        # Bytes of its requests the worker holds for it (counted in the worker's own total), and whether the
        # request arriving was taken in: it then has room for all of its body.
        self.held = 0
        self.admitted = False


class WholeRequestWorker(ThreadWorker):
    """gthread, with each request read whole by the main loop (within a deadline) before a thread serves it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        settings = ServiceSettings.from_env()
        self.deadline = settings.request_deadline
        # Bytes of requests not yet answered (arriving, or whole and with a thread): past the bound, a new request
        # still arriving is refused with 503, while those taken in and whole ones are served.
        self.buffer_bound = settings.worker_buffer
        self.held = 0
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
        status = conn.framing.feed(conn.buf)
        if status == WAIT:
            framing = conn.framing
            self._hold(conn, max(len(conn.buf) + framing.held, framing.reserve))
            if conn.admitted:
                return
            if self.held > self.buffer_bound:
                self.poller.unregister(conn.sock)
                self.reading.pop(conn, None)
                self._refuse(conn, BUSY_ANSWER)
            elif framing.head_end > 0:  # its headers are here, and there is room for the body they announce
                conn.admitted = True
                if framing.expect_continue:
                    self._send(conn, _CONTINUE)
            return
        self.poller.unregister(conn.sock)
        self.reading.pop(conn, None)
        if status == TOO_LARGE:
            self._refuse(conn, TOO_LARGE_ANSWER)
        elif status == HEAD_TOO_LARGE:
            self._refuse(conn, HEAD_TOO_LARGE_ANSWER)
        else:
            conn.request = conn.framing.take(conn.buf, status)
            conn.must_close = status == BAD
            conn.framing.reset()
            conn.admitted = False
            self._hold(conn, len(conn.request) + len(conn.buf))
            self.enqueue_req(conn)

    def _hold(self, conn: Conn, size: int) -> None:
        """conn now holds size bytes of requests not yet answered."""
        self.held += size - conn.held
        conn.held = size

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
        self._forget(conn)
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

    def _forget(self, conn: Conn) -> None:
        """Drop what conn sent that is still held: it will not be served."""
        conn.buf = bytearray()
        conn.request = b""
        conn.framing.reset()
        conn.admitted = False
        self._hold(conn, 0)

    def _close(self, conn: Conn) -> None:
        self._forget(conn)
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
        conn.request = b""
        self._hold(conn, len(conn.buf))
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
