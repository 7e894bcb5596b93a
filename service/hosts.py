"""Host names and addresses: what is loopback, and the host part of a Host header."""
from __future__ import annotations

import ipaddress


def loopback(host: str | None) -> bool:
    """Whether host (a name or an address) names this machine only."""
    if host is None:
        return False
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_only(host: str) -> str:
    """The host of a Host header value, without its port, lower-cased ("[::1]:9095" -> "::1")."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host
