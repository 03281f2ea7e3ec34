"""The HTTP server on port 49999 (tornado, which ipykernel already brings): the routes
the SDK calls, over the contexts of ``contexts.py``.

``POST /execute`` streams NDJSON as the code runs. A client that goes away (the SDK's
``timeout`` expired, or it was cancelled) interrupts the call it was waiting for, and only
that call: a ``keepalive`` line every second makes its absence show up through proxies.
``GET /health`` answers 200 once the default Python context and a spare kernel are warm.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import uuid
from typing import Any

from tornado.iostream import StreamClosedError
from tornado.web import Application, HTTPError, RequestHandler

from agentenv.interpreter import wire
from agentenv.interpreter.contexts import BashContext, Context, ContextError, PythonContext

log = logging.getLogger("agentenv.interpreter")

PORT = 49999
LANGUAGES = ("python", "bash")
# How often a running call writes a line the SDK ignores, so that a client gone away (its
# `timeout` passed) is noticed and the call interrupted even while the code prints nothing.
KEEPALIVE_S = 1.0
# Imported in the default Python context before the template's snapshot, so the first
# call that uses them does not pay for the import (seconds under emulation).
WARM_MODULES = ("numpy", "pandas", "matplotlib", "matplotlib.pyplot")


class Contexts:
    """Every context of this sandbox, and the default one per language."""

    def __init__(self, home: str, warm_modules: tuple[str, ...] = WARM_MODULES) -> None:
        self.home = home
        self.warm_modules = warm_modules
        self.all: dict[str, Context] = {}
        self.defaults: dict[str, str] = {}
        self.ready = asyncio.Event()
        self._creating = asyncio.Lock()
        # One Python kernel started ahead (warm, in the template's snapshot), handed to
        # the next new or restarted Python context; another is then started behind it.
        self._spare: asyncio.Task[PythonContext] | None = None

    async def start(self) -> None:
        await self.default("python")
        self._refill()
        assert self._spare is not None
        await self._spare
        self.ready.set()

    def _refill(self) -> None:
        if self._spare is None or (self._spare.done() and self._spare.exception() is not None):
            self._spare = asyncio.ensure_future(self._new_python())

    async def _new_python(self) -> PythonContext:
        context = PythonContext(str(uuid.uuid4()), self.home, self.warm_modules, self._take)
        await context.start()
        return context

    async def _take(self) -> PythonContext:
        """A started Python context: the spare if there is one."""
        self._refill()
        spare, self._spare = self._spare, None
        assert spare is not None
        try:
            context = await spare
        finally:
            self._refill()
        return context

    async def create(self, language: str, cwd: str | None) -> Context:
        if language not in LANGUAGES:
            raise ContextError(
                f"language {language!r} is not supported here; supported: {', '.join(LANGUAGES)}",
                400,
            )
        cwd = cwd or self.home
        if not os.path.isdir(cwd):
            raise ContextError(f"cwd {cwd!r} is not a directory", 400)
        context: Context
        if language == "python":
            context = await self._take()
            if cwd != context.cwd:
                await context.chdir(cwd)
        else:
            context = BashContext(str(uuid.uuid4()), cwd)
            await context.start()
        self.all[context.id] = context
        return context

    async def default(self, language: str) -> Context:
        async with self._creating:
            context_id = self.defaults.get(language)
            if context_id in self.all:
                return self.all[context_id]
            context = await self.create(language, None)
            self.defaults[language] = context.id
            return context

    def get(self, context_id: str) -> Context:
        context = self.all.get(context_id)
        if context is None:
            raise ContextError(f"context {context_id!r} not found", 404)
        return context

    async def remove(self, context_id: str) -> None:
        context = self.get(context_id)
        del self.all[context_id]
        await context.shutdown()

    async def shutdown(self) -> None:
        if self._spare is not None:
            self._spare.cancel()
            if self._spare.done() and not self._spare.cancelled() and not self._spare.exception():
                await self._spare.result().shutdown()
        for context in list(self.all.values()):
            await context.shutdown()
        self.all.clear()


def describe(context: Context) -> dict[str, str]:
    return {"id": context.id, "language": context.language, "cwd": context.cwd}


class Base(RequestHandler):
    def initialize(self, contexts: Contexts) -> None:
        self.contexts = contexts

    def body(self) -> dict[str, Any]:
        if not self.request.body:
            return {}
        try:
            data = json.loads(self.request.body)
        except ValueError:
            raise HTTPError(400, reason="the body is not JSON") from None
        if not isinstance(data, dict):
            raise HTTPError(400, reason="the body must be a JSON object")
        return data

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        message = str(exc) if isinstance(exc, ContextError) else self._reason
        self.set_header("Content-Type", "text/plain; charset=utf-8")
        self.finish(message)


class Health(Base):
    async def get(self) -> None:
        if not self.contexts.ready.is_set():
            raise HTTPError(503, reason="warming up")
        self.finish("OK")


class ContextList(Base):
    async def get(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps([describe(c) for c in self.contexts.all.values()]))

    async def post(self) -> None:
        body = self.body()
        language = body.get("language") or "python"
        cwd = body.get("cwd")
        if not isinstance(language, str) or not (cwd is None or isinstance(cwd, str)):
            raise HTTPError(400, reason="language and cwd must be strings")
        context = await self.contexts.create(language, cwd)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(describe(context)))


class ContextItem(Base):
    async def delete(self, context_id: str) -> None:
        await self.contexts.remove(context_id)
        self.set_status(204)
        self.finish()


class ContextRestart(Base):
    async def post(self, context_id: str) -> None:
        context = self.contexts.get(context_id)
        await context.restart()
        self.set_status(204)
        self.finish()


class Execute(Base):
    _context: Context | None = None
    _gone = False
    _interrupt: asyncio.Future[None] | None = None

    async def post(self) -> None:
        body = self.body()
        code = body.get("code")
        if not isinstance(code, str):
            raise HTTPError(400, reason="code must be a string")
        context_id, language = body.get("context_id"), body.get("language")
        envs = body.get("env_vars") or {}
        if not isinstance(envs, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in envs.items()
        ):
            raise HTTPError(400, reason="env_vars must map names to strings")
        if context_id and language:
            raise HTTPError(400, reason="give context_id or language, not both")
        if context_id:
            context = self.contexts.get(context_id)
        else:
            context = await self.contexts.default(language or "python")
        self._context = context
        self.set_header("Content-Type", "application/x-ndjson")
        self.set_header("Cache-Control", "no-store")
        beat = asyncio.ensure_future(self._keepalive())
        try:
            await context.execute(code, envs, self.emit, lambda: self._gone)
        finally:
            beat.cancel()
        await self.emit(wire.end())
        if not self._gone:
            self.finish()

    async def _keepalive(self) -> None:
        while not self._gone:
            await asyncio.sleep(KEEPALIVE_S)
            await self.emit(wire.keepalive())

    async def emit(self, data: bytes) -> None:
        if self._gone:
            return
        self.write(data)
        try:
            await self.flush()
        except StreamClosedError:
            self.on_connection_close()

    def on_connection_close(self) -> None:
        if self._gone:
            return
        self._gone = True
        context = self._context
        if context is not None:
            owner = context.owner()
            if owner is not None:
                # Kept until done: the loop holds only weak references to tasks.
                self._interrupt = asyncio.ensure_future(context.interrupt(owner))


def make_app(contexts: Contexts) -> Application:
    args = {"contexts": contexts}
    return Application(
        [
            (r"/health", Health, args),
            (r"/contexts", ContextList, args),
            (r"/contexts/([^/]+)", ContextItem, args),
            (r"/contexts/([^/]+)/restart", ContextRestart, args),
            (r"/execute", Execute, args),
        ]
    )


async def serve(host: str, port: int, home: str) -> None:
    contexts = Contexts(home)
    app = make_app(contexts)
    server = app.listen(port, address=host)
    log.info("listening on %s:%d; starting the default Python context", host, port)
    try:
        await contexts.start()
        log.info("ready")
        await asyncio.Event().wait()
    finally:
        server.stop()
        await contexts.shutdown()
