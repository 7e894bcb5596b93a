"""A record's seal: a MAC (keyed from the signing key) over what the service decided, kept beside it in Redis.

Trainers and agents may write their own target's hashes; before the service acts on what a record says (an
approval's release, a deferred record's steps, a ladder's next stage, an on_resolved's context, a silence), it
checks the seal, and a record that no longer matches is never signed: it ends skipped / tampered.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...client.wire.protocol import dumps


def seal_text(record_id: str, decided: str) -> bytes:
    """The bytes a record's seal covers: its id (which names its target) and what was decided, its `d`."""
    return dumps([record_id, "d", decided]).encode()


# What a record an earlier version made is sealed over: every field the service reads back to build a
# command, besides its id and its steps.
_SEALED_BEFORE = ("playbook", "mode", "n", "alert", "start", "fence", "expire_after", "context", "stage", "parent")


def earlier_seal_text(record_id: str, h: Mapping[str, Any]) -> bytes:
    """The bytes the seal of a record an earlier version made covers (its hash's fields)."""
    n = int(h.get("n") or 0)
    values = [record_id, *(None if h.get(k) is None else str(h[k]) for k in _SEALED_BEFORE),
              *(h.get(f"a:{i}:spec") for i in range(n))]
    return dumps(values).encode()


def silence_text(record_id: str, silence_id: str) -> bytes:
    """The bytes the seal of a record's silence covers (its `silence_seal`): the silence the service made for
    it, which it alone may expire when the ladder ends."""
    return dumps([record_id, "silence", silence_id]).encode()
