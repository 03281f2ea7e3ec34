"""Sandboxes' resource history, sampled every ``Config.metrics_interval`` seconds (by
default :data:`SAMPLE_INTERVAL_S`, E2B's interval) while a sandbox runs and kept for its
life, so ``GET /sandboxes/{id}/metrics?start=&end=`` answers a time window as E2B's does.

Most samples do not wake a guest program. An envd ``/metrics`` request costs an idle guest
about 20 ms of the node's CPU under TCG (35-40 ms with its TCP connection), which at E2B's
interval was most of what an idle sandbox cost. So envd is asked for a sandbox's first
sample, and afterwards only for its disk figures, which need the guest's filesystem: at
most every :data:`GUEST_SAMPLE_INTERVAL_S`, and only if the guest has written to its drives
since envd's last sample (the VMM counts the writes), or :data:`GUEST_SAMPLE_MAX_AGE_S` has
passed (a guest may keep written data in its page cache for a while before it reaches the
drive). In between, the host measures: CPU use is the VMM's CPU time over the interval, per
vCPU (so it includes what emulating the guest costs: what the sandbox costs the node),
memory is what the guest kernel's balloon driver reports by itself, and disk is carried
from the last envd sample. A VMM without balloon statistics is asked through envd every
time; one that does not count writes, every :data:`GUEST_SAMPLE_INTERVAL_S`.

Nor do the samples of an idle sandbox wake its guest kernel. A balloon report is a
virtio request the guest answers, with the timer ticks around it, and reports every
5 s were a third of an idle sandbox's VMM wakeups (11.5 against 7.1 a second without
samples, one sandbox of each side by side). Memory does not change while the guest does
not run, so when the VMM used less than :data:`IDLE_CPU_SHARE` of a core since the last
sample, the balloon reports only every :data:`IDLE_REPORT_INTERVAL_S`, and the VMM is
asked for the figures once in that time; the samples in between carry them. The first
busy sample sets the interval back, and envd is asked until the guest has reported
again (the VMM asks it at once), so that no sample of a busy guest has its idle figures.

Owns the samples (in memory: a restart of the server starts the history again). Asks
the envd and the VMM of the running sandboxes it is given; changes nothing else.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

import httpx

from agentenv.orchestrator import envd_client
from agentenv.orchestrator.store import SandboxEvent, Store, utcnow
from agentenv.orchestrator.views import SandboxView
from agentenv.vmm.base import GuestMemory, VirtualMachine, VMMError

log = logging.getLogger("agentenv.orchestrator")

#: E2B collects a sandbox's metrics every 5 seconds.
SAMPLE_INTERVAL_S = 5.0
#: A sample not answered by then is skipped (the guest may be pausing).
SAMPLE_TIMEOUT_S = 3.0
#: Samples kept per sandbox: a day at the interval, E2B's longest sandbox life.
MAX_SAMPLES = int(24 * 3600 / SAMPLE_INTERVAL_S)
#: How often envd itself is asked at most (for the disk figures) once the host can measure
#: the rest, if the guest has written to its drives.
GUEST_SAMPLE_INTERVAL_S = 60.0
#: How old envd's disk figures may grow when the guest has written nothing to its drives.
GUEST_SAMPLE_MAX_AGE_S = 600.0
#: A VMM that used less of one core than this since the last sample runs an idle guest
#: (an idle VMM uses 0.1-0.4 % here, its guest's timer ticks emulated under TCG).
IDLE_CPU_SHARE = 0.01
#: How often the balloon of an idle guest reports, and the VMM is asked for its figures.
IDLE_REPORT_INTERVAL_S = 60.0
MIB = 1024 * 1024


@dataclass
class _HostBaseline:
    """What host-side samples of one sandbox's VMM are measured against."""

    vmm_pid: int
    cpu_seconds: float
    at: float  # time.monotonic()
    disk: dict[str, object]  # disk_used and disk_total from envd's last sample
    guest_sampled_at: float  # time.monotonic() of envd's last sample
    disk_writes: int | None  # the VMM's count of the guest's drive writes before it
    disk_checked_at: float  # when the disk figures were last found current
    memory: GuestMemory | None = None  # the balloon's last figures
    memory_at: float = 0.0  # when the VMM was last asked for them
    report_every_s: float = 0.0  # how often the balloon was last asked to report


def _memory_of(figures: dict[str, object]) -> GuestMemory | None:
    """envd's memory figures (used is total less available, as the balloon's)."""
    total, used, cached = (figures.get(key) for key in ("mem_total", "mem_used", "mem_cache"))
    if not isinstance(total, int) or not isinstance(used, int):
        return None
    return GuestMemory(total, total - used, cached if isinstance(cached, int) else 0)


@dataclass(frozen=True)
class GuestSample:
    """envd's ``/metrics`` figures, and when the host took them."""

    at: datetime
    figures: dict[str, object]


class MetricsHistory:
    """Every sandbox's samples, oldest first, until its record is removed."""

    def __init__(
        self,
        store: Store,
        http: httpx.AsyncClient,
        machine_of: Callable[[str], VirtualMachine | None] = lambda _: None,
        interval_s: float = SAMPLE_INTERVAL_S,
        limit: int = MAX_SAMPLES,
    ) -> None:
        self._store = store
        self._http = http
        self._machine_of = machine_of
        self._interval_s = interval_s if interval_s > 0 else SAMPLE_INTERVAL_S
        self._limit = limit
        self._samples: dict[str, deque[GuestSample]] = {}
        self._baselines: dict[str, _HostBaseline] = {}
        store.listen(self._follow)

    def _follow(self, event: SandboxEvent) -> None:
        if event.new is None:
            self._samples.pop(event.sandbox_id, None)
            self._baselines.pop(event.sandbox_id, None)

    def record(self, sandbox_id: str, sample: GuestSample) -> None:
        samples = self._samples.get(sandbox_id)
        if samples is None:
            samples = self._samples[sandbox_id] = deque(maxlen=self._limit)
        samples.append(sample)

    def between(
        self, sandbox_id: str, start: datetime | None, until: datetime | None
    ) -> list[GuestSample]:
        """The samples taken in [start, until) (None: no bound)."""
        return [
            s
            for s in self._samples.get(sandbox_id, ())
            if (start is None or s.at >= start) and (until is None or s.at < until)
        ]

    def latest(self, sandbox_id: str) -> GuestSample | None:
        samples = self._samples.get(sandbox_id)
        return samples[-1] if samples else None

    async def sample(self, running: list[SandboxView]) -> None:
        """One sample of each of the ``running`` sandboxes, all at once. A sandbox whose
        sample takes longer than the interval (its envd or VMM slow to answer) goes
        without this one rather than holding back the next samples of every sandbox."""
        await asyncio.gather(*(self._bounded_sample(view) for view in running))

    async def _bounded_sample(self, view: SandboxView) -> None:
        try:
            await asyncio.wait_for(self._sample(view), self._interval_s)
        except TimeoutError:
            log.debug(
                "no metrics sample of %s: not taken within %s s", view.sandbox_id, self._interval_s
            )

    async def _sample(self, view: SandboxView) -> None:
        vm = self._machine_of(view.sandbox_id)
        figures = await self._host_figures(view, vm) if vm is not None else None
        if figures is None:
            figures = await self._guest_figures(view, vm)
        if figures is not None and self._store.get_sandbox(view.sandbox_id) is not None:
            self.record(view.sandbox_id, GuestSample(utcnow(), figures))  # not removed meanwhile

    async def _guest_figures(
        self, view: SandboxView, vm: VirtualMachine | None
    ) -> dict[str, object] | None:
        """envd's sample, which also starts the host's measurements of the sandbox."""
        # Counted before envd is asked: a write while it answers is seen by the next check.
        writes = await self._disk_writes(view, vm) if vm is not None else None
        try:
            figures = await envd_client.metrics(
                self._http, view.guest_address, view.record.envd_token, timeout=SAMPLE_TIMEOUT_S
            )
        except envd_client.EnvdUnreachable as exc:
            log.debug("no metrics sample of %s: %s", view.sandbox_id, exc)
            return None
        self._baselines.pop(view.sandbox_id, None)
        if vm is not None:
            try:
                # Asked now so the guest's balloon driver has reported by the next sample.
                await vm.guest_memory(self._interval_s)
                cpu_seconds = vm.cpu_seconds()
            except VMMError as exc:
                log.debug("no host measurements of %s: %s", view.sandbox_id, exc)
            else:
                now = time.monotonic()
                disk: dict[str, object] = {
                    key: figures[key] for key in ("disk_used", "disk_total") if key in figures
                }
                # envd's memory figures stand in for the balloon's while the guest is
                # idle and its balloon has not reported yet.
                self._baselines[view.sandbox_id] = _HostBaseline(
                    vm.pid, cpu_seconds, now, disk, now, writes, now,
                    _memory_of(figures), now, self._interval_s,
                )  # fmt: skip
        return figures

    async def _memory(
        self, vm: VirtualMachine, base: _HostBaseline, cpu_seconds: float, now: float
    ) -> GuestMemory | None:
        """The balloon's figures: reported at the interval while the guest runs; while it
        is idle, reported and asked for every :data:`IDLE_REPORT_INTERVAL_S` (the
        reports wake it), carried in between."""
        idle = cpu_seconds - base.cpu_seconds < IDLE_CPU_SHARE * (now - base.at)
        every = max(IDLE_REPORT_INTERVAL_S, self._interval_s) if idle else self._interval_s
        if (
            idle
            and base.memory is not None
            and base.report_every_s == every
            and now - base.memory_at < every
        ):
            return base.memory
        base.memory = await vm.guest_memory(every) or (base.memory if idle else None)
        base.memory_at, base.report_every_s = now, every
        return base.memory

    async def _disk_writes(self, view: SandboxView, vm: VirtualMachine) -> int | None:
        try:
            return await vm.disk_writes()
        except VMMError as exc:
            log.debug("no drive write count of %s: %s", view.sandbox_id, exc)
            return None

    async def _disk_figures_current(
        self, view: SandboxView, vm: VirtualMachine, base: _HostBaseline
    ) -> bool:
        """Whether envd's disk figures in ``base`` still hold: not yet due, or due while
        the guest has written nothing to its drives since (then they are renewed)."""
        now = time.monotonic()
        if now - base.guest_sampled_at >= GUEST_SAMPLE_MAX_AGE_S:
            return False
        if now - base.disk_checked_at < GUEST_SAMPLE_INTERVAL_S:
            return True
        if base.disk_writes is None:
            return False
        if await self._disk_writes(view, vm) != base.disk_writes:
            return False
        base.disk_checked_at = now
        return True

    async def _host_figures(
        self, view: SandboxView, vm: VirtualMachine
    ) -> dict[str, object] | None:
        """A sample measured on the host, or None when envd must be asked: no baseline
        yet, another VMM process since (a resume), disk figures due, or no balloon
        statistics."""
        base = self._baselines.get(view.sandbox_id)
        now = time.monotonic()
        if (
            base is None
            or base.vmm_pid != vm.pid
            or not await self._disk_figures_current(view, vm, base)
        ):
            return None
        try:
            cpu_seconds = vm.cpu_seconds()
            memory = await self._memory(vm, base, cpu_seconds, now)
        except VMMError as exc:
            log.debug("no host measurements of %s: %s", view.sandbox_id, exc)
            return None
        if memory is None:
            return None
        vcpus = max(1, view.record.vcpus)
        elapsed = now - base.at
        busy = (cpu_seconds - base.cpu_seconds) / (elapsed * vcpus) if elapsed > 0 else 0.0
        base.cpu_seconds, base.at = cpu_seconds, now
        used = max(0, memory.total_bytes - memory.available_bytes)
        return {
            "ts": int(time.time()),
            "cpu_count": vcpus,
            "cpu_used_pct": round(min(max(100.0 * busy, 0.0), 100.0), 2),
            "mem_total": memory.total_bytes,
            "mem_used": used,
            "mem_cache": memory.cached_bytes,
            "mem_total_mib": memory.total_bytes // MIB,
            "mem_used_mib": used // MIB,
            **base.disk,
        }
