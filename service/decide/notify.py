"""Notifications to a Slack-compatible incoming webhook: what waits for a person, and what trainmedic could
not fix. Only the reconciler sends them, with a timeout and bounded retries; never the webhook."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from urllib.parse import urlsplit
from collections.abc import Sequence

from ..http import Http, HttpError

log = logging.getLogger("trainmedic.notify")

# Events a record can be notified for, in the order a message lists them, and what each says.
EVENTS = {
    "held": "is held for approval: approve or reject it on its page",
    "no_actions": "has no actions for trainmedic to run: it is recorded for people to look into",
    "failed": "failed: none of its actions was applied",
    "lost": "was lost: the process that took it ended before acknowledging it",
    "ineffective": "was ineffective: its alert still fires after the verify time",
    "unresolved": "ended its escalation ladder unresolved: trainmedic has nothing left to try",
    "breaker_open": ("was not dispatched: its playbook's breaker opened (as many targets have an open remediation "
                     "as max_active allows); later alerts are skipped until remediations end"),
}


def slack_escape(text: str) -> str:
    """Text as Slack shows it literally (its markup is &, < and >)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


@dataclass(frozen=True)
class Notice:
    """One message about one record."""

    record_id: str
    playbook: str
    target: str
    alertname: str
    stage: int
    events: tuple[str, ...]
    link: str

    @property
    def text(self) -> str:
        what = "; it ".join(EVENTS[e] for e in self.events)
        stage = f" (escalation stage {self.stage})" if self.stage else ""
        head = slack_escape(f"{self.playbook} on {self.target}{stage}")
        # Alert text comes from outside: escaped, and never inside the link's own markup.
        return (f"trainmedic: <{self.link}|{head}> for alert {slack_escape(self.alertname)} {slack_escape(what)}.")


class Notifier:
    """Posts notices to a playbook's `notify` URL, else TRAINMEDIC_NOTIFY_URL."""

    def __init__(self, default_url: str | None, timeout: float = 5.0, retries: int = 2):
        self.default_url = default_url
        self.timeout = timeout
        self.retries = retries

    def url_for(self, playbook_url: str | None) -> str | None:
        return playbook_url or self.default_url

    def send(self, url: str, notice: Notice) -> bool:
        """POST {"text": ...}; False (logged) when the hook did not take it after the retries."""
        http = Http(url, timeout=self.timeout, retries=self.retries)
        try:
            http.post("", {"text": notice.text})
            return True
        except HttpError as exc:
            # The URL is a secret (it is the credential): the log names its host only.
            why = f"HTTP {exc.status}" if exc.status else "unreachable or no answer in time"
            log.warning("notification for %s to %s not delivered: %s", notice.record_id, urlsplit(url).hostname,
                        why, extra={"remediation_id": notice.record_id})
            return False
        finally:
            http.close()


def ordered(events: Sequence[str]) -> tuple[str, ...]:
    """Events in the order messages list them, each once."""
    return tuple(e for e in EVENTS if e in events)
