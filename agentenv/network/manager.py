"""Creation, teardown and crash reclamation of per-sandbox network namespaces.

Layout of one sandbox (slot N, host subnet S split into /30 blocks, block N = S + 4N):

    root namespace                      namespace <prefix>-N
    <prefix>hN  S+4N+1/30  <-- veth -->  veth0  S+4N+2/30 (the sandbox's "guest address")
                                         tap0   GUEST_GATEWAY/30  <-- VMM --> guest GUEST_IP

Inside the namespace nftables DNATs TCP/UDP arriving on veth0 for the namespace end to
GUEST_IP, so the host reaches guest port P at ``<S+4N+2>:P`` and the guest sees the host end
as the peer. Guest-originated traffic leaving via veth0 is SNATed to the namespace end, and
is forwarded only as the sandbox's :class:`EgressPolicy` allows (chains ``egress``,
``intercept`` and ``guard``, see :mod:`agentenv.network.egress_rules`; the guest cannot
touch rules in its namespace). When the policy may let anything out, a table
``agentenv_<prefix>`` in the root namespace masquerades it out of the default interface
and keeps it away from the host's own services and from other sandboxes
(:mod:`agentenv.network.uplink`).

Every resource carries the manager's prefix and the slot in its name, so leftovers of a
crashed server can be found and removed (`NetworkManager.reclaim`) without touching
another server's sandboxes on the same host.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import ipaddress
import logging
import re
import socket
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pyroute2 import IPRoute, netns
from pyroute2.netlink.exceptions import NetlinkError

from agentenv.network.addresses import (
    GATEWAY_MAC,
    GUEST_GATEWAY,
    GUEST_IP,
    GUEST_MAC,
    GUEST_PREFIX,
    TAP_NAME,
)
from agentenv.network.egress_filter import EgressFilter, SecretLookup
from agentenv.network.egress_rules import (
    NAMESPACE_TABLE,
    BlockedRanges,
    needs_uplink,
    policy_chains,
    policy_update_script,
)
from agentenv.network.errors import NetworkError
from agentenv.network.namespaces import call_in_namespace, enter_new_namespace
from agentenv.network.policy import EgressPolicy
from agentenv.network.uplink import NFT_TIMEOUT_S, HostUplinks, default_interface

__all__ = ["NetworkError", "NetworkManager", "SandboxNetwork"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

# Name of the veth end inside every sandbox namespace; like TAP_NAME it is the same everywhere.
NAMESPACE_VETH = "veth0"
_IFNAMSIZ = 15  # longest interface name the kernel accepts
# No "h" in prefixes: host veths are <prefix>h<slot> and host rules match "<prefix>h*", which
# must not also match the veths of another instance's prefix.
_PREFIX_PATTERN = re.compile(r"[a-gi-z][a-gi-z0-9]{0,7}")
_TABLE_SLOT = -1  # stands for "no slot" where resources are listed with their slot


@dataclass(frozen=True)
class SandboxNetwork:
    """Names and addresses of one sandbox's network, as seen from the host."""

    slot: int
    netns: str  # namespace to start the VMM in
    tap: str  # tap device inside `netns` for the VMM to attach to
    host_veth: str  # veth end in the root namespace
    host_ip: str  # address of `host_veth`
    guest_address: str  # namespace end of the veth: the host connects here to reach the guest
    guest_mac: str  # MAC the VMM should give the guest's NIC


class NetworkManager:
    """Creates and removes sandbox networks for one server instance.

    ``prefix`` names every resource of this instance (so several servers can share a
    host), ``subnet`` is the IPv4 range host-side addresses come from, one /30 per slot.
    Operations on different slots may run concurrently; operations on one slot are
    serialised.
    """

    def __init__(
        self, prefix: str, subnet: str = "10.200.0.0/16", *, max_slots: int | None = None
    ) -> None:
        if not _PREFIX_PATTERN.fullmatch(prefix):
            raise ValueError(
                f"prefix {prefix!r} must be 1-8 lowercase letters other than 'h' or digits, "
                "starting with a letter"
            )
        try:
            network = ipaddress.IPv4Network(subnet)
        except ValueError as exc:
            raise ValueError(f"subnet {subnet!r} is not an IPv4 network: {exc}") from exc
        if network.prefixlen > 30:
            raise ValueError(f"subnet {subnet} is smaller than one /30 block")
        guest_net = ipaddress.IPv4Network(f"{GUEST_IP}/{GUEST_PREFIX}", strict=False)
        if network.overlaps(guest_net):
            raise ValueError(f"subnet {subnet} overlaps the guest network {guest_net}")

        # Host veth names are <prefix>h<slot> and must fit in an interface name.
        slot_digits = _IFNAMSIZ - len(prefix) - 1
        capacity = min(network.num_addresses // 4, 10**slot_digits)
        if max_slots is None:
            max_slots = capacity
        elif not 1 <= max_slots <= capacity:
            raise ValueError(
                f"max_slots must be between 1 and {capacity} for prefix {prefix!r} and "
                f"subnet {subnet}, got {max_slots}"
            )

        self.prefix = prefix
        self.subnet = network
        self.max_slots = max_slots
        self._netns_name = re.compile(rf"{re.escape(prefix)}-(0|[1-9][0-9]*)")
        self._veth_name = re.compile(rf"{re.escape(prefix)}h(0|[1-9][0-9]*)")
        self._slot_locks: dict[int, asyncio.Lock] = {}
        # The host table forwarding the traffic of sandboxes that may reach the internet.
        self._uplinks = HostUplinks(prefix)
        # The host address read creates are waiting to start (see _fresh_host_addresses).
        self._pending_address_read: asyncio.Future[list[HostAddress]] | None = None
        self._address_read_lock = asyncio.Lock()
        # Relays the connections of sandboxes whose policy has host-name rules.
        self.egress_filter = EgressFilter()

    def resolve_secrets_with(self, secret: SecretLookup) -> None:
        """Where the egress filter gets the values of secrets that network ``rules``
        headers name (``${e2b.secrets.<name>}``); without it such headers are refused."""
        self.egress_filter.secret = secret

    # -- names and addresses --------------------------------------------------------------

    def describe(self, slot: int) -> SandboxNetwork:
        """Names and addresses `slot` has (or would have); creates nothing."""
        self._check_slot(slot)
        block = self.subnet.network_address + 4 * slot
        return SandboxNetwork(
            slot=slot,
            netns=f"{self.prefix}-{slot}",
            tap=TAP_NAME,
            host_veth=f"{self.prefix}h{slot}",
            host_ip=str(block + 1),
            guest_address=str(block + 2),
            guest_mac=GUEST_MAC,
        )

    def _check_slot(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int):
            raise TypeError(f"slot must be an int, got {type(slot).__name__}")
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} is outside 0..{self.max_slots - 1}")

    def _slot_block(self, slot: int) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network((self.subnet.network_address + 4 * slot, 30))

    # -- lifecycle --------------------------------------------------------------------------

    async def create(self, slot: int, *, policy: EgressPolicy | None = None) -> SandboxNetwork:
        """Build the network for `slot`, replacing any leftovers of an earlier one, with
        egress as `policy` says (default: nothing leaves). One ``nft`` run builds the
        namespace's whole ruleset, policy included.

        On failure (or cancellation) everything built so far is removed before the error
        propagates.
        """
        net = self.describe(slot)
        policy = policy or EgressPolicy()
        async with self._slot_lock(slot):
            try:
                await self._destroy_slot(slot)
                addresses = await self._fresh_host_addresses()
                blocked = await _run_blocking(self._build_namespace, net, policy, addresses)
                if needs_uplink(policy):
                    await self._uplinks.add(slot, str(self._slot_block(slot)))
                if policy.needs_filter:
                    await self.egress_filter.serve(slot, net.netns, policy, blocked)
            except BaseException as exc:
                await asyncio.shield(self._rollback(slot))
                if isinstance(exc, NetworkError | asyncio.CancelledError):
                    raise
                if isinstance(exc, Exception):
                    raise NetworkError(f"creating network for slot {slot} failed: {exc}") from exc
                raise
        return net

    async def update_policy(self, slot: int, policy: EgressPolicy) -> None:
        """Replace the egress policy of the live network of `slot`, atomically: a
        connection is decided by the old rules or the new ones, never a mix.

        New connections follow the new policy at once; connections already established
        continue (conntrack accepts them before the policy is consulted), as cutting them
        would also cut the host's own connections to envd. Works on any namespace this
        manager's prefix built, including one lingering after a pause.
        """
        net = self.describe(slot)
        async with self._slot_lock(slot):
            if net.netns not in await asyncio.to_thread(netns.listnetns):
                raise NetworkError(f"slot {slot} has no network to change the policy of")
            blocked = await asyncio.to_thread(self._current_blocked_ranges)
            # The host forwards a sandbox's traffic only while its namespace may let
            # something out; it is opened before the namespace rules allow anything and
            # closed after they stop allowing it. Likewise the filter listens before the
            # namespace redirects to it, and stops after it no longer does.
            if needs_uplink(policy):
                await self._uplinks.add(slot, str(self._slot_block(slot)))
            if policy.needs_filter:
                await self.egress_filter.serve(slot, net.netns, policy, blocked)
            await _run_blocking(self._replace_policy_chains, net, policy, blocked)
            if not policy.needs_filter:
                await self.egress_filter.stop(slot)
            if not needs_uplink(policy):
                await self._uplinks.remove(slot)

    async def destroy(self, slot: int) -> None:
        """Remove the namespace, veth and host rules of `slot`; absent parts are fine.

        The VMM running in the namespace must have exited: the kernel keeps a namespace
        alive while a process is inside it.
        """
        self._check_slot(slot)
        async with self._slot_lock(slot):
            await self._destroy_slot(slot)

    async def detach(self, slot: int) -> None:
        """The part of :meth:`destroy` a kill waits for, about a millisecond: the egress
        filter of `slot` stops and its namespace loses its name, so nothing can enter it
        and no listing shows it. With no process and no socket left inside, the kernel
        then tears the namespace down by itself, its veth pair included; :meth:`destroy`
        (run later, off the request) waits for the host end to go and drops the host
        rules. Until then the slot must not be reused (the caller keeps it reserved).

        The VMM of `slot` must have exited."""
        self._check_slot(slot)
        net = self.describe(slot)
        async with self._slot_lock(slot):
            await self.egress_filter.stop(slot)
            with contextlib.suppress(FileNotFoundError):
                await asyncio.to_thread(netns.remove, net.netns)

    async def reclaim(self, keep: set[int]) -> list[str]:
        """Remove every resource of this prefix whose slot is not in `keep`.

        Meant for startup after a crash: `keep` holds the slots of sandboxes that are
        still alive. Returns the names of what was removed.
        """
        self.warn_if_no_default_route(await asyncio.to_thread(default_interface))
        found = await asyncio.to_thread(self._scan, True)
        removed: list[str] = []
        slots = {slot for _, slot in found if slot != _TABLE_SLOT}
        for slot in sorted(slots - keep):
            names = [name for name, owner in found if owner == slot]
            if 0 <= slot < self.max_slots:
                await self.destroy(slot)
            else:
                # Made by a run configured with more slots; remove by name.
                await asyncio.to_thread(self._remove_by_name, names)
                await self._uplinks.remove(slot)
            removed.extend(names)
        await self._uplinks.delete_table_if_unused()
        had_table = any(slot == _TABLE_SLOT for _, slot in found)
        if had_table and not await asyncio.to_thread(self._uplinks.table_exists):
            removed.append(self._uplinks.table)
        return removed

    def resources(self) -> list[str]:
        """Names of this prefix's namespaces, host veths and host nft table/chains now present.

        Blocking (a few milliseconds); usable with or without a running event loop.
        """
        found = _call_in_thread(self._scan, True)
        return sorted(name for name, _ in found)

    # -- building ---------------------------------------------------------------------------

    async def _fresh_host_addresses(self) -> list[HostAddress]:
        """The host's IPv4 addresses, read after this call: creates asking at once (a
        fork's children) share one read, started after each of them asked. Decoding
        the dump is most of a create's CPU on a host with many sandboxes, and each
        create adds an address for the next to decode."""
        pending = self._pending_address_read
        if pending is None:
            pending = asyncio.ensure_future(self._read_host_addresses())
            self._pending_address_read = pending
        return await asyncio.shield(pending)

    async def _read_host_addresses(self) -> list[HostAddress]:
        async with self._address_read_lock:
            # From here on a caller needs a read that starts later: the next one.
            self._pending_address_read = None
            return await asyncio.to_thread(_call_with_host_socket, _host_addresses)

    def _build_namespace(
        self, net: SandboxNetwork, policy: EgressPolicy, addresses: list[HostAddress]
    ) -> BlockedRanges:
        """Create and configure the namespace and veth. Blocking; runs in its own thread.

        The namespace is made by, and configured from, a thread that moves into it (a
        namespace is per thread), which saves forking a helper process to make it and
        for each netlink socket, the tap ioctl and the nft run.
        """
        outcome: list[BaseException] = []
        built: list[BlockedRanges] = []

        def configure() -> None:
            try:
                with IPRoute() as host:  # opened before the thread moves, so it stays here
                    enter_new_namespace(net.netns)
                    with IPRoute() as inside:
                        built.append(self._configure(host, inside, net, policy, addresses))
            except BaseException as exc:
                outcome.append(exc)

        # A fresh thread, never a pool thread: it ends inside the sandbox namespace.
        worker = threading.Thread(target=configure, name=f"netns-{net.netns}")
        worker.start()
        worker.join()
        if outcome:
            raise outcome[0]
        return built[0]

    def _configure(
        self,
        host: IPRoute,
        inside: IPRoute,
        net: SandboxNetwork,
        policy: EgressPolicy,
        addresses: list[HostAddress],
    ) -> BlockedRanges:
        # Runs with the calling thread inside the namespace: /proc/sys/net and child
        # processes see the namespace, `host` is still bound to the root namespace.
        _write_sysctl("net/ipv4/ip_forward", "1")
        # The guest network is IPv4 only; this keeps router solicitations and DAD off tap0.
        _write_sysctl("net/ipv6/conf/all/disable_ipv6", "1")
        _write_sysctl("net/ipv6/conf/default/disable_ipv6", "1")
        # Egress refusals are ICMP errors to the guest; the kernel's per-peer limit (a
        # burst of 6, then one a second) would turn the 7th refusal in a row into a
        # silent drop and the guest's connect into a timeout. The errors only ever go to
        # this sandbox's own guest, so there is nothing for the limit to protect.
        _write_sysctl("net/ipv4/icmp_ratelimit", "0")
        # nft takes longer to start than all the netlink work below; its rules match
        # interfaces by name, so it can load them while the interfaces are being made.
        # The ruleset is written to it once the interfaces exist.
        nft = _NftRun()
        try:
            host_networks = self._claim_host_addresses(addresses, net)
            self._configure_links(host, inside, net)
        except BaseException:
            nft.abandon()
            raise
        blocked = self._blocked_ranges(host_networks)
        nft.finish(self._namespace_ruleset(net, policy, blocked))
        return blocked

    def _blocked_ranges(self, host_networks: list[ipaddress.IPv4Network]) -> BlockedRanges:
        # The sandbox subnet is named even when it lies outside the fixed ranges (a
        # configured public-looking subnet): guests never reach the host's veth ends.
        return BlockedRanges([*host_networks, self.subnet])

    def _current_blocked_ranges(self) -> BlockedRanges:
        with IPRoute() as host:
            return self._blocked_ranges(_host_networks(host))

    @staticmethod
    def _replace_policy_chains(
        net: SandboxNetwork, policy: EgressPolicy, blocked: BlockedRanges
    ) -> None:
        """Rewrite the policy's chains in `net`'s namespace in one nft transaction.
        Blocking; runs in its own thread, which it moves into the namespace."""
        call_in_namespace(
            net.netns, lambda: _NftRun().finish(policy_update_script(policy, blocked))
        )

    def _configure_links(self, host: IPRoute, inside: IPRoute, net: SandboxNetwork) -> None:
        """Make the veth and tap. Runs in the thread that is inside the namespace:
        interfaces there are looked up by ``if_nametoindex`` (an ioctl in the thread's
        namespace), as a netlink lookup decodes the whole link in Python, a few times the
        cost of setting it."""
        host.link(
            "add",
            ifname=net.host_veth,
            kind="veth",
            peer={"ifname": NAMESPACE_VETH, "net_ns_fd": net.netns},
        )
        host_index = _index(host, net.host_veth)
        host.addr("add", index=host_index, address=net.host_ip, prefixlen=30)
        host.link("set", index=host_index, state="up")

        inside.link("set", index=socket.if_nametoindex("lo"), state="up")
        inside.link(
            "add",
            ifname=net.tap,
            kind="tuntap",
            mode="tap",
            ifr={"no_pi": True, "one_queue": False, "vnet_hdr": False, "multi_queue": False},
        )
        tap_index = socket.if_nametoindex(net.tap)
        # A fixed MAC: a restored guest still has the template's ARP entry for its
        # gateway, and frames to any other MAC would be dropped by the tap. The kernel
        # sets the address before it brings the link up.
        inside.addr("add", index=tap_index, address=GUEST_GATEWAY, prefixlen=GUEST_PREFIX)
        inside.link("set", index=tap_index, address=GATEWAY_MAC, state="up")
        veth_index = socket.if_nametoindex(NAMESPACE_VETH)
        inside.addr("add", index=veth_index, address=net.guest_address, prefixlen=30)
        inside.link("set", index=veth_index, state="up")
        inside.route("add", dst="0.0.0.0/0", gateway=net.host_ip)

    def _claim_host_addresses(
        self, addresses: list[HostAddress], net: SandboxNetwork
    ) -> list[ipaddress.IPv4Network]:
        """Refuse a slot whose block is in use; returns the host's connected networks
        (for the blocked ranges)."""
        # Two servers given overlapping subnets would route each other's sandboxes wrongly;
        # refuse instead of adding a second route to the same /30.
        block = self._slot_block(net.slot)
        for found in addresses:
            if found.address in block:
                raise NetworkError(
                    f"{block} (slot {net.slot}) is already in use on interface index "
                    f"{found.index}; does another agentenv server use an overlapping subnet?"
                )
        return [found.network for found in addresses]

    @staticmethod
    def _namespace_ruleset(
        net: SandboxNetwork, policy: EgressPolicy, blocked: BlockedRanges
    ) -> str:
        # The policy's own chains come first so the fixed chains can jump to them; see
        # egress_rules for what they hold.
        return (
            f"table ip {NAMESPACE_TABLE} {{\n"
            f"{policy_chains(policy, blocked)}"
            "    chain prerouting {\n"
            "        type nat hook prerouting priority dstnat; policy accept;\n"
            f'        iifname "{NAMESPACE_VETH}" ip daddr {net.guest_address} '
            f"meta l4proto {{ tcp, udp }} dnat to {GUEST_IP}\n"
            f"        ip saddr {GUEST_IP} jump intercept\n"
            "    }\n"
            "    chain postrouting {\n"
            "        type nat hook postrouting priority srcnat; policy accept;\n"
            f'        oifname "{NAMESPACE_VETH}" ip saddr {GUEST_IP} snat to {net.guest_address}\n'
            "    }\n"
            "    chain forward {\n"
            "        type filter hook forward priority filter; policy drop;\n"
            "        ct state established,related accept\n"
            f'        iifname "{NAMESPACE_VETH}" ct status dnat accept\n'
            f'        oifname "{NAMESPACE_VETH}" ip saddr {GUEST_IP} jump egress\n'
            "    }\n"
            "    chain output {\n"
            "        type filter hook output priority filter; policy accept;\n"
            f'        oifname "{NAMESPACE_VETH}" jump guard\n'
            "    }\n"
            "}\n"
        )

    def warn_if_no_default_route(self, outbound: str | None) -> None:
        """Say once per manager that sandboxes asking for internet access will not get
        it (see :meth:`HostUplinks.warn_if_no_default_route`)."""
        self._uplinks.warn_if_no_default_route(outbound)

    # -- teardown ----------------------------------------------------------------------------

    async def _destroy_slot(self, slot: int) -> None:
        net = self.describe(slot)
        await self.egress_filter.stop(slot)
        await _run_blocking(self._remove_by_name, [net.host_veth, net.netns])
        await self._uplinks.remove(slot)

    async def _rollback(self, slot: int) -> None:
        try:
            await self._destroy_slot(slot)
        except Exception:
            log.exception("rolling back the network of slot %d failed", slot)

    def _remove_by_name(self, names: list[str]) -> None:
        """Delete host veths and namespaces by name; missing ones are skipped. Runs in a
        thread of the root namespace."""
        # Every create first clears its slot, which is nearly always empty: a netlink
        # socket is opened only when there is a veth to delete.
        veths = [n for n in names if self._veth_name.fullmatch(n) and _link_exists(n)]
        if veths:
            with IPRoute() as host:
                for name in veths:
                    # Deleting the host end removes the peer too, at once; the namespace
                    # itself is torn down asynchronously by the kernel.
                    with contextlib.suppress(_NoSuchDevice):
                        _delete_link(host, name)
        for name in names:
            if self._netns_name.fullmatch(name):
                with contextlib.suppress(FileNotFoundError):
                    netns.remove(name)

    # -- discovery ---------------------------------------------------------------------------

    def _scan(self, include_table: bool = False) -> list[tuple[str, int]]:
        """(name, slot) of every resource of this prefix present now."""
        found: list[tuple[str, int]] = []
        for name in netns.listnetns():
            match = self._netns_name.fullmatch(name)
            if match:
                found.append((name, int(match.group(1))))
        with IPRoute() as host:
            for msg in host.link("dump"):
                name = msg.get_attr("IFLA_IFNAME")
                match = self._veth_name.fullmatch(name) if name else None
                if match:
                    found.append((name, int(match.group(1))))
        found.extend(self._uplinks.chains())
        if include_table and self._uplinks.table_exists():
            found.append((self._uplinks.table, _TABLE_SLOT))
        return found

    def _slot_lock(self, slot: int) -> asyncio.Lock:
        lock = self._slot_locks.get(slot)
        if lock is None:
            lock = self._slot_locks[slot] = asyncio.Lock()
        return lock


class _NoSuchDevice(Exception):
    pass


def _call_in_thread(func: Callable[..., _T], *args: Any) -> _T:
    """Call `func` in a short-lived thread and wait for it.

    pyroute2's synchronous API runs its own event loop, so it cannot run in a thread whose
    event loop is already running.
    """
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(func, *args).result()


def _index(ipr: IPRoute, ifname: str) -> int:
    indexes = ipr.link_lookup(ifname=ifname)
    if not indexes:
        raise NetworkError(f"interface {ifname} not found")
    return int(indexes[0])


def _link_exists(ifname: str) -> bool:
    """Whether the calling thread's namespace has an interface ``ifname``."""
    try:
        socket.if_nametoindex(ifname)
    except OSError:
        return False
    return True


def _delete_link(ipr: IPRoute, ifname: str) -> None:
    indexes = ipr.link_lookup(ifname=ifname)
    if not indexes:
        raise _NoSuchDevice(ifname)
    try:
        ipr.link("del", index=indexes[0])
    except NetlinkError as exc:
        if exc.code == errno.ENODEV:
            raise _NoSuchDevice(ifname) from exc
        raise


@dataclass(frozen=True)
class HostAddress:
    """An IPv4 address of the host, with its network and interface."""

    address: ipaddress.IPv4Address
    network: ipaddress.IPv4Network
    index: int


def _host_addresses(host: IPRoute) -> list[HostAddress]:
    found = []
    for msg in host.addr("dump", family=2):
        address = msg.get_attr("IFA_ADDRESS")
        if address:
            found.append(
                HostAddress(
                    ipaddress.IPv4Address(address),
                    ipaddress.IPv4Network(f"{address}/{msg['prefixlen']}", strict=False),
                    int(msg["index"]),
                )
            )
    return found


def _call_with_host_socket(func: Callable[[IPRoute], _T]) -> _T:
    """``func`` given a netlink socket of the calling thread's (root) namespace."""
    with IPRoute() as host:
        return func(host)


def _host_networks(host: IPRoute) -> list[ipaddress.IPv4Network]:
    """Every IPv4 network the host has an address in (the address itself included)."""
    return [
        ipaddress.IPv4Network(f"{msg.get_attr('IFA_ADDRESS')}/{msg['prefixlen']}", strict=False)
        for msg in host.addr("dump", family=2)
        if msg.get_attr("IFA_ADDRESS")
    ]


def _write_sysctl(key: str, value: str) -> None:
    # /proc/sys/net shows the network namespace of the calling thread.
    with open(f"/proc/sys/{key}", "w") as f:
        f.write(value)


class _NftRun:
    """An ``nft -f -`` run, started at construction in the calling thread's namespace;
    the script is written to it by :meth:`finish`."""

    def __init__(self) -> None:
        try:
            self._proc = subprocess.Popen(
                ["nft", "-f", "-"],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        except OSError as exc:
            raise NetworkError(f"running nft failed: {exc}") from exc

    def finish(self, script: str) -> None:
        try:
            _, stderr = self._proc.communicate(script, timeout=NFT_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            self.abandon()
            raise NetworkError(f"nft did not finish within {NFT_TIMEOUT_S} s") from exc
        if self._proc.returncode != 0:
            raise NetworkError(f"nft rejected the ruleset: {stderr.strip()}")

    def abandon(self) -> None:
        self._proc.kill()
        self._proc.communicate()


async def _run_blocking(func: Callable[..., _T], *args: Any) -> _T:
    """Run `func` in a thread; if cancelled, wait for it to finish before propagating.

    The thread cannot be interrupted, and a rollback must not race with it.
    """
    future = asyncio.ensure_future(asyncio.to_thread(func, *args))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await future
        raise


# Where servers that were given no subnet take theirs from: /18 blocks (4096 sandboxes
# each) of 10.128.0.0/9.
SUBNET_POOL = ipaddress.IPv4Network("10.128.0.0/9")
SUBNET_PREFIX = 18


def pick_free_subnet(start_index: int) -> str:
    """The first block of :data:`SUBNET_POOL`, searching from ``start_index``, that no
    address or route on this host overlaps. Deterministic for a given host state, so
    side-by-side servers starting from different indexes rarely contend."""
    blocks = list(SUBNET_POOL.subnets(new_prefix=SUBNET_PREFIX))
    taken: list[ipaddress.IPv4Network] = []
    with IPRoute() as ipr:
        for msg in ipr.get_addr(family=socket.AF_INET):
            address = msg.get_attr("IFA_ADDRESS")
            taken.append(ipaddress.IPv4Network(f"{address}/{msg['prefixlen']}", strict=False))
        for msg in ipr.get_routes(family=socket.AF_INET):
            dst = msg.get_attr("RTA_DST")
            if dst and msg["dst_len"] > 0:
                taken.append(ipaddress.IPv4Network(f"{dst}/{msg['dst_len']}", strict=False))
    for offset in range(len(blocks)):
        block = blocks[(start_index + offset) % len(blocks)]
        if not any(block.overlaps(t) for t in taken):
            return str(block)
    raise NetworkError(f"every /{SUBNET_PREFIX} block of {SUBNET_POOL} is in use on this host")
