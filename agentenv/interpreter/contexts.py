"""Execution contexts: where code runs and keeps its state between calls.

A Python context is one ipykernel process, driven over ZeroMQ by jupyter_client: its
messages (stream, execute_input, execute_result, display_data, error) map one to one onto
the SDK's lines. A bash context is one long-lived ``bash`` reading commands on its stdin;
each call's end is found by a random marker printed after it. One call runs at a time in a
context (later calls wait their turn); a context whose process died answers the call with
an error and is started afresh on the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import shlex
import signal
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from jupyter_client.manager import AsyncKernelManager
from tornado.web import HTTPError

from agentenv.interpreter import wire

Emit = Callable[[bytes], Awaitable[None]]
# How often a call waiting for kernel output checks that the kernel is still alive.
LIVENESS_POLL_S = 1.0
KERNEL_START_TIMEOUT_S = 600.0


class ContextError(HTTPError):
    """A context could not be started or used; the API answers ``status`` with the
    message as its body."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(status)
        self.message = message

    def __str__(self) -> str:
        return self.message


class Context(Protocol):
    id: str
    language: str
    cwd: str

    async def start(self) -> None: ...
    async def execute(
        self, code: str, envs: dict[str, str], emit: Emit, gone: Callable[[], bool]
    ) -> None: ...
    async def interrupt(self, owner: object | None = None) -> None: ...
    def owner(self) -> object | None: ...
    async def restart(self) -> None: ...
    async def shutdown(self) -> None: ...


def kernel_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment code runs with: the server's, less what only the server needs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AENV_INTERPRETER_")}
    if env.get("PYTHONPATH") == os.environ.get("AENV_INTERPRETER_HOME"):
        env.pop("PYTHONPATH", None)
    env.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    env.update(extra or {})
    return env


class PythonContext:
    language = "python"

    def __init__(
        self,
        context_id: str,
        cwd: str,
        warm_modules: tuple[str, ...] = (),
        fresh: Callable[[], Awaitable[PythonContext]] | None = None,
    ) -> None:
        self.id = context_id
        self.cwd = cwd
        self.warm_modules = warm_modules
        # Where a restart takes its new kernel from (a pool's warm spare) instead of
        # starting one, which takes tens of seconds under emulation.
        self.fresh = fresh
        self._lock = asyncio.Lock()
        self._owner: object | None = None
        self._km: AsyncKernelManager | None = None
        self._kc: Any = None

    async def start(self) -> None:
        km = AsyncKernelManager(kernel_name="python3")
        try:
            await km.start_kernel(cwd=self.cwd, env=kernel_env())
            kc = km.client()
            kc.start_channels()
            await kc.wait_for_ready(timeout=KERNEL_START_TIMEOUT_S)
        except Exception as exc:
            with contextlib.suppress(Exception):
                await km.shutdown_kernel(now=True)
            raise ContextError(f"the Python kernel did not start: {exc}") from exc
        self._km, self._kc = km, kc
        if self.warm_modules:
            # Imported where user code will import them again, without naming them in
            # its namespace: the first `import pandas` is then a dictionary look-up.
            names = json.dumps(list(self.warm_modules))
            await self._silent(f"import importlib as _m\nfor _n in {names}: _m.import_module(_n)\n")
            await self._silent("del _m, _n\n")

    async def _alive(self) -> bool:
        return self._km is not None and bool(await self._km.is_alive())

    async def _silent(self, code: str) -> None:
        """Run ``code`` without output, history or execution count."""
        await self._run(code, silent=True, on_msg=None)

    async def _run(
        self, code: str, *, silent: bool, on_msg: Callable[[dict[str, Any]], Awaitable[None]] | None
    ) -> bool:
        """Run ``code`` and feed its messages to ``on_msg`` until the kernel is idle
        again; False if the kernel died meanwhile."""
        kc = self._kc
        msg_id = kc.execute(code, silent=silent, store_history=not silent, allow_stdin=False)
        while True:
            try:
                msg = await kc.get_iopub_msg(timeout=LIVENESS_POLL_S)
            except queue.Empty:
                if not await self._alive():
                    return False
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "status" and msg["content"].get("execution_state") == "idle":
                return True
            if on_msg is not None:
                await on_msg(msg)

    async def execute(
        self, code: str, envs: dict[str, str], emit: Emit, gone: Callable[[], bool]
    ) -> None:
        async with self._lock:
            if gone():
                return
            if not await self._alive():
                await self._restart_locked()
            owner = object()
            self._owner = owner
            try:
                if envs:
                    await self._silent(_set_envs(envs))
                alive = await self._run(code, silent=False, on_msg=lambda m: _relay(m, emit))
                if not alive:
                    await emit(
                        wire.error(
                            "KernelDied",
                            "the Python kernel exited while running the code; "
                            "the context restarts on the next call, without its state",
                            "",
                        )
                    )
                elif envs:
                    await self._silent(_restore_envs())
            finally:
                self._owner = None

    async def interrupt(self, owner: object | None = None) -> None:
        if self._km is not None and (owner is None or owner is self._owner):
            with contextlib.suppress(Exception):
                await self._km.interrupt_kernel()

    def owner(self) -> object | None:
        return self._owner

    async def restart(self) -> None:
        await self.interrupt()
        async with self._lock:
            await self._restart_locked()

    async def _restart_locked(self) -> None:
        await self.shutdown()
        if self.fresh is None:
            await self.start()
        else:
            self.adopt(await self.fresh())
            await self.chdir(self.cwd)

    def adopt(self, other: PythonContext) -> None:
        """Take over ``other``'s running kernel (``other`` is left without one)."""
        self._km, self._kc = other._km, other._kc
        other._km = other._kc = None

    async def chdir(self, cwd: str) -> None:
        await self._silent(f"import os as _o\n_o.chdir({cwd!r})\ndel _o\n")
        self.cwd = cwd

    async def shutdown(self) -> None:
        km, kc = self._km, self._kc
        self._km = self._kc = None
        if kc is not None:
            kc.stop_channels()
        if km is not None:
            with contextlib.suppress(Exception):
                await km.shutdown_kernel(now=True)


async def _relay(msg: dict[str, Any], emit: Emit) -> None:
    kind, content = msg["msg_type"], msg["content"]
    if kind == "stream":
        await emit(
            wire.stream("stderr" if content.get("name") == "stderr" else "stdout", content["text"])
        )
    elif kind == "execute_input":
        await emit(wire.execution_count(content["execution_count"]))
    elif kind == "execute_result":
        await emit(wire.result(content["data"], is_main_result=True))
    elif kind in ("display_data", "update_display_data"):
        await emit(wire.result(content["data"], is_main_result=False))
    elif kind == "error":
        await emit(wire.error(content["ename"], content["evalue"], "\n".join(content["traceback"])))


def _set_envs(envs: dict[str, str]) -> str:
    return (
        "import os as _aenv_os\n"
        f"_aenv_envs = {json.dumps(envs)}\n"
        "_aenv_saved = {_k: _aenv_os.environ.get(_k) for _k in _aenv_envs}\n"
        "_aenv_os.environ.update(_aenv_envs)\n"
        "del _aenv_envs, _k\n"
    )


def _restore_envs() -> str:
    return (
        "for _k, _v in _aenv_saved.items():\n"
        "    if _v is None:\n"
        "        _aenv_os.environ.pop(_k, None)\n"
        "    else:\n"
        "        _aenv_os.environ[_k] = _v\n"
        "del _aenv_saved, _aenv_os, _k, _v\n"
    )


class BashContext:
    """``bash`` kept running between calls, so variables, functions and the working
    directory carry over. Interrupting a call ends the shell (bash exits on SIGINT when
    not interactive): the context starts afresh on its next call."""

    language = "bash"

    def __init__(self, context_id: str, cwd: str) -> None:
        self.id = context_id
        self.cwd = cwd
        self._lock = asyncio.Lock()
        self._owner: object | None = None
        self._proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        try:
            self._proc = await asyncio.create_subprocess_exec(
                "bash",
                "--noprofile",
                "--norc",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=self.cwd,
                env=kernel_env(),
                start_new_session=True,
            )
        except OSError as exc:
            raise ContextError(f"bash did not start: {exc}") from exc

    async def execute(
        self, code: str, envs: dict[str, str], emit: Emit, gone: Callable[[], bool]
    ) -> None:
        async with self._lock:
            if gone():
                return
            if self._proc is None or self._proc.returncode is not None:
                await self.start()
            proc = self._proc
            assert proc is not None and proc.stdin and proc.stdout and proc.stderr
            owner = object()
            self._owner = owner
            marker = f"__aenv_end_{uuid.uuid4().hex}"
            fd, script = tempfile.mkstemp(prefix=".aenv-cell-", suffix=".sh")
            with os.fdopen(fd, "w") as f:
                f.write(code + "\n")
            prologue, epilogue = _bash_envs(envs)
            commands = (
                f"{prologue}. {shlex.quote(script)}\n__aenv_rc=$?\nrm -f {shlex.quote(script)}\n"
                f"{epilogue}printf '%s %d\\n' {marker} $__aenv_rc\n"
                f"printf '%s\\n' {marker} >&2\n"
            )
            proc.stdin.write(commands.encode())
            try:
                await proc.stdin.drain()
                out, err = await asyncio.gather(
                    _pump(proc.stdout, marker, "stdout", emit),
                    _pump(proc.stderr, marker, "stderr", emit),
                )
            except (BrokenPipeError, ConnectionResetError):
                out = err = None
            finally:
                self._owner = None
            if out is None or err is None:
                await emit(
                    wire.error(
                        "ShellExited",
                        "bash exited while running the code; "
                        "the context restarts on the next call, without its state",
                        "",
                    )
                )
                self._proc = None
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            elif out != 0:
                await emit(wire.error("ExitCodeError", f"exit status {out}", ""))

    async def interrupt(self, owner: object | None = None) -> None:
        proc = self._proc
        if proc is not None and proc.returncode is None and (owner is None or owner is self._owner):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)

    def owner(self) -> object | None:
        return self._owner

    async def restart(self) -> None:
        await self.shutdown()
        async with self._lock:
            await self.start()

    async def shutdown(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()


def _bash_envs(envs: dict[str, str]) -> tuple[str, str]:
    """Shell lines exporting ``envs`` for one call, and lines putting back what was there."""
    before, after = [], []
    for index, (key, value) in enumerate(envs.items()):
        if not key.isidentifier():
            continue
        saved = f"__aenv_saved_{index}"
        before.append(f'if [ -n "${{{key}+x}}" ]; then {saved}=${key}; else unset {saved}; fi')
        before.append(f"export {key}={shlex.quote(value)}")
        after.append(
            f'if [ -n "${{{saved}+x}}" ]; then {key}=${saved}; unset {saved}; else unset {key}; fi'
        )
    return "".join(line + "\n" for line in before), "".join(line + "\n" for line in after)


async def _pump(reader: asyncio.StreamReader, marker: str, name: str, emit: Emit) -> int | None:
    """Relay one of bash's streams until the call's marker; the exit status printed after
    the marker on stdout (0 for stderr), or None if the stream ended first."""
    while True:
        raw = await reader.readline()
        if not raw:
            return None
        text = raw.decode(errors="replace")
        at = text.find(marker)
        if at < 0:
            await emit(wire.stream(name, text))
            continue
        if at > 0:
            await emit(wire.stream(name, text[:at]))
        rest = text[at + len(marker) :].strip()
        return int(rest) if rest.lstrip("-").isdigit() else 0
