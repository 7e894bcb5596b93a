"""A local HTTP receiver for notifications: records every POST body, answers as Slack does ("ok")."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Receiver:
    """An incoming-webhook stand-in on loopback; `bodies` holds the decoded JSON of each POST."""

    def __init__(self, status: int = 200):
        self.bodies: list[Any] = []
        self.headers: list[dict[str, str]] = []
        self.status = status
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.headers.append(dict(self.headers))
                outer.bodies.append(json.loads(raw))
                self.send_response(outer.status)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/services/T000/B000/XXXX"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def texts(self) -> list[str]:
        return [b.get("text", "") for b in self.bodies if isinstance(b, dict)]

    def wait(self, n: int, timeout: float = 10.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while len(self.bodies) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.texts()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
