"""Templates: snapshots of a booted guest that every sandbox is restored from.

The built-in templates are made on each node by cold-booting a root filesystem once,
waiting until envd answers, and saving the machine: ``base`` from the guest image's, and
``code-interpreter-v1`` (built on first use) from the code-interpreter root filesystem
(``agentenv/guest/interpreter.py``), whose interpreter server is started and waited for
until its default Python kernel is warm before the save. A build is identified by the
inputs that shape the snapshot (image digest, driver, accelerator, machine size, kernel
command line, root filesystem), so a new guest image or machine size produces a new build
and old sandboxes keep their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx

from agentenv.config import Config
from agentenv.envd.version import ENVD_VERSION
from agentenv.guest import GuestImage, kernel_cmdline, load_guest_image
from agentenv.guest.interpreter import APP_DIR, InterpreterRootfs, ensure_interpreter_rootfs
from agentenv.network import NetworkManager, SandboxNetwork
from agentenv.network.addresses import GUEST_MAC, TAP_NAME
from agentenv.orchestrator import envd_client
from agentenv.orchestrator.errors import TemplateNotFound, TemplateUnavailable
from agentenv.orchestrator.machines import VOLUME_SLOTS, empty_volume_slots
from agentenv.orchestrator.store import Store, TemplateRecord, utcnow
from agentenv.snapshots.layout import MachineSnapshot, SnapshotError, commit, discard, staging_dir
from agentenv.storage.clone import flush_file
from agentenv.storage.images import make_read_only, virtual_size, writable_disk
from agentenv.vmm.base import (
    DriveSpec,
    MachineSpec,
    NetSpec,
    VirtualMachine,
    VMMDriver,
    VMRunState,
)

log = logging.getLogger("agentenv.templates")

BASE_TEMPLATE = "base"
# The template the e2b-code-interpreter SDK starts by default.
CODE_INTERPRETER_TEMPLATE = "code-interpreter-v1"
BUILTIN_TEMPLATES = (BASE_TEMPLATE, CODE_INTERPRETER_TEMPLATE)
# A Python kernel with numpy, pandas and matplotlib loaded takes ~150 MiB; a sandbox has
# room for the server, the default kernel and a few more contexts.
CODE_INTERPRETER_MIN_MEMORY_MIB = 1024
CODE_INTERPRETER_PORT = 49999
CODE_INTERPRETER_READY_TIMEOUT_S = 900.0
# Runs as the guest's `user`, like E2B's code interpreter; output kept for diagnosis.
CODE_INTERPRETER_START = (
    f"cd /home/user && PYTHONPATH={APP_DIR} AENV_INTERPRETER_HOME={APP_DIR} "
    "nohup python3 -m agentenv.interpreter --home /home/user "
    ">/tmp/.aenv-interpreter.log 2>&1 </dev/null &"
)


@dataclass(frozen=True)
class _Machine:
    """What a template boot may change from the node's defaults: the root filesystem
    (the guest image's), the machine size (the config's), and a server to start and wait
    for (on ``ready_port``'s ``/health``) before the save."""

    rootfs: Path | None = None
    vcpus: int | None = None
    memory_mib: int | None = None
    start: str | None = None
    ready_port: int | None = None


@dataclass(frozen=True)
class Template:
    record: TemplateRecord
    snapshot: MachineSnapshot


class TemplateManager:
    """Builds and loads template snapshots. Only the orchestrator calls it."""

    def __init__(
        self,
        config: Config,
        store: Store,
        driver: VMMDriver,
        accel: Literal["tcg", "kvm"],
        network: NetworkManager,
        reserve_slot: Callable[[], int],
        release_slot: Callable[[int], None],
        http: httpx.AsyncClient,
    ) -> None:
        self.config = config
        self.store = store
        self.driver = driver
        self.accel = accel
        self.network = network
        self._reserve_slot = reserve_slot
        self._release_slot = release_slot
        self._http = http
        self._builds: dict[str, asyncio.Task[Template]] = {}
        self._images: dict[str, asyncio.Task[MachineSnapshot]] = {}
        self._interpreter_rootfs: dict[str, InterpreterRootfs] = {}
        self.last_error: str | None = None
        #: Whether templates' guests give freed pages back: only where every sandbox
        #: restores them with RAM of its own (set by the orchestrator at startup), since
        #: the guest's freed pages are punched out of whatever file its RAM maps.
        self.report_free_pages = False

    # -- lookup ----------------------------------------------------------------------
    async def get(self, template_id: str) -> Template:
        """The ready template ``template_id``; waits for a built-in one being built."""
        if template_id == BASE_TEMPLATE:
            return await self.ensure_base()
        if template_id == CODE_INTERPRETER_TEMPLATE:
            return await self.ensure_code_interpreter()
        record = self.store.get_template(template_id)
        if record is None:
            raise TemplateNotFound(template_id)
        return self._load(record)

    def _load(self, record: TemplateRecord) -> Template:
        try:
            return Template(record, MachineSnapshot.load(record.snapshot_dir))
        except SnapshotError as exc:
            raise TemplateUnavailable(str(exc)) from exc

    def building(self) -> bool:
        return any(not t.done() for t in self._builds.values())

    # -- base ------------------------------------------------------------------------
    def base_build_id(self, image: GuestImage) -> str:
        inputs = {
            "image": image.digest,
            "driver": self.driver.name,
            "accel": self.accel,
            "vcpus": self.config.vcpus,
            "memory_mib": self.config.memory_mib,
            "cmdline": kernel_cmdline(),
        }
        return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]

    async def ensure_base(self) -> Template:
        """The current ``base`` build, building it if needed. Concurrent callers share
        one build; a failed build is retried by the next caller."""
        try:
            image = load_guest_image(self.config.image_cache)
        except Exception as exc:
            raise TemplateUnavailable(f"guest image not available: {exc}") from exc
        return await self._ensure_builtin(BASE_TEMPLATE, self.base_build_id(image), image, None)

    async def ensure_code_interpreter(self) -> Template:
        """The current ``code-interpreter-v1`` build, building it (and its root
        filesystem, cached in the image cache) if needed."""
        try:
            image = load_guest_image(self.config.image_cache)
            # Looked up once per guest image: the look-up takes the image cache's build
            # lock, which a guest image build holds for minutes.
            rootfs = self._interpreter_rootfs.get(image.digest)
            if rootfs is None:
                rootfs = await ensure_interpreter_rootfs(
                    self.config.image_cache, image, lambda line: log.info("%s", line)
                )
                self._interpreter_rootfs[image.digest] = rootfs
        except Exception as exc:
            raise TemplateUnavailable(f"code-interpreter root filesystem: {exc}") from exc
        machine = _Machine(
            rootfs=rootfs.path,
            memory_mib=max(self.config.memory_mib, CODE_INTERPRETER_MIN_MEMORY_MIB),
            start=CODE_INTERPRETER_START,
            ready_port=CODE_INTERPRETER_PORT,
        )
        inputs = {
            "base": self.base_build_id(image),
            "rootfs": rootfs.key,
            "memory": machine.memory_mib,
        }
        build_id = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
        return await self._ensure_builtin(CODE_INTERPRETER_TEMPLATE, build_id, image, machine)

    async def _ensure_builtin(
        self, template_id: str, build_id: str, image: GuestImage, machine: _Machine | None
    ) -> Template:
        record = self.store.get_template(template_id)
        if record is not None and record.build_id == build_id:
            return self._load(record)
        task = self._builds.get(build_id)
        if task is None or (task.done() and task.exception() is not None):
            task = asyncio.get_running_loop().create_task(
                self._build_builtin(template_id, image, build_id, machine)
            )
            self._builds[build_id] = task
        # shield: a caller that gives up must not cancel a build others wait for.
        return await asyncio.shield(task)

    async def _build_builtin(
        self, template_id: str, image: GuestImage, build_id: str, machine: _Machine | None
    ) -> Template:
        final = self.config.templates_dir / template_id / build_id
        if final.exists():
            try:
                snapshot = MachineSnapshot.load(final)
                return self._register(template_id, build_id, snapshot)
            except SnapshotError:
                log.warning("discarding unreadable template build %s", final)
                discard(final)
        log.info("building template %s (build %s): cold boot", template_id, build_id)
        started = asyncio.get_running_loop().time()
        try:
            snapshot = await self._boot_with_retries(image, final, machine)
        except Exception as exc:
            self.last_error = str(exc)
            log.error("template build failed: %s", exc)
            if isinstance(exc, TemplateUnavailable):
                raise
            raise TemplateUnavailable(f"template build failed: {exc}") from exc
        self.last_error = None
        elapsed = asyncio.get_running_loop().time() - started
        log.info("template %s ready in %.1fs", template_id, elapsed)
        return self._register(template_id, build_id, snapshot)

    def _register(self, template_id: str, build_id: str, snapshot: MachineSnapshot) -> Template:
        record = TemplateRecord(
            template_id=template_id,
            build_id=build_id,
            snapshot_dir=snapshot.directory,
            vmm=snapshot.files.driver,
            accel=snapshot.files.accel,
            vcpus=snapshot.vcpus,
            memory_mib=snapshot.memory_mib,
            disk_size_mib=snapshot.disk_size_mib,
            envd_version=snapshot.envd_version,
            created_at=utcnow(),
        )
        self.store.put_template(record)
        return Template(record, snapshot)

    # -- machines booted from other root filesystems (OCI images) ---------------------
    async def image_machine(
        self, key: str, rootfs: Path, vcpus: int, memory_mib: int
    ) -> MachineSnapshot:
        """A snapshot of the guest booted from ``rootfs`` (an unpacked OCI image) with
        this node's kernel and tools drive, envd answering: what template builds from an
        image start from. Kept per image and machine size, built once; concurrent
        callers share the build."""
        image = load_guest_image(self.config.image_cache)
        inputs = {
            "rootfs": key,
            "base": self.base_build_id(image),
            "vcpus": vcpus,
            "mem": memory_mib,
        }
        build_id = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
        final = self.config.templates_dir / "images" / build_id
        if final.exists():
            try:
                return MachineSnapshot.load(final)
            except SnapshotError:
                discard(final)
        task = self._images.get(build_id)
        if task is None or (task.done() and task.exception() is not None):
            final.parent.mkdir(parents=True, exist_ok=True)
            task = asyncio.get_running_loop().create_task(
                self._boot_with_retries(image, final, _Machine(rootfs, vcpus, memory_mib))
            )
            self._images[build_id] = task
        return await asyncio.shield(task)

    async def _boot_with_retries(
        self, image: GuestImage, final: Path, machine: _Machine | None = None
    ) -> MachineSnapshot:
        """Cold boots under TCG occasionally hang in the kernel on a loaded host (seen here
        about once in dozens of boots); a fresh attempt then boots normally."""
        attempts = self.config.template_boot_attempts
        for attempt in range(1, attempts + 1):
            try:
                return await self._boot_and_snapshot(image, final, machine or _Machine())
            except GuestBootTimeout as exc:
                if attempt == attempts:
                    raise
                log.warning(
                    "template boot attempt %d/%d failed (%s); retrying",
                    attempt,
                    attempts,
                    exc.summary,
                )
        raise AssertionError("unreachable")

    async def _boot_and_snapshot(
        self, image: GuestImage, final: Path, machine: _Machine
    ) -> MachineSnapshot:
        staging = staging_dir(final)
        slot = self._reserve_slot()
        vm: VirtualMachine | None = None
        net: SandboxNetwork | None = None
        try:
            disk, disk_format = await writable_disk(
                machine.rootfs or image.rootfs, "raw", staging / "disk", self.driver.disk_formats
            )
            net = await self.network.create(slot)
            slot_dir = staging / "volume-slots"
            slot_dir.mkdir()
            spec = MachineSpec(
                vcpus=machine.vcpus or self.config.vcpus,
                memory_mib=machine.memory_mib or self.config.memory_mib,
                kernel=image.kernel,
                initrd=image.initrd,
                cmdline=kernel_cmdline(),
                drives=(
                    DriveSpec("root", disk, fmt=disk_format),
                    DriveSpec("tools", image.tools, read_only=True),
                    *empty_volume_slots(slot_dir, VOLUME_SLOTS),
                ),
                memory_file=staging / "memory.raw",
                memory_shared=self.driver.shared_memory_boot,
                report_free_pages=self.driver.shared_memory_boot and self.report_free_pages,
                accel=self.accel,
                net=NetSpec(tap=TAP_NAME, mac=GUEST_MAC, netns=net.netns),
            )
            boot_dir = staging / "boot"
            boot_dir.mkdir()
            vm = await self.driver.boot(spec, boot_dir)
            booted = vm

            def alive() -> bool:
                return booted.state != VMRunState.STOPPED

            try:
                await envd_client.wait_healthy(
                    self._http,
                    net.guest_address,
                    self.config.template_boot_timeout,
                    alive=alive,
                )
            except envd_client.EnvdUnreachable as exc:
                # Kept outside the staging directory, which is discarded, for diagnosis.
                kept = final.parent / f"failed-boot-{int(time.time())}-console.log"
                with contextlib.suppress(OSError):
                    shutil.copy(boot_dir / "console.log", kept)
                raise GuestBootTimeout(
                    str(exc), f"{exc}; console kept in {kept}; tail:\n{_tail(kept)}"
                ) from exc
            await envd_client.warm_up(self._http, net.guest_address)
            if machine.start is not None:
                await self._start_server(net.guest_address, machine, alive)
            files = await vm.save_state(staging)
            await vm.kill()
            vm = None
            shutil.rmtree(slot_dir, ignore_errors=True)
            disk_size = await virtual_size(disk)
            make_read_only(disk, *([files.memory_file] if files.memory_file else []))
            if files.memory_file is not None:
                # Written back now, so that cloning it for each sandbox (a reflink must
                # write back dirty pages first) is instant from the first sandbox on.
                await asyncio.to_thread(flush_file, files.memory_file)
            snapshot = MachineSnapshot(
                directory=staging,
                files=files,
                disk=disk,
                disk_format=disk_format,
                kernel=image.kernel,
                initrd=image.initrd,
                tools_drive=image.tools,
                cmdline=spec.cmdline,
                vcpus=spec.vcpus,
                memory_mib=spec.memory_mib,
                disk_size_mib=disk_size // (1024 * 1024),
                image_digest=image.digest,
                envd_version=ENVD_VERSION,
            )
            shutil.copy(boot_dir / "console.log", staging / "boot-console.log")
            shutil.rmtree(boot_dir, ignore_errors=True)
            return commit(staging, final, snapshot)
        except BaseException:
            if vm is not None:
                await vm.kill()
            discard(staging)
            raise
        finally:
            if net is not None:
                await self.network.destroy(slot)
            self._release_slot(slot)

    async def _start_server(
        self, address: str, machine: _Machine, alive: Callable[[], bool]
    ) -> None:
        """Start the template's server in the guest and wait until it answers
        ``/health`` (which it does only once warm)."""
        assert machine.start is not None and machine.ready_port is not None
        started = await envd_client.execute(self._http, address, machine.start, user="user")
        if started.exit_code != 0:
            raise TemplateUnavailable(f"the template's server did not start: {started.error}")
        url = f"http://{address}:{machine.ready_port}/health"
        began = time.monotonic()
        deadline = began + CODE_INTERPRETER_READY_TIMEOUT_S
        last = "no answer"
        while time.monotonic() < deadline:
            if not alive():
                raise TemplateUnavailable("the VM exited while its server was starting")
            try:
                response = await self._http.get(url, timeout=5.0)
                if response.is_success:
                    log.info(
                        "server on :%d ready after %.1fs",
                        machine.ready_port,
                        time.monotonic() - began,
                    )
                    return
                last = f"HTTP {response.status_code}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(1.0)
        lines: list[str] = []
        await envd_client.execute(
            self._http,
            address,
            "tail -n 30 /tmp/.aenv-interpreter.log",
            user="root",
            on_output=lambda _stream, line: lines.append(line),
        )
        raise TemplateUnavailable(
            f"the template's server on :{machine.ready_port} was not ready after "
            f"{CODE_INTERPRETER_READY_TIMEOUT_S:.0f}s ({last}); its log:\n" + "\n".join(lines)
        )

    def cleanup_staging(self) -> None:
        """Remove half-built templates a crashed server left behind."""
        if not self.config.templates_dir.exists():
            return
        for path in self.config.templates_dir.glob("*/.staging-*"):
            log.info("removing leftover template staging dir %s", path)
            discard(path)


class GuestBootTimeout(TemplateUnavailable):
    """The template's guest did not bring envd up in time."""

    def __init__(self, summary: str, detail: str) -> None:
        super().__init__(detail)
        self.summary = summary


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no console log)"
