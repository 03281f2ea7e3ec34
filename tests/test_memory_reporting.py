"""Memory a guest frees comes back to the host.

A sandbox whose RAM is a file of its own runs with virtio-balloon free page reporting:
its guest kernel reports free 2 MiB blocks a couple of seconds after they are freed, and
QEMU punches them out of the RAM file, so they leave the host's page cache (the VMM's
resident set) and the file's disk blocks. Without it they would stay resident, dirty,
until the sandbox ends.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.helpers import ServerProcess, create_sandbox_id, run_command, vmm_pids

pytestmark = pytest.mark.vm

MIB = 1024 * 1024
#: What the guest allocates, writes and frees.
ALLOCATED_MIB = 200
HELD = "/tmp/memory-held"
ALLOCATE = (
    "nohup python3 -c \"import os, time; x = b'x' * (200 << 20); "
    f"open('{HELD}', 'w').write(str(os.getpid())); time.sleep(600)\" >/dev/null 2>&1 &"
    f" while [ ! -s {HELD} ]; do sleep 0.2; done"
)


def _argv(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def _resident_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Rss:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no Rss for {pid}")


def _ram_file(pid: int) -> Path:
    backend = next(arg for arg in _argv(pid) if arg.startswith("memory-backend-file,"))
    options = dict(opt.split("=", 1) for opt in backend.split(",")[1:])
    assert options["share"] == "on", backend  # the sandbox's own file
    return Path(options["mem-path"])


def _allocated_mib(path: Path) -> float:
    return os.stat(path).st_blocks * 512 / MIB


def test_memory_freed_in_the_guest_leaves_the_host(server: ServerProcess) -> None:
    with server.client() as api:
        own_files = api.get("/health").json()["memoryMode"] == "shared"
        sandbox_id = create_sandbox_id(api)
        try:
            (pid,) = vmm_pids(f"/{sandbox_id}/")
            balloon = next(arg for arg in _argv(pid) if arg.startswith("virtio-balloon"))
            if not own_files:
                # A node without reflinks maps the template's RAM privately: QEMU 7.2
                # would punch freed pages out of that shared file, so nothing reports.
                assert balloon == "virtio-balloon-device"
                return
            assert balloon == "virtio-balloon-device,free-page-reporting=on"
            ram = _ram_file(pid)
            result = run_command(server.url, sandbox_id, ALLOCATE, timeout=300)
            assert result.exit_code == 0, result.stderr
            held_rss, held_file = _resident_mib(pid), _allocated_mib(ram)
            result = run_command(server.url, sandbox_id, f"kill $(cat {HELD}); rm {HELD}")
            assert result.exit_code == 0, result.stderr
            # Reported 2 s after the free at the earliest, slower on a busy host.
            deadline = time.monotonic() + 180
            while True:
                rss, allocated = _resident_mib(pid), _allocated_mib(ram)
                returned = min(held_rss - rss, held_file - allocated)
                if returned >= ALLOCATED_MIB / 2 or time.monotonic() > deadline:
                    break
                time.sleep(2)
        finally:
            api.delete(f"/sandboxes/{sandbox_id}")
    assert returned >= ALLOCATED_MIB / 2, (
        f"while held: VMM RSS {held_rss:.0f} MiB, RAM file {held_file:.0f} MiB; "
        f"after the free: {rss:.0f} MiB and {allocated:.0f} MiB"
    )
