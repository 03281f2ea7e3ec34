"""Object stores: the flat key/value storage a durable snapshot repository lives in.

A store maps keys (``/``-separated, relative to the store's root) to immutable-looking
byte strings. Two backends exist: a POSIX directory (``file:///abs/path``), for one host
or a shared filesystem, and an S3-compatible bucket (``s3://bucket/prefix``). Both give
the two guarantees the repository is built on: a reader never sees half an object (a
write replaces the whole object or nothing), and ``put_bytes_if_absent`` is an atomic
create-only write, which is what makes name claims race-free.

Every failure of the store itself (unreachable, access denied, corrupt) is a
:class:`RepositoryError`; errors reading or writing local files the caller named are left
as ``OSError``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import os
import re
import secrets
import stat
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import boto3
import botocore.config
import botocore.exceptions
from pydantic import SecretStr

from agentenv.snapshots.settings import S3Settings

_T = TypeVar("_T")

# Temporary files of the POSIX store; `list` skips them and no key may look like one.
_TMP_RE = re.compile(r"^\.aetmp-[0-9a-f]{16}$")
_COPY_CHUNK = 1024 * 1024


class RepositoryError(Exception):
    """The object store is unreachable, denied the request, or holds corrupt data."""


class ObjectNotFound(RepositoryError):
    """The object does not exist."""


class RepositoryFull(RepositoryError):
    """The object store has no space for the write (ENOSPC or EDQUOT of a directory, an
    S3-compatible server saying its storage is full): retrying will not help until
    someone makes room."""


def check_key(key: str) -> None:
    """ValueError unless ``key`` is a relative ``/``-separated key that cannot escape the
    store's root."""
    if not key or key.startswith("/") or "\0" in key:
        raise ValueError(f"invalid object key {key!r}")
    for part in key.split("/"):
        if part in ("", ".", "..") or _TMP_RE.match(part):
            raise ValueError(f"invalid object key {key!r}")


class ObjectStore(ABC):
    """Atomic whole-object storage under one root."""

    url: str

    @abstractmethod
    async def put_bytes(self, key: str, data: bytes) -> None:
        """Create or atomically replace ``key``."""

    @abstractmethod
    async def put_bytes_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` only if it does not exist; True if this call created it."""

    @abstractmethod
    async def get_bytes(self, key: str) -> bytes:
        """The object's content; :class:`ObjectNotFound` if it is missing."""

    @abstractmethod
    async def put_file(
        self, key: str, path: Path, offset: int = 0, length: int | None = None
    ) -> None:
        """Store ``length`` bytes of ``path`` from ``offset`` (to its end if None)."""

    @abstractmethod
    async def get_file(self, key: str, dest: Path) -> None:
        """Write the object to ``dest`` (through a temporary name renamed into place)."""

    @abstractmethod
    async def exists(self, key: str) -> bool: ...

    @abstractmethod
    async def size(self, key: str) -> int | None:
        """The object's length in bytes, or None if it does not exist."""

    @abstractmethod
    async def delete(self, key: str) -> None:
        """Delete ``key``; a missing object is not an error."""

    @abstractmethod
    async def list(self, prefix: str) -> list[str]:
        """Keys starting with ``prefix`` (a string prefix, not only a directory), sorted."""

    async def age(self, key: str) -> float | None:
        """Seconds since ``key`` was last written, or None if the store cannot tell.
        :class:`ObjectNotFound` if it is missing."""
        return None


def _tmp_name() -> str:
    return f".aetmp-{secrets.token_hex(8)}"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_range(path: Path, offset: int, length: int | None) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read() if length is None else f.read(length)


class PosixObjectStore(ObjectStore):
    """Objects as files under a directory. A write goes to a temporary file in the
    object's directory, is fsynced and renamed over the object, so a crash leaves the old
    object or the new one, never a mixture."""

    def __init__(self, root: Path) -> None:
        if not root.is_absolute():
            raise ValueError(f"a file:// store needs an absolute path, not {root}")
        self.root = root
        self.url = f"file://{root}"

    def _path(self, key: str) -> Path:
        check_key(key)
        return self.root / key

    def _error(self, what: str, key: str, exc: OSError) -> RepositoryError:
        if isinstance(exc, FileNotFoundError):
            return ObjectNotFound(f"{self.url}: {what} {key}: not found")
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return RepositoryFull(f"{self.url}: {what} {key}: {exc}")
        return RepositoryError(f"{self.url}: {what} {key}: {exc}")

    def _write_tmp(self, final: Path, write: Callable[[int], None]) -> Path:
        """A fsynced temporary file next to ``final`` holding what ``write`` wrote."""
        final.parent.mkdir(parents=True, exist_ok=True)
        return _write_fsynced(final.with_name(_tmp_name()), write)

    def _install(self, final: Path, write: Callable[[int], None]) -> None:
        tmp = self._write_tmp(final, write)
        try:
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise
        _fsync_dir(final.parent)

    def _install_if_absent(self, final: Path, data: bytes) -> bool:
        tmp = self._write_tmp(final, lambda fd: _write_all(fd, data))
        try:
            # link() fails if the name exists: an atomic create-only publish of a complete
            # file, which O_EXCL on the final name (then writing) would not be.
            os.link(tmp, final)
        except FileExistsError:
            return False
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        _fsync_dir(final.parent)
        return True

    async def put_bytes(self, key: str, data: bytes) -> None:
        path = self._path(key)
        try:
            await asyncio.to_thread(self._install, path, lambda fd: _write_all(fd, data))
        except OSError as exc:
            raise self._error("writing", key, exc) from exc

    async def put_bytes_if_absent(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        try:
            return await asyncio.to_thread(self._install_if_absent, path, data)
        except OSError as exc:
            raise self._error("creating", key, exc) from exc

    async def get_bytes(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return await asyncio.to_thread(path.read_bytes)
        except IsADirectoryError as exc:
            raise ObjectNotFound(f"{self.url}: reading {key}: not found") from exc
        except OSError as exc:
            raise self._error("reading", key, exc) from exc

    async def put_file(
        self, key: str, path: Path, offset: int = 0, length: int | None = None
    ) -> None:
        final = self._path(key)
        data = await asyncio.to_thread(_read_range, path, offset, length)
        try:
            await asyncio.to_thread(self._install, final, lambda fd: _write_all(fd, data))
        except OSError as exc:
            raise self._error("writing", key, exc) from exc

    def _get_file(self, key: str, dest: Path) -> None:
        try:
            src = open(self._path(key), "rb")
        except OSError as exc:
            raise self._error("reading", key, exc) from exc
        with src:

            def copy(fd: int) -> None:
                while block := src.read(_COPY_CHUNK):
                    _write_all(fd, block)

            tmp = _write_tmp_local(dest, copy)
            os.replace(tmp, dest)

    async def get_file(self, key: str, dest: Path) -> None:
        check_key(key)
        await asyncio.to_thread(self._get_file, key, dest)

    async def exists(self, key: str) -> bool:
        path = self._path(key)
        try:
            return await asyncio.to_thread(path.is_file)
        except OSError as exc:
            raise self._error("checking", key, exc) from exc

    async def size(self, key: str) -> int | None:
        path = self._path(key)

        def regular_file_size() -> int | None:
            try:
                st = path.stat()
            except FileNotFoundError:
                return None
            return st.st_size if stat.S_ISREG(st.st_mode) else None

        try:
            return await asyncio.to_thread(regular_file_size)
        except OSError as exc:
            raise self._error("checking", key, exc) from exc

    async def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            await asyncio.to_thread(path.unlink, missing_ok=True)
        except OSError as exc:
            raise self._error("deleting", key, exc) from exc

    def _list(self, prefix: str) -> list[str]:
        directory, _, _ = prefix.rpartition("/")
        base = self.root / directory if directory else self.root
        keys: list[str] = []

        def walk_error(exc: OSError) -> None:
            # A directory removed while walking is fine; one we may not read is not.
            if not isinstance(exc, FileNotFoundError):
                raise exc

        for dirpath, _dirnames, filenames in os.walk(base, onerror=walk_error):
            rel = os.path.relpath(dirpath, self.root)
            for name in filenames:
                if _TMP_RE.match(name):
                    continue
                key = name if rel == "." else f"{rel}/{name}"
                if key.startswith(prefix):
                    keys.append(key)
        keys.sort()
        return keys

    async def list(self, prefix: str) -> list[str]:
        try:
            return await asyncio.to_thread(self._list, prefix)
        except OSError as exc:
            raise self._error("listing", prefix, exc) from exc

    async def age(self, key: str) -> float | None:
        path = self._path(key)
        try:
            st = await asyncio.to_thread(path.stat)
        except OSError as exc:
            raise self._error("checking", key, exc) from exc
        return time.time() - st.st_mtime


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _write_tmp_local(dest: Path, write: Callable[[int], None]) -> Path:
    """A temporary file next to ``dest`` with what ``write`` wrote (removed on failure)."""
    return _write_fsynced(dest.with_name(f".{dest.name}.{secrets.token_hex(4)}.tmp"), write)


def _write_fsynced(tmp: Path, write: Callable[[int], None]) -> Path:
    """Create ``tmp`` (which must not exist) with what ``write`` wrote, fsynced; removed
    again on failure."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        write(fd)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    os.close(fd)
    return tmp


_S3_POOL = 16
# A dead or unreachable server must fail within seconds, not minutes: short connect
# timeout, one retry. Checksums only when the API requires them: several S3-compatible
# servers reject the trailing checksums newer botocore sends by default, and every
# object's content is verified against its sha256 by the repository anyway.
_S3_CONFIG = botocore.config.Config(
    connect_timeout=3,
    read_timeout=60,
    retries={"max_attempts": 2, "mode": "standard"},
    s3={"addressing_style": "path"},
    max_pool_connections=_S3_POOL,
    request_checksum_calculation="when_required",
    response_checksum_validation="when_required",
)
_NOT_FOUND = frozenset({"NoSuchKey", "404", "NotFound"})
# What S3-compatible servers answer when their disks are full (MinIO, and the generic
# code of 507 Insufficient Storage).
_STORAGE_FULL = frozenset({"XMinioStorageFull", "InsufficientStorage"})
_S3_THREADS = _S3_POOL
_executor: concurrent.futures.ThreadPoolExecutor | None = None


def _s3_executor() -> concurrent.futures.ThreadPoolExecutor:
    """Threads for S3 requests, as many as the client's connection pool: the event
    loop's default executor has only a few on a small host, and requests for small
    chunks are mostly waiting on the network."""
    global _executor
    if _executor is None:
        _executor = concurrent.futures.ThreadPoolExecutor(
            _S3_THREADS, thread_name_prefix="agentenv-s3"
        )
    return _executor


def _reveal(secret: SecretStr | None) -> str | None:
    return None if secret is None else secret.get_secret_value()


class S3ObjectStore(ObjectStore):
    """Objects in an S3-compatible bucket under a key prefix. The bucket is created on
    first use if it does not exist."""

    def __init__(self, bucket: str, prefix: str, settings: S3Settings) -> None:
        self.bucket = bucket
        self.prefix = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
        self.url = f"s3://{bucket}/{self.prefix}"
        self._settings = settings
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._bucket_ready = False
        self._bucket_lock = asyncio.Lock()

    def _make_client(self) -> Any:
        # boto3's default session is shared and not thread-safe; a client is.
        with self._client_lock:
            if self._client is None:
                settings = self._settings
                session = boto3.session.Session(
                    aws_access_key_id=settings.access_key_id,
                    aws_secret_access_key=_reveal(settings.secret_access_key),
                    aws_session_token=_reveal(settings.session_token),
                    region_name=settings.region,
                )
                self._client = session.client(
                    "s3", endpoint_url=settings.endpoint_url, config=_S3_CONFIG
                )
            return self._client

    def _key(self, key: str) -> str:
        check_key(key)
        return self.prefix + key

    def _error(self, what: str, exc: Exception) -> RepositoryError:
        if isinstance(exc, botocore.exceptions.ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            message = f"{self.url}: {what}: {code} {err.get('Message', '')}".rstrip()
            if code in _NOT_FOUND:
                return ObjectNotFound(message)
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in _STORAGE_FULL or status == 507:
                return RepositoryFull(message)
            return RepositoryError(message)
        return RepositoryError(f"{self.url}: {what}: {exc}")

    async def _call(self, what: str, fn: Callable[[Any], _T]) -> _T:
        """Run ``fn(client)`` in a thread, turning every boto failure into a
        :class:`RepositoryError` that says what was being done."""
        await self._ensure_bucket()
        return await self._run(what, fn)

    async def _run(self, what: str, fn: Callable[[Any], _T]) -> _T:
        def call() -> _T:
            return fn(self._make_client())

        try:
            return await asyncio.get_running_loop().run_in_executor(_s3_executor(), call)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            raise self._error(what, exc) from exc

    async def _ensure_bucket(self) -> None:
        if self._bucket_ready:
            return
        async with self._bucket_lock:
            if self._bucket_ready:
                return

            def ensure(client: Any) -> None:
                try:
                    client.head_bucket(Bucket=self.bucket)
                    return
                except botocore.exceptions.ClientError as exc:
                    code = str(exc.response.get("Error", {}).get("Code", ""))
                    if code not in ("404", "NoSuchBucket", "NotFound"):
                        # 403: HeadBucket may be denied where objects are not; carry on.
                        if code in ("403", "AccessDenied"):
                            return
                        raise
                try:
                    client.create_bucket(Bucket=self.bucket)
                except botocore.exceptions.ClientError as exc:
                    code = str(exc.response.get("Error", {}).get("Code", ""))
                    if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                        raise

            await self._run(f"creating bucket {self.bucket}", ensure)
            self._bucket_ready = True

    async def put_bytes(self, key: str, data: bytes) -> None:
        k = self._key(key)
        await self._call(
            f"writing {key}", lambda c: c.put_object(Bucket=self.bucket, Key=k, Body=data)
        )

    async def put_bytes_if_absent(self, key: str, data: bytes) -> bool:
        k = self._key(key)

        def put(client: Any) -> bool:
            try:
                client.put_object(Bucket=self.bucket, Key=k, Body=data, IfNoneMatch="*")
            except botocore.exceptions.ClientError as exc:
                code = str(exc.response.get("Error", {}).get("Code", ""))
                # 409: a concurrent conditional write of the same key is in progress.
                if code in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                    return False
                raise
            return True

        return await self._call(f"creating {key}", put)

    async def get_bytes(self, key: str) -> bytes:
        k = self._key(key)

        def get(client: Any) -> bytes:
            body = client.get_object(Bucket=self.bucket, Key=k)["Body"]
            try:
                data: bytes = body.read()
            finally:
                body.close()
            return data

        return await self._call(f"reading {key}", get)

    async def put_file(
        self, key: str, path: Path, offset: int = 0, length: int | None = None
    ) -> None:
        data = await asyncio.to_thread(_read_range, path, offset, length)
        await self.put_bytes(key, data)

    async def get_file(self, key: str, dest: Path) -> None:
        k = self._key(key)

        def get(client: Any) -> None:
            body = client.get_object(Bucket=self.bucket, Key=k)["Body"]
            try:

                def copy(fd: int) -> None:
                    for block in body.iter_chunks(_COPY_CHUNK):
                        _write_all(fd, block)

                tmp = _write_tmp_local(dest, copy)
            finally:
                body.close()
            os.replace(tmp, dest)

        await self._call(f"reading {key}", get)

    async def exists(self, key: str) -> bool:
        k = self._key(key)

        def head(client: Any) -> bool:
            try:
                client.head_object(Bucket=self.bucket, Key=k)
            except botocore.exceptions.ClientError as exc:
                if str(exc.response.get("Error", {}).get("Code", "")) in _NOT_FOUND:
                    return False
                raise
            return True

        return await self._call(f"checking {key}", head)

    async def size(self, key: str) -> int | None:
        k = self._key(key)

        def head(client: Any) -> int | None:
            try:
                response = client.head_object(Bucket=self.bucket, Key=k)
            except botocore.exceptions.ClientError as exc:
                if str(exc.response.get("Error", {}).get("Code", "")) in _NOT_FOUND:
                    return None
                raise
            return int(response["ContentLength"])

        return await self._call(f"checking {key}", head)

    async def delete(self, key: str) -> None:
        k = self._key(key)

        def delete(client: Any) -> None:
            try:
                client.delete_object(Bucket=self.bucket, Key=k)
            except botocore.exceptions.ClientError as exc:
                if str(exc.response.get("Error", {}).get("Code", "")) not in _NOT_FOUND:
                    raise

        await self._call(f"deleting {key}", delete)

    async def list(self, prefix: str) -> list[str]:
        full = self.prefix + prefix

        def list_keys(client: Any) -> list[str]:
            keys: list[str] = []
            pages = client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=full
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    key = obj["Key"][len(self.prefix) :]
                    if key and not key.endswith("/"):  # not "directory" markers
                        keys.append(key)
            keys.sort()
            return keys

        return await self._call(f"listing {prefix}", list_keys)

    async def age(self, key: str) -> float | None:
        k = self._key(key)

        def head(client: Any) -> float:
            modified = client.head_object(Bucket=self.bucket, Key=k)["LastModified"]
            return time.time() - float(modified.timestamp())

        return await self._call(f"checking {key}", head)


def open_store(url: str, s3: S3Settings | Mapping[str, str]) -> ObjectStore:
    """The store ``url`` names: ``file:///abs/path`` or ``s3://bucket[/prefix]``.
    An S3 store is reached with ``s3``: the server passes its configured settings; a
    mapping is read as environment variables (``AWS_ENDPOINT_URL_S3`` or
    ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``
    or ``AWS_DEFAULT_REGION``; see :class:`S3Settings`)."""
    parts = urlsplit(url)
    if parts.query or parts.fragment:
        raise ValueError(f"snapshot repository URL {url!r}: no query or fragment allowed")
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"snapshot repository URL {url!r}: use file:///absolute/path")
        if not parts.path.startswith("/") or parts.path.rstrip("/") == "":
            raise ValueError(f"snapshot repository URL {url!r}: needs an absolute directory")
        return PosixObjectStore(Path(os.path.normpath(parts.path)))
    if parts.scheme == "s3":
        bucket = parts.netloc
        if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket):
            raise ValueError(f"snapshot repository URL {url!r}: invalid bucket name {bucket!r}")
        prefix = parts.path.strip("/")
        if prefix:
            check_key(prefix)
        settings = s3 if isinstance(s3, S3Settings) else S3Settings.from_environment(s3)
        return S3ObjectStore(bucket, prefix, settings)
    raise ValueError(
        f"snapshot repository URL {url!r}: unsupported scheme "
        f"{parts.scheme or '(none)'!r}; use file:///path or s3://bucket/prefix"
    )
