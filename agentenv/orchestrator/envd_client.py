"""The orchestrator's side of envd: ``/health``, ``/init``, ``/files`` and running commands
(waiting for them, or streaming their output for template build logs).

``/init`` goes to envd's control port, which only the node reaches (the proxy never
forwards to it); everything else to envd's public port, as clients use it. Guests saved
by an older agentenv run an envd without the control port: their /init is on the public
port, which the node still uses for them (the proxy refuses /init whatever the guest)."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx

from agentenv.network.addresses import ENVD_CONTROL_PORT, ENVD_PORT

log = logging.getLogger("agentenv.orchestrator")


# How long /init waits for the guest to take its connection; once taken, the request is
# given whatever is left of the whole /init timeout to be answered.
INIT_CONNECT_TIMEOUT_S = 5.0


class EnvdUnreachable(Exception):
    """envd did not answer in time."""


def envd_url(address: str, path: str) -> str:
    return f"http://{address}:{ENVD_PORT}{path}"


def init_url(address: str) -> str:
    return f"http://{address}:{ENVD_CONTROL_PORT}/init"


async def wait_healthy(
    client: httpx.AsyncClient,
    address: str,
    timeout: float,
    *,
    alive: Callable[[], bool] | None = None,
    interval: float = 0.05,
) -> None:
    """Poll ``/health`` until it answers 2xx. ``alive`` lets the caller stop early when
    the VM has died instead of waiting out the whole timeout."""
    deadline = time.monotonic() + timeout
    last_error = "no answer"
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            raise EnvdUnreachable("the VM exited before envd became healthy")
        try:
            response = await client.get(envd_url(address, "/health"), timeout=2.0)
            if response.is_success:
                return
            last_error = f"HTTP {response.status_code}"
        except httpx.HTTPError as exc:
            last_error = f"{type(exc).__name__}: {exc}"
        await asyncio.sleep(interval)
    raise EnvdUnreachable(f"envd at {address} not healthy after {timeout:.0f}s ({last_error})")


async def init(
    client: httpx.AsyncClient,
    address: str,
    *,
    env_vars: Mapping[str, str],
    access_token: str | None,
    timeout: float = 30.0,
) -> int:
    """Hand a freshly restored guest its identity: environment, token, a clock set from
    the host (the snapshot's clock is stale) and fresh entropy (every restore of one
    snapshot starts with the same RNG state). Returns how many requests it took (the
    first can race the guest's network coming back).

    ``timeout`` is generous: a guest answers in a few hundred milliseconds alone, but
    sixteen fork children restoring at once on a busy 2-core TCG host took over 10 s, and
    a create that fails then loses the sandbox for nothing."""
    body: dict[str, object] = {
        "envVars": dict(env_vars),
        "timestamp": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
        "seed": base64.b64encode(os.urandom(64)).decode(),
    }
    if access_token:
        body["accessToken"] = access_token
    deadline = time.monotonic() + timeout
    url = init_url(address)
    attempts = 0
    while True:
        attempts += 1
        # A guest that took the request is not asked again: sent anew after a read
        # timeout, the (busy) guest did the work twice. With 16 fork children on a
        # loaded 2-core TCG host, half their /inits took over 5 s, the read timeout this
        # used to have, and were sent two or three times.
        remaining = max(deadline - time.monotonic(), INIT_CONNECT_TIMEOUT_S)
        try:
            response = await client.post(
                url, json=body, timeout=httpx.Timeout(INIT_CONNECT_TIMEOUT_S, read=remaining)
            )
        except httpx.HTTPError as exc:
            if url == init_url(address) and _refused(exc):
                # The guest answered, but nothing listens on the control port: an envd
                # saved before it existed (a template, snapshot or paused sandbox made by
                # an older agentenv), whose /init is on its public port.
                log.warning(
                    "envd at %s has no control port (saved by an older agentenv): "
                    "using its legacy /init; rebuild its template to drop this",
                    address,
                )
                url = envd_url(address, "/init")
                continue
            # Right after a restore the first packets can race the guest's ARP refresh.
            if time.monotonic() > deadline:
                # httpx timeouts have empty messages: the type says what happened.
                raise EnvdUnreachable(
                    f"envd /init failed after {timeout:.0f} s: {type(exc).__name__}: {exc}"
                ) from exc
            await asyncio.sleep(0.02)
            continue
        if response.is_success:
            return attempts
        raise EnvdUnreachable(f"envd /init answered {response.status_code}: {response.text}")


def _refused(exc: BaseException) -> bool:
    """Whether the connection was refused (a TCP reset from the guest: it runs, but
    nothing listens there), as opposed to not reaching the guest at all."""
    seen: BaseException | None = exc
    for _ in range(10):  # httpx -> httpcore -> OSError: a short chain
        if seen is None:
            break
        if isinstance(seen, ConnectionRefusedError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


async def warm_up(client: httpx.AsyncClient, address: str, timeout: float = 60.0) -> None:
    """Exercise envd's request paths once before a template is snapshotted.

    Whatever a first request costs in the guest (first-use code paths, files read into
    the guest's page cache, lazily built state) is then paid once at template build
    instead of in every sandbox restored from it."""
    await client.post(
        init_url(address),
        json={"timestamp": datetime.now(UTC).isoformat().replace("+00:00", "Z")},
        timeout=timeout,
    )
    await run(client, address, "/bin/bash", ["-l", "-c", "true"], None, timeout=timeout)


async def run(
    client: httpx.AsyncClient,
    address: str,
    cmd: str,
    args: list[str],
    access_token: str | None,
    *,
    timeout: float = 60.0,
) -> None:
    """Run a command in the guest through envd's process service and wait for its end
    (the orchestrator's own uses: warming a template, syncing filesystems)."""
    start = {"process": {"cmd": cmd, "args": args}, "stdin": False}
    body = json.dumps(start).encode()
    headers = {"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"}
    if access_token:
        headers["X-Access-Token"] = access_token
    try:
        response = await client.post(
            envd_url(address, "/process.Process/Start"),
            content=struct.pack(">BI", 0, len(body)) + body,
            headers=headers,
            timeout=timeout,
        )
    except httpx.HTTPError as exc:
        raise EnvdUnreachable(f"running {cmd} in the guest failed: {exc}") from exc
    if response.status_code != 200:
        raise EnvdUnreachable(f"running {cmd} in the guest failed: {response.status_code}")


async def metrics(
    client: httpx.AsyncClient, address: str, access_token: str | None, *, timeout: float = 10
) -> dict[str, object]:
    """The guest's resource figures from envd's ``/metrics``."""
    headers = {"X-Access-Token": access_token} if access_token else {}
    try:
        response = await client.get(envd_url(address, "/metrics"), headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        raise EnvdUnreachable(f"envd /metrics failed: {exc}") from exc
    if not response.is_success:
        raise EnvdUnreachable(f"envd /metrics answered {response.status_code}")
    data = response.json()
    if not isinstance(data, dict):
        raise EnvdUnreachable("envd /metrics did not return an object")
    return data


@dataclass(frozen=True)
class CommandResult:
    exit_code: int
    error: str | None


def _basic_user(user: str | None) -> dict[str, str]:
    if not user:
        return {}
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:".encode()).decode()}


async def execute(
    client: httpx.AsyncClient,
    address: str,
    command: str | Sequence[str],
    *,
    user: str | None = None,
    cwd: str | None = None,
    envs: Mapping[str, str] | None = None,
    on_output: Callable[[str, str], None] | None = None,
    timeout: float = 3600.0,
    access_token: str | None = None,
    login: bool = True,
) -> CommandResult:
    """Run ``command`` with ``bash -l -c`` (without ``login``: ``sh -c``, much quicker to
    start; a sequence: that program and arguments, no shell) as ``user`` and wait for its
    end, passing each line of output to ``on_output(stream, line)``."""
    if not isinstance(command, str):
        argv = list(command)
    elif login:
        argv = ["/bin/bash", "-l", "-c", command]
    else:
        argv = ["/bin/sh", "-c", command]
    process: dict[str, object] = {"cmd": argv[0], "args": argv[1:]}
    if cwd:
        process["cwd"] = cwd
    if envs:
        process["envs"] = dict(envs)
    body = json.dumps({"process": process, "stdin": False}).encode()
    headers = {
        "Content-Type": "application/connect+json",
        "Connect-Protocol-Version": "1",
        **_basic_user(user),
    }
    if access_token:
        headers["X-Access-Token"] = access_token
    pending = {"stdout": b"", "stderr": b""}

    def emit(stream: str, data: bytes, final: bool = False) -> None:
        buffered = pending[stream] + data
        *lines, rest = buffered.split(b"\n")
        if final and rest:
            lines.append(rest)
            rest = b""
        pending[stream] = rest
        if on_output is not None:
            for line in lines:
                on_output(stream, line.decode(errors="replace"))

    end: dict[str, object] | None = None
    try:
        async with client.stream(
            "POST",
            envd_url(address, "/process.Process/Start"),
            content=struct.pack(">BI", 0, len(body)) + body,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=10.0),
        ) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                raise EnvdUnreachable(f"starting the command failed: {response.status_code} {text}")
            buffer = b""
            async for chunk in response.aiter_bytes():
                buffer += chunk
                while len(buffer) >= 5:
                    flags, length = struct.unpack(">BI", buffer[:5])
                    if len(buffer) < 5 + length:
                        break
                    frame, buffer = buffer[5 : 5 + length], buffer[5 + length :]
                    message = json.loads(frame or b"{}")
                    if flags & 0x02:
                        if message.get("error"):
                            raise EnvdUnreachable(f"command stream failed: {message['error']}")
                        continue
                    event = message.get("event", {})
                    data = event.get("data")
                    if data:
                        for stream in ("stdout", "stderr"):
                            if data.get(stream):
                                emit(stream, base64.b64decode(data[stream]))
                    if "end" in event:
                        end = event["end"]
    except httpx.HTTPError as exc:
        raise EnvdUnreachable(f"running a command in the guest failed: {exc}") from exc
    emit("stdout", b"", final=True)
    emit("stderr", b"", final=True)
    if end is None:
        raise EnvdUnreachable("the command's output ended without an exit status")
    error = end.get("error")
    return CommandResult(int(str(end.get("exitCode", 0) or 0)), str(error) if error else None)


async def configure(
    client: httpx.AsyncClient,
    address: str,
    *,
    env_vars: Mapping[str, str] | None = None,
    user: str | None = None,
    workdir: str | None = None,
) -> None:
    """Set envd's defaults (environment, user, working directory): what commands of
    sandboxes restored from this guest's snapshot get."""
    body: dict[str, object] = {}
    if env_vars:
        body["envVars"] = dict(env_vars)
    if user:
        body["defaultUser"] = user
    if workdir:
        body["defaultWorkdir"] = workdir
    try:
        response = await client.post(init_url(address), json=body, timeout=30.0)
    except httpx.HTTPError as exc:
        raise EnvdUnreachable(f"envd /init failed: {exc}") from exc
    if not response.is_success:
        raise EnvdUnreachable(f"envd /init answered {response.status_code}: {response.text}")


async def write_file(
    client: httpx.AsyncClient, address: str, source: Path, guest_path: str
) -> None:
    """Upload a host file to ``guest_path`` (as root) through envd's ``/files``."""
    # Build contexts are archives of source files: read whole, not streamed.
    data = await asyncio.to_thread(source.read_bytes)
    try:
        response = await client.post(
            envd_url(address, "/files"),
            params={"path": guest_path, "username": "root"},
            files={"file": (os.path.basename(guest_path), data)},
            timeout=600.0,
        )
    except httpx.HTTPError as exc:
        raise EnvdUnreachable(f"uploading {guest_path} failed: {exc}") from exc
    if not response.is_success:
        raise EnvdUnreachable(
            f"uploading {guest_path} answered {response.status_code}: {response.text}"
        )
