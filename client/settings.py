"""The TRAINMEDIC_* settings that code on GPU nodes reads (the training client, `trainmedic agent`), read from the
environment once per entry point into one frozen Settings; and the parsing every entry point's settings share."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self
from collections.abc import Mapping

from .wire.durations import HINT, parse_duration

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


class SettingsError(ValueError):
    """A setting that cannot be used; the message is one sentence naming the variable."""


def parse_bool(text: str | None, name: str = "value") -> bool:
    """The one boolean parser: 1/true/yes/on, 0/false/no/off or empty; anything else is an error."""
    value = (text or "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise SettingsError(f"{name} must be 1, true, yes or on (or 0, false, no, off), not {text!r}")


def comma_separated(text: str | None) -> tuple[str, ...]:
    """The non-empty items of a comma-separated value, stripped."""
    return tuple(p.strip() for p in (text or "").split(",") if p.strip())


def secret(env: Mapping[str, str], name: str) -> str | None:
    """NAME's value, else the content of the file NAME_FILE names (stripped), else None."""
    value = env.get(name)
    if value:
        return value
    path = env.get(f"{name}_FILE")
    if not path:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or type(exc).__name__
        raise SettingsError(f"cannot read {name}_FILE {path}: {reason}") from None
    return text or None


def duration(env: Mapping[str, str], name: str, default: float) -> float:
    """NAME as a positive duration (30s, 10m, ...) or a plain number of seconds; default when unset."""
    raw = (env.get(name) or "").strip()
    if not raw:
        return default
    try:
        value = parse_duration(float(raw) if raw.replace(".", "", 1).isdigit() else raw)
    except ValueError:
        value = 0.0
    if value <= 0:
        raise SettingsError(f"{name} must be a positive duration ({HINT}) or a number of seconds, not {raw!r}")
    return value


@dataclass(frozen=True)
class Settings:
    """What the training client and the node agent read (defaults where unset); see the README's Settings table."""

    redis_url: str | None = None
    # Secrets stay out of repr(): a Settings that reaches a log or a traceback must not carry them.
    # An agent given no verify key checks commands with the signing key's public half, when it has that key.
    signing_key: str | None = dataclasses.field(default=None, repr=False)
    verify_keys: tuple[str, ...] = ()
    dry_run: bool = False
    job: str | None = None
    log_level: str = "info"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Self:
        """Settings from the environment; SettingsError (one sentence) for a value that cannot be used."""
        return cls(**cls.read(os.environ if environ is None else environ))

    @classmethod
    def read(cls, env: Mapping[str, str]) -> dict[str, Any]:
        """Each field's value from env, checked; a subclass adds its own fields' to these."""
        level = (env.get("TRAINMEDIC_LOG_LEVEL") or "info").strip().lower()
        if level not in LOG_LEVELS:
            raise SettingsError(f"TRAINMEDIC_LOG_LEVEL must be one of {', '.join(LOG_LEVELS)}, not {level!r}")
        return {
            # Or _FILE: a node agent's own URL (it holds the password) in a file on its node, as `trainmedic
            # credentials node NAME` printed it; the chart mounts that file into the agent's pod.
            "redis_url": secret(env, "TRAINMEDIC_REDIS_URL"),
            "signing_key": secret(env, "TRAINMEDIC_SIGNING_KEY"),
            "verify_keys": comma_separated(secret(env, "TRAINMEDIC_VERIFY_KEY")),
            "dry_run": parse_bool(env.get("TRAINMEDIC_DRY_RUN"), "TRAINMEDIC_DRY_RUN"),
            "job": env.get("TRAINMEDIC_JOB") or None,
            "log_level": level,
        }

    def replace(self, **changes: Any) -> Self:
        """A copy with some fields changed (tests, command-line flags)."""
        return dataclasses.replace(self, **changes)
