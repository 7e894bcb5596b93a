"""trainmedic's training-side client: receives remediation commands and applies them at step boundaries."""
from __future__ import annotations

from .trainer.client import RemediationClient
from .wire.protocol import Ack, Command

__all__ = ["RemediationClient", "Ack", "Command"]
