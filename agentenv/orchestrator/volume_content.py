"""The volume content API's reach into a volume's files, wherever they are:

- on the host, through fuse2fs over the image, while no sandbox holds the volume
  (:class:`HostVolumeFiles`, over :func:`agentenv.storage.volumes.mounted`);
- in the guest of the running sandbox that holds it, through that sandbox's envd
  (:class:`GuestVolumeFiles`): ext4 has one writer, and while a guest has the
  filesystem mounted the host must not touch the image, so the guest's own kernel does
  the work. Each operation runs :mod:`agentenv.storage.volume_tree` (the code the host
  runs over its fuse2fs mount, paths confined to the volume the same way) on the tools
  drive's Python, as root, over the path the volume is mounted at, after checking the
  volume's device is still mounted there; file contents go through envd's ``/files``
  (a write lands in a partial file beside the target, renamed into place).

Both answer the same :class:`VolumeFiles` calls, so the API does not know which it has.
A guest operation costs a process start in the guest (a fraction of a second under
TCG); the host's costs a fuse2fs mount.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

import httpx

from agentenv.orchestrator import envd_client
from agentenv.orchestrator.errors import Conflict, OperationFailed
from agentenv.storage.volume_tree import (
    Entry,
    MountedVolume,
    VolumePathError,
    entry_from_wire,
    read_chunks,
)

# The tools drive every guest has (agentenv.guest.tools): its Python runs on any root
# filesystem, through its own loader, whatever the template's image holds.
GUEST_PYTHON = ("/.aenv/bin/busybox", "sh", "/.aenv/bin/python")
_GUEST_OPERATION_TIMEOUT = 120.0
_TRANSFER_TIMEOUT = httpx.Timeout(3600.0, connect=10.0)

Chunks = AsyncIterator[bytes]


class VolumeFiles(Protocol):
    """A volume's files, as the content API uses them. Paths are volume paths;
    :class:`VolumePathError` for one that is missing or not what the call needs."""

    async def entry(self, path: str) -> Entry: ...

    async def listing(self, path: str, depth: int) -> list[Entry]: ...

    async def make_dir(
        self, path: str, uid: int | None, gid: int | None, mode: int | None, *, force: bool
    ) -> Entry: ...

    async def write(
        self, path: str, body: Chunks, uid: int | None, gid: int | None, mode: int | None,
        *, force: bool,
    ) -> Entry: ...  # fmt: skip

    async def read(self, path: str) -> tuple[int | None, Chunks]:
        """The file's size (if known before it is sent) and its contents, read while
        the caller's hold on the volume lasts."""
        ...

    async def remove(self, path: str) -> None: ...

    async def set_metadata(
        self, path: str, uid: int | None, gid: int | None, mode: int | None
    ) -> Entry: ...


@dataclass
class HostVolumeFiles:
    """The files of a volume image mounted on the host."""

    vol: MountedVolume

    async def entry(self, path: str) -> Entry:
        return await asyncio.to_thread(self.vol.entry, path)

    async def listing(self, path: str, depth: int) -> list[Entry]:
        return await asyncio.to_thread(self.vol.listing, path, depth)

    async def make_dir(
        self, path: str, uid: int | None, gid: int | None, mode: int | None, *, force: bool
    ) -> Entry:
        return await asyncio.to_thread(self.vol.make_dir, path, uid, gid, mode, force=force)

    async def write(
        self, path: str, body: Chunks, uid: int | None, gid: int | None, mode: int | None,
        *, force: bool,
    ) -> Entry:  # fmt: skip
        clean, local = await asyncio.to_thread(self.vol.open_for_write, path, force=force)
        partial = local.with_name(f".{local.name}.{secrets.token_hex(4)}.partial")
        try:
            await _receive(body, partial)
            return await asyncio.to_thread(
                self.vol.finish_write, clean, local, partial, uid, gid, mode
            )
        finally:
            partial.unlink(missing_ok=True)

    async def read(self, path: str) -> tuple[int | None, Chunks]:
        local = await asyncio.to_thread(self.vol.read_path, path)
        size = local.stat().st_size

        async def chunks() -> Chunks:
            reader = read_chunks(local)
            while chunk := await asyncio.to_thread(next, reader, b""):
                yield chunk

        return size, chunks()

    async def remove(self, path: str) -> None:
        await asyncio.to_thread(self.vol.remove, path)

    async def set_metadata(
        self, path: str, uid: int | None, gid: int | None, mode: int | None
    ) -> Entry:
        return await asyncio.to_thread(self.vol.set_metadata, path, uid, gid, mode)


async def _receive(body: Chunks, partial: Path) -> None:
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as fh:
        async for chunk in body:
            if chunk:
                await asyncio.to_thread(fh.write, chunk)


def _tree_source() -> str:
    return resources.files("agentenv.storage").joinpath("volume_tree.py").read_text()


@dataclass
class GuestVolumeFiles:
    """The files of a volume mounted at ``root`` (from ``device``) in a running
    sandbox's guest, reached through its envd at ``address``."""

    http: httpx.AsyncClient
    address: str
    token: str | None
    device: str
    root: str
    name: str

    async def _call(self, op: str, **args: Any) -> Any:
        request = json.dumps({"op": op, "args": args})
        lines: list[str] = []

        def keep(stream: str, line: str) -> None:
            if stream == "stdout":
                lines.append(line)

        # -S: no site module (the operation needs only the standard library), a
        # noticeable part of the interpreter's start under TCG.
        argv = [*GUEST_PYTHON, "-S", "-c", _tree_source(), self.device, self.root, request]
        try:
            result = await envd_client.execute(
                self.http, self.address, argv, user="root", on_output=keep,
                timeout=_GUEST_OPERATION_TIMEOUT, access_token=self.token,
            )  # fmt: skip
        except envd_client.EnvdUnreachable as exc:
            raise Conflict(
                f"volume {self.name!r}: the sandbox holding it did not answer ({exc}); "
                "retry once it runs, or kill it"
            ) from exc
        answer: dict[str, Any] = {}
        for line in reversed(lines):
            try:
                answer = json.loads(line)
                break
            except ValueError:
                continue
        if result.exit_code != 0 or not answer:
            raise OperationFailed(
                f"volume {self.name!r}: the content operation failed in the sandbox "
                f"(exit {result.exit_code}): {' '.join(lines)[-500:]}"
            )
        if "unmounted" in answer:
            raise Conflict(
                f"volume {self.name!r} is held by a sandbox that no longer has it mounted at "
                f"{self.root}: mount it there again, or kill the sandbox"
            )
        if "error" in answer:
            raise VolumePathError(str(answer["error"]), missing=bool(answer.get("missing")))
        return answer.get("result")

    async def entry(self, path: str) -> Entry:
        return entry_from_wire(await self._call("entry", path=path))

    async def listing(self, path: str, depth: int) -> list[Entry]:
        return [entry_from_wire(e) for e in await self._call("listing", path=path, depth=depth)]

    async def make_dir(
        self, path: str, uid: int | None, gid: int | None, mode: int | None, *, force: bool
    ) -> Entry:
        wire = await self._call("make_dir", path=path, uid=uid, gid=gid, mode=mode, force=force)
        return entry_from_wire(wire)

    def _headers(self) -> dict[str, str]:
        return {"X-Access-Token": self.token} if self.token else {}

    async def write(
        self, path: str, body: Chunks, uid: int | None, gid: int | None, mode: int | None,
        *, force: bool,
    ) -> Entry:  # fmt: skip
        clean, local = await self._call("open_for_write", path=path, force=force)
        target = Path(local)
        partial = str(target.with_name(f".{target.name}.{secrets.token_hex(4)}.partial"))
        try:
            try:
                response = await self.http.post(
                    envd_client.envd_url(self.address, "/files"),
                    params={"path": partial, "username": "root"},
                    content=body,
                    headers={**self._headers(), "Content-Type": "application/octet-stream"},
                    timeout=_TRANSFER_TIMEOUT,
                )
            except httpx.HTTPError as exc:
                raise Conflict(f"volume {self.name!r}: writing {clean} failed: {exc}") from exc
            if not response.is_success:
                raise OperationFailed(
                    f"volume {self.name!r}: writing {clean} answered {response.status_code}: "
                    f"{response.text[:300]}"
                )
            wire = await self._call(
                "finish_write", clean=clean, local=local, partial=partial,
                uid=uid, gid=gid, mode=mode,
            )  # fmt: skip
        except BaseException:
            try:
                await self._call("discard", partial=partial)
            except Exception:
                pass
            raise
        return entry_from_wire(wire)

    async def read(self, path: str) -> tuple[int | None, Chunks]:
        local, _ = await self._call("read_path", path=path)
        request = self.http.build_request(
            "GET",
            envd_client.envd_url(self.address, "/files"),
            params={"path": local, "username": "root"},
            # The size envd sends is the file's when envd opened it; the guest may be
            # changing it, so no length is promised before then.
            headers={**self._headers(), "Accept-Encoding": "identity"},
            timeout=_TRANSFER_TIMEOUT,
        )
        try:
            response = await self.http.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise Conflict(f"volume {self.name!r}: reading {path} failed: {exc}") from exc
        if not response.is_success:
            text = (await response.aread()).decode(errors="replace")[:300]
            await response.aclose()
            raise OperationFailed(
                f"volume {self.name!r}: reading {path} answered {response.status_code}: {text}"
            )

        async def chunks() -> Chunks:
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()

        length = response.headers.get("content-length")
        return (int(length) if length and length.isdigit() else None), chunks()

    async def remove(self, path: str) -> None:
        await self._call("remove", path=path)

    async def set_metadata(
        self, path: str, uid: int | None, gid: int | None, mode: int | None
    ) -> Entry:
        return entry_from_wire(
            await self._call("set_metadata", path=path, uid=uid, gid=gid, mode=mode)
        )
