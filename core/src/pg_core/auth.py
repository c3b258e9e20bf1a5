"""Authenticated jobs: the job's secret and its message authentication codes (torch-free:
``pgrun`` makes a secret without importing torch).

A job that has a secret (``PG_CORE_AUTH_KEY``, ``ProcessGroup(..., auth_key=)``; ``pgrun``
makes one per job) proves with it that a value or a connection comes from one of its own
processes: HMAC-SHA256 under the secret, compared in constant time. Without a secret,
anyone who can reach the store or a rank's port is taken for a member (see
``docs/security.md``).

* :class:`AuthKey` holds the secret and computes MACs. It never shows the secret: its
  ``repr`` says ``<AuthKey>``.
* :class:`~pg_core.store.AuthenticatedStore` wraps the store a group is formed on. Every value written
  through it is ``MAC || payload``, the MAC over the full store key and the payload, and
  every value read back is verified before anything uses it: a value some process without
  the secret wrote (or one copied from another key) raises
  :class:`~pg_core.errors.AuthenticationError` naming the key. Counters (``add``) are
  integers the store server adds to, so they cannot carry a MAC: a poisoned counter gives
  wrong counts at worst, and a counter that is not a number raises the same error.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping
from typing import Any, Final

__all__ = ["ENV", "MAC_BYTES", "AuthKey", "environment_with_key", "new_secret", "resolve_key"]

#: The environment variable that carries the job's secret.
ENV: Final = "PG_CORE_AUTH_KEY"
#: Bytes of one MAC (HMAC-SHA256).
MAC_BYTES: Final = 32


def new_secret() -> str:
    """A fresh random secret for one job (256 bits, as hex)."""
    return secrets.token_hex(32)


class AuthKey:
    """A job's secret. Equal keys compare equal; the secret itself is never shown."""

    __slots__ = ("_secret",)

    def __init__(self, secret: str | bytes) -> None:
        if isinstance(secret, str):
            secret = secret.encode()
        elif not isinstance(secret, bytes):
            raise TypeError(f"auth_key must be a str or bytes, got {type(secret).__name__}")
        if not secret:
            raise ValueError(
                f"auth_key is empty: pass a non-empty secret (or set {ENV}), or None to read {ENV}; "
                "pgrun makes one per job"
            )
        self._secret = secret

    def mac(self, *parts: bytes) -> bytes:
        """The MAC of ``parts``, each length-prefixed, so that no two sequences of parts
        give the same input."""
        h = hmac.new(self._secret, digestmod=hashlib.sha256)
        for part in parts:
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
        return h.digest()

    def verify(self, mac: bytes, *parts: bytes) -> bool:
        """Whether ``mac`` is the MAC of ``parts`` (constant time)."""
        return hmac.compare_digest(mac, self.mac(*parts))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AuthKey) and hmac.compare_digest(self._secret, other._secret)

    def __hash__(self) -> int:
        return hash(hashlib.sha256(self._secret).digest())

    def __repr__(self) -> str:
        return "<AuthKey>"

    __str__ = __repr__

    def __reduce__(self) -> Any:  # a secret must not travel by accident (a pickled group, a log)
        raise TypeError("an AuthKey cannot be pickled: hand the secret to processes through PG_CORE_AUTH_KEY")


def resolve_key(auth_key: str | bytes | AuthKey | None, env: Mapping[str, str]) -> AuthKey | None:
    """The key a group uses: ``auth_key`` where given, else ``PG_CORE_AUTH_KEY`` of ``env``
    (``None`` when unset). An empty secret is refused with ``ValueError``."""
    if isinstance(auth_key, AuthKey):
        return auth_key
    if auth_key is not None:
        return AuthKey(auth_key)
    value = env.get(ENV)
    if value is None:
        return None
    if not value:
        raise ValueError(f"{ENV} is set but empty: set it to the job's secret, or unset it to run without one")
    return AuthKey(value)


def environment_with_key(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with ``PG_CORE_AUTH_KEY`` set: its own where it has one, else a fresh secret
    (how ``pgrun`` hands its ranks one per job)."""
    out = dict(env)
    if not out.get(ENV):
        out[ENV] = new_secret()
    return out
