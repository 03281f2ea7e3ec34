"""Sandbox access tokens (envd's, and the traffic token that guards a sandbox's other
ports), derived from a node key instead of stored.

A secured sandbox's envd token is HMAC-SHA256(key, purpose, sandbox id), its traffic
access token the same with another purpose: the orchestrator can compute
it whenever it calls the sandbox's envd or hands the token to a client again
(``connect``), so neither ``state.db`` nor a paused sandbox's record in the repository
holds it; they keep its SHA-256 instead, which tells whether this node's key is the one
the token was made with. Sandbox ids are never reused, so every sandbox (fork children
included) has a token of its own.

The key is ``Config.envd_token_key`` if set, else the file :data:`KEY_FILE` in the data
directory, made (mode 0600) at first start. Nodes that share a repository and resume each
other's sandboxes must have the same key.
Tokens made before tokens were derived (random ones, stored as they are) stay valid:
:meth:`EnvdTokens.stored` and :meth:`EnvdTokens.restored` pass them through unchanged.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from pathlib import Path

#: The key's file name in the data directory.
KEY_FILE = "envd_token.key"
#: What a stored derived token starts with; the rest is the token's SHA-256 (hex).
DIGEST_PREFIX = "sha256:"
_KEY_BYTES = 32
# Binds the HMAC to this use, so the key could serve other derivations later without
# one value standing in for another.
_PURPOSE = b"agentenv envd access token\x00"
_TRAFFIC_PURPOSE = b"agentenv traffic access token\x00"


class TokenKeyMismatch(ValueError):
    """A stored token digest was not made with this node's key."""


def token_digest(token: str) -> str:
    """What is stored in place of ``token``."""
    return DIGEST_PREFIX + hashlib.sha256(token.encode()).hexdigest()


def key_file(path: Path, size: int) -> bytes:
    """The hex key kept in ``path``; a new random one of ``size`` bytes written there
    first (mode 0600, its directory 0700, made durable) if there is none. Creating it
    exclusively means two servers starting at once agree on one key."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        return bytes.fromhex(path.read_text().strip())
    key = secrets.token_bytes(size)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")
        f.flush()
        os.fsync(f.fileno())
    return key


class EnvdTokens:
    """Derives sandboxes' envd tokens from one key."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("an envd token key must have at least 16 bytes")
        self._key = key

    @classmethod
    def load(cls, path: Path) -> EnvdTokens:
        """The key in ``path``, made there (mode 0600) if there is none."""
        return cls(key_file(path, _KEY_BYTES))

    @classmethod
    def configured(cls, key_hex: str | None, key_file: Path) -> EnvdTokens:
        """The key a node is configured with (``Config.envd_token_key``), else the one
        in ``key_file``."""
        return cls(bytes.fromhex(key_hex)) if key_hex else cls.load(key_file)

    def _derive(self, purpose: bytes, sandbox_id: str) -> str:
        mac = hmac.new(self._key, purpose + sandbox_id.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()

    def token(self, sandbox_id: str) -> str:
        """The envd access token of sandbox ``sandbox_id``."""
        return self._derive(_PURPOSE, sandbox_id)

    def traffic_token(self, sandbox_id: str) -> str:
        """The traffic access token of sandbox ``sandbox_id`` (required on its ports
        other than envd's when it refuses public traffic)."""
        return self._derive(_TRAFFIC_PURPOSE, sandbox_id)

    def restored_traffic(self, sandbox_id: str, digest: str | None) -> str | None:
        """The traffic token a stored ``digest`` stands for (traffic tokens are only
        ever stored as digests). :class:`TokenKeyMismatch` as :meth:`restored`."""
        if digest is None:
            return None
        token = self.traffic_token(sandbox_id)
        if not hmac.compare_digest(token_digest(token), digest):
            raise TokenKeyMismatch(
                f"the traffic token of sandbox {sandbox_id} was made with another key than "
                f"this node's (envd_token_key, else {KEY_FILE} in the data directory)"
            )
        return token

    def is_derived(self, sandbox_id: str, token: str) -> bool:
        return hmac.compare_digest(token.encode(), self.token(sandbox_id).encode())

    def stored(self, sandbox_id: str, token: str | None) -> str | None:
        """What a record keeps of ``token``: its digest if this key derives it, else (a
        token from before tokens were derived) the token itself."""
        if token is None:
            return None
        return token_digest(token) if self.is_derived(sandbox_id, token) else token

    def restored(self, sandbox_id: str, stored: str | None) -> str | None:
        """The token a record's ``stored`` value stands for. :class:`TokenKeyMismatch`
        if it is a digest this key does not reproduce (the key file was replaced, or the
        record comes from a node with another key)."""
        if stored is None or not stored.startswith(DIGEST_PREFIX):
            return stored
        token = self.token(sandbox_id)
        if not hmac.compare_digest(token_digest(token), stored):
            raise TokenKeyMismatch(
                f"the envd token of sandbox {sandbox_id} was made with another key than "
                f"this node's (envd_token_key, else {KEY_FILE} in the data directory: nodes "
                "sharing a repository must have the same key)"
            )
        return token
