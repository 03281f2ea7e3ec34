"""Fakes for running the orchestrator without root, VMs or network namespaces:
:class:`FakeDriver` (VMMs kept as small record files), :class:`FakeNetwork` (slots only),
:class:`FakeEnvd` (an ``httpx`` transport answering like a guest's envd), a fake
template snapshot on disk, and :class:`Node`, a started :class:`Orchestrator` on a
temporary data directory wired to them.

Disks are real (tiny) images: the orchestrator's storage code creates qcow2 overlays
with ``qemu-img``, which needs no privileges.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import struct
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import httpx
from fastapi import FastAPI

from agentenv.config import Config
from agentenv.network import EgressPolicy, NetworkError, NetworkManager, SandboxNetwork
from agentenv.network.addresses import ENVD_CONTROL_PORT, ENVD_PORT
from agentenv.orchestrator.layout import SandboxDir
from agentenv.orchestrator.orchestrator import Orchestrator
from agentenv.orchestrator.store import Store, TemplateRecord, utcnow
from agentenv.orchestrator.views import SandboxView
from agentenv.snapshots.layout import MachineSnapshot, write_manifest
from agentenv.storage.images import create_overlay
from agentenv.vmm.base import (
    DiskCapture,
    MachineSpec,
    SnapshotFiles,
    SnapshotIncompatible,
    VirtualMachine,
    VMMCommandError,
    VMMDriver,
    VMMExit,
    VMMGone,
    VMMStartError,
    VMRunState,
    VMStats,
)

FAKE_DRIVER = "fake"
# The file in a VM directory that stands for a running VMM process: what a real driver
# finds there (pid file, control socket) to re-adopt the process after a server restart.
VMM_RECORD = "fake-vmm.json"
STATE_FILE = "state.fake"
# The RAM image a save writes with ``FakeDriver.ram_image_in_save``.
RAM_IMAGE_FILE = "memory.fake"
MIB = 1024 * 1024

_pids = itertools.count(40000)


# -- the VMM driver --------------------------------------------------------------------------
class FakeVM(VirtualMachine):
    """A handle on a fake VMM. Its record file in ``workdir`` is the "process": every
    handle (the one ``restore`` returned, those ``attach`` returns later) reads and
    writes it, so a VMM outlives the handle, and the server, like a real one."""

    def __init__(self, driver: FakeDriver, workdir: Path, spec: MachineSpec, pid: int) -> None:
        self.driver = driver
        self.workdir = workdir
        self.spec = spec
        self._pid = pid

    @property
    def record_path(self) -> Path:
        return self.workdir / VMM_RECORD

    def _load(self) -> dict[str, Any] | None:
        try:
            data: dict[str, Any] = json.loads(self.record_path.read_text())
        except (OSError, ValueError):
            return None
        return data if data.get("pid") == self._pid and data.get("alive") else None

    def _alive_record(self) -> dict[str, Any]:
        data = self._load()
        if data is None:
            raise VMMGone(f"fake VMM {self._pid} has exited")
        return data

    def _set(self, **changes: Any) -> None:
        data = self._alive_record()
        data.update(changes)
        _write_json(self.record_path, data)

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def state(self) -> VMRunState:
        data = self._load()
        return VMRunState.STOPPED if data is None else VMRunState(data["state"])

    @property
    def restored_from(self) -> str | None:
        """The state file this VMM was restored from (None: booted)."""
        data = self._load()
        return None if data is None else data.get("restored_from")

    async def pause(self) -> None:
        self.driver.consume("pause")
        self._set(state=VMRunState.PAUSED.value)

    async def resume(self) -> None:
        self.driver.consume("resume")
        self._set(state=VMRunState.RUNNING.value)

    async def save_state(self, dest: Path) -> SnapshotFiles:
        """Like QEMU's: a state file in ``dest``; with shared RAM the memory file is the
        VM's own (not copied), with private RAM the RAM is "in the stream" (or, with the
        driver's ``ram_image_in_save``, as Firecracker's: a RAM image written into
        ``dest``). Leaves the VM paused; on failure nothing in ``dest`` and the VM as it
        was."""
        self._alive_record()
        self.driver.consume("save_state")
        state_file = dest / STATE_FILE
        image = self.driver.ram_image_in_save and not self.spec.memory_shared
        _write_json(
            state_file,
            {"pid": self._pid, "ram_in_stream": not (self.spec.memory_shared or image)},
        )
        memory: Path | None = self.spec.memory_file if self.spec.memory_shared else None
        if image:
            memory = dest / RAM_IMAGE_FILE
            memory.write_bytes(f"RAM of fake VMM {self._pid}".encode())
        self._set(state=VMRunState.PAUSED.value)
        return SnapshotFiles(
            driver=FAKE_DRIVER,
            accel=self.spec.accel,
            state_file=state_file,
            memory_file=memory,
            shape=self.spec.shape(),
            meta={"reports_free_pages": self.spec.report_free_pages},
        )

    async def seal_drive(self, drive_id: str, sealed: Path, new_top: Path) -> None:
        """As QEMU does it: a hard link names the current top ``sealed``, and a new qcow2
        top over it takes the writes."""
        self._alive_record()
        self.driver.consume("seal_drive")
        drive = next((d for d in self.spec.drives if d.drive_id == drive_id), None)
        if drive is None or drive.fmt != "qcow2" or drive.read_only:
            raise VMMCommandError(f"drive {drive_id!r} is not a writable qcow2 drive")
        os.link(drive.path, sealed)
        try:
            await create_overlay(sealed, new_top, "qcow2")
        except BaseException:
            sealed.unlink(missing_ok=True)
            new_top.unlink(missing_ok=True)
            raise
        drives = tuple(
            replace(d, path=new_top) if d.drive_id == drive_id else d for d in self.spec.drives
        )
        self.spec = replace(self.spec, drives=drives)
        self._set(spec=self.spec.to_dict())

    async def stop(self, timeout: float = 5.0) -> None:
        await self.kill()

    async def kill(self) -> None:
        self.driver.consume("kill")
        if self._load() is not None:
            self.record_path.unlink(missing_ok=True)
            self.driver.exited(self._pid, -9)
        self.driver.killed.append(self.workdir)

    async def stats(self) -> VMStats:
        return VMStats(self._pid, self.state, 0, 0, 0.0)

    async def wait_exit(self) -> VMMExit:
        returncode = await self.driver.exit_of(self._pid)
        return VMMExit(self._pid, returncode, "fake console: the guest was here")

    async def close(self) -> None:
        pass


class FakeDriver(VMMDriver):
    """A :class:`VMMDriver` whose VMMs are record files in their VM directories (see
    :class:`FakeVM`). ``fail_next(method, error)`` makes the next call of ``method``
    (``boot``, ``restore``, ``attach``, or a VM's ``save_state``, ``seal_drive``,
    ``pause``, ``resume``, ``kill``) raise ``error``; :meth:`die` makes a VMM exit
    unseen (as while no server runs), :meth:`crash` makes it exit under the eyes of
    this driver's handles (as a real VMM's pidfd reports it)."""

    name = FAKE_DRIVER
    disk_formats: tuple[str, ...] = ("raw", "qcow2")
    shared_memory_boot = True
    accelerators: tuple[Literal["tcg", "kvm"], ...] = ("tcg", "kvm")
    disk_capture = DiskCapture.SEAL
    publishes_paused_state = True
    # Whether a save of a machine with private RAM writes a RAM image (Firecracker's
    # way) rather than streaming RAM into the state file (QEMU's).
    ram_image_in_save = False

    def __init__(self) -> None:
        self._failures: dict[str, list[BaseException]] = defaultdict(list)
        self.calls: list[tuple[str, Path]] = []
        self.killed: list[Path] = []
        # The exit status of each fake VMM process, set when it exits.
        self._exits: dict[int, asyncio.Future[int]] = {}

    def fail_next(self, method: str, error: BaseException) -> None:
        self._failures[method].append(error)

    def consume(self, method: str) -> None:
        """Raise the failure queued for ``method``, if any."""
        queued = self._failures.get(method)
        if queued:
            raise queued.pop(0)

    @staticmethod
    def die(vm_dir: Path) -> None:
        """The VMM whose files are in ``vm_dir`` exits (crashes)."""
        (vm_dir / VMM_RECORD).unlink(missing_ok=True)

    def crash(self, vm_dir: Path, returncode: int = -9) -> None:
        """The VMM whose files are in ``vm_dir`` exits (by default, killed by SIGKILL)
        and the handles on it notice, as a real VMM's pidfd tells them."""
        data = json.loads((vm_dir / VMM_RECORD).read_text())
        self.die(vm_dir)
        self.exited(int(data["pid"]), returncode)

    def exited(self, pid: int, returncode: int) -> None:
        future = self._exit_future(pid)
        if not future.done():
            future.set_result(returncode)

    async def exit_of(self, pid: int) -> int:
        return await asyncio.shield(self._exit_future(pid))

    def _exit_future(self, pid: int) -> asyncio.Future[int]:
        if pid not in self._exits:
            self._exits[pid] = asyncio.get_running_loop().create_future()
        return self._exits[pid]

    @staticmethod
    def running(vm_dir: Path) -> bool:
        return (vm_dir / VMM_RECORD).exists()

    def _start(self, spec: MachineSpec, workdir: Path, restored_from: Path | None) -> FakeVM:
        workdir.mkdir(parents=True, exist_ok=True)
        for drive in spec.drives:
            if not drive.path.exists():
                raise VMMStartError(f"drive {drive.drive_id}: {drive.path} does not exist")
        if spec.memory_shared and not spec.memory_file.exists():
            # A VMM creates the file backing RAM it maps shared.
            with open(spec.memory_file, "wb") as f:
                f.truncate(4096)
        pid = next(_pids)
        _write_json(
            workdir / VMM_RECORD,
            {
                "pid": pid,
                "alive": True,
                "state": VMRunState.RUNNING.value,
                "spec": spec.to_dict(),
                "restored_from": str(restored_from) if restored_from else None,
            },
        )
        return FakeVM(self, workdir, spec, pid)

    async def boot(self, spec: MachineSpec, workdir: Path) -> VirtualMachine:
        self.calls.append(("boot", workdir))
        self.consume("boot")
        return self._start(spec, workdir, None)

    async def restore(
        self,
        spec: MachineSpec,
        snapshot: SnapshotFiles,
        workdir: Path,
        *,
        resume: bool = True,
    ) -> VirtualMachine:
        self.calls.append(("restore", workdir))
        self.consume("restore")
        snapshot.check_compatible(self.name, spec)
        if not snapshot.state_file.is_file():
            raise VMMStartError(f"state file {snapshot.state_file} does not exist")
        if snapshot.memory_file is not None and not spec.memory_file.exists():
            raise VMMStartError(f"memory file {spec.memory_file} does not exist")
        # As QEMU's balloon: a restore keeps the snapshot's, and one that reports free
        # pages never maps a file privately.
        reports = self.needs_own_memory(snapshot)
        if reports and not spec.memory_shared:
            raise SnapshotIncompatible("a reporting guest cannot map RAM privately")
        spec = replace(spec, report_free_pages=reports)
        vm = self._start(spec, workdir, snapshot.state_file)
        if not resume:
            vm._set(state=VMRunState.PAUSED.value)
        return vm

    def needs_own_memory(self, snapshot: SnapshotFiles) -> bool:
        return bool(snapshot.meta.get("reports_free_pages"))

    async def attach(self, workdir: Path) -> VirtualMachine:
        self.calls.append(("attach", workdir))
        self.consume("attach")
        try:
            data = json.loads((workdir / VMM_RECORD).read_text())
        except (OSError, ValueError) as exc:
            raise VMMGone(f"no fake VMM in {workdir}") from exc
        if not data.get("alive"):
            raise VMMGone(f"the fake VMM in {workdir} has exited")
        return FakeVM(self, workdir, MachineSpec.from_dict(data["spec"]), int(data["pid"]))


class FakeRawDriver(FakeDriver):
    """A :class:`FakeDriver` with Firecracker's capabilities: raw disks only, RAM never in
    a shared file (a save writes a RAM image, a restore maps it privately), a running
    disk captured by copying it (:attr:`DiskCapture.COPY`), nothing of a pause
    published."""

    disk_formats = ("raw",)
    shared_memory_boot = False
    disk_capture = DiskCapture.COPY
    publishes_paused_state = False
    ram_image_in_save = True


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


# -- the network -----------------------------------------------------------------------------
class FakeNetwork(NetworkManager):
    """Slots and addresses as the real manager computes them, without namespaces: the
    slots with a "namespace" are kept in :attr:`live`. ``fail_next("create", error)``
    makes the next create fail."""

    def __init__(self, max_slots: int | None = 64) -> None:
        super().__init__(prefix="fk", subnet="10.251.0.0/16", max_slots=max_slots)
        self.live: set[int] = set()
        self.internet: set[int] = set()
        self.policies: dict[int, EgressPolicy] = {}
        self._failures: dict[str, list[BaseException]] = defaultdict(list)

    def fail_next(self, method: str, error: BaseException) -> None:
        self._failures[method].append(error)

    def _consume(self, method: str) -> None:
        queued = self._failures.get(method)
        if queued:
            raise queued.pop(0)

    async def create(self, slot: int, *, policy: EgressPolicy | None = None) -> SandboxNetwork:
        net = self.describe(slot)
        self._consume("create")
        self.live.add(slot)
        self.policies[slot] = policy or EgressPolicy()
        if self.policies[slot].allow_internet:
            self.internet.add(slot)
        return net

    async def update_policy(self, slot: int, policy: EgressPolicy) -> None:
        self._check_slot(slot)
        self._consume("update_policy")
        if slot not in self.live:
            raise NetworkError(f"slot {slot} has no network")
        self.policies[slot] = policy
        self.internet.discard(slot)
        if policy.allow_internet:
            self.internet.add(slot)

    async def detach(self, slot: int) -> None:
        self._check_slot(slot)
        self._consume("detach")

    async def destroy(self, slot: int) -> None:
        self._check_slot(slot)
        self._consume("destroy")
        self.live.discard(slot)
        self.internet.discard(slot)

    async def reclaim(self, keep: set[int]) -> list[str]:
        gone = sorted(self.live - keep)
        self.live -= set(gone)
        self.internet -= set(gone)
        return [self.describe(slot).netns for slot in gone]


# -- envd ------------------------------------------------------------------------------------
@dataclass
class EnvdRequest:
    address: str
    port: int
    method: str
    path: str
    body: bytes
    headers: dict[str, str]

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class FakeEnvd:
    """Every guest's envd, as an ``httpx`` transport: ``/init`` on the control port,
    ``/health``, ``/metrics`` and ``process.Process/Start`` on the public one. Addresses
    in ``unreachable`` refuse connections; ``init_status`` is what ``/init`` answers."""

    requests: list[EnvdRequest] = field(default_factory=list)
    unreachable: set[str] = field(default_factory=set)
    init_status: int = 204

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self.handle), trust_env=False)

    def inits(self, address: str | None = None) -> list[EnvdRequest]:
        return [r for r in self.requests if r.path == "/init" and address in (None, r.address)]

    def handle(self, request: httpx.Request) -> httpx.Response:
        address, port = request.url.host, request.url.port or 80
        if address in self.unreachable:
            raise httpx.ConnectError("connection refused", request=request)
        self.requests.append(
            EnvdRequest(
                address,
                port,
                request.method,
                request.url.path,
                request.content,
                dict(request.headers),
            )
        )
        path = request.url.path
        if path == "/init" and port == ENVD_CONTROL_PORT and request.method == "POST":
            return httpx.Response(self.init_status)
        if port != ENVD_PORT:
            raise httpx.ConnectError("connection refused", request=request)
        if path == "/health":
            return httpx.Response(204)
        if path == "/metrics":
            return httpx.Response(
                200,
                json={
                    "cpu_count": 1,
                    "mem_total": 512 * MIB,
                    "disk_used": 300 * MIB,
                    "disk_total": 1024 * MIB,
                },
            )
        if path == "/process.Process/Start":
            return httpx.Response(
                200,
                headers={"content-type": "application/connect+json"},
                content=_envelope({"event": {"start": {"pid": 1}}})
                + _envelope({"event": {"end": {"exitCode": 0, "status": "exit status 0"}}})
                + _envelope({}, flags=2),
            )
        return httpx.Response(404)


def _envelope(message: dict[str, Any], flags: int = 0) -> bytes:
    body = json.dumps(message).encode()
    return struct.pack(">BI", flags, len(body)) + body


# -- a template and a started node -----------------------------------------------------------
FAKE_TEMPLATE = "fake"


def make_fake_template(directory: Path, *, accel: str = "tcg") -> MachineSnapshot:
    """A restorable (by :class:`FakeDriver`) template snapshot in ``directory``: small
    boot files, a 1 MiB raw disk, a state file and a RAM file, and its manifest."""
    directory.mkdir(parents=True)
    for name in ("vmlinux", "tools.raw"):
        (directory / name).write_bytes(b"fake " + name.encode())
    with open(directory / "disk.raw", "wb") as f:
        f.truncate(MIB)
    _write_json(directory / STATE_FILE, {"template": True})
    (directory / "memory.raw").write_bytes(b"\0" * 4096)
    shape = {"vcpus": 1, "memory_mib": 128, "drives": ["root", "tools"], "net": True}
    files = SnapshotFiles(
        driver=FAKE_DRIVER,
        accel=accel,
        state_file=directory / STATE_FILE,
        memory_file=directory / "memory.raw",
        shape={**shape, "accel": accel},
    )
    return write_manifest(
        MachineSnapshot(
            directory=directory,
            files=files,
            disk=directory / "disk.raw",
            disk_format="raw",
            kernel=directory / "vmlinux",
            initrd=None,
            tools_drive=directory / "tools.raw",
            cmdline="console=ttyS0",
            vcpus=1,
            memory_mib=128,
            disk_size_mib=1,
            image_digest="sha256:" + "0" * 64,
            envd_version="0.0.0-fake",
        )
    )


@dataclass
class Node:
    """A started orchestrator on a temporary data directory, with its fakes. Make
    another on the same ``home`` (and ``network``, the same host) to simulate a
    server restart."""

    orchestrator: Orchestrator
    config: Config
    driver: FakeDriver
    network: FakeNetwork
    envd: FakeEnvd

    async def stop(self) -> None:
        await self.orchestrator.shutdown()


async def start_node(
    home: Path,
    repository: Path,
    *,
    node_id: str = "node-a",
    driver: FakeDriver | None = None,
    network: FakeNetwork | None = None,
    envd: FakeEnvd | None = None,
    sandbox_memory: Literal["auto", "file", "shared-image"] = "file",
    template: bool = True,
    in_memory_store: bool = False,
    configure: Callable[[Config], Config] = lambda c: c,
    watch_handoffs: bool = True,
    accel: Literal["tcg", "kvm"] = "tcg",
) -> Node:
    """An :class:`Orchestrator` started on data directory ``home`` with the
    ``file://`` repository ``repository`` (shared by nodes given the same one); with
    ``template``, the fake template is registered as :data:`FAKE_TEMPLATE`. The store is
    the data directory's (a restart finds it again) unless ``in_memory_store``. The node
    runs the fake driver under ``accel`` (its mode: ``fake/<accel>``)."""
    config = configure(
        Config(
            home=home,
            image_cache=home / "images",
            repository=repository.resolve().as_uri(),
            node_id=node_id,
            sandbox_memory=sandbox_memory,
            network_linger=0.05,
            template_boot_timeout=2.0,
        )
    )
    driver = driver or FakeDriver()
    network = network or FakeNetwork()
    envd = envd or FakeEnvd()
    orchestrator = Orchestrator(
        config,
        driver,
        accel,
        network=network,
        store=Store(None) if in_memory_store else None,
        http=envd.client(),
        mode_reason=f"accel={accel}: set explicitly",
    )
    await orchestrator.startup(build_base=False, watch_handoffs=watch_handoffs)
    if template and orchestrator.store.get_template(FAKE_TEMPLATE) is None:
        snapshot = make_fake_template(config.templates_dir / FAKE_TEMPLATE / "build-1", accel=accel)
        orchestrator.store.put_template(
            TemplateRecord(
                template_id=FAKE_TEMPLATE,
                build_id="build-1",
                snapshot_dir=snapshot.directory,
                vmm=FAKE_DRIVER,
                accel=accel,
                vcpus=snapshot.vcpus,
                memory_mib=snapshot.memory_mib,
                disk_size_mib=snapshot.disk_size_mib,
                envd_version=snapshot.envd_version,
                created_at=utcnow(),
            )
        )
    return Node(orchestrator, config, driver, network, envd)


def vm_dir(view: SandboxView) -> Path:
    """Where the fake driver keeps the VM of sandbox ``view``."""
    return SandboxDir(view.record.workdir).vm_dir


def in_process_client(app: FastAPI, api_key: str) -> httpx.AsyncClient:
    """An HTTP client of ``app`` served in this process, sending ``api_key``."""
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://api.test",
        headers={"X-API-Key": api_key},
    )
