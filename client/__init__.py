"""trainmedic's training-side client: receives remediation commands and applies them at step boundaries."""
from __future__ import annotations

from trainmedic.client.trainer.client import RemediationClient
from trainmedic.client.wire.protocol import Ack, Command

__all__ = ["RemediationClient", "Ack", "Command"]
