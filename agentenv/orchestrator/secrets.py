"""Secrets (E2B's secrets API): named values kept encrypted in the repository, which
no API ever returns and which reach only the egress filter, where a network ``rules``
header transform names them (``${e2b.secrets.<name>}``).

A secret is one record in the repository (``catalog/secret/<id>``, through
:class:`~agentenv.orchestrator.catalog.Catalog`) holding its metadata in the clear and its
current value encrypted with AES-256-GCM; the associated data binds the ciphertext to the
secret's id and version, so a value cannot be moved onto another secret or version. The
key is ``Config.secrets_key`` if set, else the file :data:`KEY_FILE` in the data directory,
made (mode 0600) at the server's first start; it never enters the repository. Nodes
sharing a repository must have the same key to resolve each other's secrets; ``key_id`` (a
digest of the key) in each record tells a node with another key to say so rather than
fail to decrypt.

Names are unique across nodes: a create claims the repository name ``secret:<name>``
with a create-only write before it writes the record.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import re
import secrets
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from agentenv.config import Config
from agentenv.orchestrator.catalog import Catalog
from agentenv.orchestrator.errors import Conflict, InvalidRequest, SecretNotFound
from agentenv.orchestrator.records import SecretEntry
from agentenv.orchestrator.tokens import key_file

__all__ = [
    "KEY_FILE",
    "SecretCipher",
    "SecretKeyMismatch",
    "Secrets",
    "check_metadata",
    "check_name",
    "check_value",
]

#: The key's file name in the data directory.
KEY_FILE = "secrets.key"
_KEY_BYTES = 32
_NONCE_BYTES = 12
_ID_PREFIX = "sec_"
_ID = re.compile(r"sec_[0-9a-f]{24}")
# Lower-cased before they are stored (as E2B does); they appear in URL paths and in
# ``${e2b.secrets.<name>}`` placeholders, hence the plain alphabet.
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")
MAX_VALUE_BYTES = 64 * 1024
# E2B's documented limits on a secret's metadata.
MAX_METADATA_ENTRIES = 32
MAX_METADATA_KEY_BYTES = 128
MAX_METADATA_VALUE_BYTES = 1024
MAX_METADATA_BYTES = 8192


class SecretKeyMismatch(ValueError):
    """A secret was encrypted with another key than this node's."""


def check_name(name: str) -> str:
    """`name` as stored (lower-cased), or :class:`InvalidRequest` saying why not."""
    canonical = name.lower() if isinstance(name, str) else ""
    if canonical.startswith(_ID_PREFIX):
        raise InvalidRequest(f"secret name {name!r}: the {_ID_PREFIX} prefix is reserved for ids")
    if not _NAME.fullmatch(canonical):
        raise InvalidRequest(
            f"secret name {name!r}: 1 to 128 characters of letters, digits, '.', '_' and '-', "
            "starting with a letter or digit"
        )
    return canonical


def _utf8_length(text: str, what: str) -> int:
    try:
        return len(text.encode())
    except UnicodeEncodeError:  # a lone surrogate, which JSON can carry
        raise InvalidRequest(f"{what}: not valid Unicode text") from None


def check_value(value: str) -> str:
    """`value` if it can be stored and sent as an HTTP header value (where secrets are
    used), else :class:`InvalidRequest` (which never repeats the value)."""
    if not isinstance(value, str) or not value:
        raise InvalidRequest("secret value: must be a non-empty string")
    if _utf8_length(value, "secret value") > MAX_VALUE_BYTES:
        raise InvalidRequest(f"secret value: at most {MAX_VALUE_BYTES} bytes")
    if any(ch in value for ch in "\r\n\0"):
        raise InvalidRequest("secret value: line breaks and NUL cannot go into a header value")
    return value


def check_metadata(metadata: dict[str, str]) -> dict[str, str]:
    if len(metadata) > MAX_METADATA_ENTRIES:
        raise InvalidRequest(f"metadata: at most {MAX_METADATA_ENTRIES} entries")
    total = 0
    for key, value in metadata.items():
        key_bytes = _utf8_length(key, "metadata key")
        value_bytes = _utf8_length(value, "metadata value")
        if not key or key_bytes > MAX_METADATA_KEY_BYTES:
            raise InvalidRequest(f"metadata key {key[:40]!r}: 1 to 128 bytes")
        if value_bytes > MAX_METADATA_VALUE_BYTES:
            raise InvalidRequest(f"metadata value of {key!r}: at most 1024 bytes")
        total += key_bytes + value_bytes
    if total > MAX_METADATA_BYTES:
        raise InvalidRequest(f"metadata: at most {MAX_METADATA_BYTES} bytes in all")
    return dict(metadata)


class SecretCipher:
    """AES-256-GCM under one key, bound to a secret's id and version."""

    def __init__(self, key: bytes) -> None:
        if len(key) != _KEY_BYTES:
            raise ValueError(f"a secrets key has {_KEY_BYTES} bytes")
        self._aead = AESGCM(key)
        self.key_id = hashlib.sha256(b"agentenv secrets key id\x00" + key).hexdigest()[:16]

    @classmethod
    def load(cls, path: Path) -> SecretCipher:
        """The key in ``path``, made there (mode 0600) if there is none."""
        return cls(key_file(path, _KEY_BYTES))

    @classmethod
    def configured(cls, key_hex: str | None, key_file: Path) -> SecretCipher:
        return cls(bytes.fromhex(key_hex)) if key_hex else cls.load(key_file)

    @staticmethod
    def _associated(secret_id: str, version: int) -> bytes:
        return f"agentenv secret\x00{secret_id}\x00{version}".encode()

    def seal(self, secret_id: str, version: int, value: str) -> tuple[str, str]:
        """(nonce, ciphertext), base64."""
        nonce = secrets.token_bytes(_NONCE_BYTES)
        sealed = self._aead.encrypt(nonce, value.encode(), self._associated(secret_id, version))
        return base64.b64encode(nonce).decode(), base64.b64encode(sealed).decode()

    def open(self, entry: SecretEntry) -> str:
        """The value `entry` holds. :class:`SecretKeyMismatch` if another key sealed it
        (or the record was altered)."""
        if entry.key_id != self.key_id:
            raise SecretKeyMismatch(
                f"secret {entry.name!r} was encrypted with another key than this node's "
                f"(secrets_key, else {KEY_FILE} in the data directory: nodes sharing a "
                "repository must have the same key)"
            )
        try:
            plain = self._aead.decrypt(
                base64.b64decode(entry.nonce),
                base64.b64decode(entry.ciphertext),
                self._associated(entry.id, entry.current_version),
            )
        except (InvalidTag, ValueError) as exc:
            raise SecretKeyMismatch(f"secret {entry.name!r} does not decrypt: {exc!r}") from exc
        return plain.decode()


class Secrets:
    """The secrets API's operations over the repository. Values go in through
    :meth:`create` and :meth:`update` and come out only through :meth:`value`, which only
    the egress filter calls."""

    def __init__(self, config: Config, catalog: Catalog) -> None:
        self._config = config
        self._catalog = catalog
        self._cipher: SecretCipher | None = None
        self._lock = asyncio.Lock()  # one change at a time on this node

    def load_key(self) -> None:
        """Read the key (making the key file, mode 0600, if there is none)."""
        _ = self.cipher

    @property
    def cipher(self) -> SecretCipher:
        if self._cipher is None:
            self._cipher = SecretCipher.configured(
                self._config.secrets_key, self._config.secrets_key_path
            )
        return self._cipher

    async def find(self, key: str) -> SecretEntry:
        """The secret with id or name `key`; :class:`SecretNotFound` if none."""
        entry: SecretEntry | None = None
        if isinstance(key, str) and _ID.fullmatch(key):
            entry = await self._catalog.get_secret(key)
        elif isinstance(key, str) and _NAME.fullmatch(key.lower()):
            secret_id = await self._catalog.secret_named(key.lower())
            if secret_id is not None and _ID.fullmatch(secret_id):
                entry = await self._catalog.get_secret(secret_id)
        if entry is None:
            raise SecretNotFound(key)
        return entry

    async def list(self) -> list[SecretEntry]:
        """Every secret, by name."""
        return sorted(await self._catalog.list_secrets(), key=lambda entry: entry.name)

    async def create(self, name: str, value: str, metadata: dict[str, str]) -> SecretEntry:
        name, value, metadata = check_name(name), check_value(value), check_metadata(metadata)
        async with self._lock:
            secret_id = _ID_PREFIX + secrets.token_hex(12)
            if not await self._catalog.claim_secret_name(name, secret_id, replace=False):
                holder = await self._catalog.secret_named(name)
                # A name whose record is missing was left by a create that crashed
                # between its two writes: it is free.
                if holder is not None and await self._catalog.get_secret(holder) is not None:
                    raise Conflict(f"a secret named {name!r} exists")
                await self._catalog.claim_secret_name(name, secret_id, replace=True)
            now = datetime.now(UTC)
            entry = self._sealed(secret_id, name, 1, value, metadata, now, now)
            await self._catalog.put_secret(entry)
            return entry

    async def update(self, key: str, value: str, metadata: dict[str, str] | None) -> SecretEntry:
        value = check_value(value)
        if metadata is not None:
            metadata = check_metadata(metadata)
        async with self._lock:
            current = await self.find(key)
            entry = self._sealed(
                current.id,
                current.name,
                current.current_version + 1,
                value,
                current.metadata if metadata is None else metadata,
                current.created_at,
                datetime.now(UTC),
            )
            await self._catalog.put_secret(entry)
            return entry

    async def destroy(self, key: str) -> None:
        async with self._lock:
            await self._catalog.delete_secret(await self.find(key))

    async def require(self, names: Iterable[str]) -> None:
        """:class:`InvalidRequest` naming the first of `names` that is no secret (network
        rules are checked when they are given, not first when a request needs them)."""
        for name in names:
            try:
                await self.find(name)
            except SecretNotFound:
                raise InvalidRequest(
                    f"rules: ${{e2b.secrets.{name}}} names no secret (create it first)"
                ) from None

    async def value(self, name: str) -> str:
        """The current value of secret `name` (id or name), for the egress filter only.
        :class:`SecretNotFound`, or :class:`SecretKeyMismatch` if this node cannot
        decrypt it."""
        return self.cipher.open(await self.find(name))

    def _sealed(
        self,
        secret_id: str,
        name: str,
        version: int,
        value: str,
        metadata: dict[str, str],
        created_at: datetime,
        updated_at: datetime,
    ) -> SecretEntry:
        nonce, ciphertext = self.cipher.seal(secret_id, version, value)
        return SecretEntry(
            id=secret_id,
            name=name,
            current_version=version,
            metadata=metadata,
            created_at=created_at,
            updated_at=updated_at,
            node=self._config.node_name,
            key_id=self.cipher.key_id,
            nonce=nonce,
            ciphertext=ciphertext,
        )
