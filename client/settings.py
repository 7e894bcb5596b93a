"""Every TRAINMEDIC_* setting, read from the environment once per entry point into one frozen Settings."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Mapping

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
DEFAULT_URL = "http://127.0.0.1:9095"
DEFAULT_HISTORY_MAX = 1_000_000
# A just-started Alertmanager knows no alerts until Prometheus sends them again (about a minute).
DEFAULT_ALERTMANAGER_TRUST_AFTER = 120.0
# A job whose step has not moved this long while it heartbeats gets a TrainingHang alert.
DEFAULT_HANG_AFTER = 600.0
DEFAULT_RESYNC_AFTER = 300.0
# TRAINMEDIC_REDIS_FSYNC: the embedded Redis's appendfsync, the default first.
FSYNC_MODES = ("everysec", "always")
# How long a client may take to send one request's headers and body before its connection is closed.
DEFAULT_REQUEST_DEADLINE = 5.0


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


def _csv(text: str | None) -> tuple[str, ...]:
    return tuple(p.strip() for p in (text or "").split(",") if p.strip())


def _secret(env: Mapping[str, str], name: str) -> str | None:
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


def _urls(env: Mapping[str, str], name: str) -> tuple[str, ...]:
    """NAME as comma-separated http(s) base URLs, without trailing slashes."""
    out = []
    for url in _csv(env.get(name)):
        scheme, _, rest = url.partition("://")
        if scheme.lower() not in ("http", "https") or not rest.strip("/") or any(c.isspace() for c in url):
            raise SettingsError(f"{name} must be http:// or https:// URLs (comma-separated), not {url!r}")
        out.append(url.rstrip("/"))
    return tuple(out)


def _url(env: Mapping[str, str], name: str) -> str | None:
    urls = _urls(env, name)
    if len(urls) > 1:
        raise SettingsError(f"{name} takes one URL, not {len(urls)}")
    return urls[0] if urls else None


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise SettingsError(f"{name} must be a number of seconds of at least 0, not {raw!r}")
    return value


def _deadline(env: Mapping[str, str], name: str, default: float) -> float:
    value = _seconds(env, name, default)
    if not 0 < value <= 300:
        raise SettingsError(f"{name} must be a number of seconds above 0 and at most 300, not {env.get(name)!r}")
    return value


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str:
    """One of choices (the first when unset); SettingsError names the others."""
    raw = (env.get(name) or choices[0]).strip().lower()
    if raw not in choices:
        raise SettingsError(f"{name} must be {' or '.join(choices)}, not {raw!r}")
    return raw


def _duration(env: Mapping[str, str], name: str, default: float) -> float:
    raw = (env.get(name) or "").strip()
    if not raw:
        return default
    from .wire.durations import HINT, parse_duration

    try:
        value = parse_duration(float(raw) if raw.replace(".", "", 1).isdigit() else raw)
    except ValueError:
        value = 0.0
    if value <= 0:
        raise SettingsError(f"{name} must be a positive duration ({HINT}) or a number of seconds, not {raw!r}")
    return value


def _positive_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    if not raw.strip().isascii() or not raw.strip().isdigit() or int(raw) < 1:
        raise SettingsError(f"{name} must be a whole number of at least 1, not {raw!r}")
    return int(raw)


@dataclass(frozen=True)
class Settings:
    """The environment's TRAINMEDIC_* values (defaults where unset); see the README's Environment table."""

    redis_url: str | None = None
    playbooks: str | None = None
    # Secrets stay out of repr(): a Settings that reaches a log or a traceback must not carry them.
    webhook_token: str | None = dataclasses.field(default=None, repr=False)
    operator_token: str | None = dataclasses.field(default=None, repr=False)
    signing_key: str | None = dataclasses.field(default=None, repr=False)
    # People's own operator tokens (`NAME TOKEN` lines); the service reads and checks the file at start.
    operator_tokens_file: str | None = None
    read_token: str | None = dataclasses.field(default=None, repr=False)
    verify_keys: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    public_url: str | None = None
    alertmanager_urls: tuple[str, ...] = ()
    # How long an Alertmanager must have been up before an alert it does not list counts as resolved.
    alertmanager_trust_after: float = DEFAULT_ALERTMANAGER_TRUST_AFTER
    prometheus_url: str | None = None
    notify_url: str | None = None
    history_max: int = DEFAULT_HISTORY_MAX
    hang_after: float = DEFAULT_HANG_AFTER
    # The embedded Redis's appendfsync (everysec: may lose the last second, which the resync heals).
    redis_fsync: str = "everysec"
    # How long Alertmanager must have listed an alert as active before the resync may decide it.
    resync_after: float = DEFAULT_RESYNC_AFTER
    dry_run: bool = False
    job: str | None = None
    log_level: str = "info"
    # What `trainmedic serve` hands to gunicorn and its own tools.
    url: str = DEFAULT_URL
    bind: str = "127.0.0.1:9095"
    workers: int = 2
    threads: int = 4
    request_deadline: float = DEFAULT_REQUEST_DEADLINE
    data_dir: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Settings from the environment; SettingsError (one sentence) for a value that cannot be used."""
        env = os.environ if environ is None else environ
        level = (env.get("TRAINMEDIC_LOG_LEVEL") or "info").strip().lower()
        if level not in LOG_LEVELS:
            raise SettingsError(f"TRAINMEDIC_LOG_LEVEL must be one of {', '.join(LOG_LEVELS)}, not {level!r}")
        return cls(
            # Or _FILE: a node agent's own URL (it holds the password) in a file on its node, as `trainmedic
            # credentials node NAME` printed it; the chart mounts that file into the agent's pod.
            redis_url=_secret(env, "TRAINMEDIC_REDIS_URL"),
            playbooks=env.get("TRAINMEDIC_PLAYBOOKS") or None,
            webhook_token=_secret(env, "TRAINMEDIC_WEBHOOK_TOKEN"),
            operator_token=_secret(env, "TRAINMEDIC_OPERATOR_TOKEN"),
            signing_key=_secret(env, "TRAINMEDIC_SIGNING_KEY"),
            operator_tokens_file=env.get("TRAINMEDIC_OPERATOR_TOKENS_FILE") or None,
            read_token=_secret(env, "TRAINMEDIC_READ_TOKEN"),
            verify_keys=_csv(_secret(env, "TRAINMEDIC_VERIFY_KEY")),
            allowed_hosts=tuple(h.lower() for h in _csv(env.get("TRAINMEDIC_ALLOWED_HOSTS"))),
            public_url=_url(env, "TRAINMEDIC_PUBLIC_URL"),
            alertmanager_urls=_urls(env, "TRAINMEDIC_ALERTMANAGER_URL"),
            alertmanager_trust_after=_seconds(env, "TRAINMEDIC_ALERTMANAGER_TRUST_AFTER",
                                              DEFAULT_ALERTMANAGER_TRUST_AFTER),
            prometheus_url=_url(env, "TRAINMEDIC_PROMETHEUS_URL"),
            notify_url=_url(env, "TRAINMEDIC_NOTIFY_URL"),
            history_max=_positive_int(env, "TRAINMEDIC_HISTORY_MAX", DEFAULT_HISTORY_MAX),
            hang_after=_duration(env, "TRAINMEDIC_HANG_AFTER", DEFAULT_HANG_AFTER),
            redis_fsync=_choice(env, "TRAINMEDIC_REDIS_FSYNC", FSYNC_MODES),
            resync_after=_duration(env, "TRAINMEDIC_RESYNC_AFTER", DEFAULT_RESYNC_AFTER),
            dry_run=parse_bool(env.get("TRAINMEDIC_DRY_RUN"), "TRAINMEDIC_DRY_RUN"),
            job=env.get("TRAINMEDIC_JOB") or None,
            log_level=level,
            url=(env.get("TRAINMEDIC_URL") or DEFAULT_URL).rstrip("/"),
            bind=env.get("TRAINMEDIC_BIND") or "127.0.0.1:9095",
            workers=_positive_int(env, "TRAINMEDIC_WORKERS", 2),
            threads=_positive_int(env, "TRAINMEDIC_THREADS", 4),
            request_deadline=_deadline(env, "TRAINMEDIC_REQUEST_DEADLINE", DEFAULT_REQUEST_DEADLINE),
            data_dir=env.get("TRAINMEDIC_DATA_DIR") or None,
        )

    def replace(self, **changes: Any) -> Settings:
        """A copy with some fields changed (tests, command-line flags)."""
        return dataclasses.replace(self, **changes)
