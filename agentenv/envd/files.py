"""``GET /files`` (download) and ``POST /files`` (upload), as E2B's envd serves them
(protocol reference, sections 4.7 and 4.8).

Both stream: downloads are read a chunk at a time (with HTTP flow control pacing the
reads; files that do not know their size, and pipes, until EOF: see ``downloads``),
uploads are written to a temporary file next to the target as the body arrives and
renamed over it once complete. Every filesystem call runs with the requesting user's
permissions (see ``fsaccess``), so files and parent directories an upload creates belong
to that user, and a user can never read or write what the OS would not let them.

Errors are JSON ``{"code": <http status>, "message": ...}``: 400 bad request or a
directory, 401 unknown user, bad token or signature, 403 permission denied (the SDK
raises SandboxException "403: permission denied ..."), 404 missing, 406 no acceptable
encoding, 416 bad range, 507 out of space.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mimetypes
import os
import secrets
import stat
import urllib.parse
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from .downloads import (
    CHUNK_SIZE,
    file_range,
    file_to_eof,
    open_for_reading,
    pipe_to_eof,
    send_chunks,
)
from .fsaccess import run_as, run_io
from .multipart import (
    MultipartError,
    MultipartParser,
    PartData,
    PartEnd,
    PartStart,
    boundary_from_content_type,
    parse_header_params,
)
from .signatures import SignatureRefused, SignedFileRequest, query_params
from .state import EnvdState
from .users import OSUser, UnknownUserError, lookup_user
from .watchers import staging_name

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

#: The form field name E2B's SDK (and envd) use for uploaded files.
FILE_FIELD = "file"
METADATA_HEADER_PREFIX = "x-metadata-"
METADATA_XATTR_PREFIX = "user.e2b."


class FileRequestError(Exception):
    """A /files request fails with this HTTP status and message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _ClientGone(Exception):
    pass


def os_error_response(e: OSError, path: str) -> FileRequestError:
    """Map a filesystem error to the status E2B's envd answers with."""
    reason = e.strerror or str(e)
    if e.errno in (errno.ENOENT, errno.ENOTDIR):
        return FileRequestError(404, f"path {path!r} does not exist")
    if e.errno == errno.EISDIR:
        return FileRequestError(400, f"path {path!r} is a directory")
    if e.errno in (errno.EACCES, errno.EPERM):
        return FileRequestError(403, f"permission denied for {path!r}: {reason}")
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return FileRequestError(507, f"not enough disk space to write {path!r}: {reason}")
    if e.errno in (errno.ENAMETOOLONG, errno.ELOOP, errno.EINVAL, errno.EEXIST):
        return FileRequestError(400, f"invalid path {path!r}: {reason}")
    return FileRequestError(500, f"{path!r}: {reason}")


@dataclass(frozen=True, slots=True)
class _Query:
    params: dict[str, str]

    @classmethod
    def parse(cls, scope: Scope) -> _Query:
        return cls(query_params(scope.get("query_string", b"")))

    def get(self, key: str) -> str | None:
        return self.params.get(key)


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


class FileTransfer:
    """Serves /files for envd's application."""

    def __init__(self, state: EnvdState) -> None:
        self._state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = scope["method"]
        try:
            if method in ("GET", "HEAD"):
                await self._download(scope, receive, send)
            elif method == "POST":
                await self._upload(scope, receive, send)
            else:
                raise FileRequestError(405, f"method {method} is not allowed on /files")
        except FileRequestError as e:
            await send_error(send, e.status, e.message)
        except _ClientGone:
            pass

    # -- shared --------------------------------------------------------------------

    def _authorize(self, query: _Query, headers: dict[str, str], operation: str) -> None:
        """Token header or signature, when a token is set (section 4.8)."""
        token = self._state.access_token
        if token is None:
            return
        presented = headers.get("x-access-token")
        if presented is not None:
            if not self._state.token_matches(presented):
                raise FileRequestError(401, "invalid access token")
            return
        signed = SignedFileRequest.of(query.params, operation)
        if signed is None:
            raise FileRequestError(401, "missing access token or signature")
        try:
            signed.verify(token)
        except SignatureRefused as e:
            raise FileRequestError(401, str(e)) from None

    def _user(self, query: _Query) -> OSUser:
        name = query.get("username") or self._state.default_user
        try:
            return lookup_user(name)
        except UnknownUserError as e:
            raise FileRequestError(401, f"invalid user: {e}") from None

    # -- download ------------------------------------------------------------------

    async def _download(self, scope: Scope, receive: Receive, send: Send) -> None:
        query = _Query.parse(scope)
        headers = _headers(scope)
        self._authorize(query, headers, "read")
        user = self._user(query)
        requested = query.get("path")
        if not requested:
            raise FileRequestError(400, "the path query parameter is required")
        path = self._state.resolve_path(requested, user)
        use_gzip = _choose_encoding(headers.get("accept-encoding"))

        try:
            source = await run_as(user, open_for_reading, path)
        except OSError as e:
            raise os_error_response(e, path) from None
        fd, size = source.fd, source.size
        try:
            span = _parse_range(headers.get("range"), size) if size is not None else None
            response_headers = [
                (b"content-type", _content_type(path)),
                (b"content-disposition", _content_disposition(os.path.basename(path))),
                (b"accept-ranges", b"bytes"),
                (b"vary", b"Accept-Encoding"),
            ]
            status = 200
            start, end = 0, size  # [start, end); end None: to EOF
            if span is not None:
                start, end = span
                status = 206
                response_headers.append(
                    (b"content-range", f"bytes {start}-{end - 1}/{size}".encode())
                )
                use_gzip = False  # ranges address the identity bytes
            if use_gzip:
                response_headers.append((b"content-encoding", b"gzip"))
            elif end is not None:
                response_headers.append((b"content-length", str(end - start).encode()))
            await send(
                {"type": "http.response.start", "status": status, "headers": response_headers}
            )
            if scope["method"] == "HEAD":
                await send({"type": "http.response.body", "body": b""})
                return
            if end is not None:
                chunks = file_range(fd, start, end)
            elif source.pollable:
                chunks = pipe_to_eof(fd)
            else:
                chunks = file_to_eof(fd)
            await send_chunks(chunks, use_gzip, receive, send)
        finally:
            os.close(fd)

    # -- upload --------------------------------------------------------------------

    async def _upload(self, scope: Scope, receive: Receive, send: Send) -> None:
        query = _Query.parse(scope)
        headers = _headers(scope)
        self._authorize(query, headers, "write")
        user = self._user(query)
        metadata = _metadata_from_headers(headers)
        path_param = query.get("path") or None
        body = _request_body(receive, headers.get("content-encoding"))
        media_type, _ = parse_header_params(headers.get("content-type", ""))

        upload = _Upload(user, metadata)
        try:
            if media_type == "multipart/form-data":
                try:
                    boundary = boundary_from_content_type(headers["content-type"])
                except MultipartError as e:
                    raise FileRequestError(400, str(e)) from None
                await self._receive_multipart(upload, boundary, body, path_param)
            else:
                if path_param is None:
                    raise FileRequestError(
                        400, "the path query parameter is required for a raw upload"
                    )
                target = self._target(path_param, user)
                await upload.begin(target)
                async for chunk in body:
                    await upload.write(chunk)
                await upload.end_file()
            if not upload.files:
                raise FileRequestError(400, "the request contains no file")
            written = await upload.commit()
        finally:
            await upload.discard()
        await send_json(send, 200, written)

    async def _receive_multipart(
        self,
        upload: _Upload,
        boundary: str,
        body: AsyncIterator[bytes],
        path_param: str | None,
    ) -> None:
        parser = MultipartParser(boundary)
        in_file = False
        try:
            async for chunk in body:
                for event in parser.feed(chunk):
                    if isinstance(event, PartStart):
                        if event.name != FILE_FIELD:
                            continue  # other form fields are ignored
                        raw_path = path_param or event.filename
                        if not raw_path:
                            raise FileRequestError(
                                400, "a file part has no filename and there is no path"
                            )
                        await upload.begin(self._target(raw_path, upload.user))
                        in_file = True
                    elif isinstance(event, PartData):
                        if in_file:
                            await upload.write(event.data)
                    elif isinstance(event, PartEnd) and in_file:
                        await upload.end_file()
                        in_file = False
            parser.finish()
        except MultipartError as e:
            raise FileRequestError(400, f"malformed multipart body: {e}") from None

    def _target(self, raw_path: str, user: OSUser) -> str:
        if "\0" in raw_path:
            raise FileRequestError(400, "path contains a NUL byte")
        return self._state.resolve_path(raw_path, user)


# -- download helpers ---------------------------------------------------------------


def _choose_encoding(accept: str | None) -> bool:
    """Whether to gzip the response; 406 if neither gzip nor identity is acceptable.

    Compression is done only on an explicit request: gzip as the sole coding (what the
    SDK's ``gzip=True`` sends) or identity refused. HTTP clients list gzip by default
    (httpx: "gzip, deflate"), and compressing in the guest costs more than it saves on
    the host-local link: a 1 MiB download took 4x longer gzipped under TCG."""
    if accept is None or not accept.strip():
        return False
    weights: dict[str, float] = {}
    for item in accept.split(","):
        coding, _, params = item.strip().partition(";")
        coding = coding.strip().lower()
        if not coding:
            continue
        quality = 1.0
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key.strip().lower() == "q":
                try:
                    quality = float(value)
                except ValueError:
                    quality = 0.0
        weights[coding] = quality
    star = weights.get("*")
    gzip_q = weights.get("gzip", weights.get("x-gzip", star if star is not None else 0.0))
    identity_q = weights.get("identity", star if star is not None else 1.0)
    gzip_only = set(weights) <= {"gzip", "x-gzip"}
    if gzip_q > 0 and (gzip_only or identity_q <= 0):
        return True
    if identity_q > 0:
        return False
    if gzip_q > 0:
        return True
    raise FileRequestError(406, f"no supported content encoding in {accept!r}")


def _parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """A single ``bytes=`` range as [start, end); None to send the whole file."""
    if header is None:
        return None
    unit, _, spec = header.strip().partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None  # multiple ranges or other units: answering 200 is allowed
    first, sep, last = spec.strip().partition("-")
    try:
        if not sep:
            return None
        if not first:
            suffix = int(last)
            if suffix <= 0:
                raise ValueError
            start, end = max(size - suffix, 0), size
        else:
            start = int(first)
            end = min(int(last) + 1, size) if last else size
            if int(first) < 0 or (last and int(last) < start):
                return None
    except ValueError:
        return None
    if start >= size or start >= end:
        raise FileRequestError(416, f"range {header!r} is not satisfiable (size {size})")
    return start, end


def _content_type(path: str) -> bytes:
    guessed, _ = mimetypes.guess_type(path, strict=False)
    return (guessed or "application/octet-stream").encode("latin-1")


def _content_disposition(name: str) -> bytes:
    if name.isascii() and name.isprintable():
        escaped = name.replace("\\", "\\\\").replace('"', '\\"')
        return f'inline; filename="{escaped}"'.encode()
    fallback = name.encode("ascii", "replace").decode().replace('"', "_").replace("\\", "_")
    encoded = urllib.parse.quote(name, safe="")
    return f"inline; filename=\"{fallback}\"; filename*=UTF-8''{encoded}".encode()


# -- upload helpers -----------------------------------------------------------------


def _metadata_from_headers(headers: dict[str, str]) -> dict[str, str]:
    metadata: dict[str, str] = {}
    for key, value in headers.items():
        if key.startswith(METADATA_HEADER_PREFIX):
            name = key[len(METADATA_HEADER_PREFIX) :]
            if not name:
                raise FileRequestError(400, "empty metadata key")
            metadata[name] = value
    return metadata


async def _request_body(receive: Receive, content_encoding: str | None) -> AsyncIterator[bytes]:
    """The request body as it arrives, gunzipped if it was sent gzipped."""
    coding = (content_encoding or "identity").strip().lower()
    decoder: Any = None
    if coding in ("gzip", "x-gzip"):
        decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
    elif coding not in ("identity", ""):
        raise FileRequestError(415, f"unsupported Content-Encoding {content_encoding!r}")
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk: bytes = message.get("body", b"")
        more = bool(message.get("more_body", False))
        if decoder is None:
            if chunk:
                yield chunk
        else:
            try:
                # max_length bounds what one compressed chunk may inflate to at once.
                data = decoder.decompress(chunk, CHUNK_SIZE)
                while data:
                    yield data
                    data = decoder.decompress(decoder.unconsumed_tail, CHUNK_SIZE)
                if not more:
                    if not decoder.eof:
                        raise FileRequestError(400, "gzip body is truncated")
                    tail = decoder.flush()
                    if tail:
                        yield tail
            except zlib.error as e:
                raise FileRequestError(400, f"gzip body is invalid: {e}") from None
        if not more:
            return


@dataclass(slots=True)
class _StagedFile:
    target: str
    temp: str
    fd: int | None


@dataclass(slots=True)
class _Upload:
    """The files of one upload request, staged next to their targets until commit."""

    user: OSUser
    metadata: dict[str, str]
    files: list[_StagedFile] = field(default_factory=list)

    @property
    def _current(self) -> _StagedFile:
        return self.files[-1]

    async def begin(self, target: str) -> None:
        if any(f.target == target for f in self.files):
            raise FileRequestError(400, f"the request writes {target!r} more than once")
        try:
            fd, temp = await run_as(self.user, _create_staging_file, target)
        except OSError as e:
            raise os_error_response(e, target) from None
        self.files.append(_StagedFile(target, temp, fd))

    async def write(self, data: bytes) -> None:
        staged = self._current
        assert staged.fd is not None
        try:
            await run_io(_write_all, staged.fd, data)
        except OSError as e:
            raise os_error_response(e, staged.target) from None

    async def end_file(self) -> None:
        staged = self._current
        assert staged.fd is not None
        fd, staged.fd = staged.fd, None
        try:
            for key, value in self.metadata.items():
                os.setxattr(fd, METADATA_XATTR_PREFIX + key, value.encode())
        except OSError as e:
            raise os_error_response(e, staged.target) from None
        finally:
            os.close(fd)

    async def commit(self) -> list[dict[str, Any]]:
        """Move every staged file onto its target (as the user)."""
        written: list[dict[str, Any]] = []
        for staged in self.files:
            try:
                await run_as(self.user, _replace, staged.temp, staged.target)
            except OSError as e:
                raise os_error_response(e, staged.target) from None
            staged.temp = ""
            info: dict[str, Any] = {
                "path": staged.target,
                "name": os.path.basename(staged.target),
                "type": "file",
            }
            if self.metadata:
                info["metadata"] = dict(self.metadata)
            written.append(info)
        return written

    async def discard(self) -> None:
        """Remove whatever was not committed (after an error, or nothing at all)."""
        for staged in self.files:
            if staged.fd is not None:
                os.close(staged.fd)
                staged.fd = None
            if staged.temp:
                with contextlib.suppress(OSError):
                    os.unlink(staged.temp)
                staged.temp = ""


def _create_staging_file(target: str) -> tuple[int, str]:
    """Runs as the user: make the parent directories and a temporary file beside
    ``target``; the kernel makes both the user's."""
    try:
        existing: os.stat_result | None = os.stat(target)
    except FileNotFoundError:
        existing = None
    if existing is not None and stat.S_ISDIR(existing.st_mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory", target)
    parent = os.path.dirname(target)
    os.makedirs(parent, mode=0o755, exist_ok=True)
    while True:
        name = staging_name(secrets.token_hex(8), replaces=existing is not None)
        temp = os.path.join(parent, name)
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            break
        except FileExistsError:
            continue
    try:
        # An overwrite keeps the file's permission bits; a new file gets 0644
        # (0666 under the 022 umask Go's envd runs with).
        os.fchmod(fd, stat.S_IMODE(existing.st_mode) if existing is not None else 0o644)
    except OSError:
        os.close(fd)
        os.unlink(temp)
        raise
    return fd, temp


def _replace(temp: str, target: str) -> None:
    if os.path.isdir(target):
        raise IsADirectoryError(errno.EISDIR, "is a directory", target)
    os.rename(temp, target)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# -- responses ----------------------------------------------------------------------


async def send_json(send: Send, status: int, payload: object) -> None:
    body = json.dumps(payload).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, status: int, message: str) -> None:
    await send_json(send, status, {"code": status, "message": message})
