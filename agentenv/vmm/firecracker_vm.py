"""A handle on one Firecracker process: its API calls (pause, resume, snapshots, stats),
its record in the work directory, and the files it writes there.

Owns what happens to a process that runs; starting one (boot, restore, the jail's
layout) and finding one again after a server restart are :mod:`agentenv.vmm.firecracker`'s.
Snapshots after the first are diff snapshots where they can be
(:mod:`agentenv.vmm.firecracker_memory`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from agentenv.vmm import firecracker_jail as jail_paths
from agentenv.vmm.base import (
    MachineSpec,
    SnapshotFiles,
    VirtualMachine,
    VMMCommandError,
    VMMError,
    VMMExit,
    VMMGone,
    VMMStartError,
    VMMUnresponsive,
    VMRunState,
    VMStats,
    process_cpu_seconds,
    process_memory,
)
from agentenv.vmm.console import bound_console
from agentenv.vmm.firecracker_api import API_TIMEOUT_S, FirecrackerAPI
from agentenv.vmm.firecracker_jail import FirecrackerJail, FirecrackerJailError
from agentenv.vmm.firecracker_memory import DiffBase, keep_diff_base, seed_diff_target
from agentenv.vmm.process import VMMProcess

log = logging.getLogger("agentenv.vmm")

#: The driver's name, recorded in the snapshots its machines write.
DRIVER_NAME = "firecracker"
# The work directory's files.
API_SOCKET = "fc.sock"
LOG_FILE = "fc.log"
STDERR_FILE = "fc.stderr"
CONSOLE_FILE = "console.log"
VM_RECORD = "vm.json"
STATE_FILE = "state.fc"
MEMORY_FILE = "memory.fc"
# The machine's reflink of the RAM image its dirty pages count from (firecracker_memory).
DIFF_BASE_FILE = "memory-base.fc"

START_TIMEOUT_S = 10.0
# Writing or mapping the RAM image scales with guest memory and disk speed.
SNAPSHOT_TIMEOUT_S = 600.0

_FIRECRACKER_STATES = {"Running": VMRunState.RUNNING, "Paused": VMRunState.PAUSED}


# --- Plain helpers (blocking file work kept out of coroutines) --------------------------


def _tail(path: Path, limit: int = 2000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-limit:].decode("utf-8", "replace").strip()


def _log_tail(workdir: Path) -> str:
    parts = [
        f"{name}: {text}" for name in (STDERR_FILE, LOG_FILE) if (text := _tail(workdir / name))
    ]
    return "\n".join(parts) or "(no log output)"


def _exit_log_tail(workdir: Path) -> str:
    """What an unexpected exit logs: the VMM's own output and the guest console's end."""
    console = _tail(workdir / CONSOLE_FILE, 1200)
    return _log_tail(workdir) + (f"\n{CONSOLE_FILE}: {console}" if console else "")


def _read_stats(pid: int) -> tuple[int, int, float]:
    """RSS, PSS (bytes) and CPU seconds of ``pid``."""
    try:
        rss, pss = process_memory(pid)
        return rss, pss, process_cpu_seconds(pid)
    except OSError as exc:
        raise VMMGone(f"firecracker pid {pid} is gone") from exc


def _make_dir(path: Path) -> Path:
    path = path.resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def _remove(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


def read_record(workdir: Path) -> tuple[Path, dict[str, Any]]:
    """``workdir`` made absolute, and the record :meth:`FirecrackerVM.write_record` left."""
    workdir = workdir.resolve()
    try:
        record: dict[str, Any] = json.loads((workdir / VM_RECORD).read_text())
        int(record["pid"]), str(record["api_socket"]), dict(record["shape"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise VMMGone(f"no Firecracker process recorded in {workdir}: {exc}") from exc
    return workdir, record


# --- Machine handle -----------------------------------------------------------------------


class FirecrackerVM(VirtualMachine):
    """A handle on one Firecracker process, started by this server or adopted."""

    def __init__(
        self,
        *,
        workdir: Path,
        spec: MachineSpec,
        process: VMMProcess,
        api: FirecrackerAPI,
        shape: dict[str, Any],
        tap: str | None,
        state: VMRunState,
        jail: FirecrackerJail | None = None,
        console_limit: int | None = None,
        diff_base: DiffBase | None = None,
    ) -> None:
        self.workdir = workdir
        # The orchestrator reads every VM's spec (VirtualMachine.spec), e.g. to flush
        # shared RAM files; Firecracker's RAM is never a shared file, but the spec must
        # be there, also on a handle adopted after a server restart.
        self.spec = spec
        self._process = process
        self._api = api
        self._shape = shape
        self._tap = tap
        self._state = state
        self._jail = jail
        # The RAM image the guest's dirty pages are counted from (firecracker_memory).
        self._diff_base = diff_base
        # After close() the process is no longer watched; this handle must not touch it.
        self._closed = False
        self._console_task: asyncio.Task[None] | None = None
        if console_limit is not None:
            self._console_task = asyncio.get_running_loop().create_task(
                bound_console((workdir / CONSOLE_FILE,), console_limit)
            )

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def state(self) -> VMRunState:
        # A closed handle keeps its last known state: the process is no longer watched.
        if not self._closed and not self._process.alive():
            self._state = VMRunState.STOPPED
        return self._state

    async def call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        read_timeout: float = API_TIMEOUT_S,
    ) -> dict[str, Any]:
        """One API request; a dead process is reported as :class:`VMMGone`."""
        if self._closed:
            raise VMMGone(f"handle on firecracker pid {self.pid} was closed")
        if not self._process.alive():
            raise VMMGone(f"firecracker pid {self.pid} has exited\n{_log_tail(self.workdir)}")
        try:
            return await self._api.request(method, path, body, read_timeout=read_timeout)
        except httpx.TransportError as exc:
            # Give the exit notification a moment to arrive before judging.
            if await self._process.wait(0.05):
                raise VMMGone(
                    f"firecracker pid {self.pid} exited during {method} {path}\n"
                    f"{_log_tail(self.workdir)}"
                ) from exc
            if isinstance(exc, httpx.TimeoutException):
                raise VMMUnresponsive(f"{method} {path}: no answer in time ({exc!r})") from exc
            raise VMMCommandError(f"{method} {path}: {exc!r}") from exc

    async def describe(self) -> dict[str, Any]:
        """Firecracker's instance info: ``id``, ``state``, ``vmm_version``."""
        return await self.call("GET", "/")

    async def pause(self) -> None:
        await self.call("PATCH", "/vm", {"state": "Paused"})
        self._state = VMRunState.PAUSED

    async def resume(self) -> None:
        await self.call("PATCH", "/vm", {"state": "Resumed"})
        self._state = VMRunState.RUNNING

    async def save_state(self, dest: Path) -> SnapshotFiles:
        dest = _make_dir(dest)
        was_running = self.state is VMRunState.RUNNING
        if was_running:
            await self.pause()
        token = uuid.uuid4().hex[:8]
        tmp_state = dest / f".{STATE_FILE}.{token}.tmp"
        tmp_memory = dest / f".{MEMORY_FILE}.{token}.tmp"
        state_file, memory_file = dest / STATE_FILE, dest / MEMORY_FILE
        # Where Firecracker writes them: in its chroot when jailed, moved out afterwards.
        written = {tmp_state: str(tmp_state), tmp_memory: str(tmp_memory)}
        if self._jail is not None:
            out = jail_paths.SNAPSHOT_OUT_IN_JAIL
            written = {tmp: f"{out}/{tmp.name}" for tmp in written}
        produced = [self._jail.host(inside) for inside in written.values()] if self._jail else []
        leftovers = [tmp_state, tmp_memory, *produced]
        base, self._diff_base = self._diff_base, None  # until this snapshot has succeeded
        try:
            version = (await self.call("GET", "/version")).get("firecracker_version", "")
            memory_target = produced[1] if self._jail else tmp_memory
            kind = "Diff" if await self._seed_diff(base, memory_target) else "Full"
            await self.call(
                "PUT",
                "/snapshot/create",
                {
                    "snapshot_type": kind,
                    "snapshot_path": written[tmp_state],
                    "mem_file_path": written[tmp_memory],
                },
                read_timeout=SNAPSHOT_TIMEOUT_S,
            )
            if self._jail is not None:
                for tmp, made in zip(written, produced, strict=True):
                    await asyncio.to_thread(self._jail.export, made, tmp)
            os.replace(tmp_memory, memory_file)
            # From here an older state file next to the new RAM image would be a mismatch.
            leftovers += [memory_file, state_file]
            os.replace(tmp_state, state_file)
            await self.track_dirty_pages_from(memory_file)
        except BaseException as exc:
            _remove(leftovers)
            self._record_quietly()
            if was_running and self._process.alive():
                with contextlib.suppress(VMMError):
                    await self.resume()
            if isinstance(exc, FirecrackerJailError):
                raise VMMCommandError(f"snapshot/create: {exc}") from exc
            raise
        self._record_quietly()
        return SnapshotFiles(
            driver=DRIVER_NAME,
            accel="kvm",
            state_file=state_file,
            memory_file=memory_file,
            shape=dict(self._shape),
            meta={"firecracker_version": version, "tap": self._tap},
        )

    async def _seed_diff(self, base: DiffBase | None, target: Path) -> bool:
        """Whether a diff snapshot can be written to ``target``: ``base`` is still the
        image the dirty pages are counted from, and ``target`` was made a reflink of it."""
        if base is None or not base.usable(self.spec.memory_mib << 20):
            return False
        owner = self._jail.owner(self.spec) if self._jail is not None else None
        try:
            return await asyncio.to_thread(seed_diff_target, base, target, owner)
        except OSError as exc:
            log.warning("full snapshot instead of a diff over %s: %s", base.path, exc)
            return False

    def _record_quietly(self) -> None:
        """:meth:`write_record` where a failure must not fail the caller (the record
        only speeds up a later snapshot of a re-adopted process)."""
        try:
            self.write_record()
        except OSError as exc:
            log.warning("firecracker record in %s not updated: %s", self.workdir, exc)

    async def stop(self, timeout: float = 5.0) -> None:
        """Send Ctrl+Alt+Del (Firecracker exits when the guest then resets through the
        i8042), and SIGKILL after ``timeout``. A guest without an i8042 driver, or a
        paused one, ignores the request, so this can end in the kill."""
        if self.state is VMRunState.RUNNING:
            with contextlib.suppress(VMMError):
                await self.call("PUT", "/actions", {"action_type": "SendCtrlAltDel"})
            await self._process.wait(timeout)
        await self.kill()

    async def kill(self) -> None:
        if self._closed:
            return
        await self._process.kill()
        self._state = VMRunState.STOPPED
        self._stop_console()
        await self._api.aclose()
        _remove([self.workdir / API_SOCKET, self.workdir / VM_RECORD])
        if self._jail is not None:
            # The chroot, its socket link and the cgroup go with the process.
            await asyncio.to_thread(self._jail.cleanup)

    def _stop_console(self) -> None:
        if self._console_task is not None:
            self._console_task.cancel()
            self._console_task = None

    async def stats(self) -> VMStats:
        state = self.state
        if state is VMRunState.STOPPED:
            raise VMMGone(f"firecracker pid {self.pid} has exited")
        rss, pss, cpu_seconds = _read_stats(self.pid)
        return VMStats(
            pid=self.pid, state=state, rss_bytes=rss, pss_bytes=pss, cpu_seconds=cpu_seconds
        )

    async def wait_exit(self) -> VMMExit:
        returncode = await self._process.exited()
        tail = await asyncio.to_thread(_exit_log_tail, self.workdir)
        return VMMExit(self.pid, returncode, tail)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._stop_console()
            self._process.detach()
            await self._api.aclose()

    def write_record(self) -> None:
        """Record what :meth:`FirecrackerDriver.attach` needs to find this process."""
        record = {
            "pid": self.pid,
            "spec": self.spec.to_dict(),
            "api_socket": str(self._api.socket_path),
            "shape": self._shape,
            "tap": self._tap,
            # What the process's command line holds (checked on attach: pids are reused).
            "cmdline": self._jail.markers() if self._jail else [str(self._api.socket_path)],
            "jailed": self._jail is not None,
            "diff_base": self._diff_base.to_dict() if self._diff_base else None,
        }
        tmp = self.workdir / f".{VM_RECORD}.tmp"
        tmp.write_text(json.dumps(record, indent=2, sort_keys=True))
        os.replace(tmp, self.workdir / VM_RECORD)

    # -- what the driver does while it starts or finds the process ---------------------

    @property
    def jailed(self) -> bool:
        return self._jail is not None

    async def wait_for_api(self) -> None:
        """Return once the process's API answers; :class:`VMMStartError` if it exits or
        does not answer within ``START_TIMEOUT_S``."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            # Connecting before the socket exists just fails fast, so no separate check.
            try:
                await self._api.request("GET", "/", read_timeout=1.0)
                return
            except (httpx.TransportError, VMMCommandError):
                pass
            if not self._process.alive():
                raise VMMStartError(f"firecracker exited while starting\n{_log_tail(self.workdir)}")
            if time.monotonic() > deadline:
                raise VMMStartError(
                    f"firecracker API did not come up within {START_TIMEOUT_S:.0f}s\n"
                    f"{_log_tail(self.workdir)}"
                )
            if await self._process.wait(0.005):
                raise VMMStartError(f"firecracker exited while starting\n{_log_tail(self.workdir)}")

    def started(self, state: VMRunState) -> None:
        """The guest was started or loaded into ``state``; recorded for re-adoption."""
        self._state = state
        self.write_record()

    async def track_dirty_pages_from(self, image: Path) -> None:
        """``image`` is the RAM image the guest's dirty pages now count from (the one
        it was loaded from, or its latest snapshot's): the next snapshot is a diff over
        the machine's own reflink of it, where the filesystem can make one."""
        try:
            self._diff_base = await asyncio.to_thread(
                keep_diff_base, image, self.workdir / DIFF_BASE_FILE
            )
        except OSError as exc:
            log.warning("the next snapshot in %s is a full one: %s", self.workdir, exc)
            self._diff_base = None

    async def take_reported_state(self) -> None:
        """Adopt the run state the process reports (a machine found after a restart)."""
        info = await self.describe()
        self._state = _FIRECRACKER_STATES.get(info.get("state", ""), VMRunState.STARTING)
