"""For benchmarks/signing_cost.py only: a service whose Signer.sign does no work (on PYTHONPATH, it is imported
at interpreter start by gunicorn's master, so every worker inherits it). Never use outside that comparison."""
from trainmedic.client.wire.signing import Signer

# The same length as a real base64 Ed25519 signature, so the records and mailbox entries weigh the same.
PLACEHOLDER = "A" * 88


def _sign(self: Signer, data: bytes) -> str:
    return PLACEHOLDER


Signer.sign = _sign  # type: ignore[method-assign]
