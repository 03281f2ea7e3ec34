"""What a node lends its sandboxes: network slots, guest RAM, network namespaces kept a
while after a pause, and the files sandboxes and snapshots depend on (pinned against
cache eviction, collected once unused).

Owns the reserved-slot set, the RAM reservations and places of starting sandboxes and
the lingering-network timers. Reads records from the
store; changes only snapshot records it collects (deleted ones whose files go).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

from agentenv.config import Config
from agentenv.network import NetworkManager, SandboxNetwork, pick_free_subnet
from agentenv.orchestrator.errors import CapacityExhausted
from agentenv.orchestrator.layout import SnapshotDir
from agentenv.orchestrator.operations import SandboxOperations
from agentenv.orchestrator.states import SandboxState
from agentenv.orchestrator.store import SandboxRecord, Store
from agentenv.orchestrator.supervisor import FinishingWork
from agentenv.snapshots.cache import NodeCache
from agentenv.snapshots.layout import MachineSnapshot, SnapshotError
from agentenv.storage.images import backing_chain

log = logging.getLogger("agentenv.orchestrator")


class Slots:
    """Network slots: a slot is a sandbox's veth range and guest address. Recorded
    sandboxes hold theirs; one being created or adopted holds a reservation."""

    def __init__(self, store: Store, network: NetworkManager) -> None:
        self.store = store
        self.network = network
        self._reserved: set[int] = set()
        self._releasing = FinishingWork()

    def reserve(self) -> int:
        used = self.store.used_slots() | self._reserved
        slot = 0
        while slot in used:
            slot += 1
        if self.network.max_slots is not None and slot >= self.network.max_slots:
            raise CapacityExhausted("no free network slots on this node")
        self._reserved.add(slot)
        return slot

    def release(self, slot: int) -> None:
        self._reserved.discard(slot)

    def release_after(self, slot: int, teardown: Coroutine[Any, Any, None]) -> None:
        """Keep `slot` reserved while ``teardown`` (its network's removal) runs in the
        background, then free it: a kill answers without waiting for the kernel to
        delete a veth pair (10-20 ms of RCU grace periods), and no new sandbox is given
        the slot before its old network is gone. A teardown that fails leaves the slot
        free: the next create on it removes leftovers first, as does the next start."""
        self._reserved.add(slot)

        async def then_free() -> None:
            try:
                await teardown
            finally:
                self._reserved.discard(slot)

        self._releasing.start(then_free(), f"the teardown of network slot {slot}")

    async def drain(self) -> None:
        """Wait for every background teardown (at shutdown: nothing is left half-removed)."""
        await self._releasing.drain()


#: States in which a sandbox has a VMM holding its guest RAM (a paused one has none).
HOLDS_RAM = frozenset(set(SandboxState) - {SandboxState.PAUSED})


def _meminfo_kib() -> dict[str, int]:
    """/proc/meminfo's figures, in KiB as it gives them."""
    info: dict[str, int] = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            info[key] = int(fields[0])
    return info


def host_ram_mib() -> int:
    total = _meminfo_kib().get("MemTotal")
    if total is None:
        raise RuntimeError("/proc/meminfo has no MemTotal")
    return total // 1024


def host_headroom_mib() -> int:
    """Memory the host can still give, in MiB: ``MemAvailable`` less the mapped file
    pages. ``MemAvailable`` counts all file pages as reclaimable, but the page cache of
    a guest RAM file the VMM maps is that guest's memory: reclaimed, it is read back at
    the guest's next touch (a host short of memory thrashes while ``MemAvailable`` still
    shows gigabytes; bench/density.py)."""
    info = _meminfo_kib()
    return (info["MemAvailable"] - info.get("Mapped", 0)) // 1024


def host_memory_pressure_pct() -> float | None:
    """Share of the last 10 s in which some task on the host stalled on memory (reclaim,
    refaults: the kernel's pressure stall information, ``some avg10``); None where the
    kernel keeps none. It measures what the headroom estimate can only guess: near the
    edge, unmapped page cache that :func:`host_headroom_mib` counts as free is what the
    guests read back (bench/density.py: under 0.2 % with 250 idle sandboxes that all
    answered, 45 % on a thrashing host)."""
    try:
        some = Path("/proc/pressure/memory").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    for field in some.split()[1:]:
        key, _, value = field.partition("=")
        if key == "avg10":
            return float(value)
    return None


class MemoryBudget:
    """Guest RAM lent to sandboxes with a VMM, against the node's RAM times
    ``Config.memory_overcommit``, and the host's own state: its headroom
    (:func:`host_headroom_mib`) against ``Config.memory_reserve_mib`` and its memory
    stalls (:func:`host_memory_pressure_pct`) against ``Config.memory_pressure_limit``.
    A start beyond any of them is refused (:class:`CapacityExhausted`, 503) instead of
    tipping the node into thrashing, swap or the OOM killer. A sandbox being started
    holds a reservation until its record shows it."""

    def __init__(
        self,
        store: Store,
        overcommit: float,
        host_mib: int | None = None,
        *,
        reserve_mib: int = 0,
        headroom_mib: Callable[[], int] = host_headroom_mib,
        pressure_limit_pct: float = 0,
        pressure_pct: Callable[[], float | None] = host_memory_pressure_pct,
    ) -> None:
        self.store = store
        self.overcommit = overcommit
        self.host_mib = host_mib if host_mib is not None else host_ram_mib()
        self.reserve_mib = reserve_mib
        self.headroom_mib = headroom_mib
        self.pressure_limit_pct = pressure_limit_pct
        self.pressure_pct = pressure_pct
        self._reserved: dict[str, int] = {}

    @property
    def limit_mib(self) -> int | None:
        """Guest RAM the node may lend; None: no limit."""
        return int(self.host_mib * self.overcommit) if self.overcommit > 0 else None

    def lent_mib(self) -> int:
        """Guest RAM of the sandboxes with a VMM, and of those being started."""
        holding = {
            r.sandbox_id: r.memory_mib for r in self.store.list_sandboxes() if r.state in HOLDS_RAM
        }
        pending = sum(mib for sid, mib in self._reserved.items() if sid not in holding)
        return sum(holding.values()) + pending

    def admit(self, memory_mib: int, operation: str) -> None:
        """:class:`CapacityExhausted` unless ``memory_mib`` more fits in the limit. A
        caller that starts the VMM after awaiting something holds a reservation instead
        (:meth:`hold`); one that changes the record's state right after needs none."""
        if self.reserve_mib > 0:
            headroom = self.headroom_mib()
            if headroom < self.reserve_mib:
                raise CapacityExhausted(
                    f"{operation} refused: this node's host has {headroom} MiB of memory "
                    f"left (beyond what its VMMs map), below its {self.reserve_mib} MiB "
                    "reserve"
                )
        if self.pressure_limit_pct > 0:
            stalled = self.pressure_pct()
            if stalled is not None and stalled >= self.pressure_limit_pct:
                raise CapacityExhausted(
                    f"{operation} refused: this node's host stalled on memory {stalled:g} % "
                    f"of the last 10 s, at or above its limit of {self.pressure_limit_pct:g} %"
                )
        limit = self.limit_mib
        if limit is None:
            return
        lent = self.lent_mib()
        if lent + memory_mib > limit:
            raise CapacityExhausted(
                f"{operation} refused: this node lends {lent} MiB of guest RAM and may lend "
                f"{limit} MiB ({self.overcommit:g} x its {self.host_mib} MiB); the sandbox "
                f"needs {memory_mib} MiB"
            )

    @contextlib.contextmanager
    def hold(self, sandbox_id: str, memory_mib: int, operation: str) -> Iterator[None]:
        """Admit ``memory_mib`` and keep it reserved for ``sandbox_id`` while it starts."""
        self.admit(memory_mib, operation)
        self._reserved[sandbox_id] = self._reserved.get(sandbox_id, 0) + memory_mib
        try:
            yield
        finally:
            left = self._reserved.pop(sandbox_id, 0) - memory_mib
            if left > 0:
                self._reserved[sandbox_id] = left


#: How long a start waits for a place before it is refused: below the e2b SDK's 60 s
#: request timeout, so the client reads why rather than timing out.
START_WAIT_S = 50.0


class StartPlace:
    """One sandbox's place among those starting; :meth:`leave` gives it back (once)."""

    def __init__(self, release: Callable[[], None] | None) -> None:
        self._release = release

    def leave(self) -> None:
        if self._release is not None:
            release, self._release = self._release, None
            release()


class StartGate:
    """How many sandboxes may be starting at once: from their restore until envd's /init
    is done (``Config.start_places``; 0: no bound).

    Under TCG a restored guest runs its first code through an empty translation cache
    (0.3-0.8 s of CPU before envd has answered /init). A create answers once the machine
    runs, so a client creating sandboxes back to back would otherwise have every one of
    them starting together: on a host already busy with idle sandboxes the /inits then
    pass their deadline and those sandboxes are lost. A start waits here for a place
    instead, and is refused (:class:`CapacityExhausted`, 503) after ``wait_s``."""

    def __init__(self, places: int, wait_s: float) -> None:
        self.places = places
        self.wait_s = wait_s
        self._semaphore = asyncio.Semaphore(places) if places > 0 else None
        self._starting = 0
        self._waiting = 0

    def starting(self) -> int:
        """Sandboxes holding a place now."""
        return self._starting

    async def enter(self, operation: str) -> StartPlace:
        if self._semaphore is None:
            return StartPlace(None)
        self._waiting += 1
        try:
            async with asyncio.timeout(self.wait_s):
                await self._semaphore.acquire()
        except TimeoutError:
            raise CapacityExhausted(
                f"{operation} refused: {self.places} sandboxes are starting on this node and "
                f"{self._waiting - 1} more wait; none finished within {self.wait_s:g} s"
            ) from None
        finally:
            self._waiting -= 1
        self._starting += 1
        return StartPlace(self._leave)

    def _leave(self) -> None:
        assert self._semaphore is not None
        self._starting -= 1
        self._semaphore.release()


class NetworkLeases:
    """Sandboxes' network namespaces across a pause: kept ``linger`` seconds after it,
    so a quick resume finds its namespace built, then released."""

    def __init__(
        self,
        network: NetworkManager,
        store: Store,
        operations: SandboxOperations,
        linger: float,
    ) -> None:
        self.network = network
        self.store = store
        self.operations = operations
        self.linger = linger
        self._lingering: dict[str, asyncio.Task[None]] = {}

    def release_later(self, rec: SandboxRecord) -> None:
        sandbox_id = rec.sandbox_id

        async def release() -> None:
            await asyncio.sleep(self.linger)
            async with self.operations.lock(sandbox_id):
                if self._lingering.get(sandbox_id) is not task:
                    return
                del self._lingering[sandbox_id]
                current = self.store.get_sandbox(sandbox_id)
                if current is None or current.state != SandboxState.PAUSED:
                    return
                try:
                    await self.network.destroy(current.slot)
                except Exception as exc:
                    # Retried when the slot is next used, or at the next start.
                    log.warning("sandbox %s: releasing its network failed: %s", sandbox_id, exc)

        task = asyncio.get_running_loop().create_task(release())
        self._lingering[sandbox_id] = task

    async def take(self, rec: SandboxRecord) -> SandboxNetwork:
        """The sandbox's network: still there if its pause was recent, else built."""
        lingering = self._lingering.pop(rec.sandbox_id, None)
        if lingering is not None and not lingering.done():
            lingering.cancel()
            return self.network.describe(rec.slot)
        return await self.network.create(rec.slot, policy=rec.network.egress)

    def forget(self, rec: SandboxRecord) -> None:
        """Stop the timer of a sandbox whose network goes another way (kill, handoff)."""
        lingering = self._lingering.pop(rec.sandbox_id, None)
        if lingering is not None:
            lingering.cancel()

    async def release_now(self, rec: SandboxRecord) -> None:
        self.forget(rec)
        try:
            await self.network.destroy(rec.slot)
        except Exception as exc:
            log.warning("sandbox %s: releasing its network failed: %s", rec.sandbox_id, exc)

    def shutdown(self) -> None:
        for lingering in self._lingering.values():
            lingering.cancel()
        self._lingering.clear()


class FilePins:
    """The files sandboxes and live snapshots depend on: their disk chains, and the
    snapshots sandboxes started from. Those are pinned in the node cache and never
    collected; hidden snapshots nothing depends on are removed."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def pinned_keys(self, cache: NodeCache) -> set[str]:
        """Node-cache entries that sandboxes of this node use (their disk chains and the
        snapshots they started from): never evicted."""
        used: set[Path] = set()
        for sandbox in self.store.list_sandboxes():
            if sandbox.source_dir is not None:
                used.add(sandbox.source_dir)
                with contextlib.suppress(SnapshotError):
                    source = MachineSnapshot.load(sandbox.source_dir)
                    used.update(source.required_files())
                    used.update(backing_chain(source.disk))
            if sandbox.disk_path is not None:
                used.update(backing_chain(sandbox.disk_path))
        for snap in self.store.list_snapshots():
            if snap.state in ("ready", "pending"):
                used.update(backing_chain(SnapshotDir(snap.snapshot_dir).disk))
        pinned = set()
        for key in cache.keys():
            path = cache.peek(key)
            if path is not None and (path in used or any(p.is_relative_to(path) for p in used)):
                pinned.add(key)
        return pinned

    def collect_snapshots(self) -> list[str]:
        """Remove hidden snapshots (deleted ones, fork images) whose files nothing uses:
        no sandbox's disk chain or source, no live snapshot's chain."""
        records = self.store.list_snapshots()
        used: set[Path] = set()
        for sandbox in self.store.list_sandboxes():
            if sandbox.source_dir is not None:
                used.add(sandbox.source_dir)
            if sandbox.disk_path is not None:
                used.update(p.parent for p in backing_chain(sandbox.disk_path))
        for snap in records:
            if snap.state == "ready":
                used.update(p.parent for p in backing_chain(SnapshotDir(snap.snapshot_dir).disk))
        removed = []
        for snap in records:
            if snap.state == "deleted" and snap.snapshot_dir not in used:
                shutil.rmtree(snap.snapshot_dir, ignore_errors=True)
                self.store.delete_snapshot(snap.snapshot_id)
                removed.append(snap.snapshot_id)
        if removed:
            log.info("removed unused snapshots %s", ", ".join(removed))
        return removed


def resolve_subnet(config: Config) -> str:
    """The host-side veth range: configured, else the one this data directory chose at
    its first start, else a block no address or route on this host uses yet (recorded,
    so re-adopted sandboxes keep their addresses)."""
    if config.net_subnet:
        return config.net_subnet
    if config.subnet_path.exists():
        return config.subnet_path.read_text().strip()
    subnet = pick_free_subnet(int(config.instance_tag, 16))
    config.home.mkdir(parents=True, exist_ok=True)
    config.subnet_path.write_text(subnet + "\n")
    return subnet
