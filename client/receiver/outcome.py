"""How a host action ends when it does not apply: failed with one sentence, or skipped with a result."""
from __future__ import annotations


class ActionFailed(Exception):
    """The action could not run; `reason` is one human sentence for the record."""

    def __init__(self, reason: str, **result: object):
        super().__init__(reason)
        self.reason = reason
        self.result = {"reason": reason, **result}


class ActionSkipped(Exception):
    """Nothing was changed on purpose (dry run, nothing to restore); `result` says why."""

    def __init__(self, result: dict):
        super().__init__(result.get("reason", "skipped"))
        self.result = result
