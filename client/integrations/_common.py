"""What both framework callbacks share: handler registration, the client's life cycle."""
from __future__ import annotations

from typing import Any
from collections.abc import Callable

from ..trainer.client import Handler, RemediationClient


class ClientHolder:
    """Holds one RemediationClient for a callback: made at the start of training, closed at its end."""

    def __init__(self, job: str | None = None, **client_kwargs: Any):
        self.job = job
        self.client_kwargs = client_kwargs
        self.client: RemediationClient | None = None
        self._handlers: dict[str, Handler] = {}
        # What the client had applied, as a resumed checkpoint saved it: given to the client once it exists.
        self._restored: dict[str, Any] | None = None

    def handler(self, action: str) -> Callable[[Handler], Handler]:
        """Decorator: register fn(params) -> result dict for an action (before or during training)."""
        def register(fn: Handler) -> Handler:
            self._handlers[action] = fn
            if self.client is not None:
                self.client.register(action, fn)
            return fn
        return register

    def _attach(self, optimizer: Any, scheduler: Any, builtins: dict[str, Handler]) -> None:
        """Make the client on these objects, or point the existing one at them (training started again)."""
        if self.client is not None:
            self.client.optimizer, self.client.scheduler = optimizer, scheduler
            return
        self.client = RemediationClient(job=self.job, optimizer=optimizer, scheduler=scheduler, **self.client_kwargs)
        # The framework's own save/stop first, so a handler the user registered replaces them.
        for action, fn in {**builtins, **self._handlers}.items():
            self.client.register(action, fn)
        if self._restored is not None:
            self.client.load_state_dict(self._restored)
            self._restored = None

    def trainmedic_state(self) -> dict[str, Any] | None:
        """What the client applied so far, for the framework's checkpoint (None before training starts)."""
        if self.client is not None:
            return self.client.state_dict()
        return self._restored

    def restore(self, state: dict[str, Any] | None) -> None:
        """A resumed checkpoint's trainmedic state: loaded into the client now, or when it is made."""
        if not state:
            return
        if self.client is not None:
            self.client.load_state_dict(state)
        else:
            self._restored = state

    def close(self) -> None:
        """Stop the client's background threads (the end of training does this)."""
        if self.client is not None:
            self.client.close()
            self.client = None
