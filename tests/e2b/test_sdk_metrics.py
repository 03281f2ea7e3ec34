"""``get_metrics`` through the official SDK: samples every 5 s while the sandbox runs,
kept for its life, and the ``start`` / ``end`` window honoured."""

from __future__ import annotations

import datetime as dt
import itertools
import time

import httpx
import pytest
from e2b import E2B
from e2b.api.client.models.sandboxes_with_metrics import SandboxesWithMetrics

from tests.helpers import ServerProcess

pytestmark = pytest.mark.vm


def test_metrics_window_and_history(e2b: E2B, e2b_server: ServerProcess) -> None:
    created = dt.datetime.now(dt.UTC)
    sbx = e2b.Sandbox.create(timeout=120, metadata={"suite": "e2b-metrics"})
    try:
        # Before the sandbox existed: nothing (it used to answer a sample of now).
        earlier = created - dt.timedelta(hours=1)
        assert sbx.get_metrics(start=earlier, end=earlier + dt.timedelta(minutes=30)) == []

        # Sampled every 5 s: two samples within two intervals, or (a sample missed while
        # the new guest was still busy with its /init on a loaded host) a few more.
        deadline = time.monotonic() + 60
        time.sleep(11)
        history = sbx.get_metrics()
        while len(history) < 2 and time.monotonic() < deadline:
            time.sleep(1)
            history = sbx.get_metrics()
        assert len(history) >= 2, history
        stamps = [m.timestamp for m in history]
        assert stamps == sorted(stamps)
        assert all(created - dt.timedelta(seconds=2) <= t for t in stamps)
        gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(stamps)]
        assert all(gap >= 2 for gap in gaps), gaps  # E2B's 5 s interval, not per request
        sample = history[-1]
        assert sample.cpu_count >= 1 and 0 < sample.mem_used < sample.mem_total
        assert 0 < sample.disk_used < sample.disk_total

        # A window holds what was sampled in it, both ends included (whole seconds).
        first = stamps[0].replace(microsecond=0)
        assert sbx.get_metrics(start=first, end=first) == [history[0]]
        later = sbx.get_metrics(start=stamps[-1].replace(microsecond=0) + dt.timedelta(seconds=1))
        assert all(m.timestamp > stamps[-1] for m in later)
        assert sbx.get_metrics(start=created + dt.timedelta(hours=1)) == []

        # The bulk route (in the SDK's API client): each sandbox's latest sample.
        bulk = httpx.get(
            f"{e2b_server.url}/sandboxes/metrics",
            params={"sandbox_ids": f"{sbx.sandbox_id},inosuchsandbox"},
            headers={"X-API-Key": e2b_server.api_key},
            trust_env=False,
        )
        assert bulk.status_code == 200, bulk.text
        latest = SandboxesWithMetrics.from_dict(bulk.json()).sandboxes
        assert set(latest) == {sbx.sandbox_id}
        assert latest[sbx.sandbox_id]["timestampUnix"] >= int(stamps[-1].timestamp())
    finally:
        sbx.kill()


def test_metrics_follow_the_guests_load(e2b: E2B) -> None:
    """Between envd's own samples (every minute) the node measures: the VMM's CPU time and
    the guest kernel's balloon report. They must follow what the guest does."""
    sbx = e2b.Sandbox.create(timeout=120, metadata={"suite": "e2b-metrics-load"})
    try:
        meminfo = sbx.commands.run("cat /proc/meminfo").stdout
        mem_total = int(meminfo.split("MemTotal:")[1].split()[0]) * 1024
        time.sleep(11)
        idle = sbx.get_metrics()[-1]
        assert idle.mem_total == mem_total
        assert idle.cpu_used_pct < 10, idle
        # One vCPU kept busy, and 200 MiB written and held, for 30 s.
        loaded_at = dt.datetime.now(dt.UTC)
        sbx.commands.run("timeout 30 sh -c 'while :; do :; done'", background=True)
        sbx.commands.run(
            "python3 -c 'import time; held = b\"x\" * (200 << 20); time.sleep(30)'",
            background=True,
        )
        time.sleep(14)
        loaded = [m for m in sbx.get_metrics() if m.timestamp > loaded_at + dt.timedelta(seconds=4)]
        assert loaded, "no sample while the guest was loaded"
        # Half the 2 vCPUs at most; the node's other work may take some of that core.
        assert max(m.cpu_used_pct for m in loaded) > 15, loaded
        assert max(m.mem_used for m in loaded) - idle.mem_used > 150 * 1024 * 1024, loaded
    finally:
        sbx.kill()
