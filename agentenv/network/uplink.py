"""The host side of sandboxes' internet access, for one manager prefix.

A sandbox whose policy may let anything out (``egress_rules.needs_uplink``) has its
traffic forwarded out of the host's default interface and masqueraded there, by a table
``agentenv_<prefix>`` in the root namespace: its ``input`` and ``forward`` chains keep
sandboxes away from the host's own services and from each other, and one chain
``slot<N>`` per such sandbox masquerades its /30 block. The table goes with its last
slot chain. What a guest may reach beyond that is decided in its own namespace
(:mod:`agentenv.network.egress_rules`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import subprocess
from collections.abc import Mapping

from pyroute2 import IPRoute

from agentenv.network.errors import NetworkError

__all__ = ["NFT_TIMEOUT_S", "HostUplinks", "default_interface", "internet_access_rules", "run_nft"]

log = logging.getLogger(__name__)

NFT_TIMEOUT_S = 10.0


class HostUplinks:
    """The host table of one manager prefix; ``prefix`` names it and its veths."""

    def __init__(self, prefix: str) -> None:
        self.table = f"agentenv_{prefix}"
        self._veths = f"{prefix}h*"
        self._chain_name = re.compile(r"slot(0|[1-9][0-9]*)")
        # Slots with a chain in the table; None until read from the kernel.
        self._slots: set[int] | None = None
        self._lock = asyncio.Lock()
        # Slots waiting for their chain (slot: its block, and what it waits on), and the
        # task adding them (see add).
        self._asked: dict[int, tuple[str, asyncio.Future[None]]] = {}
        self._adder: asyncio.Future[None] | None = None
        self._warned_no_default_route = False

    async def add(self, slot: int, block: str) -> None:
        """Open the host to the traffic of ``slot`` (its /30 ``block``). Slots asking
        while an nft run is under way wait for the next, which adds all of them in one
        transaction: a fork's children ask at once, and one nft process each, taking
        turns, made the last one wait for all the others'."""
        done = asyncio.get_running_loop().create_future()
        self._asked[slot] = (block, done)
        if self._adder is None or self._adder.done():
            self._adder = asyncio.ensure_future(self._add_asked())
        try:
            await done
        finally:
            # Cancelled before a run took it: no run will (a run that took it has
            # recorded the slot, so the caller's removal undoes what it added).
            if self._asked.get(slot, (None, None))[1] is done:
                del self._asked[slot]

    async def _add_asked(self) -> None:
        async with self._lock:
            while self._asked:
                batch = dict(self._asked)
                self._asked.clear()
                try:
                    slots = await self._known_slots()
                    outbound = await asyncio.to_thread(default_interface)
                    if outbound is None:
                        self.warn_if_no_default_route(outbound)
                    blocks = {slot: batch[slot][0] for slot in sorted(batch)}
                    script = internet_access_rules(self.table, self._veths, blocks, outbound)
                    # Before running: a partial failure must still be cleaned up.
                    slots.update(batch)
                    await run_nft(script)
                    await asyncio.to_thread(_write_host_sysctl, "net/ipv4/ip_forward", "1")
                except BaseException as exc:
                    for _, done in batch.values():
                        if not done.done():
                            done.set_exception(NetworkError(f"opening the host failed: {exc}"))
                    if not isinstance(exc, Exception):
                        raise
                    continue
                for _, done in batch.values():
                    if not done.done():
                        done.set_result(None)
                log.debug("slots %s may reach the internet via %s", sorted(batch), outbound)

    async def remove(self, slot: int) -> None:
        """Close the host to ``slot``'s traffic (nothing to do if it was not open); the
        table goes with the last slot."""
        async with self._lock:
            slots = await self._known_slots()
            if slot not in slots:
                return
            table = self.table
            slots.discard(slot)
            script = f"flush chain ip {table} slot{slot}\ndelete chain ip {table} slot{slot}\n"
            if not slots:
                # One transaction with the chain's removal: each nft run costs a process.
                script += f"delete table ip {table}\n"
            try:
                await run_nft(script)
            except NetworkError:
                # The chain was already gone, so the transaction did nothing.
                await self._delete_table_if_unused()

    async def delete_table_if_unused(self) -> bool:
        """Remove a table without slot chains (a crash between creating the table and
        its first chain leaves one); whether there was one."""
        async with self._lock:
            return await self._delete_table_if_unused()

    async def _delete_table_if_unused(self) -> bool:
        slots = await self._known_slots()
        if slots or not await asyncio.to_thread(self.table_exists):
            return False
        await run_nft(f"delete table ip {self.table}\n")
        return True

    async def _known_slots(self) -> set[int]:
        if self._slots is None:
            chains = await asyncio.to_thread(self.chains)
            self._slots = {slot for _, slot in chains}
        return self._slots

    def warn_if_no_default_route(self, outbound: str | None) -> None:
        """Say once (at start-up, from the manager's reclaim) that sandboxes asking for
        internet access will not get it: one missing route should not stop every
        create, nor fill the log with one warning per create."""
        if outbound is None and not self._warned_no_default_route:
            self._warned_no_default_route = True
            log.warning(
                "the host has no IPv4 default route: sandboxes asking for internet access "
                "start, but their egress fails as the host's does (network unreachable); "
                "sandboxes started after a route is added get it"
            )

    def table_exists(self) -> bool:
        """Blocking: one nft run."""
        result = subprocess.run(
            ["nft", "list", "table", "ip", self.table],
            capture_output=True,
            timeout=NFT_TIMEOUT_S,
            check=False,
        )
        return result.returncode == 0

    def chains(self) -> list[tuple[str, int]]:
        """(name, slot) of the per-slot chains in the table. Blocking: one nft run."""
        result = subprocess.run(
            ["nft", "-j", "list", "table", "ip", self.table],
            capture_output=True,
            text=True,
            timeout=NFT_TIMEOUT_S,
            check=False,
        )
        if result.returncode != 0:
            return []  # no table
        chains: list[tuple[str, int]] = []
        for item in json.loads(result.stdout).get("nftables", []):
            name = item.get("chain", {}).get("name")
            match = self._chain_name.fullmatch(name) if isinstance(name, str) else None
            if match:
                chains.append((f"{self.table}/{name}", int(match.group(1))))
        return chains


def default_interface() -> str | None:
    """The interface of the host's IPv4 default route; None when it has none. Blocking;
    call it from a thread of the root namespace."""
    with IPRoute() as host:
        for route in host.get_default_routes(family=2):
            index = route.get_attr("RTA_OIF")
            if index is not None:
                links = host.link("get", index=index)
                return str(links[0].get_attr("IFLA_IFNAME"))
    return None


def internet_access_rules(
    table: str, veths: str, slot_blocks: Mapping[int, str], outbound: str | None
) -> str:
    """The nft script letting each slot of ``slot_blocks`` (slot: its /30 block) out
    through ``outbound``, the host's default interface. Without one (``None``) nothing is
    forwarded or masqueraded, but each slot's chain is still made (it is what marks the
    slot as having asked): the guest's packets then meet the host's own routing, which
    has nowhere to send them, so its egress fails as the host's would (the host answers
    "network unreachable") while everything else about the sandbox works."""
    forward_out = (
        f'add rule ip {table} forward iifname "{veths}" oifname "{outbound}" accept\n'
        if outbound
        else ""
    )
    script = (
        f"add table ip {table}\n"
        # Sandboxes may only be forwarded out of the default interface: not into
        # each other, and (input) not to services of the host itself.
        f"add chain ip {table} input {{ type filter hook input priority filter; }}\n"
        f"flush chain ip {table} input\n"
        f'add rule ip {table} input iifname "{veths}" ct state new drop\n'
        f"add chain ip {table} forward {{ type filter hook forward priority filter; }}\n"
        f"flush chain ip {table} forward\n"
        + forward_out
        + f'add rule ip {table} forward iifname "{veths}" drop\n'
        f'add rule ip {table} forward oifname "{veths}" ct state new drop\n'
    )
    for slot, block in slot_blocks.items():
        script += (
            f"add chain ip {table} slot{slot} {{ type nat hook postrouting priority srcnat; }}\n"
            f"flush chain ip {table} slot{slot}\n"
        )
        if outbound:
            script += (
                f'add rule ip {table} slot{slot} ip saddr {block} oifname "{outbound}" masquerade\n'
            )
    return script


def _write_host_sysctl(key: str, value: str) -> None:
    with open(f"/proc/sys/{key}") as f:
        if f.read().strip() == value:
            return
    with open(f"/proc/sys/{key}", "w") as f:
        f.write(value)


async def run_nft(script: str) -> None:
    """Run ``script`` with ``nft -f -`` in the root namespace (one transaction)."""
    try:
        proc = await asyncio.create_subprocess_exec(
            "nft",
            "-f",
            "-",
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
    except OSError as exc:
        raise NetworkError(f"running nft failed: {exc}") from exc
    try:
        _, stderr = await asyncio.wait_for(proc.communicate(script.encode()), NFT_TIMEOUT_S)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise
    if proc.returncode != 0:
        raise NetworkError(f"nft rejected the ruleset: {stderr.decode().strip()}")
