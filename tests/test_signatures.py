"""One signature for a notification's commands: each command's signature still verifies alone, over its own
bytes, and nothing else verifies with it."""
from __future__ import annotations

import pytest

from trainmedic.client.wire.signing import Signer, Verifier

SIGNER = Signer.from_secret("a-signing-secret-of-at-least-32-bytes-0000")
VERIFIER = Verifier((SIGNER.key.public_key(),))
OTHER = Signer.from_secret("another-signing-secret-of-32-bytes-or-more")


@pytest.mark.parametrize("count", [1, 2, 3, 5, 10, 17, 100])
def test_each_command_of_a_notification_verifies_with_its_own_signature(count: int) -> None:
    items = [f'{{"record_id":"r{i}"}}'.encode() for i in range(count)]
    sigs = SIGNER.sign_many(items)
    assert len(sigs) == count and all(VERIFIER.verify(x, s) for x, s in zip(items, sigs))
    if count > 1:
        assert len(set(sigs)) == count and all(s.startswith(f"t1.{count}.") for s in sigs)
        assert not any(VERIFIER.verify(items[0], s) for s in sigs[1:])  # another command's signature


def test_a_shared_signature_changed_anywhere_or_made_by_another_key_is_refused() -> None:
    items = [f"command {i}".encode() for i in range(5)]
    sig = SIGNER.sign_many(items)[2]
    head, count, index, signature, *path = sig.split(".")
    forged = [
        ".".join([head, count, index, signature, *path[:-1]]),           # a digest left out
        ".".join([head, count, index, signature, *path, path[0]]),       # one too many
        ".".join([head, "6", index, signature, *path]),                  # another count
        ".".join([head, count, "3", signature, *path]),                  # another place
        ".".join([head, count, index, signature, *reversed(path)]),      # the path in another order
        ".".join([head, count, index, OTHER.sign_many(items)[2].split(".")[3], *path]),  # another key's
        ".".join([head, "1", "0", signature]),
        ".".join([head, count, index]),
        "t1.x.y.z",
    ]
    assert not any(VERIFIER.verify(items[2], f) for f in forged)
    assert not VERIFIER.verify(b"command 9", sig)
    # The shared signature signs the tree's root, which no single command's bytes can be.
    assert not VERIFIER.verify(items[2], signature)
