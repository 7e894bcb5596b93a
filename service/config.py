"""Service configuration: defaults, then TRAINMEDIC_* environment variables, then test overrides."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from trainmedic.service.rules.playbooks import SHIPPED

MAX_BODY = 1024 * 1024


def _token() -> str | None:
    token = os.environ.get("TRAINMEDIC_WEBHOOK_TOKEN")
    path = os.environ.get("TRAINMEDIC_WEBHOOK_TOKEN_FILE")
    if not token and path:
        try:
            token = Path(path).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ValueError(f"cannot read TRAINMEDIC_WEBHOOK_TOKEN_FILE {path}: {exc.strerror}") from None
    return token or None


def from_env() -> dict[str, Any]:
    """Settings from the environment, over the defaults."""
    return {
        "REDIS_URL": os.environ.get("TRAINMEDIC_REDIS_URL") or None,
        "PLAYBOOKS": os.environ.get("TRAINMEDIC_PLAYBOOKS") or str(SHIPPED),
        "WEBHOOK_TOKEN": _token(),
        "DRY_RUN": os.environ.get("TRAINMEDIC_DRY_RUN", "0").strip().lower() in ("1", "true", "yes", "on"),
        "MAX_CONTENT_LENGTH": MAX_BODY,
    }
