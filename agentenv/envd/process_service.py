"""``process.Process``: the Connect handlers over the process registry.

Semantics follow E2B's envd (see the protocol reference, section 4.6): Start streams
``start{pid}``, output chunks, then exactly one ``end``; keepalives fill silences; the
``connect-timeout-ms`` deadline is also the process's lifetime; a client disconnect only
ends that client's stream.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf import Oneof

from .gen import process_connect, process_pb
from .processes import (
    Launch,
    ManagedProcess,
    ProcessConfig,
    ProcessExit,
    ProcessGoneError,
    ProcessOutput,
    ProcessRegistry,
    PtySize,
    SpawnError,
    StdinUnavailableError,
    Subscription,
    process_environment,
)
from .state import EnvdState
from .users import (
    BadAuthorizationError,
    OSUser,
    UnknownUserError,
    expand_path,
    lookup_user,
    user_from_authorization,
)

logger = logging.getLogger("agentenv.envd")

#: envd's keepalive interval when the client sends no Keepalive-Ping-Interval.
DEFAULT_KEEPALIVE_S = 90.0
KEEPALIVE_HEADER = "keepalive-ping-interval"

_SIGNALS = {
    process_pb.Signal.SIGKILL: 9,
    process_pb.Signal.SIGTERM: 15,
}

_Ctx = RequestContext[Any, Any]


def request_user(state: EnvdState, ctx: _Ctx) -> OSUser:
    """The OS user a request acts as: its Basic Authorization user, else the default."""
    try:
        name = user_from_authorization(ctx.request_headers.get("authorization"))
        return lookup_user(name if name is not None else state.default_user)
    except (BadAuthorizationError, UnknownUserError) as e:
        raise ConnectError(Code.UNAUTHENTICATED, f"invalid user: {e}") from None


def keepalive_interval(ctx: _Ctx) -> float:
    raw = ctx.request_headers.get(KEEPALIVE_HEADER)
    try:
        seconds = float(raw) if raw else DEFAULT_KEEPALIVE_S
    except ValueError:
        return DEFAULT_KEEPALIVE_S
    return seconds if seconds > 0 else DEFAULT_KEEPALIVE_S


class ProcessService(process_connect.Process):  # type: ignore[misc]
    """Implements every ``process.Process`` RPC."""

    def __init__(self, state: EnvdState, registry: ProcessRegistry) -> None:
        self._state = state
        self._registry = registry

    # -- streams -------------------------------------------------------------------

    async def start(
        self, request: process_pb.StartRequest, ctx: _Ctx
    ) -> AsyncIterator[process_pb.StartResponse]:
        launch = self._launch(request, ctx)
        try:
            process, subscription = await self._registry.start(launch)
        except SpawnError as e:
            raise ConnectError(Code.INTERNAL, str(e)) from None
        try:
            async for event in _follow(process, subscription, keepalive_interval(ctx)):
                yield process_pb.StartResponse(event=event)
        finally:
            subscription.close()  # also when cancelled before the first event

    async def connect(
        self, request: process_pb.ConnectRequest, ctx: _Ctx
    ) -> AsyncIterator[process_pb.ConnectResponse]:
        process = self._find(request.process, running_only=False)
        subscription = process.subscribe()
        try:
            async for event in _follow(process, subscription, keepalive_interval(ctx)):
                yield process_pb.ConnectResponse(event=event)
        finally:
            subscription.close()

    async def stream_input(
        self, request: AsyncIterator[process_pb.StreamInputRequest], ctx: _Ctx
    ) -> process_pb.StreamInputResponse:
        process: ManagedProcess | None = None
        async for message in request:
            match message.event:
                case Oneof(field="start", value=start):
                    process = self._find(start.process)
                case Oneof(field="data", value=data):
                    if process is None:
                        raise ConnectError(
                            Code.FAILED_PRECONDITION, "stream must begin with a start event"
                        )
                    _write_input(process, data.input)
                case _:
                    pass  # keepalive
        return process_pb.StreamInputResponse()

    # -- unary ---------------------------------------------------------------------

    async def list(self, request: process_pb.ListRequest, ctx: _Ctx) -> process_pb.ListResponse:
        return process_pb.ListResponse(
            processes=[
                process_pb.ProcessInfo(config=_config_message(p.config), pid=p.pid, tag=p.tag)
                for p in self._registry.running()
            ]
        )

    async def send_input(
        self, request: process_pb.SendInputRequest, ctx: _Ctx
    ) -> process_pb.SendInputResponse:
        _write_input(self._find(request.process), request.input)
        return process_pb.SendInputResponse()

    async def send_signal(
        self, request: process_pb.SendSignalRequest, ctx: _Ctx
    ) -> process_pb.SendSignalResponse:
        signum = _SIGNALS.get(request.signal)
        if signum is None:
            raise ConnectError(Code.INVALID_ARGUMENT, f"unsupported signal {request.signal!r}")
        process = self._find(request.process)
        try:
            process.send_signal(signum)
        except (ProcessGoneError, ProcessLookupError):
            raise ConnectError(Code.NOT_FOUND, f"process {process.pid} not found") from None
        return process_pb.SendSignalResponse()

    async def close_stdin(
        self, request: process_pb.CloseStdinRequest, ctx: _Ctx
    ) -> process_pb.CloseStdinResponse:
        process = self._find(request.process)
        if process.launch.pty is not None:
            raise ConnectError(Code.FAILED_PRECONDITION, "a PTY's input cannot be closed")
        try:
            process.close_stdin()
        except StdinUnavailableError as e:
            raise ConnectError(Code.FAILED_PRECONDITION, str(e)) from None
        return process_pb.CloseStdinResponse()

    async def update(
        self, request: process_pb.UpdateRequest, ctx: _Ctx
    ) -> process_pb.UpdateResponse:
        process = self._find(request.process)
        if request.pty is None:
            return process_pb.UpdateResponse()
        if process.launch.pty is None:
            raise ConnectError(Code.FAILED_PRECONDITION, f"process {process.pid} has no PTY")
        try:
            process.resize(_pty_size(request.pty))
        except StdinUnavailableError as e:
            raise ConnectError(Code.FAILED_PRECONDITION, str(e)) from None
        return process_pb.UpdateResponse()

    # -- helpers -------------------------------------------------------------------

    def _launch(self, request: process_pb.StartRequest, ctx: _Ctx) -> Launch:
        config = request.process
        if config is None or not config.cmd:
            raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd is required")
        user = request_user(self._state, ctx)
        requested_cwd = config.cwd if config.has_field("cwd") else None
        if requested_cwd:
            cwd = expand_path(requested_cwd, user)
            if not os.path.isdir(cwd):
                raise ConnectError(
                    Code.INVALID_ARGUMENT, f"cwd {cwd!r} does not exist or is not a directory"
                )
        else:
            cwd = self._state.default_cwd(user.home)
            if not os.path.isdir(cwd):
                cwd = "/"  # e.g. nobody's /nonexistent home
        timeout_ms = ctx.timeout_ms
        return Launch(
            config=ProcessConfig(
                cmd=config.cmd,
                args=tuple(config.args),
                envs=dict(config.envs),
                cwd=requested_cwd,
            ),
            user=user,
            cwd=cwd,
            env=process_environment(user, self._state.env_vars, config.envs),
            stdin=request.stdin if request.has_field("stdin") else True,
            tag=request.tag if request.has_field("tag") else None,
            timeout_s=timeout_ms / 1000 if timeout_ms is not None else None,
            pty=_pty_size(request.pty) if request.pty is not None else None,
        )

    def _find(
        self, selector: process_pb.ProcessSelector | None, *, running_only: bool = True
    ) -> ManagedProcess:
        pid: int | None = None
        tag: str | None = None
        match selector.selector if selector is not None else None:
            case Oneof(field="pid", value=value):
                pid = value
            case Oneof(field="tag", value=value):
                tag = value
            case _:
                raise ConnectError(Code.INVALID_ARGUMENT, "a process pid or tag is required")
        if running_only:
            process = self._registry.find_running(pid=pid, tag=tag)
        else:
            process = self._registry.find(pid=pid, tag=tag)
        if process is None:
            what = f"pid {pid}" if pid is not None else f"tag {tag!r}"
            raise ConnectError(Code.NOT_FOUND, f"process with {what} not found")
        return process


async def _follow(
    process: ManagedProcess, subscription: Subscription, keepalive_s: float
) -> AsyncIterator[process_pb.ProcessEvent]:
    """``start``, then the subscription's events (keepalives in silences) up to ``end``.

    The caller closes the subscription; leaving early (client gone, deadline) drops only
    that, never the process.
    """
    yield process_pb.ProcessEvent(
        event=Oneof("start", process_pb.ProcessEvent.StartEvent(pid=process.pid))
    )
    while True:
        event = await subscription.next(keepalive_s)
        if event is None:
            yield process_pb.ProcessEvent(
                event=Oneof("keepalive", process_pb.ProcessEvent.KeepAlive())
            )
        elif isinstance(event, ProcessOutput):
            data = process_pb.ProcessEvent.DataEvent(output=Oneof(event.stream, event.data))
            yield process_pb.ProcessEvent(event=Oneof("data", data))
        else:
            yield process_pb.ProcessEvent(event=Oneof("end", _end_event(event)))
            return


def _end_event(end: ProcessExit) -> process_pb.ProcessEvent.EndEvent:
    return process_pb.ProcessEvent.EndEvent(
        exit_code=end.exit_code, exited=end.exited, status=end.status, error=end.error
    )


def _config_message(config: ProcessConfig) -> process_pb.ProcessConfig:
    return process_pb.ProcessConfig(
        cmd=config.cmd, args=list(config.args), envs=dict(config.envs), cwd=config.cwd
    )


def _pty_size(pty: process_pb.PTY) -> PtySize:
    size = pty.size
    cols = size.cols if size is not None and size.cols else 80
    rows = size.rows if size is not None and size.rows else 24
    return PtySize(cols=cols, rows=rows)


def _write_input(process: ManagedProcess, data: process_pb.ProcessInput | None) -> None:
    match data.input if data is not None else None:
        case Oneof(field="stdin", value=value):
            pass
        case Oneof(field="pty", value=value):
            if process.launch.pty is None:
                raise ConnectError(Code.FAILED_PRECONDITION, f"process {process.pid} has no PTY")
        case _:
            raise ConnectError(Code.INVALID_ARGUMENT, "input is empty")
    try:
        process.write_stdin(value)
    except StdinUnavailableError as e:
        raise ConnectError(Code.FAILED_PRECONDITION, str(e)) from None
