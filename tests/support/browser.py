"""A real headless Chromium (Debian's, through Playwright) and a served app, for the page tests."""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, Page, sync_playwright
from werkzeug.serving import WSGIRequestHandler, make_server

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


class QuietHandler(WSGIRequestHandler):
    def log_request(self, *args: Any, **kwargs: Any) -> None:
        pass  # the auto-refresh asks every second: its access log would bury a failure's output


class StaticPage(BaseHTTPRequestHandler):
    """Serves `html` (set it on a subclass) at every path: another site's page, for cross-site tests."""

    html = b""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(self.html)

    def log_message(self, *args: Any) -> None:
        pass


class Server:
    """The app from make_app behind a real HTTP server in a thread."""

    def __init__(self, app: Any):
        self.http = make_server("127.0.0.1", 0, app, threaded=True, request_handler=QuietHandler)
        self.url = f"http://127.0.0.1:{self.http.server_port}"
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.http.shutdown()
        self.thread.join(5)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        yield b
        b.close()


def shot(page: Page, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path), full_page=True)
    return path
