"""Sandbox networks: namespaces, veths, NAT, teardown and crash reclamation.

There is no VM here. A "fake guest" network namespace stands in for it: a veth from the
sandbox namespace into it takes over the gateway address from tap0 (as a VM attached to
tap0 would sit behind it), and the far end has GUEST_IP, so traffic the sandbox forwards to
GUEST_IP arrives in the fake guest exactly as it would reach a VM.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import os
import secrets
import shutil
import socket
import ssl
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import pytest
from pyroute2 import IPRoute, netns
from pyroute2.netlink.exceptions import NetlinkError

from agentenv.network import (
    EgressPolicy,
    NetworkError,
    NetworkManager,
    SandboxNetwork,
    pick_free_subnet,
)
from agentenv.network.addresses import GUEST_GATEWAY, GUEST_IP, GUEST_MAC, GUEST_PREFIX, TAP_NAME

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("nft") is None,
    reason="sandbox networks need root and the nft tool",
)

SUBNET = "10.250.0.0/16"
OTHER_SUBNET = "10.251.0.0/16"
PORT = 18080


def _new_prefix() -> str:
    return "t" + secrets.token_hex(3)[:5]


def _ipv4_addresses(ns: str | None, ifname: str) -> list[tuple[str, int]]:
    with IPRoute(netns=ns) if ns else IPRoute() as ipr:
        index = ipr.link_lookup(ifname=ifname)
        assert index, f"{ifname} missing in {ns or 'root namespace'}"
        return [
            (msg.get_attr("IFA_ADDRESS"), msg["prefixlen"])
            for msg in ipr.addr("dump", family=socket.AF_INET, index=index[0])
        ]


def _link_is_up(ns: str, ifname: str) -> bool:
    with IPRoute(netns=ns) as ipr:
        (link,) = ipr.link("get", index=ipr.link_lookup(ifname=ifname)[0])
        return bool(link["flags"] & 1)


def _guest_ns(net: SandboxNetwork) -> str:
    return f"{net.netns}-guest"


def _attach_fake_guest(net: SandboxNetwork) -> str:
    guest = _guest_ns(net)
    netns.create(guest)
    with IPRoute(netns=net.netns) as sandbox:
        sandbox.link("add", ifname="gw0", kind="veth", peer={"ifname": "eth0", "net_ns_fd": guest})
        tap = sandbox.link_lookup(ifname=TAP_NAME)[0]
        sandbox.addr("del", index=tap, address=GUEST_GATEWAY, prefixlen=GUEST_PREFIX)
        gw = sandbox.link_lookup(ifname="gw0")[0]
        sandbox.addr("add", index=gw, address=GUEST_GATEWAY, prefixlen=GUEST_PREFIX)
        sandbox.link("set", index=gw, state="up")
    with IPRoute(netns=guest) as ipr:
        ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
        eth0 = ipr.link_lookup(ifname="eth0")[0]
        ipr.addr("add", index=eth0, address=GUEST_IP, prefixlen=GUEST_PREFIX)
        ipr.link("set", index=eth0, state="up")
        ipr.route("add", dst="0.0.0.0/0", gateway=GUEST_GATEWAY)
    return guest


def _remove_test_leftovers(prefix: str) -> None:
    for name in netns.listnetns():
        if name.startswith(f"{prefix}-") and name.endswith("-guest"):
            netns.remove(name)
    with IPRoute() as ipr:
        for link in ipr.link("dump"):
            name = link.get_attr("IFLA_IFNAME")
            if name and name.startswith(f"{prefix}x"):
                with suppress(NetlinkError):  # the peer of one deleted just before
                    ipr.link("del", index=link["index"])


def _host_ip_forward() -> str:
    with open("/proc/sys/net/ipv4/ip_forward") as f:
        return f.read().strip()


@contextmanager
def _host_ip_forward_preserved() -> Iterator[None]:
    path = "/proc/sys/net/ipv4/ip_forward"
    with open(path) as f:
        before = f.read()
    try:
        yield
    finally:
        with open(path, "w") as f:
            f.write(before)


async def _cleanup(manager: NetworkManager) -> None:
    await asyncio.to_thread(_remove_test_leftovers, manager.prefix)
    await manager.reclaim(set())


@pytest.fixture
async def manager() -> AsyncIterator[NetworkManager]:
    mgr = NetworkManager(_new_prefix(), SUBNET, max_slots=64)
    try:
        yield mgr
    finally:
        await _cleanup(mgr)


def _guest_socket(guest: str, kind: socket.SocketKind, port: int) -> socket.socket:
    sock: socket.socket = netns.create_socket(guest, socket.AF_INET, kind)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((GUEST_IP, port))
    sock.settimeout(5)
    if kind == socket.SOCK_STREAM:
        sock.listen()
    return sock


def _guest_can_connect(guest: str, address: str, port: int) -> bool:
    sock = netns.create_socket(guest, socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(1)
    try:
        sock.connect((address, port))
    except OSError:
        return False
    finally:
        sock.close()
    return True


async def _assert_host_reaches_guest_tcp(net: SandboxNetwork, guest: str) -> None:
    listener = await asyncio.to_thread(_guest_socket, guest, socket.SOCK_STREAM, PORT)
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(net.guest_address, PORT), timeout=5
        )
        conn, peer = await asyncio.to_thread(listener.accept)
        with conn:
            # No SNAT on the way in: the guest sees the host end of the veth.
            assert peer[0] == net.host_ip
            conn.sendall(b"from-guest")
        assert await asyncio.wait_for(reader.read(), timeout=5) == b"from-guest"
        writer.close()
        await writer.wait_closed()
    finally:
        listener.close()


def _assert_host_reaches_guest_udp(net: SandboxNetwork, guest: str) -> None:
    server = _guest_socket(guest, socket.SOCK_DGRAM, PORT)
    with server, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
        client.settimeout(5)
        client.sendto(b"ping", (net.guest_address, PORT))
        data, peer = server.recvfrom(64)
        assert (data, peer[0]) == (b"ping", net.host_ip)
        server.sendto(b"pong", peer)
        data, source = client.recvfrom(64)
        assert (data, source[0]) == (b"pong", net.guest_address)


# -- pure computation ------------------------------------------------------------------------


def test_describe_names_and_addresses() -> None:
    mgr = NetworkManager("ae1a2b", "10.200.0.0/16")
    net = mgr.describe(3)
    assert net == SandboxNetwork(
        slot=3,
        netns="ae1a2b-3",
        tap=TAP_NAME,
        host_veth="ae1a2bh3",
        host_ip="10.200.0.13",
        guest_address="10.200.0.14",
        guest_mac=GUEST_MAC,
    )
    assert mgr.max_slots == 16384
    assert len(mgr.describe(mgr.max_slots - 1).host_veth) <= 15


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        (("AE",), {}),
        (("ae-1",), {}),
        (("aeh1",), {}),
        (("averylongprefix",), {}),
        (("ae", "not-a-subnet"), {}),
        (("ae", "10.0.0.0/31"), {}),
        (("ae", "169.254.0.0/16"), {}),
        (("ae", "10.200.0.0/24"), {"max_slots": 65}),
        (("ae", "10.200.0.0/24"), {"max_slots": 0}),
    ],
)
def test_bad_configuration_is_rejected(args: tuple[str, ...], kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        NetworkManager(*args, **kwargs)


def test_bad_slot_is_rejected() -> None:
    mgr = NetworkManager("ae", "10.200.0.0/24")
    for slot in (-1, 64):
        with pytest.raises(ValueError):
            mgr.describe(slot)
    with pytest.raises(TypeError):
        mgr.describe(True)


# -- real namespaces -------------------------------------------------------------------------


@needs_root
async def test_create_configures_namespace_and_veth(manager: NetworkManager) -> None:
    net = await manager.create(0)
    assert net == manager.describe(0)
    assert await asyncio.to_thread(manager.resources) == sorted([net.netns, net.host_veth])
    assert await asyncio.to_thread(_ipv4_addresses, net.netns, TAP_NAME) == [
        (GUEST_GATEWAY, GUEST_PREFIX)
    ]
    assert await asyncio.to_thread(_link_is_up, net.netns, TAP_NAME)
    assert await asyncio.to_thread(_ipv4_addresses, net.netns, "veth0") == [(net.guest_address, 30)]
    assert await asyncio.to_thread(_ipv4_addresses, None, net.host_veth) == [(net.host_ip, 30)]


@needs_root
async def test_host_reaches_guest_ports_through_dnat(manager: NetworkManager) -> None:
    net = await manager.create(1)
    guest = await asyncio.to_thread(_attach_fake_guest, net)
    await _assert_host_reaches_guest_tcp(net, guest)
    await asyncio.to_thread(_assert_host_reaches_guest_udp, net, guest)


@needs_root
async def test_guest_cannot_open_connections_without_internet(manager: NetworkManager) -> None:
    net = await manager.create(2)
    guest = await asyncio.to_thread(_attach_fake_guest, net)
    # Replies flow back to the host (so routing and SNAT-less return work) ...
    await _assert_host_reaches_guest_tcp(net, guest)
    with socket.create_server((net.host_ip, PORT)):
        # ... but a connection the guest opens is dropped.
        assert not await asyncio.to_thread(_guest_can_connect, guest, net.host_ip, PORT)


@needs_root
async def test_internet_access_rules_are_added_and_removed(manager: NetworkManager) -> None:
    table = f"agentenv_{manager.prefix}"
    with _host_ip_forward_preserved():
        net = await manager.create(3, policy=EgressPolicy(allow_internet=True))
        other = await manager.create(4, policy=EgressPolicy(allow_internet=True))
        host_rules = [table, f"{table}/slot3", f"{table}/slot4"]
        assert await asyncio.to_thread(manager.resources) == sorted(
            [net.netns, net.host_veth, other.netns, other.host_veth, *host_rules]
        )
        assert await asyncio.to_thread(_host_ip_forward) == "1"
        guest = await asyncio.to_thread(_attach_fake_guest, net)
        await _assert_host_reaches_guest_tcp(net, guest)
        with socket.create_server((net.host_ip, PORT)):
            # The guest may go out, but not into services of the host itself.
            assert not await asyncio.to_thread(_guest_can_connect, guest, net.host_ip, PORT)

        await manager.destroy(3)
        assert await asyncio.to_thread(manager.resources) == sorted(
            [other.netns, other.host_veth, table, f"{table}/slot4"]
        )
        await manager.destroy(4)
        assert await asyncio.to_thread(manager.resources) == []


@needs_root
async def test_destroy_removes_everything_and_is_idempotent(manager: NetworkManager) -> None:
    net = await manager.create(5)
    await asyncio.to_thread(_attach_fake_guest, net)
    await manager.destroy(5)
    assert await asyncio.to_thread(manager.resources) == []
    assert net.netns not in netns.listnetns()
    await manager.destroy(5)
    await manager.destroy(6)  # never created
    assert await asyncio.to_thread(manager.resources) == []


@needs_root
async def test_create_replaces_leftovers_of_the_same_slot(manager: NetworkManager) -> None:
    await manager.create(7)
    fresh = NetworkManager(manager.prefix, SUBNET, max_slots=64)  # as after a restart
    net = await fresh.create(7)
    assert await asyncio.to_thread(manager.resources) == sorted([net.netns, net.host_veth])
    guest = await asyncio.to_thread(_attach_fake_guest, net)
    await _assert_host_reaches_guest_tcp(net, guest)


@needs_root
async def test_failed_create_leaves_nothing_behind(manager: NetworkManager) -> None:
    net = manager.describe(8)
    squatter = f"{manager.prefix}x8"

    def occupy_slot_block() -> None:
        with IPRoute() as ipr:
            # (veth rather than dummy: this kernel has no dummy driver)
            ipr.link("add", ifname=squatter, kind="veth", peer=f"{squatter}p")
            index = ipr.link_lookup(ifname=squatter)[0]
            ipr.addr("add", index=index, address=net.host_ip, prefixlen=30)

    await asyncio.to_thread(occupy_slot_block)
    with pytest.raises(NetworkError, match="already in use"):
        await manager.create(8)
    assert await asyncio.to_thread(manager.resources) == []


@needs_root
async def test_reclaim_removes_only_slots_not_kept(manager: NetworkManager) -> None:
    with _host_ip_forward_preserved():
        for slot in (10, 11, 12):
            await manager.create(slot, policy=EgressPolicy(allow_internet=slot == 12))
        # A new manager with the same prefix, as a restarted server would have.
        restarted = NetworkManager(manager.prefix, SUBNET, max_slots=64)
        removed = await restarted.reclaim({11})
    table = f"agentenv_{manager.prefix}"
    doomed = [manager.describe(10), manager.describe(12)]
    assert sorted(removed) == sorted(
        [n.netns for n in doomed] + [n.host_veth for n in doomed] + [f"{table}/slot12", table]
    )
    kept = manager.describe(11)
    assert await asyncio.to_thread(manager.resources) == sorted([kept.netns, kept.host_veth])
    assert await restarted.reclaim({11}) == []


@needs_root
async def test_managers_with_different_prefixes_are_independent(
    manager: NetworkManager,
) -> None:
    other = NetworkManager(_new_prefix(), OTHER_SUBNET, max_slots=64)
    try:
        mine = await manager.create(0)
        theirs = await other.create(0)
        assert await asyncio.to_thread(other.resources) == sorted([theirs.netns, theirs.host_veth])
        assert await manager.reclaim(set()) == [mine.netns, mine.host_veth]
        await manager.destroy(0)
        assert await asyncio.to_thread(manager.resources) == []
        assert await asyncio.to_thread(other.resources) == sorted([theirs.netns, theirs.host_veth])
        guest = await asyncio.to_thread(_attach_fake_guest, theirs)
        await _assert_host_reaches_guest_tcp(theirs, guest)
    finally:
        await _cleanup(other)
    assert await asyncio.to_thread(other.resources) == []


@needs_root
async def test_concurrent_creates(manager: NetworkManager) -> None:
    slots = [20, 21, 22, 23]
    nets = await asyncio.gather(*(manager.create(slot) for slot in slots))
    expected = sorted(name for n in nets for name in (n.netns, n.host_veth))
    assert await asyncio.to_thread(manager.resources) == expected
    for net in nets:
        assert await asyncio.to_thread(_ipv4_addresses, net.netns, "veth0") == [
            (net.guest_address, 30)
        ]
        assert await asyncio.to_thread(_ipv4_addresses, net.netns, TAP_NAME) == [
            (GUEST_GATEWAY, GUEST_PREFIX)
        ]
    guest = await asyncio.to_thread(_attach_fake_guest, nets[-1])
    await _assert_host_reaches_guest_tcp(nets[-1], guest)
    await asyncio.gather(*(manager.destroy(slot) for slot in slots))
    assert await asyncio.to_thread(manager.resources) == []


@needs_root
async def test_cancelled_create_leaves_nothing_behind(manager: NetworkManager) -> None:
    cancelled = 0
    for slot in range(30, 40):
        task = asyncio.create_task(manager.create(slot))
        # Cancel once the namespace exists, i.e. in the middle of building.
        for _ in range(10_000):
            if task.done() or manager.describe(slot).netns in netns.listnetns():
                break
            await asyncio.sleep(0.0005)
        if task.cancel():
            with pytest.raises(asyncio.CancelledError):
                await task
            cancelled += 1
            assert await asyncio.to_thread(manager.resources) == []
        else:
            await task
            await manager.destroy(slot)
        if cancelled >= 3:
            break
    assert cancelled > 0


@needs_root
def test_pick_free_subnet_skips_blocks_in_use() -> None:
    first = pick_free_subnet(0)
    assert ipaddress.IPv4Network(first).subnet_of(ipaddress.IPv4Network("10.128.0.0/9"))
    manager = NetworkManager(prefix="aepick", subnet=first)
    asyncio.run(manager.create(0))
    try:
        # The block now carries an address, so the same search moves past it.
        assert pick_free_subnet(0) != first
    finally:
        asyncio.run(manager.destroy(0))
    assert pick_free_subnet(0) == first


# -- egress policy, against a fake internet -------------------------------------------------
#
# A namespace "<prefix>-net-guest" stands in for everything beyond the host: the manager is
# told a veth into it is the default interface, and it holds public-looking, link-local and
# private addresses with host routes to them, as a LAN, a metadata service or the internet
# would be reached through the uplink.

UPLINK_HOST = "198.51.100.1"  # the host's address on the fake uplink (TEST-NET-2)
UPLINK_FAR = "198.51.100.2"
PUBLIC = "203.0.113.5"  # TEST-NET-3: "the internet"
OTHER_PUBLIC = "203.0.113.6"
METADATA = "169.254.169.254"
PRIVATE_10 = "10.254.77.5"
PRIVATE_192 = "192.168.77.5"
FAR_ADDRESSES = (PUBLIC, OTHER_PUBLIC, METADATA, PRIVATE_10, PRIVATE_192)


def _build_fake_internet(prefix: str) -> tuple[str, str]:
    """(uplink interface on the host, namespace beyond it)."""
    far, uplink = f"{prefix}-net-guest", f"{prefix}xn"
    netns.create(far)
    with IPRoute() as host:
        host.link("add", ifname=uplink, kind="veth", peer={"ifname": "eth0", "net_ns_fd": far})
        index = host.link_lookup(ifname=uplink)[0]
        host.addr("add", index=index, address=UPLINK_HOST, prefixlen=30)
        host.link("set", index=index, state="up")
        for address in FAR_ADDRESSES:
            host.route("add", dst=f"{address}/32", gateway=UPLINK_FAR)
    with IPRoute(netns=far) as ipr:
        ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
        eth0 = ipr.link_lookup(ifname="eth0")[0]
        ipr.addr("add", index=eth0, address=UPLINK_FAR, prefixlen=30)
        for address in FAR_ADDRESSES:
            ipr.addr("add", index=eth0, address=address, prefixlen=32)
        ipr.link("set", index=eth0, state="up")
        ipr.route("add", dst="0.0.0.0/0", gateway=UPLINK_HOST)
    return uplink, far


@pytest.fixture
async def internet(manager: NetworkManager, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[str]:
    """The fake internet's namespace; the manager sends sandboxes' traffic into it."""
    with _host_ip_forward_preserved():
        uplink, far = await asyncio.to_thread(_build_fake_internet, manager.prefix)
        monkeypatch.setattr("agentenv.network.uplink.default_interface", lambda: uplink)
        yield far


def _listen(ns: str, kind: socket.SocketKind, address: str, port: int) -> socket.socket:
    sock: socket.socket = netns.create_socket(ns, socket.AF_INET, kind)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, port))
    sock.settimeout(2)
    if kind == socket.SOCK_STREAM:
        sock.listen(16)
    return sock


def _reachable(guest: str, far: str, addresses: tuple[str, ...]) -> set[str]:
    """Which of `addresses` (listeners in `far`, or on the host when not there) a TCP
    connection from the guest reaches."""
    reached = set()
    for address in addresses:
        ns = far if address in (*FAR_ADDRESSES, UPLINK_FAR) else None
        listener = _listen(ns, socket.SOCK_STREAM, address, PORT) if ns else None
        host_listener = None if ns else socket.create_server((address, PORT))
        try:
            if _guest_can_connect(guest, address, PORT):
                reached.add(address)
        finally:
            for sock in (listener, host_listener):
                if sock is not None:
                    sock.close()
    return reached


def _guest_dns_arrives(guest: str, far: str, server: str, kind: socket.SocketKind) -> bool:
    with _listen(far, kind, server, 53) as listener:
        client = netns.create_socket(guest, socket.AF_INET, kind)
        client.settimeout(1)
        try:
            if kind == socket.SOCK_DGRAM:
                client.sendto(b"query", (server, 53))
                return listener.recvfrom(64)[0] == b"query"
            client.connect((server, 53))
            return True
        except OSError:
            return False
        finally:
            client.close()


@needs_root
async def test_blocked_ranges_open_only_when_named(manager: NetworkManager, internet: str) -> None:
    net = await manager.create(40, policy=EgressPolicy(allow_internet=True))
    guest = await asyncio.to_thread(_attach_fake_guest, net)
    # Only the public address: not the host (its uplink address, its veth end), not the
    # host's connected network, not link-local, RFC 1918 or another sandbox's block.
    probes = (PUBLIC, METADATA, PRIVATE_10, PRIVATE_192, UPLINK_FAR, UPLINK_HOST, net.host_ip)
    assert await asyncio.to_thread(_reachable, guest, internet, probes) == {PUBLIC}

    opened = EgressPolicy.parse(
        allow_internet=True, allow_out=[METADATA, "10.254.77.0/24", "0.0.0.0/0", UPLINK_FAR]
    )
    await manager.update_policy(40, opened)
    # Named ranges open; 0.0.0.0/0 names none of them; the host's own addresses stay shut.
    assert await asyncio.to_thread(_reachable, guest, internet, probes) == {
        PUBLIC,
        METADATA,
        PRIVATE_10,
        UPLINK_FAR,
    }


@needs_root
async def test_every_refusal_is_answered_at_once(manager: NetworkManager) -> None:
    """Refusals are ICMP errors; the kernel's per-peer ICMP limit (6, then one a second)
    must not turn later ones into silent drops that a guest sees as timeouts."""
    net = await manager.create(41, policy=EgressPolicy(allow_internet=True))
    guest = await asyncio.to_thread(_attach_fake_guest, net)

    def refusals() -> list[str]:
        outcomes = []
        for n in range(20):
            sock = netns.create_socket(guest, socket.AF_INET, socket.SOCK_STREAM)
            # Far below the SYN retransmission (1 s) a rate-limited refusal waits for.
            sock.settimeout(0.8)
            try:
                sock.connect((f"10.254.77.{n + 1}", 80))
                outcomes.append("connected")
            except TimeoutError:
                outcomes.append("timeout")
            except OSError as exc:
                outcomes.append(errno.errorcode.get(exc.errno or 0, str(exc)))
            finally:
                sock.close()
        return outcomes

    assert await asyncio.to_thread(refusals) == ["EHOSTUNREACH"] * 20


@needs_root
async def test_allow_out_deny_out_and_allow_internet(
    manager: NetworkManager, internet: str
) -> None:
    probes = (PUBLIC, OTHER_PUBLIC)
    net = await manager.create(
        41, policy=EgressPolicy.parse(allow_internet=True, deny_out=["203.0.113.0/24"])
    )
    guest = await asyncio.to_thread(_attach_fake_guest, net)
    assert await asyncio.to_thread(_reachable, guest, internet, probes) == set()

    # allow_out wins over deny_out.
    await manager.update_policy(
        41, EgressPolicy.parse(allow_internet=True, allow_out=[PUBLIC], deny_out=["0.0.0.0/0"])
    )
    assert await asyncio.to_thread(_reachable, guest, internet, probes) == {PUBLIC}

    # Without internet access, allow_out is all that leaves.
    await manager.update_policy(41, EgressPolicy.parse(allow_internet=False, allow_out=[PUBLIC]))
    assert await asyncio.to_thread(_reachable, guest, internet, probes) == {PUBLIC}

    await manager.update_policy(41, EgressPolicy(allow_internet=False))
    assert await asyncio.to_thread(_reachable, guest, internet, probes) == set()
    assert not await asyncio.to_thread(
        _guest_dns_arrives, guest, internet, PUBLIC, socket.SOCK_DGRAM
    )
    # Nothing may leave, so the host no longer forwards or masquerades for the slot.
    assert f"agentenv_{manager.prefix}/slot41" not in await asyncio.to_thread(manager.resources)

    await manager.update_policy(41, EgressPolicy(allow_internet=True))
    assert await asyncio.to_thread(_reachable, guest, internet, probes) == set(probes)


@needs_root
async def test_dns_goes_only_to_the_named_servers(manager: NetworkManager, internet: str) -> None:
    policy = EgressPolicy.parse(allow_internet=True, dns_servers=[PUBLIC, METADATA])
    net = await manager.create(42, policy=policy)
    guest = await asyncio.to_thread(_attach_fake_guest, net)
    for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
        # A named server is reachable on port 53 even inside a blocked range ...
        for server in (PUBLIC, METADATA):
            assert await asyncio.to_thread(_guest_dns_arrives, guest, internet, server, kind)
        # ... and no other server is, although the internet is open.
        assert not await asyncio.to_thread(_guest_dns_arrives, guest, internet, OTHER_PUBLIC, kind)
    # Port 53 is all naming a server opens.
    assert await asyncio.to_thread(_reachable, guest, internet, (PUBLIC, METADATA)) == {PUBLIC}


@needs_root
async def test_policy_update_keeps_established_connections(
    manager: NetworkManager, internet: str
) -> None:
    net = await manager.create(43, policy=EgressPolicy(allow_internet=True))
    guest = await asyncio.to_thread(_attach_fake_guest, net)
    listener = await asyncio.to_thread(_listen, internet, socket.SOCK_STREAM, PUBLIC, PORT)
    client = netns.create_socket(guest, socket.AF_INET, socket.SOCK_STREAM)
    client.settimeout(2)
    try:
        await asyncio.to_thread(client.connect, (PUBLIC, PORT))
        conn, _ = await asyncio.to_thread(listener.accept)
        with conn:
            await manager.update_policy(
                43, EgressPolicy.parse(allow_internet=True, deny_out=[PUBLIC])
            )
            # The open connection continues; a new one is refused.
            client.sendall(b"still open")
            assert await asyncio.to_thread(conn.recv, 64) == b"still open"
            assert not await asyncio.to_thread(_guest_can_connect, guest, PUBLIC, PORT)
    finally:
        client.close()
        listener.close()


@needs_root
async def test_update_policy_needs_a_live_network(manager: NetworkManager) -> None:
    with pytest.raises(NetworkError, match="no network"):
        await manager.update_policy(44, EgressPolicy(allow_internet=True))


# -- host names: the egress filter ----------------------------------------------------------

NAMES = {
    "allowed.example": PUBLIC,
    "api.wild.example": PUBLIC,
    "meta.wild.example": METADATA,
    "evil.example": OTHER_PUBLIC,
}


@contextmanager
def _far_servers(far: str, ports: tuple[int, ...], shown: int = 40) -> Iterator[None]:
    """On every fake-internet address and port: read what arrives, answer with the
    address that answered and the first `shown` bytes received (hex), close."""
    listeners = [
        _listen(far, socket.SOCK_STREAM, address, port)
        for address in FAR_ADDRESSES
        for port in ports
    ]

    def serve(listener: socket.socket) -> None:
        address = listener.getsockname()[0]
        while True:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                with suppress(OSError):
                    received = conn.recv(65536)
                    # Hex, not repr: repr's quotes change with the bytes received.
                    conn.sendall(f"{address} {received[:shown].hex()}".encode())

    threads = [threading.Thread(target=serve, args=(sock,), daemon=True) for sock in listeners]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        for sock in listeners:
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def _client_hello(name: str) -> bytes:
    """A real TLS ClientHello with SNI `name`, as Python's ssl module sends it."""
    context = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=name)
    with suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def _guest_exchange(guest: str, address: str, port: int, payload: bytes) -> str | None:
    """What the far side answered to `payload` sent from the guest, or None if the
    connection was refused or closed without an answer."""
    sock = netns.create_socket(guest, socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(3)
    try:
        sock.connect((address, port))
        sock.sendall(payload)
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    except OSError:
        return None
    finally:
        sock.close()
    return answer.decode() or None


def _http(name: str) -> bytes:
    return f"GET / HTTP/1.1\r\nHost: {name}\r\nAccept: */*\r\n\r\n".encode()


async def _fake_resolve(name: str) -> list[ipaddress.IPv4Address]:
    if name not in NAMES:
        raise socket.gaierror(socket.EAI_NONAME, "unknown name")
    return [ipaddress.IPv4Address(NAMES[name])]


@needs_root
async def test_host_names_are_decided_on_sni_and_host(
    manager: NetworkManager, internet: str
) -> None:
    manager.egress_filter.resolve = _fake_resolve
    policy = EgressPolicy.parse(
        allow_internet=False, allow_out=["allowed.example", "*.wild.example"]
    )
    net = await manager.create(45, policy=policy)
    guest = await asyncio.to_thread(_attach_fake_guest, net)
    with _far_servers(internet, (80, 443, PORT)):

        def exchange(address: str, port: int, payload: bytes) -> str | None:
            return _guest_exchange(guest, address, port, payload)

        # An allowed name reaches what it resolves to on the host ...
        answer = await asyncio.to_thread(exchange, PUBLIC, 80, _http("allowed.example"))
        assert answer is not None and answer.startswith(f"{PUBLIC} {b'GET / HTTP/1.1'.hex()}")
        answer = await asyncio.to_thread(exchange, PUBLIC, 443, _client_hello("api.wild.example"))
        assert answer is not None and answer.startswith(f"{PUBLIC} 1603")
        # ... whatever address the guest sent it to: naming an allowed host never opens
        # another server, nor the metadata service.
        for address in (OTHER_PUBLIC, METADATA):
            answer = await asyncio.to_thread(exchange, address, 80, _http("allowed.example"))
            assert answer is not None and answer.startswith(PUBLIC)
        # Other names, names that resolve into blocked ranges, no name: refused.
        for address, port, payload in [
            (OTHER_PUBLIC, 80, _http("evil.example")),
            (OTHER_PUBLIC, 443, _client_hello("evil.example")),
            (PUBLIC, 80, _http("meta.wild.example")),
            (METADATA, 80, _http("meta.wild.example")),
            (PUBLIC, 80, b"GET / HTTP/1.0\r\n\r\n"),
            (PUBLIC, 443, b"\x16\x03\x01\x00\x05hello"),
        ]:
            assert await asyncio.to_thread(exchange, address, port, payload) is None, payload
        # Other ports are decided by address alone.
        assert await asyncio.to_thread(exchange, PUBLIC, PORT, _http("allowed.example")) is None

        # The filter follows policy changes: a deny_out name, then no names at all.
        await manager.update_policy(
            45, EgressPolicy.parse(allow_internet=True, deny_out=["evil.example"])
        )
        assert await asyncio.to_thread(exchange, OTHER_PUBLIC, 80, _http("evil.example")) is None
        answer = await asyncio.to_thread(exchange, OTHER_PUBLIC, 80, _http("other.example"))
        assert answer is not None and answer.startswith(OTHER_PUBLIC)
        await manager.update_policy(45, EgressPolicy(allow_internet=True))
        assert not manager.egress_filter.serving(45)
        answer = await asyncio.to_thread(exchange, OTHER_PUBLIC, 80, _http("evil.example"))
        assert answer is not None and answer.startswith(OTHER_PUBLIC)
    await manager.destroy(45)


SECRET_VALUE = "s3cret-value-the-guest-never-holds"


async def _secret(name: str) -> str:
    if name == "tok":
        return SECRET_VALUE
    raise LookupError(f"no secret {name!r}")


def _received(answer: str | None) -> bytes:
    """What a far server received, from its answer (see ``_far_servers``)."""
    assert answer is not None
    return bytes.fromhex(answer.split(" ", 1)[1])


@needs_root
async def test_rules_add_headers_on_the_host(manager: NetworkManager, internet: str) -> None:
    """Network ``rules`` headers reach the allowed host with the secret resolved by the
    filter; the guest's own header of that name is dropped; TLS, other hosts and other
    addresses are untouched; a secret that does not resolve closes the connection."""
    manager.egress_filter.resolve = _fake_resolve
    manager.resolve_secrets_with(_secret)
    header = {"Authorization": "Bearer ${e2b.secrets.tok}"}
    policy = EgressPolicy.parse(
        allow_internet=False,
        allow_out=["allowed.example", "*.wild.example", OTHER_PUBLIC],
        rules={
            "allowed.example": [{"transform": {"headers": header}}],
            OTHER_PUBLIC: [{"transform": {"headers": {"X-Net": "n-${e2b.secrets.tok}"}}}],
        },
    )
    net = await manager.create(46, policy=policy)
    guest = await asyncio.to_thread(_attach_fake_guest, net)
    with _far_servers(internet, (80, 443), shown=4096):

        def exchange(address: str, port: int, payload: bytes) -> str | None:
            return _guest_exchange(guest, address, port, payload)

        guest_request = (
            b"POST /v1 HTTP/1.1\r\nHost: allowed.example\r\nauthorization: guest-made\r\n"
            b"Content-Length: 2\r\n\r\nhi"
        )
        # Sent to any address, it goes where the filter resolved the name, with the header.
        answer = await asyncio.to_thread(exchange, METADATA, 80, guest_request)
        assert answer is not None and answer.startswith(PUBLIC)
        received = _received(answer)
        assert f"Authorization: Bearer {SECRET_VALUE}".encode() in received.split(b"\r\n")
        assert b"guest-made" not in received and received.endswith(b"\r\n\r\nhi")
        assert b"Connection: close" in received
        # A network rule: by the address connected to, whatever the Host says.
        received = _received(await asyncio.to_thread(exchange, OTHER_PUBLIC, 80, _http("x.y")))
        assert f"X-Net: n-{SECRET_VALUE}".encode() in received
        # No rule for the name: unchanged. TLS: relayed untouched.
        unchanged = _http("api.wild.example")
        assert _received(await asyncio.to_thread(exchange, PUBLIC, 80, unchanged)) == unchanged
        hello = _client_hello("allowed.example")
        assert _received(await asyncio.to_thread(exchange, PUBLIC, 443, hello)) == hello[:4096]

        # A rule whose secret does not resolve: the request never leaves.
        gone = "${e2b.secrets.gone}"
        await manager.update_policy(
            46,
            EgressPolicy.parse(
                allow_internet=False,
                allow_out=["allowed.example"],
                rules={"allowed.example": [{"transform": {"headers": {"X": gone}}}]},
            ),
        )
        assert await asyncio.to_thread(exchange, PUBLIC, 80, _http("allowed.example")) is None
    await manager.destroy(46)


# -- a host without a default route ----------------------------------------------------------
def _connect_errno(ns: str | None, address: str, port: int) -> int | None:
    """The errno a TCP connect from ``ns`` (None: the calling thread's) ends with; None
    if it connects, -1 if it times out."""
    if ns is None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    else:
        sock = netns.create_socket(ns, socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(5)
    try:
        sock.connect((address, port))
    except TimeoutError:
        return -1
    except OSError as exc:
        return exc.errno
    finally:
        sock.close()
    return None


@needs_root
def test_internet_access_without_a_default_route(caplog: pytest.LogCaptureFixture) -> None:
    """The manager runs in a namespace standing for a host with no default route: a
    network asking for the internet is made, the guest still reaches the host both ways,
    its connections out fail at once as the host's own do, and the warning is said once."""
    prefix = _new_prefix()
    host_ns = f"{prefix}-noroute-guest"  # "-guest": removed with the test's leftovers
    outcome: dict[str, Any] = {}

    async def scenario() -> None:
        manager = NetworkManager(prefix, SUBNET, max_slots=8)
        try:
            await manager.reclaim(set())  # what a server does at start-up
            nets = [
                await manager.create(slot, policy=EgressPolicy(allow_internet=True))
                for slot in (2, 3)
            ]
            guest = await asyncio.to_thread(_attach_fake_guest, nets[0])
            await _assert_host_reaches_guest_tcp(nets[0], guest)
            outcome["guest"] = await asyncio.to_thread(_connect_errno, guest, "203.0.113.7", 80)
            outcome["host"] = await asyncio.to_thread(_connect_errno, None, "203.0.113.7", 80)
        finally:
            await asyncio.to_thread(_remove_test_leftovers, prefix)
            await manager.reclaim(set())

    def in_host_namespace() -> None:
        try:
            netns.setns(host_ns, flags=0)
            with IPRoute() as ipr:
                ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
                assert not ipr.get_default_routes(family=socket.AF_INET)
            asyncio.run(scenario())
        except BaseException as exc:
            outcome["error"] = exc

    netns.create(host_ns)
    try:
        with caplog.at_level("WARNING", logger="agentenv.network.manager"):
            thread = threading.Thread(target=in_host_namespace)
            thread.start()
            thread.join(timeout=60)
    finally:
        with suppress(FileNotFoundError):  # the scenario's clean-up removed it already
            netns.remove(host_ns)
    if "error" in outcome:
        raise outcome["error"]
    assert outcome["host"] == errno.ENETUNREACH
    assert outcome["guest"] == outcome["host"], outcome  # failing as the host's own
    warnings = [r for r in caplog.records if "no IPv4 default route" in r.getMessage()]
    assert len(warnings) == 1
