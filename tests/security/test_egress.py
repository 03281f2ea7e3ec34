"""A hostile guest against the host's egress enforcement, with real VMs through the real
server.

The finding these reproduce: with internet access, ``curl http://169.254.169.254/`` from a
guest left the host, because the host accepted everything from the sandbox veths toward
the uplink: link-local (cloud metadata), RFC 1918 and the host's own LAN were open. What
counts is what leaves through the host's default interface, so a counter table on that
interface records every packet to the probed addresses.

Sandboxes are created, and their rules changed while they run, through the API as e2b's
SDK sends them (the create body's ``network``, ``PUT /sandboxes/{id}/network``). Only the
host-name test applies its policy from a :class:`NetworkManager` in this process (with the
server's prefix and subnet), so its filter resolves names with a resolver the test
controls: this host has no DNS to the internet.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import socket
import sqlite3
import subprocess
from collections.abc import AsyncIterator, Iterator

import pytest
from pyroute2 import IPRoute

from agentenv.config import Config
from agentenv.network import EgressPolicy, NetworkManager
from agentenv.orchestrator.resources import resolve_subnet
from tests.helpers import ServerProcess, create_sandbox_id, run_command

pytestmark = pytest.mark.vm

PROBE_PORT = 18181
METADATA = "169.254.169.254"
PRIVATE_10 = "10.254.77.5"
PRIVATE_192 = "192.168.77.5"
PUBLIC = "1.1.1.1"  # reached only if this host has internet access; else those parts skip
OTHER_PUBLIC = "1.0.0.1"
COUNTER_TABLE = "aenv_egress_probe"

# Run in the guest: try each host:port, print what happened. A refusal by the policy is
# ICMP "administratively prohibited" (EHOSTUNREACH); a connection, or a reset from the far
# end, reached it.
GUEST_PROBE = r"""
import errno, socket, sys
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    s = socket.socket()
    s.settimeout(3)
    try:
        s.connect((host, int(port)))
        print(target, "reached")
    except ConnectionRefusedError:
        print(target, "reached")
    except TimeoutError:
        print(target, "timeout")
    except OSError as e:
        print(target, "prohibited" if e.errno == errno.EHOSTUNREACH else f"errno{e.errno}")
    finally:
        s.close()
"""


def _uplink() -> tuple[str, ipaddress.IPv4Address, ipaddress.IPv4Address]:
    """(default interface, its address, the default gateway)."""
    with IPRoute() as ipr:
        (route,) = ipr.get_default_routes(family=socket.AF_INET)[:1]
        index = route.get_attr("RTA_OIF")
        name = ipr.link("get", index=index)[0].get_attr("IFLA_IFNAME")
        address = ipr.get_addr(family=socket.AF_INET, index=index)[0].get_attr("IFA_ADDRESS")
        return (
            name,
            ipaddress.IPv4Address(address),
            ipaddress.IPv4Address(route.get_attr("RTA_GATEWAY")),
        )


UPLINK, HOST_ADDRESS, GATEWAY = _uplink()
COUNTED = (METADATA, PRIVATE_10, PRIVATE_192, str(GATEWAY), PUBLIC, OTHER_PUBLIC)


def _nft(script: str) -> None:
    subprocess.run(["nft", "-f", "-"], input=script, text=True, check=True)


@pytest.fixture
def uplink_counters() -> Iterator[dict[str, int]]:
    """Packets sent out of the default interface to each of :data:`COUNTED`, read on
    demand: ``counters()`` refreshes the dict it yields."""
    rules = "".join(
        f'        oifname "{UPLINK}" ip daddr {address} counter\n' for address in COUNTED
    )
    _nft(
        f"table ip {COUNTER_TABLE} {{\n    chain out {{\n"
        "        type filter hook postrouting priority 300; policy accept;\n"
        f"{rules}    }}\n}}\n"
    )
    counts: dict[str, int] = {}
    try:
        yield counts
    finally:
        _nft(f"delete table ip {COUNTER_TABLE}\n")


def _read_counters(counts: dict[str, int]) -> dict[str, int]:
    listing = subprocess.run(
        ["nft", "-j", "list", "table", "ip", COUNTER_TABLE],
        capture_output=True,
        text=True,
        check=True,
    )
    counts.clear()
    for item in json.loads(listing.stdout)["nftables"]:
        rule = item.get("rule")
        if not rule:
            continue
        address = packets = None
        for expr in rule["expr"]:
            if "match" in expr and expr["match"]["left"].get("payload", {}).get("field") == "daddr":
                address = expr["match"]["right"]
            if "counter" in expr:
                packets = expr["counter"]["packets"]
        if address is not None and packets is not None:
            counts[address] = int(packets)
    return counts


@pytest.fixture
def host_listeners() -> Iterator[list[str]]:
    """Listeners on the host's own addresses: its uplink address, and a veth pair (this
    kernel has no dummy driver) carrying link-local and private addresses, removed after.
    Yields their ``host:port`` targets."""
    local = ("169.254.170.9", "10.254.78.9", "192.168.78.9")
    with IPRoute() as ipr:
        ipr.link("add", ifname="aeegrx0", kind="veth", peer="aeegrx1")
        index = ipr.link_lookup(ifname="aeegrx0")[0]
        for address in local:
            ipr.addr("add", index=index, address=address, prefixlen=32)
        ipr.link("set", index=index, state="up")
    sockets = []
    try:
        for address in (str(HOST_ADDRESS), *local):
            sockets.append(socket.create_server((address, PROBE_PORT)))
        yield [f"{address}:{PROBE_PORT}" for address in (str(HOST_ADDRESS), *local)]
    finally:
        for sock in sockets:
            sock.close()
        with IPRoute() as ipr:
            with contextlib.suppress(Exception):
                ipr.link("del", index=ipr.link_lookup(ifname="aeegrx0")[0])


def _host_has_internet() -> bool:
    try:
        socket.create_connection((PUBLIC, 443), timeout=3).close()
    except OSError:
        return False
    return True


def _slot(server: ServerProcess, sandbox_id: str) -> int:
    config = Config.load(env={}, home=server.home)
    with contextlib.closing(
        sqlite3.connect(f"file:{config.home / 'state.db'}?mode=ro", uri=True)
    ) as db:
        (slot,) = db.execute(
            "SELECT slot FROM sandboxes WHERE sandbox_id = ?", (sandbox_id,)
        ).fetchone()
    return int(slot)


@pytest.fixture
async def server_network(server: ServerProcess) -> AsyncIterator[NetworkManager]:
    """A manager for the server's sandbox networks (its prefix and subnet)."""
    config = Config.load(env={}, home=server.home)
    manager = NetworkManager(prefix=f"ae{config.instance_tag}", subnet=resolve_subnet(config))
    try:
        yield manager
    finally:
        await manager.egress_filter.close()


@pytest.fixture
def sandboxes(server: ServerProcess) -> Iterator[list[str]]:
    """Ids of sandboxes a test created; killed after it."""
    created: list[str] = []
    yield created
    with server.client() as client:
        for sandbox_id in created:
            client.delete(f"/sandboxes/{sandbox_id}")


def _new_sandbox(
    server: ServerProcess,
    sandboxes: list[str],
    *,
    internet: bool,
    network: dict[str, object] | None = None,
) -> str:
    body: dict[str, object] = {"timeout": 600, "allow_internet_access": internet}
    if network is not None:
        body["network"] = network
    sandbox_id = create_sandbox_id(server, "base", **body)
    sandboxes.append(sandbox_id)
    return sandbox_id


def _update_network(server: ServerProcess, sandbox_id: str, **body: object) -> None:
    """``PUT /sandboxes/{id}/network`` with the body e2b's ``Sandbox.update_network``
    sends: the rules given replace all the old ones."""
    with server.client() as client:
        answer = client.put(f"/sandboxes/{sandbox_id}/network", json=body)
    assert answer.status_code == 204, answer.text


async def _probe(server: ServerProcess, sandbox_id: str, targets: list[str]) -> dict[str, str]:
    command = f"python3 -c '{GUEST_PROBE}' " + " ".join(targets)
    result = await asyncio.to_thread(run_command, server.url, sandbox_id, command, timeout=120)
    assert result.exit_code == 0, result.stderr
    return dict(line.split(" ", 1) for line in result.stdout.splitlines())


async def _curl(server: ServerProcess, sandbox_id: str, arguments: str) -> str:
    """The HTTP status curl in the guest got ("000": no answer)."""
    command = f"curl -sk -o /dev/null -w '%{{http_code}}' --max-time 8 {arguments}; true"
    result = await asyncio.to_thread(run_command, server.url, sandbox_id, command, timeout=120)
    return result.stdout.strip()


async def test_guest_reaches_no_blocked_range_by_default(
    server: ServerProcess,
    sandboxes: list[str],
    uplink_counters: dict[str, int],
    host_listeners: list[str],
) -> None:
    """The reported finding: with internet access, nothing of link-local, RFC 1918, the
    host's LAN or the host itself is reachable, and no packet to them leaves the host."""
    sandbox_id = _new_sandbox(server, sandboxes, internet=True)
    blocked = [f"{address}:80" for address in (METADATA, PRIVATE_10, PRIVATE_192, GATEWAY)]
    outcome = await _probe(server, sandbox_id, blocked + host_listeners)
    assert all(outcome[target] == "prohibited" for target in blocked), outcome
    assert all(outcome[target] != "reached" for target in host_listeners), outcome
    counts = _read_counters(uplink_counters)
    assert all(
        counts[address] == 0 for address in (METADATA, PRIVATE_10, PRIVATE_192, str(GATEWAY))
    ), counts


async def test_allow_out_opens_only_what_it_names(
    server: ServerProcess,
    sandboxes: list[str],
    uplink_counters: dict[str, int],
    host_listeners: list[str],
) -> None:
    named_local = host_listeners[1].split(":")[0]
    sandbox_id = _new_sandbox(
        server,
        sandboxes,
        internet=True,
        network={"allowOut": [str(GATEWAY), METADATA, named_local, "0.0.0.0/0"]},
    )
    targets = [f"{GATEWAY}:80", f"{METADATA}:80", f"{PRIVATE_10}:80", host_listeners[1]]
    outcome = await _probe(server, sandbox_id, targets)
    # The named LAN host answers; the named metadata address is let out of the uplink
    # (nothing answers it here); an unnamed private address stays shut (0.0.0.0/0 names
    # no range); the host's own addresses stay shut even when named.
    assert outcome[f"{GATEWAY}:80"] == "reached", outcome
    assert outcome[f"{PRIVATE_10}:80"] == "prohibited", outcome
    assert outcome[host_listeners[1]] != "reached", outcome
    counts = _read_counters(uplink_counters)
    assert counts[METADATA] > 0 and counts[str(GATEWAY)] > 0 and counts[PRIVATE_10] == 0, counts


async def test_allow_internet_false_lets_nothing_out(
    server: ServerProcess, sandboxes: list[str], uplink_counters: dict[str, int]
) -> None:
    sandbox_id = _new_sandbox(server, sandboxes, internet=False)
    targets = [f"{PUBLIC}:443", f"{GATEWAY}:80", "8.8.8.8:53", f"{METADATA}:80"]
    outcome = await _probe(server, sandbox_id, targets)
    assert set(outcome.values()) == {"prohibited"}, outcome
    assert sum(_read_counters(uplink_counters).values()) == 0


async def test_deny_out_and_runtime_updates_change_what_a_running_guest_reaches(
    server: ServerProcess,
    sandboxes: list[str],
    uplink_counters: dict[str, int],
) -> None:
    if not _host_has_internet():
        pytest.skip(f"this host cannot reach {PUBLIC}:443")
    sandbox_id = _new_sandbox(server, sandboxes, internet=True)
    targets = [f"{PUBLIC}:443", f"{OTHER_PUBLIC}:443"]
    assert await _probe(server, sandbox_id, targets) == dict.fromkeys(targets, "reached")

    _update_network(server, sandbox_id, denyOut=[f"{PUBLIC}/32"], allow_internet_access=True)
    assert await _probe(server, sandbox_id, targets) == {
        targets[0]: "prohibited",
        targets[1]: "reached",
    }
    _update_network(server, sandbox_id, allowOut=[PUBLIC], allow_internet_access=False)
    assert await _probe(server, sandbox_id, targets) == {
        targets[0]: "reached",
        targets[1]: "prohibited",
    }
    _update_network(server, sandbox_id, allow_internet_access=False)
    assert await _probe(server, sandbox_id, targets) == dict.fromkeys(targets, "prohibited")
    # The sandbox still answers the host (envd) throughout.
    assert run_command(server.url, sandbox_id, "echo alive").stdout == "alive\n"


async def test_dns_goes_only_to_the_named_servers(
    server: ServerProcess, sandboxes: list[str]
) -> None:
    if not _host_has_internet():
        pytest.skip(f"this host cannot reach {PUBLIC}")
    sandbox_id = _new_sandbox(server, sandboxes, internet=True, network={"dnsServers": [PUBLIC]})
    outcome = await _probe(server, sandbox_id, [f"{PUBLIC}:53", "8.8.8.8:53", f"{PUBLIC}:443"])
    assert outcome == {
        f"{PUBLIC}:53": "reached",
        "8.8.8.8:53": "prohibited",
        f"{PUBLIC}:443": "reached",
    }, outcome


async def test_host_names_are_decided_on_sni_and_host(
    server: ServerProcess,
    sandboxes: list[str],
    server_network: NetworkManager,
    uplink_counters: dict[str, int],
) -> None:
    if not _host_has_internet():
        pytest.skip(f"this host cannot reach {PUBLIC}")
    names = {"one.one.one.one": PUBLIC, "meta.example": METADATA}

    async def resolve(name: str) -> list[ipaddress.IPv4Address]:
        if name not in names:
            raise socket.gaierror(socket.EAI_NONAME, name)
        return [ipaddress.IPv4Address(names[name])]

    server_network.egress_filter.resolve = resolve
    sandbox_id = _new_sandbox(server, sandboxes, internet=True)
    await server_network.update_policy(
        _slot(server, sandbox_id),
        EgressPolicy.parse(allow_internet=False, allow_out=["one.one.one.one", "meta.example"]),
    )
    one = f"--resolve one.one.one.one:443:{OTHER_PUBLIC} https://one.one.one.one/"
    evil = f"--resolve evil.example:443:{PUBLIC} https://evil.example/"
    # SNI: the allowed name is answered (by what it resolves to on the host), another
    # name on the same address is not.
    assert await _curl(server, sandbox_id, one) != "000"
    assert await _curl(server, sandbox_id, evil) == "000"
    # Host: likewise; and naming the allowed host while connecting to the metadata
    # address reaches the allowed host, never the metadata address.
    assert await _curl(server, sandbox_id, f"http://{PUBLIC}/ -H 'Host: one.one.one.one'") != "000"
    assert await _curl(server, sandbox_id, f"http://{PUBLIC}/ -H 'Host: evil.example'") == "000"
    assert (
        await _curl(server, sandbox_id, f"http://{METADATA}/ -H 'Host: one.one.one.one'") != "000"
    )
    # An allowed name that resolves into a blocked range is refused.
    assert await _curl(server, sandbox_id, f"http://{PUBLIC}/ -H 'Host: meta.example'") == "000"
    # Other ports are decided by address: nothing but the names is allowed.
    outcome = await _probe(server, sandbox_id, [f"{PUBLIC}:8443"])
    assert outcome[f"{PUBLIC}:8443"] == "prohibited"
    assert _read_counters(uplink_counters)[METADATA] == 0


# Run in the guest as root: send UDP datagrams to argv[1]:9 through a raw socket with the
# IP header written here, first with each source address in argv[2:] (spoofed), then with
# the guest's own. Prints the guest's own address.
GUEST_SPOOF = r"""
import socket, struct, sys
target, spoofed = sys.argv[1], sys.argv[2:]
probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
probe.connect((target, 9))
own = probe.getsockname()[0]
raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
def checksum(data):
    total = sum(struct.unpack("!%dH" % (len(data) // 2), data))
    total = (total >> 16) + (total & 0xFFFF)
    return ~(total + (total >> 16)) & 0xFFFF
def datagram(source):
    payload = b"spoofed?"
    udp = struct.pack("!HHHH", 40000, 9, 8 + len(payload), 0) + payload
    header = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, 17, 0,
                         socket.inet_aton(source), socket.inet_aton(target))
    header = header[:10] + struct.pack("!H", checksum(header)) + header[12:]
    return header + udp
for source in spoofed + [own]:
    for _ in range(5):
        raw.sendto(datagram(source), (target, 0))
print(own)
"""


async def test_spoofed_sources_never_leave(
    server: ServerProcess, sandboxes: list[str], uplink_counters: dict[str, int]
) -> None:
    """A hostile guest writes its own IP headers: datagrams with another source (a
    private address, the host's, a public one, a link-local neighbour of its own) are
    dropped in its namespace, while the same datagrams with its own source reach the
    uplink (the destination is opened by allowOut, so only the source decides)."""
    sandbox_id = _new_sandbox(server, sandboxes, internet=True, network={"allowOut": [METADATA]})
    spoofed = [PRIVATE_192, str(HOST_ADDRESS), OTHER_PUBLIC, "169.254.0.22"]
    command = f"python3 -c '{GUEST_SPOOF}' {METADATA} " + " ".join(spoofed)
    result = await asyncio.to_thread(
        run_command, server.url, sandbox_id, command, user="root", timeout=120
    )
    assert result.exit_code == 0, result.stderr
    counts = _read_counters(uplink_counters)
    # Exactly the five with the guest's own source left (masqueraded), none of the 20.
    assert counts[METADATA] == 5, counts
