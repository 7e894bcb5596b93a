"""HTTP/1.1 on a bare socket, for tests that send what no client library would: stalls, odd framing, pipelining."""
from __future__ import annotations

import socket
import time


def read_response(sock: socket.socket, buf: bytearray) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response read off sock (bytes after it stay in buf): status, headers, body."""
    while b"\r\n\r\n" not in buf:
        data = sock.recv(65536)
        assert data, f"the connection closed before a whole response: {bytes(buf)!r}"
        buf += data
    head, _, _ = bytes(buf).partition(b"\r\n\r\n")
    del buf[:len(head) + 4]
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(buf) < length:
        data = sock.recv(65536)
        assert data, "the connection closed inside a response body"
        buf += data
    body = bytes(buf[:length])
    del buf[:length]
    return int(lines[0].split()[1]), headers, body


def closed_after(sock: socket.socket, limit: float) -> tuple[float, bytes]:
    """Seconds until the server closed sock (at most limit), and what it sent before closing."""
    start, got = time.monotonic(), b""
    sock.settimeout(limit)
    try:
        while data := sock.recv(65536):
            got += data
    except (TimeoutError, ConnectionResetError):
        pass
    return time.monotonic() - start, got


def chunked(data: bytes, size: int) -> bytes:
    """data as a chunked body of chunks of `size` bytes, and the last chunk."""
    return b"".join(b"%x\r\n%s\r\n" % (len(data[i:i + size]), data[i:i + size])
                    for i in range(0, len(data), size)) + b"0\r\n\r\n"
