"""A WSGI app for the service's gunicorn worker that says how a request's body reached it.

It counts the chunk-size lines gunicorn's own chunked reader parses (each parse copies what is left of the
request), so a test can tell a body read in one pass from one read chunk by chunk. Run it with one thread: the
count is the process's.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any
from collections.abc import Callable, Iterable

from gunicorn.http import body  # type: ignore[import-untyped]

parsed = [0]
_parse_chunk_size = body.ChunkedReader.parse_chunk_size


def _counted(self: Any, *args: Any, **kwargs: Any) -> Any:
    parsed[0] += 1
    return _parse_chunk_size(self, *args, **kwargs)


body.ChunkedReader.parse_chunk_size = _counted


def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    """The body's length and digest, its framing as gunicorn handed it over, and the chunk-size lines parsed."""
    parsed[0] = 0
    data = environ["wsgi.input"].read()
    answer = json.dumps({"length": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                         "content_length": environ.get("CONTENT_LENGTH"),
                         "transfer_encoding": environ.get("HTTP_TRANSFER_ENCODING"),
                         "chunk_lines": parsed[0]}).encode()
    start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(answer)))])
    return [answer]
