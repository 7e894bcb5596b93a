"""The service's TRAINMEDIC_* settings (the web app, gunicorn and every `trainmedic` command but `agent`), read
from the environment once per entry point into one frozen ServiceSettings."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping

from ..client.settings import Settings, SettingsError, comma_separated, duration, secret

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
# How many MiB of requests not yet answered a gunicorn worker holds (TRAINMEDIC_WORKER_BUFFER), and the least it
# may be: one request whose body is 1 MiB, with its headers, must always fit.
DEFAULT_WORKER_BUFFER_MIB = 32
LEAST_WORKER_BUFFER_MIB = 2


def _urls(env: Mapping[str, str], name: str) -> tuple[str, ...]:
    """NAME as comma-separated http(s) base URLs, without trailing slashes."""
    out = []
    for url in comma_separated(env.get(name)):
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


def _positive_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    if not raw.strip().isascii() or not raw.strip().isdigit() or int(raw) < 1:
        raise SettingsError(f"{name} must be a whole number of at least 1, not {raw!r}")
    return int(raw)


def _mebibytes(env: Mapping[str, str], name: str, default: int, least: int) -> int:
    """NAME as a whole number of MiB (at least `least`), in bytes."""
    raw = (env.get(name) or "").strip()
    if not raw:
        return default * 1024 * 1024
    if not raw.isascii() or not raw.isdigit() or len(raw) > 9 or int(raw) < least:
        raise SettingsError(f"{name} must be a whole number of MiB of at least {least}, not {raw!r}")
    return int(raw) * 1024 * 1024


@dataclass(frozen=True)
class ServiceSettings(Settings):
    """The client's settings and the service's own (defaults where unset); see the README's Settings table."""

    playbooks: str | None = None
    # Secrets stay out of repr(), as the client's do.
    webhook_token: str | None = dataclasses.field(default=None, repr=False)
    operator_token: str | None = dataclasses.field(default=None, repr=False)
    # People's own operator tokens (`NAME TOKEN` lines); the service reads and checks the file at start.
    operator_tokens_file: str | None = None
    read_token: str | None = dataclasses.field(default=None, repr=False)
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
    # The service's address for the commands that call its API (send, approve, reject, history, show).
    url: str = DEFAULT_URL
    # What `trainmedic serve` hands to gunicorn and its own tools.
    bind: str = "127.0.0.1:9095"
    workers: int = 2
    threads: int = 4
    request_deadline: float = DEFAULT_REQUEST_DEADLINE
    # Bytes of requests not yet answered that one gunicorn worker holds before it refuses more with 503.
    worker_buffer: int = DEFAULT_WORKER_BUFFER_MIB * 1024 * 1024
    data_dir: str | None = None

    @classmethod
    def read(cls, env: Mapping[str, str]) -> dict[str, Any]:
        """The client's fields, then the service's own, from env, checked."""
        return {
            **super().read(env),
            "playbooks": env.get("TRAINMEDIC_PLAYBOOKS") or None,
            "webhook_token": secret(env, "TRAINMEDIC_WEBHOOK_TOKEN"),
            "operator_token": secret(env, "TRAINMEDIC_OPERATOR_TOKEN"),
            "operator_tokens_file": env.get("TRAINMEDIC_OPERATOR_TOKENS_FILE") or None,
            "read_token": secret(env, "TRAINMEDIC_READ_TOKEN"),
            "allowed_hosts": tuple(h.lower() for h in comma_separated(env.get("TRAINMEDIC_ALLOWED_HOSTS"))),
            "public_url": _url(env, "TRAINMEDIC_PUBLIC_URL"),
            "alertmanager_urls": _urls(env, "TRAINMEDIC_ALERTMANAGER_URL"),
            "alertmanager_trust_after": _seconds(env, "TRAINMEDIC_ALERTMANAGER_TRUST_AFTER",
                                                 DEFAULT_ALERTMANAGER_TRUST_AFTER),
            "prometheus_url": _url(env, "TRAINMEDIC_PROMETHEUS_URL"),
            "notify_url": _url(env, "TRAINMEDIC_NOTIFY_URL"),
            "history_max": _positive_int(env, "TRAINMEDIC_HISTORY_MAX", DEFAULT_HISTORY_MAX),
            "hang_after": duration(env, "TRAINMEDIC_HANG_AFTER", DEFAULT_HANG_AFTER),
            "redis_fsync": _choice(env, "TRAINMEDIC_REDIS_FSYNC", FSYNC_MODES),
            "resync_after": duration(env, "TRAINMEDIC_RESYNC_AFTER", DEFAULT_RESYNC_AFTER),
            "url": (env.get("TRAINMEDIC_URL") or DEFAULT_URL).rstrip("/"),
            "bind": env.get("TRAINMEDIC_BIND") or "127.0.0.1:9095",
            "workers": _positive_int(env, "TRAINMEDIC_WORKERS", 2),
            "threads": _positive_int(env, "TRAINMEDIC_THREADS", 4),
            "request_deadline": _deadline(env, "TRAINMEDIC_REQUEST_DEADLINE", DEFAULT_REQUEST_DEADLINE),
            "worker_buffer": _mebibytes(env, "TRAINMEDIC_WORKER_BUFFER", DEFAULT_WORKER_BUFFER_MIB,
                                        LEAST_WORKER_BUFFER_MIB),
            "data_dir": env.get("TRAINMEDIC_DATA_DIR") or None,
        }
