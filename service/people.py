"""Who a bearer token names: the operator token, people's own operator tokens, the read token.

People's own tokens come from TRAINMEDIC_OPERATOR_TOKENS_FILE, one `NAME TOKEN` per line; what one does is
recorded as `operator:NAME`. The single TRAINMEDIC_OPERATOR_TOKEN records `operator`. The read token (and any
operator token) lets a client read when TRAINMEDIC_READ_TOKEN is set. Every comparison is constant-time, and
no message here ever shows a token.
"""
from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..client.settings import SettingsError

from .settings import ServiceSettings

NAME_RE = re.compile(r"[A-Za-z0-9_.@-]{1,64}\Z")
# People's tokens are typed into a form and kept in files: long enough that guessing is hopeless.
MIN_TOKEN = 16
READER = "reader"
TOKENS_FILE = "TRAINMEDIC_OPERATOR_TOKENS_FILE"
MAKE_TOKEN = "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"


def read_tokens_file(path: str, others: Mapping[str, str | None] | None = None) -> tuple[tuple[str, str], ...]:
    """The file's (NAME, TOKEN) pairs; SettingsError naming the file, the line and why for a bad one (a token
    that is also one of `others`, the service's other tokens by variable name, among them)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or type(exc).__name__
        raise SettingsError(f"cannot read {TOKENS_FILE} {path}: {reason}") from None
    pairs: list[tuple[str, str]] = []
    names: dict[str, int] = {}
    tokens: dict[str, int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) > 2 and fields[2].startswith("#"):
            fields = fields[:2]  # a comment after the token
        where = f"{TOKENS_FILE} {path}, line {n}"
        # The fields may hold a token, so no message below repeats them.
        if len(fields) != 2:
            raise SettingsError(f"{where}: a line is `NAME TOKEN` (two fields separated by spaces), "
                                f"not {len(fields)} field{'s' if len(fields) != 1 else ''}")
        name, token = fields
        if not NAME_RE.match(name):
            raise SettingsError(f"{where}: the name must be 1 to 64 letters, digits or _.@-")
        if len(token) < MIN_TOKEN:
            raise SettingsError(f"{where}: the token is shorter than {MIN_TOKEN} characters (make one with "
                                f"{MAKE_TOKEN})")
        if name in names:
            raise SettingsError(f"{where}: the name {name} is already on line {names[name]}")
        if token in tokens:
            raise SettingsError(f"{where}: the token is already on line {tokens[token]}; each person needs their own")
        for var, value in (others or {}).items():
            if value and hmac.compare_digest(token.encode(), value.encode()):
                raise SettingsError(f"{where}: the token of {name} is also {var}; give each its own")
        names[name], tokens[token] = n, n
        pairs.append((name, token))
    return tuple(pairs)


def _fingerprint(secret: bytes, token: str) -> str:
    return hmac.new(secret, b"token\0" + token.encode(), hashlib.sha256).hexdigest()[:32]


@dataclass(frozen=True)
class People:
    """The tokens the service knows and whom each names; built once at start."""

    operators: tuple[tuple[str, str], ...] = ()  # (who, token): ("operator", T), ("operator:alice", T2), ...
    read_token: str | None = field(default=None, repr=False)
    webhook_token: str | None = field(default=None, repr=False)
    secret: bytes = field(default=b"", repr=False)  # signs page sessions; derived from the signing key
    _fingerprints: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_settings(cls, settings: ServiceSettings) -> People:
        """The settings' tokens; SettingsError (one sentence) for a bad tokens file or tokens that collide."""
        others = {"TRAINMEDIC_WEBHOOK_TOKEN": settings.webhook_token, "TRAINMEDIC_OPERATOR_TOKEN":
                  settings.operator_token, "TRAINMEDIC_READ_TOKEN": settings.read_token}
        path = settings.operator_tokens_file
        named = read_tokens_file(path, others) if path else ()
        operators = ([("operator", settings.operator_token)] if settings.operator_token else []) + [
            (f"operator:{name}", token) for name, token in named]
        read = settings.read_token
        if read:
            for var in ("TRAINMEDIC_WEBHOOK_TOKEN", "TRAINMEDIC_OPERATOR_TOKEN"):
                value = others[var]
                if value and hmac.compare_digest(read.encode(), value.encode()):
                    raise SettingsError(f"TRAINMEDIC_READ_TOKEN is also {var}; the read token must be its own")
        key = hmac.new((settings.signing_key or "").encode(), b"trainmedic page sessions", hashlib.sha256).digest()
        who_tokens = operators + ([(READER, read)] if read else [])
        return cls(tuple(operators), read, settings.webhook_token, key,
                   {who: _fingerprint(key, token) for who, token in who_tokens})

    @property
    def reads_closed(self) -> bool:
        """Whether reading needs a token (TRAINMEDIC_READ_TOKEN is set)."""
        return bool(self.read_token)

    @property
    def anyone(self) -> bool:
        """Whether any token could log in on the pages."""
        return bool(self.operators or self.read_token)

    @property
    def names(self) -> list[str]:
        """The named operators, as recorded (operator:NAME)."""
        return [who for who, _ in self.operators if who != "operator"]

    def operator(self, given: str) -> str | None:
        """Who the operator token `given` names ("operator" or "operator:NAME"), else None."""
        found = None
        raw = given.encode()
        for who, token in self.operators:  # every one compared: the time says nothing about which matched
            if hmac.compare_digest(raw, token.encode()) and found is None:
                found = who
        return found

    def reader(self, given: str) -> bool:
        """Whether `given` is the read token."""
        return self.read_token is not None and hmac.compare_digest(given.encode(), self.read_token.encode())

    def webhook(self, given: str) -> bool:
        """Whether `given` is the webhook token."""
        return self.webhook_token is not None and hmac.compare_digest(given.encode(), self.webhook_token.encode())

    def who(self, given: str) -> str | None:
        """Whom a token names for logging in: an operator, else "reader" for the read token, else None."""
        return self.operator(given) or (READER if self.reader(given) else None)

    def fingerprint(self, who: str) -> str | None:
        """What a page session keeps to prove it was made with `who`'s current token (never the token)."""
        return self._fingerprints.get(who)

    def still(self, who: str, fingerprint: str) -> bool:
        """Whether a session made for `who` with that fingerprint is still good (its token not changed)."""
        current = self._fingerprints.get(who)
        return current is not None and hmac.compare_digest(current.encode(), fingerprint.encode())
