"""Ed25519 signatures over a command's exact bytes: the service signs, agents and trainers verify.

A notification's commands share one signature (sign_many): the service signs the root of a Merkle tree of
their SHA-256 digests, and each command's signature carries the path from its leaf to that root, so each is
still checked on its own, over its own bytes, by verify.

A shared HMAC key would not do: whoever can verify could also sign. Only the service holds the secret
(TRAINMEDIC_SIGNING_KEY); appliers hold the public half (TRAINMEDIC_VERIFY_KEY), several for rotation.
`cryptography` is imported on first use, so the base client needs it only when it verifies.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from dataclasses import dataclass
from functools import cached_property
from typing import Any
from collections.abc import Iterable

MIN_SECRET_BYTES = 32
# Domain separation: the same secret used elsewhere never yields this key.
_SEED_PREFIX = b"trainmedic-ed25519-v1:"
# The record seal's key is derived from the signing key, so it needs no secret of its own; a MAC (not a
# signature) because only the service that made a seal ever checks it.
_SEAL_PREFIX = b"trainmedic-record-seal-v1:"


# A signature shared by several commands: "t1.<commands>.<index>.<base64 signature>.<sibling>...", each
# sibling a base64url digest from the leaf's level up. Base64 never holds a dot.
_TREE = "t1"
# What the shared signature signs: this prefix, the number of commands and the tree's root (never the bytes of
# a single command, which are JSON).
_ROOT_PREFIX = b"trainmedic-commands-v1:"
# The most commands one shared signature may cover (a path is at most 17 digests).
TREE_MAX = 100_000


def _leaf(data: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + data).digest()


def _node(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def _signed_root(count: int, root: bytes) -> bytes:
    return _ROOT_PREFIX + str(count).encode() + b":" + root


def _levels(leaves: list[bytes]) -> list[list[bytes]]:
    """The tree's levels, leaves first; a level's last node without a sibling moves up as it is."""
    levels = [leaves]
    while len(levels[-1]) > 1:
        cur = levels[-1]
        levels.append([_node(cur[j], cur[j + 1]) if j + 1 < len(cur) else cur[j] for j in range(0, len(cur), 2)])
    return levels


def _root(data: bytes, count: int, index: int, path: list[bytes]) -> bytes | None:
    """The root that a leaf's path leads to, or None when the path does not fit a tree of `count` leaves."""
    h, j, n, p = _leaf(data), index, count, iter(path)
    while n > 1:
        if j ^ 1 < n:
            sibling = next(p, None)
            if sibling is None or len(sibling) != 32:
                return None
            h = _node(h, sibling) if j % 2 == 0 else _node(sibling, h)
        j, n = j // 2, (n + 1) // 2
    return h if next(p, None) is None else None


class SigningError(ValueError):
    """A key that cannot be used; one sentence naming what is wrong."""


def _ed25519() -> Any:
    try:
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise SigningError("signed commands need the cryptography package: pip install 'trainmedic[agent]'") from None
    return ed25519


def private_key(secret: str) -> Any:
    """The Ed25519 key of a signing secret: a PEM private key as it is, any other string (>= 32 bytes) hashed."""
    ed = _ed25519()
    text = secret.strip()
    if text.startswith("-----BEGIN"):
        from cryptography.hazmat.primitives.serialization import load_pem_private_key

        try:
            key = load_pem_private_key(text.encode(), password=None)
        except (ValueError, TypeError) as exc:
            raise SigningError(f"TRAINMEDIC_SIGNING_KEY is not a readable PEM private key ({exc})") from None
        if not isinstance(key, ed.Ed25519PrivateKey):
            raise SigningError("TRAINMEDIC_SIGNING_KEY is a PEM key, but not an Ed25519 one")
        return key
    if len(secret.encode()) < MIN_SECRET_BYTES:
        raise SigningError(f"TRAINMEDIC_SIGNING_KEY must be at least {MIN_SECRET_BYTES} bytes long")
    return ed.Ed25519PrivateKey.from_private_bytes(hashlib.sha256(_SEED_PREFIX + secret.encode()).digest())


def public_b64(key: Any) -> str:
    """The base64 of a key's raw 32-byte public half (what TRAINMEDIC_VERIFY_KEY holds)."""
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    pub = key.public_key() if hasattr(key, "public_key") else key
    return base64.b64encode(pub.public_bytes(Encoding.Raw, PublicFormat.Raw)).decode()


def public_key(text: str) -> Any:
    """One verify key: base64 of the raw 32 bytes, or a PEM public key or certificate holding an Ed25519 key."""
    ed = _ed25519()
    text = text.strip()
    key: Any
    if text.startswith("-----BEGIN CERTIFICATE"):
        from cryptography import x509

        try:
            key = x509.load_pem_x509_certificate(text.encode()).public_key()
        except ValueError as exc:
            raise SigningError(f"a verify key is not a readable PEM certificate ({exc})") from None
    elif text.startswith("-----BEGIN"):
        from cryptography.hazmat.primitives.serialization import load_pem_public_key

        try:
            key = load_pem_public_key(text.encode())
        except ValueError as exc:
            raise SigningError(f"a verify key is not a readable PEM public key ({exc})") from None
    else:
        try:
            raw = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise SigningError("a verify key is not base64 (TRAINMEDIC_VERIFY_KEY holds base64 keys, "
                               "comma-separated)") from None
        if len(raw) != 32:
            raise SigningError(f"a verify key must be 32 bytes of base64, not {len(raw)}")
        return ed.Ed25519PublicKey.from_public_bytes(raw)
    if not isinstance(key, ed.Ed25519PublicKey):
        raise SigningError("a verify key is not an Ed25519 key")
    return key


@dataclass(frozen=True)
class Signer:
    """Signs command bytes with the service's key."""

    key: Any

    @classmethod
    def from_secret(cls, secret: str) -> Signer:
        return cls(private_key(secret))

    @property
    def public(self) -> str:
        return public_b64(self.key)

    def sign(self, data: bytes) -> str:
        """The base64 signature of data."""
        return base64.b64encode(self.key.sign(data)).decode()

    def sign_many(self, items: list[bytes]) -> list[str]:
        """A signature for each of items, made with one Ed25519 signature for all of them (see _TREE)."""
        if len(items) <= 1 or len(items) > TREE_MAX:
            return [self.sign(x) for x in items]
        levels = _levels([_leaf(x) for x in items])
        head = f"{_TREE}.{len(items)}"
        sig = base64.b64encode(self.key.sign(_signed_root(len(items), levels[-1][0]))).decode()
        out = []
        for i in range(len(items)):
            path, j = [], i
            for level in levels[:-1]:
                if j ^ 1 < len(level):
                    path.append(base64.urlsafe_b64encode(level[j ^ 1]).decode())
                j //= 2
            out.append(".".join([head, str(i), sig, *path]))
        return out

    @cached_property
    def _seal_key(self) -> bytes:
        from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

        raw = self.key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        return hashlib.sha256(_SEAL_PREFIX + raw).digest()

    def seal(self, data: bytes) -> str:
        """A MAC of data that only the service can make or check (what it decided, kept where appliers can write)."""
        return base64.b64encode(hmac.new(self._seal_key, data, hashlib.sha256).digest()[:18]).decode()

    def sealed(self, data: bytes, seal: str | None) -> bool:
        """Whether seal is this service's seal of data."""
        return bool(seal) and hmac.compare_digest(self.seal(data), str(seal))


@dataclass(frozen=True)
class Verifier:
    """Checks signatures against one or more public keys (rotation: any of them may have signed)."""

    keys: tuple[Any, ...]

    @classmethod
    def from_texts(cls, texts: Iterable[str]) -> Verifier:
        keys = tuple(public_key(t) for t in texts if t.strip())
        if not keys:
            raise SigningError("no verify key given")
        return cls(keys)

    def verify(self, data: bytes, signature: str | None) -> bool:
        """Whether one of the keys signed data, alone or among others (sign_many); False for a missing or
        malformed signature."""
        if not signature:
            return False
        if signature.startswith(_TREE + "."):
            parts = signature.split(".")
            try:
                count, index = int(parts[1]), int(parts[2])
                path = [base64.urlsafe_b64decode(x.encode()) for x in parts[4:]]
            except (IndexError, ValueError, binascii.Error):
                return False
            if not (1 < count <= TREE_MAX and 0 <= index < count):
                return False
            root = _root(data, count, index, path)
            return root is not None and self.verify(_signed_root(count, root), parts[3])
        try:
            sig = base64.b64decode(signature, validate=True)
        except (binascii.Error, ValueError):
            return False
        if len(sig) != 64:
            return False
        from cryptography.exceptions import InvalidSignature

        for key in self.keys:
            try:
                key.verify(sig, data)
                return True
            except InvalidSignature:
                continue
        return False


def verifier_from(verify_keys: Iterable[str], signing_key: str | None = None) -> Verifier | None:
    """The verifier of TRAINMEDIC_VERIFY_KEY, else of the public half of TRAINMEDIC_SIGNING_KEY, else None."""
    texts = [t for t in verify_keys if t.strip()]
    if texts:
        return Verifier.from_texts(texts)
    if signing_key:
        return Verifier((private_key(signing_key).public_key(),))
    return None
