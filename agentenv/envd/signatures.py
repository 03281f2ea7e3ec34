"""E2B's v1 signatures of ``/files`` URLs: what a signed download or upload URL proves and
how it is checked. envd checks them on every unauthenticated ``/files`` request; the
node's proxy uses the same rules to find which sandbox a signed URL was made for when
the URL names none (it carries no sandbox id through ``E2B_SANDBOX_URL``).

A signature is ``v1_`` + unpadded base64 of SHA-256 over
``{path}:{operation}:{username}:{access token}`` (``:{expiration}`` appended when the URL
has ``signature_expiration``, a Unix time, as sent), ``operation`` being ``read`` for a
download and ``write`` for an upload.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
import urllib.parse
from dataclasses import dataclass

SIGNATURE_PREFIX = "v1_"


class SignatureRefused(Exception):
    """A signed URL that must not be served (envd answers 401); ``str(exc)`` says why."""


def file_signature(
    path: str, operation: str, username: str, token: str, expiration: str | None
) -> str:
    """E2B's v1 signature for a /files URL (``operation`` is ``read`` or ``write``)."""
    raw = f"{path}:{operation}:{username}:{token}"
    if expiration is not None:
        raw += f":{expiration}"
    digest = hashlib.sha256(raw.encode()).digest()
    return SIGNATURE_PREFIX + base64.b64encode(digest).decode().rstrip("=")


def operation_of(method: str) -> str:
    """The operation a /files request with this method is signed for."""
    return "write" if method == "POST" else "read"


def query_params(raw: bytes) -> dict[str, str]:
    """A /files query string as envd reads it: decoded as UTF-8, blank values kept, the
    last value of a repeated key winning."""
    pairs = urllib.parse.parse_qsl(
        raw.decode("latin-1"), keep_blank_values=True, encoding="utf-8", errors="replace"
    )
    return dict(pairs)


@dataclass(frozen=True)
class SignedFileRequest:
    """The signed parts of a /files request."""

    path: str
    operation: str
    username: str
    signature: str
    expiration: str | None

    @classmethod
    def of(cls, params: dict[str, str], operation: str) -> SignedFileRequest | None:
        """The request's signed parts, or None when it carries no signature."""
        signature = params.get("signature")
        if not signature:
            return None
        return cls(
            path=params.get("path") or "",
            operation=operation,
            username=params.get("username") or "",
            signature=signature,
            expiration=params.get("signature_expiration"),
        )

    def check_expiration(self, now: float | None = None) -> None:
        """Raise :class:`SignatureRefused` if the URL's expiration is malformed or past."""
        if self.expiration is None:
            return
        try:
            expires_at = int(self.expiration)
        except ValueError:
            raise SignatureRefused("invalid signature expiration") from None
        if expires_at < (time.time() if now is None else now):
            raise SignatureRefused("signature has expired")

    def signed_with(self, token: str) -> bool:
        """Whether the signature was made with this access token."""
        expected = file_signature(self.path, self.operation, self.username, token, self.expiration)
        return hmac.compare_digest(self.signature.encode(), expected.encode())

    def verify(self, token: str, now: float | None = None) -> None:
        """Raise :class:`SignatureRefused` unless the URL is signed with ``token`` and has
        not expired."""
        self.check_expiration(now)
        if not self.signed_with(token):
            raise SignatureRefused("invalid signature")
