"""Guest RAM in the host's page cache: a restored sandbox caches what its guest touches,
and the first sandbox of a template records its working set for the next to read ahead
(that the read-ahead happens is tested on the driver, test_vmm_qemu.py).

QEMU's own MADV_HUGEPAGE on its RAM file made each first touch read 2 MiB around it: a
sandbox that answered a command held about 140 MiB of its RAM file in the page cache.
The RAM advice library QEMU runs with turns that advice into MADV_RANDOM, and the node
records and reads ahead each snapshot's working set (agentenv/vmm/working_set.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from agentenv.vmm.working_set import PAGE, WorkingSets, resident_extents
from tests.helpers import ServerProcess, create_sandbox, run_command, vmm_pids

pytestmark = pytest.mark.vm

MIB = 1024 * 1024
#: Above what a sandbox that ran a command caches of its RAM file now (about 30 MiB)
#: and well below what it cached with QEMU's huge-page advice (138-144 MiB).
CACHED_LIMIT_MIB = 96


def _ram_file(pid: int) -> Path:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    backend = next(arg for arg in argv if arg.startswith("memory-backend-file,"))
    options = dict(opt.split("=", 1) for opt in backend.split(",")[1:])
    return Path(options["mem-path"])


def _pages(extents: list[tuple[int, int]]) -> set[int]:
    return {page for first, count in extents for page in range(first, first + count)}


def _template_record(server: ServerProcess) -> set[int] | None:
    """The recorded working set of the ``base`` template's RAM file, if any yet."""
    sets = WorkingSets(server.home / "working-sets")
    for memory in server.home.glob("templates/base/*/memory.raw"):
        key = sets.key(memory)
        if key is not None and sets.has(key):
            text = (sets.directory / key).read_text()
            return _pages([(int(a), int(b)) for a, b in json.loads(text)["extents"]])
    return None


def test_a_sandbox_caches_what_its_guest_touches_and_records_it(
    server: ServerProcess,
) -> None:
    with server.client() as api:
        first = create_sandbox(api)
        sandbox_id = first["sandboxID"]
        try:
            (pid,) = vmm_pids(f"/{sandbox_id}/")
            assert "agentenv-ram-advice.so" in Path(f"/proc/{pid}/maps").read_text()
            result = run_command(
                server.url, sandbox_id, "echo hi", token=first.get("envdAccessToken")
            )
            assert result.stdout.strip() == "hi"
            cached = len(_pages(resident_extents(_ram_file(pid)))) * PAGE / MIB
            assert cached < CACHED_LIMIT_MIB, f"{cached:.0f} MiB of the RAM file cached"
            # The first sandbox of the template records its working set a few seconds
            # after its /init (or an earlier test's sandbox did).
            deadline = time.monotonic() + 120
            while (recorded := _template_record(server)) is None:
                assert time.monotonic() < deadline, "no working set was recorded"
                time.sleep(0.5)
            assert 1 * MIB < len(recorded) * PAGE < CACHED_LIMIT_MIB * MIB
        finally:
            api.delete(f"/sandboxes/{sandbox_id}")
