"""trainmedic's training-side client: receives remediation commands and applies them at step boundaries."""
from __future__ import annotations

from .applier import RemediationClient
from .protocol import Ack, Command

__all__ = ["RemediationClient", "Ack", "Command"]
