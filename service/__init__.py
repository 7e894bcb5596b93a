"""trainmedic's central service (Flask, run by gunicorn).

Importing this package imports nothing heavy: `create_app` is loaded from `app.py` on first use, so the
CLI's `agent` and `send` commands run with the `[agent]` extra alone.
"""
from __future__ import annotations

from typing import Any

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
