"""An idle sandbox leaves the node alone: its VMM sleeps until the guest has work.

Every wakeup of an idle guest runs guest code (at TCG speed here) and the VMM's main loop
on the node's CPU, so idle sandboxes cost CPU in proportion to their wakeups. Counted as
voluntary context switches of the VMM's threads (each one a sleep that ended), which the
host's load does not inflate the way it inflates CPU time.
"""

from __future__ import annotations

import time

import pytest

from agentenv.vmm.base import thread_wakeups
from tests.helpers import ServerProcess, create_sandbox_id, vmm_pids

pytestmark = pytest.mark.vm

#: Wakeups a second of one idle sandbox's VMM, all threads. Measured: about 250 with
#: uvicorn's 10 Hz tick in envd, kcompactd's proactive compaction and QEMU's PIT; 25-35
#: without them on a loaded host, with tini's one-second loop as PID 1; 10-27 with
#: catatonit instead (the remainder is the guest kernel's own housekeeping).
IDLE_WAKEUPS_PER_S = 50
WINDOW_S = 10.0


def test_idle_sandbox_vmm_sleeps(server: ServerProcess) -> None:
    with server.client() as api:
        sandbox_id = create_sandbox_id(api)
        try:
            (pid,) = vmm_pids(f"/{sandbox_id}/")
            time.sleep(3)  # the create's own traffic settles
            before = thread_wakeups(pid)
            started = time.monotonic()
            time.sleep(WINDOW_S)
            after = thread_wakeups(pid)
            elapsed = time.monotonic() - started
        finally:
            api.delete(f"/sandboxes/{sandbox_id}")
    per_thread = {tid: (after[tid] - before.get(tid, 0)) / elapsed for tid in after}
    total = sum(per_thread.values())
    busiest = sorted(per_thread.values(), reverse=True)[:4]
    assert total < IDLE_WAKEUPS_PER_S, (
        f"idle VMM woke {total:.0f} times a second (busiest threads: {busiest})"
    )
