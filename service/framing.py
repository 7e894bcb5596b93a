"""Where one HTTP/1.1 request ends in the bytes a connection has sent, and the request as gunicorn then reads it.

The worker's main loop feeds each connection's bytes to a Framing until the request is whole. A chunked body is
taken apart here as its chunks arrive and handed on as a single chunk: gunicorn's chunked reader copies what is
left of the request once per chunk, so 50,000 one-byte chunks would cost a thread minutes of copying, and the
chunk-size lines need not be kept in memory at all. Whatever gunicorn's parser would refuse reaches it as it came
(from the first byte it would refuse), so that it answers 400 and the two never disagree on where a request ends.
"""
from __future__ import annotations

import re

from .errors import MAX_BODY

WAIT, READY, BAD, TOO_LARGE, HEAD_TOO_LARGE = range(5)
# gunicorn's own limits are per line (8190 bytes) and per count (100 fields); a whole header block or
# trailer section past this is refused before its end is looked for any further.
MAX_HEAD = 64 * 1024
MAX_CHUNK_LINE = 8190
# Chunk-size lines count towards what is read but not towards the body: a body cut into tiny chunks may take
# this much on the wire before it is refused as too large.
MAX_CHUNKED_WIRE = 2 * MAX_BODY
_HEX = frozenset(b"0123456789abcdefABCDEF")
# RFC 9112 section 7.1.1, from a chunk-size line's first ";": what gunicorn's parser takes as extensions.
_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_QUOTED = rb'"(?:[\t !#-\[\]-~\x80-\xff]|\\[\t -~\x80-\xff])*"'
_EXTENSIONS = re.compile(rb"(?:[ \t]*;[ \t]*" + _TOKEN + rb"(?:[ \t]*=[ \t]*(?:" + _TOKEN + rb"|" + _QUOTED
                         + rb"))?)*")
# A chunk-size line of hex digits only, as nearly every client sends: read without the general checks.
_PLAIN_LINE = re.compile(rb"([0-9a-fA-F]{1,12})\r\n")
# Where a chunked body is: a chunk-size line, a chunk's data, the CRLF after it, or the trailer section.
_LINE, _DATA, _CRLF, _TRAILERS = range(4)


def _gunicorn_takes(line: bytes) -> bool:
    """Whether gunicorn's parser takes this chunk-size line (its own checks, in its order)."""
    size, semicolon, extensions = line.partition(b";")
    if semicolon:
        if b"\r" in extensions:
            return False
        size = size.rstrip(b" \t")
    if not size or not _HEX.issuperset(size):
        return False
    return not semicolon or _EXTENSIONS.fullmatch(b";" + extensions) is not None


class Framing:
    """One connection's request so far; each call reads only what is new."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Ready for the next request on the connection."""
        self.searched = 0  # how far the end of the headers has been looked for
        self.head_end = -1
        self.chunked = False
        self.end = 0  # where the request ends in the buffer, once known
        self.expect_continue = False
        # Bytes this request may come to hold, once its headers say: all of a Content-Length body, or 1 MiB of a
        # chunked one.
        self.reserve = 0
        # Chunked: the headers and the body so far, out of the buffer, which keeps only what is not yet read.
        self.head = b""
        self.body = bytearray()
        self.at = _LINE
        self.left = 0  # data of the current chunk still to come
        self.wire = 0  # bytes of the chunked body read and dropped from the buffer

    @property
    def held(self) -> int:
        """Bytes of this request kept outside the connection's buffer (a chunked request's head and body)."""
        return len(self.head) + len(self.body)

    def feed(self, buf: bytearray) -> int:
        """WAIT, READY, BAD, TOO_LARGE or HEAD_TOO_LARGE; after READY or BAD, take() is the request."""
        if self.head_end < 0:
            status = self._head(buf)
            if status != READY:
                return status
        if not self.chunked:
            return READY if len(buf) >= self.end else WAIT
        status = self._chunks(buf)
        if status == WAIT and self.wire + len(buf) > MAX_CHUNKED_WIRE:
            return TOO_LARGE
        return status

    def take(self, buf: bytearray, status: int) -> bytes:
        """The request (after READY) or what gunicorn should refuse (after BAD), removed from buf."""
        end = self.end if status == READY else len(buf)
        if not self.chunked:
            request = bytes(buf[:end])
        else:
            parts: list[bytes | bytearray] = [self.head]
            if self.body:
                parts += [b"%x\r\n" % len(self.body), self.body]
                if self.at != _CRLF:  # refused at the CRLF after a chunk: gunicorn finds it missing
                    parts.append(b"\r\n")
            if self.at == _TRAILERS:
                parts.append(b"0\r\n")
            parts.append(buf[:end])
            request = b"".join(parts)
        del buf[:end]
        return request

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
            self.head = bytes(buf[:self.head_end])
            del buf[:self.head_end]
            self.reserve = len(self.head) + MAX_BODY
            return READY
        if not lengths:
            self.end = self.reserve = self.head_end
            return READY
        if len(lengths) > 1 or not lengths[0].isdigit():
            return BAD
        # int() of thousands of digits is slow (and refused past 4300): this many is past the limit anyway.
        if len(lengths[0].lstrip(b"0")) > 12 or int(lengths[0]) > MAX_BODY:
            return TOO_LARGE
        self.end = self.reserve = self.head_end + int(lengths[0])
        return READY

    def _chunks(self, buf: bytearray) -> int:
        """Move the chunks in buf into the body; buf then starts at what is not read yet (or at the trailers)."""
        pos = 0
        status = WAIT
        body, plain = self.body, _PLAIN_LINE.match
        while status == WAIT:
            if self.at == _LINE:
                # The common case at the cost of a few calls: a plain chunk-size line, the chunk and its CRLF.
                m = plain(buf, pos)
                if m is not None:
                    start = m.end()
                    stop = start + int(m[1], 16)
                    if start < stop <= start + MAX_BODY - len(body) and buf.startswith(b"\r\n", stop):
                        body += buf[start:stop]
                        pos = stop + 2
                        continue
            if self.at == _TRAILERS:
                if buf[:2] == b"\r\n":
                    self.end, status = 2, READY
                    break
                idx = buf.find(b"\r\n\r\n")
                if idx >= 0:
                    self.end, status = idx + 4, READY
                elif len(buf) > MAX_HEAD:
                    status = BAD
                break
            if self.at == _DATA:
                take = min(self.left, len(buf) - pos)
                body += buf[pos:pos + take]
                pos += take
                self.left -= take
                if self.left:
                    break
                self.at = _CRLF
            if self.at == _CRLF:
                if len(buf) - pos < 2:
                    break
                if buf[pos:pos + 2] != b"\r\n":
                    status = BAD
                    break
                pos += 2
                self.at = _LINE
            idx = buf.find(b"\r\n", pos)
            if idx < 0:
                status = BAD if len(buf) - pos > MAX_CHUNK_LINE else WAIT
                break
            line = bytes(buf[pos:idx])
            text = line.split(b";", 1)[0].rstrip(b" \t")
            if not text or not _HEX.issuperset(text):
                status = BAD
                break
            if len(text.lstrip(b"0")) > 12:
                return TOO_LARGE
            if not _gunicorn_takes(line):
                status = BAD
                break
            size = int(text, 16)
            pos = idx + 2
            if size == 0:
                self.at = _TRAILERS
                del buf[:pos]
                self.wire += pos
                pos = 0
                continue
            if len(body) + size > MAX_BODY:
                return TOO_LARGE
            self.at, self.left = _DATA, size
        # What was read is in the body now (a refusal keeps the bytes it is about, from their first).
        del buf[:pos]
        self.wire += pos
        return status
