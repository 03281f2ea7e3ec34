"""Template builds (E2B's build API): start a build sandbox from an OCI image or an
existing template, run the build's steps in it through envd, start its start command
and wait for its ready command, then snapshot it as a template committed to the
repository under the build's name, with the build's tags (:mod:`.tags`): a build with
no tag takes the name (the ``default`` tag); one with tags takes only those.

As in E2B, readiness decides, not the start command's lifetime: the start command runs
in the background and the ready command is tried until it succeeds (then the template is
snapshotted with whatever is running) or 10 minutes pass. A start command that ends
with status 0 (``echo ready``) is fine; one that fails before the template is ready (a
non-zero status, a signal) fails the build with its output.

Build records (status and logs) are kept in memory by this node: a build is driven by
the node that received it, and the result, the template, is in the repository.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import shlex
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Literal, Protocol

import httpx

from agentenv.config import Config
from agentenv.orchestrator import envd_client
from agentenv.orchestrator.build_plan import (
    BuildPlan,
    CopyStep,
    EnvStep,
    RunStep,
    UserStep,
    WorkdirStep,
    copy_script,
    describe,
)
from agentenv.orchestrator.catalog import check_user_name
from agentenv.orchestrator.errors import (
    BuildFailed,
    Conflict,
    InvalidRequest,
    OrchestratorError,
    SandboxNotFound,
    TemplateNotFound,
)
from agentenv.orchestrator.readiness import (
    DEFAULT_READY_CMD,
    NotReady,
    StartCommandFailed,
    StartState,
    wait_until_ready,
)
from agentenv.orchestrator.store import utcnow
from agentenv.orchestrator.tags import DEFAULT_TAG, TEMPLATE_NAME_KEY
from agentenv.orchestrator.templates import BASE_TEMPLATE, BUILTIN_TEMPLATES, TemplateManager
from agentenv.orchestrator.upload_check import UploadMismatch, check_upload
from agentenv.orchestrator.views import SandboxView, SnapshotView
from agentenv.snapshots.layout import MachineSnapshot
from agentenv.storage.oci import ImageError, pull_image

log = logging.getLogger("agentenv.builds")

# Where a build's start command writes its output in the guest (read back when it dies).
START_LOG = "/tmp/.agentenv-start.log"
# Where the shell around the start command writes its exit status when it ends.
START_STATUS = "/tmp/.agentenv-start.status"
BUILD_SANDBOX_TIMEOUT_S = 3 * 3600
SDK_DEFAULT_IMAGES = ("e2bdev/base", "e2bdev/base:latest")
# The account E2B's sandboxes run commands as by default.
DEFAULT_USER = "user"
# How long a registered build that was never started keeps its name from another (the
# SDK starts a build right after registering it; a client that died in between must not
# hold the name until the server restarts).
UNSTARTED_BUILD_HOLD = timedelta(minutes=10)


@dataclass
class LogEntry:
    timestamp: datetime
    level: str
    message: str
    step: str | None = None


@dataclass
class Build:
    template_id: str
    build_id: str
    name: str
    cpu_count: int
    memory_mb: int
    # What the build is tagged with once ready ("default": it takes the name).
    tags: list[str] = field(default_factory=lambda: [DEFAULT_TAG])
    status: str = "waiting"  # waiting | building | ready | error
    logs: list[LogEntry] = field(default_factory=list)
    reason: dict[str, Any] | None = None
    created_at: datetime = field(default_factory=utcnow)
    updated_at: datetime = field(default_factory=utcnow)
    task: asyncio.Task[None] | None = None

    def log(self, message: str, level: str = "info", step: str | None = None) -> None:
        self.logs.append(LogEntry(utcnow(), level, message, step))
        self.updated_at = utcnow()


class SandboxHost(Protocol):
    """What builds need of the node: the orchestrator facade, which builds use like
    any other client (they are one), without importing it."""

    config: Config
    http: httpx.AsyncClient
    templates: TemplateManager

    async def create(
        self, template_id: str, *, timeout: int | None = ..., metadata: dict[str, str] | None = ...
    ) -> SandboxView: ...

    async def create_from_machine(
        self, snapshot: MachineSnapshot, template_id: str, *, timeout: int, metadata: dict[str, str]
    ) -> SandboxView: ...

    async def snapshot(
        self,
        sandbox_id: str,
        name: str | None = ...,
        *,
        metadata: dict[str, str] | None = ...,
        kind: Literal["snapshot", "template"] = ...,
        replace_name: bool = ...,
        wait_commit: bool = ...,
        snapshot_id: str | None = ...,
    ) -> SnapshotView: ...

    async def kill(self, sandbox_id: str) -> None: ...

    async def tag_build(self, name: str, tags: list[str], build_id: str) -> None: ...


class BuildManager:
    def __init__(self, orchestrator: SandboxHost) -> None:
        self.orchestrator = orchestrator
        self.config = orchestrator.config
        self._builds: dict[str, Build] = {}

    # -- uploaded COPY sources -----------------------------------------------------------
    @property
    def uploads_dir(self) -> Path:
        return self.config.home / "uploads"

    def upload_path(self, files_hash: str) -> Path:
        if not files_hash or not all(c in "0123456789abcdefABCDEF" for c in files_hash):
            raise InvalidRequest(f"bad files hash {files_hash!r}")
        return self.uploads_dir / files_hash.lower()

    def _verified_marker(self, files_hash: str) -> Path:
        return self.upload_path(files_hash).with_suffix(".verified")

    async def _check_upload(self, step: CopyStep) -> None:
        """Refuse a COPY step whose upload is missing or is not what its hash names (the
        mismatching upload is removed, so the client's next attempt uploads again)."""
        path = self.upload_path(step.files_hash)
        if not path.exists():
            raise InvalidRequest(f"files {step.files_hash} of a COPY step were not uploaded")
        marker = self._verified_marker(step.files_hash)
        if marker.exists():
            return
        try:
            await asyncio.to_thread(check_upload, path, step.files_hash, step.src, step.dest)
        except UploadMismatch as exc:
            path.unlink(missing_ok=True)
            raise InvalidRequest(f"{exc}; upload it again") from None
        marker.touch()

    # -- records -------------------------------------------------------------------------
    def register(
        self,
        name: str,
        cpu_count: int | None,
        memory_mb: int | None,
        tags: list[str] | None = None,
    ) -> Build:
        """A build of template ``name`` to be started, to be tagged ``tags`` (normalized;
        ``default`` when empty) once ready."""
        if not name or len(name) > 128 or any(c.isspace() for c in name) or ":" in name:
            raise InvalidRequest(f"bad template name {name!r}")
        if name in BUILTIN_TEMPLATES:
            raise Conflict(f"the name {name!r} is a built-in template's")
        check_user_name(name)
        cpus = cpu_count or self.config.vcpus
        memory = memory_mb or self.config.memory_mib
        if not 1 <= cpus <= 64 or not 128 <= memory <= 65536:
            raise InvalidRequest("cpuCount must be 1-64 and memoryMB 128-65536")
        self._check_name_free(name)
        template_id = str(uuid.uuid4())
        build = Build(template_id, template_id, name, cpus, memory, tags or [DEFAULT_TAG])
        self._builds[template_id] = build
        return build

    def _check_name_free(self, name: str, starting: Build | None = None) -> None:
        """Refuse a second build of template ``name`` while one runs (or, registered,
        is about to): both would commit under the name, the last one winning."""
        now = utcnow()
        for other in self._builds.values():
            if other is starting or other.name != name:
                continue
            if other.status == "building" or (
                other.status == "waiting"
                and starting is None
                and now - other.created_at < UNSTARTED_BUILD_HOLD
            ):
                raise Conflict(
                    f"template {name!r} is already being built (build {other.build_id}); "
                    "build it again when that build has finished"
                )

    def get(self, template_id: str, build_id: str | None = None) -> Build:
        build = self._builds.get(template_id)
        if build is None or (build_id is not None and build.build_id != build_id):
            raise TemplateNotFound(template_id)
        return build

    def by_name(self) -> dict[str, Build]:
        return {b.name: b for b in self._builds.values()}

    def builds(self) -> list[Build]:
        return list(self._builds.values())

    async def start(self, build: Build, plan: BuildPlan) -> None:
        if build.status != "waiting":
            raise Conflict(f"build {build.build_id} was already started")
        for step in plan.steps:
            if isinstance(step, CopyStep):
                await self._check_upload(step)
        if build.status != "waiting":  # started meanwhile, by a request that did not wait
            raise Conflict(f"build {build.build_id} was already started")
        self._check_name_free(build.name, starting=build)
        build.status = "building"
        build.log(f"build {build.build_id} of template {build.name!r} started")
        build.task = asyncio.get_running_loop().create_task(self._run(build, plan))

    async def shutdown(self) -> None:
        for build in self._builds.values():
            if build.task is not None and not build.task.done():
                build.task.cancel()
                with contextlib.suppress(BaseException):
                    await build.task

    # -- running a build -------------------------------------------------------------------
    async def _run(self, build: Build, plan: BuildPlan) -> None:
        started = time.monotonic()
        view: SandboxView | None = None
        try:
            guest = BuildGuest(self.orchestrator, build)
            view = await self._base(build, plan, guest)
            guest.address = view.guest_address
            await guest.prepare()
            await guest.apply(plan, self.upload_path)
            if plan.start_cmd or plan.ready_cmd:
                await guest.start(plan.start_cmd, plan.ready_cmd)
            await guest.finish()
            build.log("snapshotting the template")
            await self.orchestrator.snapshot(
                view.sandbox_id,
                build.name if DEFAULT_TAG in build.tags else None,
                kind="template",
                replace_name=True,
                wait_commit=True,
                snapshot_id=build.template_id,
                metadata={
                    "templateID": build.template_id,
                    "buildID": build.build_id,
                    "cpuCount": str(build.cpu_count),
                    "memoryMB": str(build.memory_mb),
                    TEMPLATE_NAME_KEY: build.name,
                },
            )
            others = [tag for tag in build.tags if tag != DEFAULT_TAG]
            if others:
                await self.orchestrator.tag_build(build.name, others, build.template_id)
                build.log(f"tagged {', '.join(others)}")
            build.status = "ready"
            build.log(f"template {build.name!r} ready in {time.monotonic() - started:.1f}s")
        except asyncio.CancelledError:
            build.status = "error"
            build.reason = {"message": "the build was cancelled (server shutting down)"}
            raise
        except Exception as exc:
            message = str(exc) if isinstance(exc, OrchestratorError | ImageError) else repr(exc)
            build.status = "error"
            step = exc.step if isinstance(exc, StepFailed) else None
            build.reason = {"message": message, **({"step": step} if step else {})}
            build.log(f"build failed: {message}", level="error", step=step)
            log.warning("build %s of %s failed: %s", build.build_id, build.name, message)
        finally:
            if view is not None:
                with contextlib.suppress(SandboxNotFound):
                    await self.orchestrator.kill(view.sandbox_id)
            build.updated_at = utcnow()

    async def _base(self, build: Build, plan: BuildPlan, guest: BuildGuest) -> SandboxView:
        metadata = {"agentenv.build": build.build_id}
        from_template = plan.from_template
        if plan.from_image in SDK_DEFAULT_IMAGES:
            # What the SDK sends when no base is chosen: E2B's base image, whose
            # counterpart here is the built-in template.
            from_template = BASE_TEMPLATE
        if from_template:
            build.log(f"FROM template {from_template}")
            try:
                return await self.orchestrator.create(
                    from_template, timeout=BUILD_SANDBOX_TIMEOUT_S, metadata=metadata
                )
            except OrchestratorError as exc:
                raise StepFailed("base", f"FROM template {from_template}", str(exc)) from exc
        assert plan.from_image is not None
        build.log(f"FROM {plan.from_image}")
        insecure = [h.strip() for h in self.config.insecure_registries.split(",") if h.strip()]
        try:
            image = await pull_image(
                plan.from_image,
                self.config.oci_cache,
                insecure_registries=insecure,
                log=build.log,
                user_home=self.config.user_home,
            )
        except ImageError as exc:
            raise StepFailed("base", f"FROM {plan.from_image}", str(exc)) from exc
        build.log(f"image {image.digest}: booting it")
        machine = await self.orchestrator.templates.image_machine(
            image.digest, image.rootfs, build.cpu_count, build.memory_mb
        )
        # The image's environment carries over; its USER and WORKDIR give way to E2B's
        # build defaults (BuildGuest.prepare), as in E2B.
        guest.env.update(image.config.env)
        return await self.orchestrator.create_from_machine(
            machine, build.template_id, timeout=BUILD_SANDBOX_TIMEOUT_S, metadata=metadata
        )


class StepFailed(BuildFailed):
    """A build step failed. ``step`` is what E2B's SDK reports it as: the step's number
    (1-based), ``base`` for the FROM, ``finalize`` for the start and ready commands."""

    def __init__(self, step: str, label: str, message: str) -> None:
        super().__init__(f"{label}: {message}")
        self.step = step


class BuildGuest:
    """The build sandbox's guest as the build's steps change it: environment, working
    directory and user carry from step to step, as in a Dockerfile."""

    def __init__(self, orchestrator: SandboxHost, build: Build) -> None:
        self.http = orchestrator.http
        self.build = build
        self.address = ""
        self.env: dict[str, str] = {}
        self.workdir: str | None = None
        self.user = "root"

    async def run(
        self, command: str, *, user: str | None = None, step: str | None = None, quiet: bool = False
    ) -> envd_client.CommandResult:
        def output(stream: str, line: str) -> None:
            if not quiet:
                self.build.log(line, level="error" if stream == "stderr" else "info", step=step)

        return await envd_client.execute(
            self.http,
            self.address,
            command,
            user=user or self.user,
            cwd=self.workdir,
            envs=self.env,
            on_output=output,
        )

    async def check(self, command: str, step: str, label: str, *, user: str | None = None) -> None:
        result = await self.run(command, user=user, step=step)
        if result.exit_code != 0:
            detail = f" ({result.error})" if result.error else ""
            raise StepFailed(step, label, f"exited with code {result.exit_code}{detail}")

    async def prepare(self) -> None:
        """E2B's build defaults: steps run as ``user`` in its home directory (as root
        where the image has no such account)."""
        exists = await self.run(f"id -u {DEFAULT_USER}", user="root", quiet=True)
        if exists.exit_code == 0:
            self.user, self.workdir = DEFAULT_USER, f"/home/{DEFAULT_USER}"

    async def apply(self, plan: BuildPlan, uploads: Callable[[str], Path]) -> None:
        total = len(plan.steps)
        for index, step in enumerate(plan.steps, 1):
            number = str(index)
            self.build.log(f"step {index}/{total}: {describe(step)}", step=number)
            name = f"step {index} ({describe(step)})"
            if isinstance(step, RunStep):
                await self.check(step.command, number, name, user=step.user)
            elif isinstance(step, EnvStep):
                self.env.update(step.values)
            elif isinstance(step, WorkdirStep):
                path = (
                    step.path if step.path.startswith("/") else f"{self.workdir or '/'}/{step.path}"
                )
                q = shlex.quote(path)
                # Created for a non-root build user, it is theirs (E2B builds as "user").
                owner = "" if self.user == "root" else f" && chown {shlex.quote(self.user)} {q}"
                await self.check(
                    f"test -d {q} || {{ mkdir -p {q}{owner}; }}", number, name, user="root"
                )
                self.workdir = path
            elif isinstance(step, UserStep):
                await self._ensure_user(step.user, number, name)
                self.user = step.user
            elif isinstance(step, CopyStep):
                digest = hashlib.sha256(step.files_hash.encode()).hexdigest()[:12]
                archive = f"/tmp/.agentenv-copy-{digest}"
                try:
                    await envd_client.write_file(
                        self.http, self.address, uploads(step.files_hash), archive
                    )
                except envd_client.EnvdUnreachable as exc:
                    raise StepFailed(number, name, str(exc)) from exc
                if step.user is None and self.user != "root":
                    # As E2B does: copied files belong to the build's current user.
                    step = replace(step, user=self.user)
                script = copy_script(step, archive, self.workdir or "/")
                await self.check(script, number, name, user="root")

    async def _ensure_user(self, user: str, step: str, label: str) -> None:
        if user.isdigit() or user == "root":
            return
        q = shlex.quote(user)
        await self.check(
            f"id -u {q} >/dev/null 2>&1 || useradd -m -s /bin/bash {q} 2>/dev/null "
            f"|| adduser -D {q}",
            step,
            label,
            user="root",
        )

    async def start(self, start_cmd: str | None, ready_cmd: str | None) -> None:
        """Run the start command in the background (it keeps running in every sandbox
        made from the template) and wait until the ready command succeeds, as E2B does
        (:mod:`.readiness`): a start command that ends with status 0 is fine, one that
        fails first fails the build."""
        start_state = None
        if start_cmd:
            start_state = await self._launch(start_cmd)
        ready = ready_cmd or (DEFAULT_READY_CMD if start_cmd else "true")
        self.build.log(f"waiting for the ready command: {ready}")

        async def check() -> bool:
            return (await self.run(ready, quiet=True)).exit_code == 0

        try:
            await wait_until_ready(start_state, check)
        except StartCommandFailed as exc:
            tail = await self._start_log_tail()
            raise StepFailed(
                "finalize",
                "start command",
                f"{exc} before the template was ready; its output:\n{tail}",
            ) from None
        except NotReady as exc:
            raise StepFailed("finalize", "ready command", str(exc)) from None
        self.build.log("ready")

    async def _launch(self, start_cmd: str) -> Callable[[], Awaitable[StartState]]:
        """Start ``start_cmd`` in the background: how to ask the guest about it. A shell
        around it writes its exit status where the build reads it."""
        self.build.log(f"start command: {start_cmd}")
        status = START_STATUS
        wrapper = f'bash -l -c "$1"; echo $? >{status}.tmp; mv {status}.tmp {status}'
        launch = (
            f"rm -f {START_STATUS}; nohup sh -c {shlex.quote(wrapper)} sh "
            f"{shlex.quote(start_cmd)} >{START_LOG} 2>&1 </dev/null & echo $!"
        )
        lines: list[str] = []
        result = await envd_client.execute(
            self.http,
            self.address,
            launch,
            user=self.user,
            cwd=self.workdir,
            envs=self.env,
            on_output=lambda _s, line: lines.append(line),
        )
        if result.exit_code != 0 or not lines or not lines[-1].strip().isdigit():
            raise StepFailed(
                "finalize", "start command", f"could not be started: {' '.join(lines)}"
            )
        pid = lines[-1].strip()
        probe = (
            f"if [ -e {START_STATUS} ]; then cat {START_STATUS}; "
            f"elif kill -0 {pid} 2>/dev/null; then echo running; else echo gone; fi"
        )

        async def state() -> StartState:
            out: list[str] = []
            await envd_client.execute(
                self.http,
                self.address,
                probe,
                user="root",
                on_output=lambda _s, line: out.append(line.strip()),
            )
            answer = out[-1] if out else "gone"
            if answer == "running":
                return StartState(running=True)
            return StartState(running=False, exit_code=int(answer) if answer.isdigit() else None)

        return state

    async def _start_log_tail(self) -> str:
        lines: list[str] = []
        await envd_client.execute(
            self.http,
            self.address,
            f"tail -n 20 {START_LOG}",
            user="root",
            on_output=lambda _s, line: lines.append(line),
        )
        return "\n".join(lines)

    async def finish(self) -> None:
        """What sandboxes of the template get by default: the build's environment,
        working directory and user as the last steps left them."""
        try:
            await envd_client.configure(
                self.http, self.address, env_vars=self.env, user=self.user, workdir=self.workdir
            )
        except envd_client.EnvdUnreachable as exc:
            raise BuildFailed(f"configuring the template's defaults failed: {exc}") from exc
