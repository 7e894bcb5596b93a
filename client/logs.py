"""JSON logs: one object per line, for the service (gunicorn), the node agent and the CLI."""
from __future__ import annotations

import json
import logging
import sys
import traceback
from typing import IO, Any
from collections.abc import Callable

from .wire.protocol import rfc3339

# Attributes every LogRecord has; anything else on a record came in through `extra=`.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}
# Keys the formatter writes itself; an `extra=` of the same name is kept under "extra_<name>".
_OWN = ("ts", "level", "logger", "msg", "pid", "exc")
# default=str: an odd extra (a Path, a dataclass) must never cost the log line. One encoder for every line:
# orjson where it is installed (the service's extra brings it), else the standard one.
_ENCODER = json.JSONEncoder(default=str, ensure_ascii=False, separators=(",", ":"))


def _encoder() -> Callable[[Any], str]:
    try:
        import orjson
    except ImportError:
        return _ENCODER.encode
    options = orjson.OPT_NON_STR_KEYS | orjson.OPT_PASSTHROUGH_DATACLASS

    def encode(value: Any) -> str:
        try:
            return orjson.dumps(value, default=str, option=options).decode()
        except TypeError:  # what orjson refuses (an integer over 64 bits...), the standard encoder writes
            return _ENCODER.encode(value)
    return encode


_encode = _encoder()


# A record whose `extra=` holds EACH (a list of (message, fields)) is written as one line per item: a
# notification logs its remediations in one call, and each still gets its own line to select by id.
EACH = "_each"


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object on one line; `extra=` fields become top-level keys."""

    def format(self, record: logging.LogRecord) -> str:
        each = getattr(record, EACH, None)
        if each:
            return "\n".join(self._line(record, msg, fields) for msg, fields in each)
        return self._line(record, _message(record), {})

    def _line(self, record: logging.LogRecord, msg: str, fields: dict[str, Any]) -> str:
        out: dict[str, Any] = {
            "ts": rfc3339(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": msg,
            "pid": record.process,
        }
        for key, value in (*vars(record).items(), *fields.items()):
            if key not in _STANDARD and not key.startswith("_"):
                out[f"extra_{key}" if key in _OWN else key] = value
        if record.exc_info:
            out["exc"] = "".join(traceback.format_exception(*record.exc_info)).rstrip()
        elif record.exc_text:
            out["exc"] = record.exc_text
        if record.stack_info:
            out["stack"] = record.stack_info
        return _encode(out)


def _message(record: logging.LogRecord) -> str:
    try:
        return record.getMessage()
    except Exception:  # bad %-args: keep the template rather than lose the line
        return f"{record.msg} {record.args!r}"


def remediation(record_id: str | None, fingerprint: str | None, target: Any, **more: Any) -> dict[str, Any]:
    """The `extra=` fields of a log line about a remediation: id, alert fingerprint, target."""
    label = target.label if hasattr(target, "label") else target
    return {"remediation_id": record_id, "fingerprint": fingerprint, "target": label, **more}


def _lean_records() -> None:
    """The JSON lines never show a record's source line, thread or process name: logging need not find them
    for every record (walking the stack for the caller is most of a record's cost; the logging docs'
    "Optimization" section names these switches)."""
    logging._srcfile = None
    logging.logThreads = False
    logging.logMultiprocessing = False


def setup(level: str = "info", stream: IO[str] | None = None) -> logging.Handler:
    """Send every logger's records to `stream` (stderr) as JSON lines at `level`; safe to call twice."""
    _lean_records()
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_trainmedic_json", False):
            root.removeHandler(h)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    handler._trainmedic_json = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level.upper())
    # Python warnings are printed, not logged, unless captured: they would break the one-object-per-line rule.
    logging.captureWarnings(True)
    return handler


def gunicorn_config(level: str = "info") -> dict[str, Any]:
    """gunicorn's logconfig_dict: its own loggers and the app's, all as JSON lines on stderr."""
    _lean_records()
    level = level.upper()  # dictConfig knows "INFO", not "info"
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {
            "console": {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"},
            # gunicorn's defaults name this handler; point it at the same stream so nothing prints plain text.
            "error_console": {"class": "logging.StreamHandler", "formatter": "json",
                              "stream": "ext://sys.stderr"},
        },
        "root": {"level": level, "handlers": ["console"]},
        "loggers": {
            "gunicorn.error": {"level": level, "handlers": [], "propagate": True},
            # accesslog = None: a logconfig_dict turns gunicorn's access log on, so keep it quiet here.
            "gunicorn.access": {"level": "WARNING", "handlers": [], "propagate": False},
            "py.warnings": {"level": "WARNING", "handlers": [], "propagate": True},
        },
    }
