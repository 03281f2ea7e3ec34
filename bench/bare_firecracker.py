"""The bare Firecracker baseline of ``bench/lifecycle.py``: a Firecracker template
snapshot restored by plain ``firecracker`` processes driven through raw HTTP on their API
socket (no agentenv code on the timed path, as the bare QEMU baseline drives raw QMP).

  bare restore → running   process start → ``PUT /snapshot/load`` (``resume_vm``)
                           answered, the disk's raw clone made on the way (RAM: the
                           template's image, which Firecracker always maps privately)
  bare kill                SIGKILL → reaped
  bare resume → running    the same load from a RAM image of its own (a reflink of the
                           template's) with the disk made beforehand, as a paused
                           sandbox's resume restores its own pause's image
  bare pause               on that process: ``PATCH /vm`` Paused, ``PUT /snapshot/create``
                           (Full: device state and the whole RAM image, as agentenv's
                           Firecracker pause writes), then SIGKILL → reaped
  bare fork → running      N loads at once, each with its own disk clone and network
                           namespace, until all answered

Firecracker runs unconfined with the work directory as its cwd: the snapshot records its
drives as the relative links ``drives/<id>`` (see agentenv.vmm.firecracker), made here
to point at this run's files, and its tap is replaced with ``network_overrides``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from agentenv.network import NetworkManager
from agentenv.network.addresses import TAP_NAME
from agentenv.storage.volumes import make_empty_slot
from agentenv.vmm.firecracker_binary import find_firecracker
from bench.bare_qemu import run_tool, timed_restores

API_SOCKET = "fc.sock"
LOG_FILE = "fc.log"
# The interface id agentenv's driver gives the one NIC (the snapshot records it).
NET_IFACE_ID = "eth0"
API_WAIT_S = 30.0
# Loading or writing a RAM image scales with guest memory; nested, that is slow.
SNAPSHOT_TIMEOUT_S = 600.0


class BareFirecracker:
    """One bare Firecracker process and a client on its API socket."""

    def __init__(self, proc: subprocess.Popen[bytes], workdir: Path) -> None:
        self.proc, self.workdir = proc, workdir
        self.api = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=str(workdir / API_SOCKET)),
            base_url="http://localhost",
            timeout=SNAPSHOT_TIMEOUT_S,
        )

    async def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> None:
        response = await self.api.request(method, path, json=body)
        if response.status_code >= 300:
            raise RuntimeError(
                f"{method} {path}: {response.status_code} {response.text}\n{_log_tail(self)}"
            )

    async def wait_for_api(self) -> None:
        deadline = time.perf_counter() + API_WAIT_S
        while True:
            try:
                await self.api.get("/", timeout=1.0)
                return
            except httpx.TransportError:
                if self.proc.poll() is not None or time.perf_counter() > deadline:
                    raise RuntimeError(
                        f"firecracker API never answered\n{_log_tail(self)}"
                    ) from None
            await asyncio.sleep(0.001)

    async def kill(self) -> float:
        """SIGKILL and reap; seconds that took."""
        k0 = time.perf_counter()
        self.proc.kill()
        self.proc.wait()
        k1 = time.perf_counter()
        await self.api.aclose()
        return k1 - k0


def _log_tail(vm: BareFirecracker) -> str:
    try:
        return (vm.workdir / LOG_FILE).read_text(errors="replace")[-2000:]
    except OSError:
        return "(no log)"


async def _clone(source: Path, dest: Path) -> None:
    await run_tool("cp", "--reflink=auto", "--sparse=always", str(source), str(dest))


def _link_drives(manifest: dict[str, Any], workdir: Path, disk: Path) -> None:
    """``drives/<id>`` in ``workdir`` for every drive the snapshot recorded: the root
    disk's clone, the tools drive and empty volume slots."""
    drives = workdir / "drives"
    drives.mkdir(exist_ok=True)
    targets = {"root": disk, "tools": Path(manifest["tools_drive"])}
    for drive_id in manifest["files"]["shape"]["drives"]:
        target = targets.get(drive_id)
        if target is None:
            target = workdir / f"{drive_id}.empty"
            if not target.exists():
                make_empty_slot(target)
        link = drives / drive_id
        link.unlink(missing_ok=True)
        link.symlink_to(target.resolve())


async def bare_fc_restore(
    binary: Path,
    snapshot_dir: Path,
    workdir: Path,
    netns: str,
    *,
    memory_file: Path | None = None,
    time_disk: bool = True,
) -> tuple[BareFirecracker, float]:
    """A bare Firecracker loaded from ``snapshot_dir`` and resumed, and the seconds from
    start (the disk's clone included unless not ``time_disk``: a resume finds its disk
    there) until the load was answered."""
    manifest = json.loads((snapshot_dir / "snapshot.json").read_text())
    files = manifest["files"]
    if files.get("driver") != "firecracker":
        raise RuntimeError(f"{snapshot_dir} was saved by {files.get('driver')}, not firecracker")
    workdir.mkdir(parents=True, exist_ok=True)
    disk = workdir / "disk.raw"
    memory = memory_file or Path(files["memory_file"])
    if not time_disk:
        await _clone(snapshot_dir / manifest["disk"], disk)
    t0 = time.perf_counter()
    if time_disk:
        await _clone(snapshot_dir / manifest["disk"], disk)
    _link_drives(manifest, workdir, disk)
    (workdir / API_SOCKET).unlink(missing_ok=True)
    argv = [
        "nsenter",
        f"--net=/run/netns/{netns}",
        "--",
        str(binary),
        "--api-sock",
        str(workdir / API_SOCKET),
        "--id",
        f"bare-{workdir.name}",
    ]
    log = os.open(workdir / LOG_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        # Its stdout is the guest console.
        proc = subprocess.Popen(argv, cwd=workdir, stdout=log, stderr=log)
    finally:
        os.close(log)
    vm = BareFirecracker(proc, workdir)
    try:
        await vm.wait_for_api()
        body: dict[str, Any] = {
            "snapshot_path": str(Path(files["state_file"]).resolve()),
            "mem_backend": {"backend_type": "File", "backend_path": str(memory.resolve())},
            "enable_diff_snapshots": False,
            "resume_vm": True,
        }
        if files["shape"].get("net"):
            body["network_overrides"] = [{"iface_id": NET_IFACE_ID, "host_dev_name": TAP_NAME}]
        await vm.call("PUT", "/snapshot/load", body)
        t1 = time.perf_counter()
    except BaseException:
        await vm.kill()
        raise
    return vm, t1 - t0


def _cleanup(workdir: Path) -> None:
    """Everything a bare run left in ``workdir`` (disk, RAM copy, links, socket, log)."""
    for path in list(workdir.rglob("*")):
        if path.is_symlink() or not path.is_dir():
            path.unlink(missing_ok=True)


async def bare_fc_restore_once(
    binary: Path, snapshot_dir: Path, workdir: Path, netns: str
) -> tuple[float, float]:
    vm, running = await bare_fc_restore(binary, snapshot_dir, workdir, netns)
    try:
        killed = await vm.kill()
        if vm.proc.returncode not in (-9, 0):
            raise RuntimeError(f"bare Firecracker failed: {_log_tail(vm)}")
    finally:
        _cleanup(workdir)
    return running, killed


async def bare_fc_pause_once(
    binary: Path, snapshot_dir: Path, workdir: Path, netns: str, settle: float = 0.5
) -> tuple[float, float, int, int]:
    """Load from a RAM image of its own (a reflink of the template's), then pause it as
    agentenv's Firecracker driver does: pause the vCPUs, write a full snapshot (device
    state and RAM image), SIGKILL. Returns the load's seconds, the pause's seconds and
    the sizes of the state file and the RAM image written."""
    manifest = json.loads((snapshot_dir / "snapshot.json").read_text())
    workdir.mkdir(parents=True, exist_ok=True)
    memory = workdir / "own-memory.fc"
    await _clone(Path(manifest["files"]["memory_file"]), memory)
    state_out, memory_out = workdir / "paused-state.fc", workdir / "paused-memory.fc"
    try:
        vm, resumed = await bare_fc_restore(
            binary, snapshot_dir, workdir, netns, memory_file=memory, time_disk=False
        )
        try:
            await asyncio.sleep(settle)
            t0 = time.perf_counter()
            await vm.call("PATCH", "/vm", {"state": "Paused"})
            await vm.call(
                "PUT",
                "/snapshot/create",
                {
                    "snapshot_type": "Full",
                    "snapshot_path": str(state_out),
                    "mem_file_path": str(memory_out),
                },
            )
        finally:
            await vm.kill()
        t1 = time.perf_counter()
        sizes = state_out.stat().st_size, memory_out.stat().st_size
    finally:
        _cleanup(workdir)
    return resumed, t1 - t0, *sizes


async def bare_fc_fork_once(
    binary: Path, snapshot_dir: Path, workdir: Path, netns: list[str], settle: float = 3.0
) -> tuple[float, float]:
    """``len(netns)`` loads started at once (own disk clone, the template's RAM image
    mapped privately, own namespace). Returns the seconds until all were answered and
    their PSS per process (MiB) ``settle`` seconds later."""

    async def kill(vm: BareFirecracker) -> None:
        await vm.kill()

    return await timed_restores(
        lambda d, ns: bare_fc_restore(binary, snapshot_dir, d, ns),
        kill,
        _cleanup,
        workdir,
        netns,
        settle,
        "Firecracker loads",
    )


async def _bench(
    binary: Path, snapshot_dir: Path, workdir: Path, runs: int, fork_runs: int, fork_count: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    results: dict[str, list[float]] = {
        "bare_restore_to_running": [],
        "bare_kill": [],
        "bare_resume_to_running": [],
        "bare_pause": [],
        "bare_fork_to_running": [],
    }
    extra: dict[str, list[float]] = {
        "bare_pause_state_bytes": [],
        "bare_pause_memory_bytes": [],
        "bare_fork_child_pss_mib": [],
    }
    slots = max(1, fork_count)
    network = NetworkManager(prefix="aebase", subnet="10.254.0.0/24")
    try:
        nets = [await network.create(slot) for slot in range(slots)]
        netns = nets[0].netns
        restore_dir = workdir / "restore"
        await bare_fc_restore_once(binary, snapshot_dir, restore_dir, netns)  # warm-up
        for _ in range(runs):
            running, killed = await bare_fc_restore_once(binary, snapshot_dir, restore_dir, netns)
            results["bare_restore_to_running"].append(running)
            results["bare_kill"].append(killed)
        for _ in range(runs):
            resumed, paused, state_size, memory_size = await bare_fc_pause_once(
                binary, snapshot_dir, workdir / "pause", netns
            )
            results["bare_resume_to_running"].append(resumed)
            results["bare_pause"].append(paused)
            extra["bare_pause_state_bytes"].append(state_size)
            extra["bare_pause_memory_bytes"].append(memory_size)
        for _ in range(fork_runs):
            forked, pss = await bare_fc_fork_once(
                binary, snapshot_dir, workdir / "fork", [n.netns for n in nets[:fork_count]]
            )
            results["bare_fork_to_running"].append(forked)
            extra["bare_fork_child_pss_mib"].append(pss)
    finally:
        for slot in range(slots):
            await network.destroy(slot)
    return results, extra


def bench_bare_firecracker(
    snapshot_dir: Path,
    runs: int,
    fork_runs: int = 0,
    fork_count: int = 1,
    workdir: Path | None = None,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """The baselines above for a Firecracker snapshot; ``workdir`` should be on the data
    directory's filesystem (disks and RAM images are reflinked there)."""
    binary = find_firecracker()
    if binary is None:
        raise RuntimeError("no Firecracker binary found (scripts/install-firecracker)")
    with tempfile.TemporaryDirectory(prefix="aenv-bare-fc-", dir=workdir) as tmp:
        return asyncio.run(_bench(binary, snapshot_dir, Path(tmp), runs, fork_runs, fork_count))
