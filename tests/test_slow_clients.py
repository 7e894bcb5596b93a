"""Slow, stalled and oversized requests against real gunicorn: probes keep answering, bodies stay bounded.

The worker reads each request whole before a thread serves it, within TRAINMEDIC_REQUEST_DEADLINE (5 s by
default), and refuses a body over 1 MiB however it is sent. Keep-alive, pipelining and 100-continue still work.
"""
from __future__ import annotations

import http.client
import io
import json
import selectors
import socket
import threading
import time
from typing import Any

import pytest
import requests

from trainmedic.client.settings import SettingsError
from trainmedic.client.wire import keys
from trainmedic.service.settings import ServiceSettings

from tests.conftest import AUTH, TOKEN, load_fixture
from tests.support.raw_http import closed_after, read_response

MiB = 1024 * 1024
STALLED_BODY = (f"POST /webhook HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
                "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n").encode() + b'{"alerts":'
PARTIAL_HEADERS = b"POST /webhook HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty"


def _chunked(data: bytes, size: int = 64 * 1024) -> Any:
    for i in range(0, len(data), size):
        yield data[i:i + size]


class Stallers(threading.Thread):
    """Keeps n connections stalled mid-request, opening a new one each time the server closes one."""

    def __init__(self, port: int, payloads: list[bytes]):
        super().__init__(daemon=True)
        self.port, self.payloads = port, payloads
        self.stop = threading.Event()
        self.lifetimes: list[float] = []  # seconds from connect to the server's close, per closed connection
        self.answers: list[bytes] = []  # the status line the server sent before closing, if any
        self.errors: list[str] = []

    def run(self) -> None:
        sel = selectors.DefaultSelector()

        def stall(payload: bytes) -> None:
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=5)
            sock.sendall(payload)
            sock.setblocking(False)
            sel.register(sock, selectors.EVENT_READ, (payload, time.monotonic()))

        try:
            for payload in self.payloads:
                stall(payload)
            while not self.stop.is_set():
                for key, _ in sel.select(0.2):
                    sock: Any = key.fileobj
                    try:
                        data = sock.recv(65536)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if data:
                        self.answers.append(data.split(b"\r\n", 1)[0])
                        continue
                    payload, opened = key.data
                    self.lifetimes.append(time.monotonic() - opened)
                    sel.unregister(sock)
                    sock.close()
                    stall(payload)
        except OSError as exc:  # pragma: no cover - reported by the test
            self.errors.append(repr(exc))
        finally:
            for key in list(sel.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
            sel.close()


def test_twelve_stalled_clients_for_30s_never_keep_the_probes_waiting(gunicorn: Any) -> None:
    # 2 workers of 4 threads: 12 stalled requests are more than all the threads there are.
    g = gunicorn(workers=2)
    stallers = Stallers(g.port, [STALLED_BODY] * 8 + [PARTIAL_HEADERS] * 4)
    stallers.start()
    slowest = 0.0
    try:
        time.sleep(0.5)  # all 12 connected and stalled
        end = time.monotonic() + 30
        while time.monotonic() < end:
            for path in ("/healthz", "/readyz"):
                t0 = time.monotonic()
                try:
                    resp = requests.get(g.url + path, timeout=2)
                except requests.RequestException as exc:
                    pytest.fail(f"{path} did not answer within 2 s with 12 stalled clients: {exc}")
                slowest = max(slowest, time.monotonic() - t0)
                assert resp.status_code == 200, resp.text
            time.sleep(0.2)
    finally:
        stallers.stop.set()
        stallers.join(10)
    assert not stallers.errors
    assert slowest < 2
    # Each of the 12 was closed at the 5 s deadline (the worker looks once a second), then opened again.
    assert len(stallers.lifetimes) >= 12 * 4, stallers.lifetimes
    assert all(4.5 < t < 7 for t in stallers.lifetimes), sorted(stallers.lifetimes)
    assert set(stallers.answers) == {b"HTTP/1.1 408 Request Timeout"}


def test_a_request_trickling_in_is_closed_at_its_total_deadline(gunicorn: Any) -> None:
    g = gunicorn(workers=1, TRAINMEDIC_REQUEST_DEADLINE="2")
    trickle = socket.create_connection(("127.0.0.1", g.port))
    idle = socket.create_connection(("127.0.0.1", g.port))
    t0 = time.monotonic()
    # A byte every 0.25 s: a deadline per read would never fire; the request's total one does.
    got = b""
    trickle.settimeout(0.25)
    for byte in PARTIAL_HEADERS * 2:
        trickle.send(bytes([byte]))
        try:
            got = trickle.recv(65536)
            break
        except TimeoutError:
            pass
    got += closed_after(trickle, 5)[1]
    assert time.monotonic() - t0 < 3.5
    assert got.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert json.loads(got.partition(b"\r\n\r\n")[2]) == {"error": "the request did not arrive within 2 seconds"}
    # A connection that never sends a byte is closed at the same deadline, without an answer.
    assert closed_after(idle, 5)[1] == b"" and time.monotonic() - t0 < 3.5
    assert requests.get(g.url + "/healthz", timeout=2).ok


def test_a_chunked_body_over_1_mib_is_refused_413_and_records_nothing(gunicorn: Any, r: Any) -> None:
    g = gunicorn(workers=1)
    group = json.dumps(load_fixture("firing_single.json")).encode()
    headers = {**AUTH, "Content-Type": "application/json"}
    over = requests.post(g.url + "/webhook", data=_chunked(group + b" " * (2 * MiB)), headers=headers, timeout=10)
    assert over.status_code == 413
    assert over.json() == {"error": "the body is larger than 1024 KiB"}
    assert over.headers["Connection"] == "close"
    # With a Content-Length over the limit, the answer comes before the body is sent.
    with socket.create_connection(("127.0.0.1", g.port), timeout=5) as sock:
        sock.sendall(f"POST /webhook HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {2 * MiB}\r\n\r\n".encode())
        status, _, body = read_response(sock, bytearray())
        assert status == 413 and json.loads(body)["error"] == "the body is larger than 1024 KiB"
    # The same alert, chunked and under 1 MiB (900 KiB of it padding), is taken: it is new, so nothing was
    # recorded from the refused one.
    under = requests.post(g.url + "/webhook", data=_chunked(group + b" " * (900 * 1024)), headers=headers, timeout=10)
    assert under.status_code == 200, under.text
    assert under.json()["duplicates"] == 0
    [rem] = under.json()["remediations"]
    assert rem["status"] == "dispatched"
    assert r.xlen(keys.mailbox(keys.Target("job", "llama-ft-01"))) == 1


def test_keep_alive_pipelining_and_100_continue_still_work(gunicorn: Any) -> None:
    g = gunicorn(workers=1)
    group = json.dumps(load_fixture("firing_group.json")).encode()
    post = (f"POST /webhook HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(group)}\r\n").encode()
    with socket.create_connection(("127.0.0.1", g.port), timeout=5) as sock:
        buf = bytearray()
        for _ in range(3):  # one connection, one request after another
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert read_response(sock, buf)[0] == 200
        # Three requests in one write, the webhook's among them; three answers, in order.
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" + post + b"\r\n" + group
                     + b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_response(sock, buf)[0] == 200
        status, _, body = read_response(sock, buf)
        assert status == 200 and json.loads(body)["alerts"] == len(json.loads(group)["alerts"])
        assert read_response(sock, buf)[0] == 200
        # Expect: 100-continue: the go-ahead comes before the body is sent, the answer after.
        sock.sendall(post + b"Expect: 100-continue\r\n\r\n")
        assert read_response(sock, buf)[0] == 100
        sock.sendall(group)
        status, _, body = read_response(sock, buf)
        assert status == 200 and json.loads(body)["duplicates"] == len(json.loads(group)["alerts"])
        assert buf == b""
    # An idle kept-alive connection is closed after gunicorn's keepalive (5 s), without an answer.
    with socket.create_connection(("127.0.0.1", g.port), timeout=5) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        buf = bytearray()
        assert read_response(sock, buf)[0] == 200
        waited, got = closed_after(sock, 8)
        assert got == b"" and 4 < waited < 7
    # http.client (as Alertmanager's client does) sends request after request on one connection.
    client = http.client.HTTPConnection("127.0.0.1", g.port, timeout=5)
    ports = set()
    for _ in range(3):
        client.request("POST", "/webhook", body=group, headers={**AUTH, "Content-Type": "application/json"})
        assert client.getresponse().read() and client.sock is not None
        ports.add(client.sock.getsockname()[1])
    client.close()
    assert len(ports) == 1


def test_the_app_refuses_a_chunked_body_over_1_mib_under_any_server(make_app: Any, r: Any) -> None:
    # What another WSGI server hands over: a terminated stream with no length; the app reads past the limit.
    http = make_app().test_client()
    chunked = {**AUTH, "Transfer-Encoding": "chunked"}
    group = json.dumps(load_fixture("firing_single.json")).encode()
    resp = http.post("/webhook", input_stream=io.BytesIO(group + b" " * (2 * MiB)), content_type="application/json",
                     headers=chunked, environ_overrides={"wsgi.input_terminated": True})
    assert resp.status_code == 413 and resp.json == {"error": "the body is larger than 1024 KiB"}
    assert r.xlen(keys.mailbox(keys.Target("job", "llama-ft-01"))) == 0
    terminated = {"wsgi.input_terminated": True}
    exact = http.post("/webhook", input_stream=io.BytesIO(group + b" " * (MiB - len(group))),
                      content_type="application/json", headers=chunked, environ_overrides=terminated)
    assert exact.status_code == 200, exact.json


@pytest.mark.parametrize("value", ["0", "-1", "abc", "301"])
def test_a_request_deadline_that_cannot_be_used_is_refused_in_one_sentence(value: str) -> None:
    with pytest.raises(SettingsError, match="TRAINMEDIC_REQUEST_DEADLINE must be a number of seconds"):
        ServiceSettings.from_env({"TRAINMEDIC_REQUEST_DEADLINE": value})
    assert ServiceSettings.from_env({}).request_deadline == 5.0
