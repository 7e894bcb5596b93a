"""Requests reach a thread whole and cheap to parse, on every endpoint, within a bounded buffer per worker.

Against real gunicorn with the service's worker: a body of 50,000 one-byte chunks reaches the app in one pass
(gunicorn's own chunked reader copies what is left of the request at every chunk), so eight of them cannot
starve the probes; /login is read like every other endpoint; and a worker whose buffer of requests not yet
answered is full refuses a new incomplete request with 503 while it serves whole ones, and takes new ones again
once the others are answered or timed out.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
import requests

from trainmedic.service.embedded_redis import free_port

from tests.conftest import AUTH, OPERATOR, ROOT, TOKEN, load_fixture
from tests.support.raw_http import chunked, closed_after, read_response

CHUNKS = 50_000
MiB = 1024 * 1024
FORM = "application/x-www-form-urlencoded"


def head(method: str, path: str, *lines: str) -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n" + "".join(f"{line}\r\n" for line in lines)
            + "\r\n").encode()


def ask(port: int, request: bytes, timeout: float = 30) -> tuple[int, dict[str, str], bytes]:
    """One request on a new connection; its answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        return read_response(sock, bytearray())


class Echo:
    """The service's worker in real gunicorn, serving tests/support/echo_app.py with one thread."""

    def __init__(self, tmp: Path):
        self.port = free_port()
        self.log = open(tmp / "echo.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "--worker-class", "trainmedic.service.worker.WholeRequestWorker",
             "--workers", "1", "--threads", "1", "--bind", f"127.0.0.1:{self.port}", "tests.support.echo_app:app"],
            cwd=ROOT, env={**os.environ, "TRAINMEDIC_REQUEST_DEADLINE": "5"}, stdout=self.log,
            stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                ask(self.port, head("GET", "/"), timeout=1)
                return
            except OSError:
                assert self.proc.poll() is None and time.monotonic() < deadline, (tmp / "echo.log").read_text()
                time.sleep(0.1)

    def post(self, body: bytes, *lines: str) -> tuple[int, bytes]:
        status, _, answer = ask(self.port, head("POST", "/", "Transfer-Encoding: chunked", *lines) + body)
        return status, answer

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(15)
        self.log.close()


@pytest.fixture
def echo(tmp_path: Path) -> Iterator[Echo]:
    e = Echo(tmp_path)
    yield e
    e.stop()


def test_a_body_of_50000_one_byte_chunks_reaches_the_app_in_one_pass(echo: Echo) -> None:
    data = os.urandom(CHUNKS)
    sent = {"length": CHUNKS, "sha256": hashlib.sha256(data).hexdigest(), "content_length": None,
            "transfer_encoding": "chunked"}
    # gunicorn parses two chunk-size lines (one chunk, then the last), not 50,001.
    status, answer = echo.post(chunked(data, 1))
    assert status == 200 and json.loads(answer) == {**sent, "chunk_lines": 2}
    # Extensions on every chunk and trailers after them: the same body, still two lines for gunicorn.
    with_extensions = b"".join(b'1;n=v;q="a b"\r\n%c\r\n' % byte for byte in data)
    status, answer = echo.post(with_extensions + b"0;last\r\nX-Trailer: t\r\n\r\n")
    assert status == 200 and json.loads(answer) == {**sent, "chunk_lines": 2}
    # An empty chunked body: only the last chunk.
    status, answer = echo.post(b"0\r\n\r\n")
    assert status == 200 and json.loads(answer)["length"] == 0 and json.loads(answer)["chunk_lines"] == 1


BAD_REQUEST = "HTTP/1.1 400 Bad Request"
# Framing that could smuggle a second request past the worker: gunicorn's parser refuses each with 400 and the
# connection closes, so the request pipelined behind it is never answered.
SMUGGLING = {
    "Transfer-Encoding and Content-Length": (head("POST", "/", "Transfer-Encoding: chunked", "Content-Length: 6")
                                             + b"1\r\na\r\n0\r\n\r\n"),
    "a chunk size that is not hex": head("POST", "/", "Transfer-Encoding: chunked") + b"1\r\na\r\nzz\r\n",
    "a negative chunk size": head("POST", "/", "Transfer-Encoding: chunked") + b"-1\r\na\r\n0\r\n\r\n",
    "a space after the chunk size": head("POST", "/", "Transfer-Encoding: chunked") + b"1 \r\na\r\n0\r\n\r\n",
    "a bad chunk extension": head("POST", "/", "Transfer-Encoding: chunked") + b"1\r\na\r\n0;@\r\n\r\n",
    "a bare CR in an extension": head("POST", "/", "Transfer-Encoding: chunked") + b"1;x\rz\r\na\r\n0\r\n\r\n",
    "a chunk longer than its size": (head("POST", "/", "Transfer-Encoding: chunked")
                                     + b"2\r\nab\r\n" * 1000 + b"1\r\nabX\r\n0\r\n\r\n"),
    "a trailer that is no header": head("POST", "/", "Transfer-Encoding: chunked") + b"0\r\nnot a header\r\n\r\n",
    "a bare LF in the trailers": head("POST", "/", "Transfer-Encoding: chunked") + b"0\r\nX: 1\nY: 2\r\n\r\n",
    "chunked under HTTP/1.0": (b"POST / HTTP/1.0\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
                               b"1\r\na\r\n0\r\n\r\n"),
    "chunked that is not the last coding": (head("POST", "/", "Transfer-Encoding: chunked, gzip")
                                            + b"1\r\na\r\n0\r\n\r\n"),
}


@pytest.mark.parametrize("name", SMUGGLING)
def test_framing_that_could_smuggle_a_request_is_refused_400_and_closes(echo: Echo, name: str) -> None:
    with socket.create_connection(("127.0.0.1", echo.port), timeout=10) as sock:
        sock.sendall(SMUGGLING[name] + head("GET", "/smuggled"))
        _, got = closed_after(sock, 10)
    assert got.startswith(BAD_REQUEST.encode()), got[:200]
    assert got.count(b"HTTP/1.1") == 1, got


def test_trailers_and_a_pipelined_request_after_a_chunked_body_are_kept(echo: Echo) -> None:
    body = head("POST", "/", "Transfer-Encoding: chunked") + b"3\r\nabc\r\n2\r\nde\r\n0\r\nX-Sum: 5\r\n\r\n"
    with socket.create_connection(("127.0.0.1", echo.port), timeout=10) as sock:
        sock.sendall(body + head("POST", "/", "Content-Length: 2") + b"fg")
        buf = bytearray()
        first, second = read_response(sock, buf), read_response(sock, buf)
    assert first[0] == second[0] == 200
    assert json.loads(first[2])["sha256"] == hashlib.sha256(b"abcde").hexdigest()
    assert json.loads(second[2])["content_length"] == "2" and json.loads(second[2])["length"] == 2


# -- the service


def login_form(**fields: str) -> bytes:
    """A login form padded to CHUNKS bytes, as 50,000 one-byte chunks."""
    form = urlencode(fields).encode() + b"&pad="
    return chunked(form + b"a" * (CHUNKS - len(form)), 1)


def test_the_probes_answer_while_eight_logins_of_50000_chunks_are_served(gunicorn: Any) -> None:
    g = gunicorn(workers=2)  # 8 threads in all, as many as the requests
    attack = head("POST", "/login", "Transfer-Encoding: chunked", f"Content-Type: {FORM}") + login_form(token="x")
    answers: list[tuple[int, bytes]] = []

    def attacker() -> None:
        status, _, body = ask(g.port, attack, timeout=120)
        answers.append((status, body))

    threads = [threading.Thread(target=attacker, daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    # Before, each took a thread for tens of seconds of copying, and the probes waited as long; the bound here
    # is generous, for a busy machine.
    probes = 0
    while any(t.is_alive() for t in threads) or probes < 5:
        try:
            assert requests.get(g.url + "/healthz", timeout=10).status_code == 200
        except requests.RequestException as exc:
            pytest.fail(f"/healthz did not answer within 10 s while 8 chunked logins were served: {exc}")
        probes += 1
        time.sleep(0.1)
    for t in threads:
        t.join()
    # Each was read whole, form and all: no session, so the form had expired.
    assert len(answers) == 8
    assert all(status == 403 and b"The form had expired" in body for status, body in answers), answers[0]


def test_a_login_whose_form_comes_in_50000_chunks_logs_in(gunicorn: Any) -> None:
    g = gunicorn(workers=1)
    with requests.Session() as s:
        page = s.get(g.url + "/login?again=1", timeout=10)
        [csrf] = re.findall(r'name="csrf" value="([^"]+)"', page.text)
        cookie = "; ".join(f"{k}={v}" for k, v in s.cookies.items())
    status, headers, _ = ask(g.port, head("POST", "/login", "Transfer-Encoding: chunked", f"Content-Type: {FORM}",
                                          f"Cookie: {cookie}") + login_form(csrf=csrf, token=OPERATOR, next="/x"))
    assert status == 303 and headers["location"].endswith("/x")
    assert "trainmedic_session=" in headers["set-cookie"]


def stalled_at(port: int, request: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(request)
    return sock


def answered_within(sock: socket.socket, seconds: float) -> bytes:
    """What the server sent on sock within `seconds` (b"" if nothing), up to its close."""
    sock.settimeout(seconds)
    try:
        first = sock.recv(65536)
    except TimeoutError:
        return b""
    return first + closed_after(sock, 5)[1]


def fill(port: int) -> tuple[list[socket.socket], int]:
    """Two webhooks whose headers announce bodies that, with them, leave 16 bytes of a 2 MiB buffer free; and
    their Content-Length. Neither sends its body yet: each has been told to (100 Continue), so both were taken in."""
    def announce(length: int) -> bytes:
        return head("POST", "/webhook", f"Authorization: Bearer {TOKEN}", "Content-Type: application/json",
                    "Expect: 100-continue", f"Content-Length: {length}")

    length = (2 * MiB - 16) // 2 - len(announce(1_000_000))
    fillers = []
    for _ in range(2):
        fillers.append(stalled_at(port, announce(length)))
        assert read_response(fillers[-1], bytearray())[0] == 100
    return fillers, length


BUSY = b"HTTP/1.1 503 Service Unavailable"


# What each endpoint gets that the worker answers itself, before any thread: a stalled request, a chunked body
# over 1 MiB, and an incomplete request while the buffer is full.
ENDPOINTS = {
    "POST /login": head("POST", "/login", f"Content-Type: {FORM}", "Content-Length: 100") + b"token=",
    "POST /webhook": head("POST", "/webhook", f"Authorization: Bearer {TOKEN}", "Content-Type: application/json",
                          "Content-Length: 100") + b'{"alerts":',
    "POST /commands": head("POST", "/commands", f"Authorization: Bearer {OPERATOR}", "Content-Type: application/json",
                           "Content-Length: 100") + b"{",
    "GET /": b"GET /?limit=5 HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/h",
}


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_every_endpoint_is_read_by_the_worker_within_its_deadline_and_buffer(gunicorn: Any, endpoint: str) -> None:
    g = gunicorn(workers=1, TRAINMEDIC_REQUEST_DEADLINE="2", TRAINMEDIC_WORKER_BUFFER="2")
    partial = ENDPOINTS[endpoint]
    method, path = endpoint.split()
    # Stalled: the worker's 408 at the deadline, not the app's answer.
    t0 = time.monotonic()
    waited, got = closed_after(stalled_at(g.port, partial), 5)
    assert got.startswith(b"HTTP/1.1 408 Request Timeout\r\n") and time.monotonic() - t0 < 4
    assert json.loads(got.partition(b"\r\n\r\n")[2]) == {"error": "the request did not arrive within 2 seconds"}
    # Chunked over 1 MiB: the worker's 413 as soon as it is past the limit.
    with socket.create_connection(("127.0.0.1", g.port), timeout=10) as sock:
        sock.sendall(head(method, path, "Transfer-Encoding: chunked", f"Authorization: Bearer {OPERATOR}"))
        try:
            for _ in range(40):
                sock.sendall(chunked(b" " * 64 * 1024, 64 * 1024)[:-5])
        except OSError:
            pass
        got = closed_after(sock, 5)[1]
    assert got.startswith(b"HTTP/1.1 413 Content Too Large\r\n"), got[:100]
    # The buffer full: 503, and the connection closed.
    fillers, _ = fill(g.port)
    got = answered_within(stalled_at(g.port, partial), 5)
    assert got.startswith(BUSY), got[:100]
    for sock in fillers:
        sock.close()


def test_a_full_buffer_refuses_a_new_incomplete_request_with_503_and_recovers(gunicorn: Any) -> None:
    g = gunicorn(workers=1, TRAINMEDIC_REQUEST_DEADLINE="4", TRAINMEDIC_WORKER_BUFFER="2")
    group = json.dumps(load_fixture("firing_single.json")).encode()
    partial = head("POST", "/webhook", f"Authorization: Bearer {TOKEN}", "Content-Type: application/json",
                   f"Content-Length: {len(group)}") + group[:10]
    t0 = time.monotonic()
    (first, second), length = fill(g.port)
    padded = group + b" " * (length - len(group))
    got = answered_within(stalled_at(g.port, partial), 5)
    assert got.startswith(BUSY + b"\r\n"), got[:100]
    assert b"Retry-After: 1\r\n" in got and b"Connection: close\r\n" in got
    assert json.loads(got.partition(b"\r\n\r\n")[2]) == {
        "error": "the service is reading too many requests at once; try again"}
    # Whole requests are served meanwhile: the probes, and a webhook that arrives in one piece.
    assert requests.get(g.url + "/healthz", timeout=2).status_code == 200
    status, _, body = ask(g.port, head("POST", "/webhook", f"Authorization: Bearer {TOKEN}",
                                       "Content-Type: application/json", f"Content-Length: {len(group)}") + group)
    assert status == 200, body
    # The first filler sends its body: it was taken in, so it is served, although the buffer is full ...
    first.sendall(padded)
    status, _, body = read_response(first, bytearray())
    assert status == 200 and json.loads(body)["alerts"] == 1, body
    # (A worker lets go of a request's bytes once it has answered it: its next request on the connection is read
    # after that.)
    first.sendall(head("GET", "/healthz"))
    assert read_response(first, bytearray())[0] == 200
    first.close()
    # ... and a new incomplete request is held again instead of refused: completed, it is answered.
    taken = stalled_at(g.port, partial)
    assert answered_within(taken, 0.5) == b""
    taken.sendall(group[10:])
    assert read_response(taken, bytearray())[0] == 200
    taken.close()
    # The second filler stalls until its deadline (408); then the buffer is empty, and a request as large as
    # the first filler's is taken whole.
    assert answered_within(second, 10).startswith(b"HTTP/1.1 408 Request Timeout")
    assert time.monotonic() - t0 < 8
    second.close()
    for _ in range(2):
        resp = requests.post(g.url + "/webhook", data=padded, headers={**AUTH, "Content-Type": "application/json"},
                             timeout=10)
        assert resp.status_code == 200, resp.text
