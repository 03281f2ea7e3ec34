"""Egress enforcement without a kernel: the nftables rules a policy becomes, the order in
which a destination is decided, and how the host-name filter reads SNI and Host."""

from __future__ import annotations

import ipaddress
import ssl
from contextlib import suppress

import pytest

from agentenv.network.egress_filter import (
    IncompleteName,
    Verdict,
    decide_connection,
    name_of,
    read_host_name,
    server_name_of,
)
from agentenv.network.egress_rules import (
    BlockedRanges,
    decide_address,
    egress_rules,
    guard_rules,
    intercept_rules,
    needs_uplink,
    policy_chains,
    policy_update_script,
)
from agentenv.network.policy import EgressPolicy

HOST_LAN = ipaddress.IPv4Network("192.0.2.0/24")  # the host's own network (TEST-NET-1)
BLOCKED = BlockedRanges([HOST_LAN, ipaddress.IPv4Network("10.200.0.0/16")])
REFUSE = "reject with icmp type admin-prohibited"


def _ip(text: str) -> ipaddress.IPv4Address:
    return ipaddress.IPv4Address(text)


def test_blocked_ranges_hold_the_fixed_ranges_and_the_hosts_networks() -> None:
    for address in ("169.254.169.254", "10.1.2.3", "172.16.0.1", "192.168.1.1", "100.64.0.1"):
        assert BLOCKED.contains(_ip(address)), address
    assert BLOCKED.contains(_ip("192.0.2.77"))  # the host's LAN
    assert BLOCKED.contains(_ip("127.0.0.1")) and BLOCKED.contains(_ip("224.0.0.1"))
    assert not BLOCKED.contains(_ip("203.0.113.5"))
    # A subnet outside the fixed ranges is blocked when the manager names it.
    assert BlockedRanges([ipaddress.IPv4Network("198.18.0.0/16")]).contains(_ip("198.18.0.1"))


def test_only_networks_inside_a_blocked_range_open_it() -> None:
    policy = EgressPolicy.parse(
        allow_internet=True,
        allow_out=["0.0.0.0/0", "8.0.0.0/5", "169.254.169.254", "192.0.2.0/24", "1.1.1.1"],
    )
    assert BLOCKED.opened_by(policy) == (
        ipaddress.IPv4Network("169.254.169.254/32"),
        ipaddress.IPv4Network("192.0.2.0/24"),
    )
    assert decide_address(policy, BLOCKED, _ip("169.254.169.254"))
    assert decide_address(policy, BLOCKED, _ip("192.0.2.1"))
    assert not decide_address(policy, BLOCKED, _ip("169.254.169.253"))
    assert not decide_address(policy, BLOCKED, _ip("10.0.0.1"))  # 8.0.0.0/5 names no range


@pytest.mark.parametrize(
    ("options", "address", "allowed"),
    [
        ({"allow_internet": True}, "203.0.113.5", True),
        ({"allow_internet": False}, "203.0.113.5", False),
        ({"allow_internet": True, "deny_out": ["203.0.113.0/24"]}, "203.0.113.5", False),
        ({"allow_internet": True, "deny_out": ["203.0.113.0/24"]}, "198.51.100.1", True),
        (
            {"allow_internet": True, "allow_out": ["203.0.113.5"], "deny_out": ["0.0.0.0/0"]},
            "203.0.113.5",
            True,
        ),
        ({"allow_internet": False, "allow_out": ["203.0.113.5"]}, "203.0.113.6", False),
        ({"allow_internet": True, "allow_out": ["0.0.0.0/0"]}, "10.0.0.1", False),
        ({"allow_internet": True, "allow_out": ["10.0.0.0/8"]}, "10.0.0.1", True),
        (
            {"allow_internet": True, "deny_out": ["10.0.0.0/8"], "allow_out": ["10.0.0.0/8"]},
            "10.0.0.1",
            True,
        ),
    ],
)
def test_destinations_are_decided_in_the_documented_order(
    options: dict[str, object], address: str, allowed: bool
) -> None:
    policy = EgressPolicy.parse(**options)  # type: ignore[arg-type]
    assert decide_address(policy, BLOCKED, _ip(address)) is allowed


def test_default_policy_rules_refuse_everything() -> None:
    policy = EgressPolicy()
    rules = egress_rules(policy, BLOCKED)
    assert rules[-1] == REFUSE
    assert not any(rule.endswith("accept") for rule in rules)
    assert intercept_rules(policy) == []
    assert not needs_uplink(policy)


def test_egress_rules_follow_the_policy_order() -> None:
    policy = EgressPolicy.parse(
        allow_internet=True,
        allow_out=["169.254.169.254", "1.1.1.1", "1.1.1.0/24"],
        deny_out=["8.8.8.8", "9.9.9.9"],
        dns_servers=["9.9.9.9"],
    )
    blocked = ", ".join(str(net) for net in BLOCKED.networks)
    assert egress_rules(policy, BLOCKED) == [
        "meta l4proto { tcp, udp } th dport 53 ip daddr { 9.9.9.9 } accept",
        f"meta l4proto {{ tcp, udp }} th dport 53 {REFUSE}",
        "ip daddr { 169.254.169.254/32 } accept",
        f"ip daddr {{ {blocked} }} {REFUSE}",
        "ip daddr { 1.1.1.0/24, 169.254.169.254/32 } accept",
        f"ip daddr {{ 8.8.8.8/32, 9.9.9.9/32 }} {REFUSE}",
        "accept",
    ]
    assert guard_rules(policy, BLOCKED) == [
        "ip daddr { 169.254.169.254/32 } accept",
        f"ip daddr {{ {blocked} }} {REFUSE}",
    ]
    assert needs_uplink(policy)


def test_host_name_rules_redirect_web_ports_and_let_dns_to_the_default_resolver() -> None:
    policy = EgressPolicy.parse(allow_internet=False, allow_out=["*.pypi.org"])
    assert intercept_rules(policy) == [
        "ip saddr 169.254.0.21 tcp dport { 80, 443 } redirect to :15001"
    ]
    assert egress_rules(policy, BLOCKED)[0] == (
        "meta l4proto { tcp, udp } th dport 53 ip daddr 8.8.8.8 accept"
    )
    assert needs_uplink(policy)
    # With servers named, DNS goes to them only, host names or not.
    named = EgressPolicy.parse(allow_internet=False, allow_out=["x.org"], dns_servers=["1.1.1.1"])
    assert "8.8.8.8" not in " ".join(egress_rules(named, BLOCKED))


def test_update_script_replaces_every_policy_chain_in_one_transaction() -> None:
    policy = EgressPolicy.parse(allow_internet=True, allow_out=["example.com"])
    script = policy_update_script(policy, BLOCKED).splitlines()
    flushes = [line for line in script if line.startswith("flush chain")]
    assert flushes == [
        "flush chain ip agentenv egress",
        "flush chain ip agentenv intercept",
        "flush chain ip agentenv guard",
    ]
    assert script.index("flush chain ip agentenv intercept") < script.index(
        "add rule ip agentenv intercept ip saddr 169.254.0.21 tcp dport { 80, 443 } "
        "redirect to :15001"
    )
    chains = policy_chains(policy, BLOCKED)
    assert chains.count("chain ") == 3 and "redirect to :15001" in chains


# -- the host-name filter --------------------------------------------------------------------


def _client_hello(name: str | None) -> bytes:
    context = ssl.create_default_context()
    if name is None:
        context.check_hostname = False
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=name)
    with suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def test_sni_is_read_from_a_real_client_hello() -> None:
    hello = _client_hello("API.Example.com")
    assert server_name_of(hello) in ("API.Example.com", "api.example.com")
    assert name_of(hello) is not None
    assert server_name_of(_client_hello(None)) is None
    assert server_name_of(b"SSH-2.0-OpenSSH\r\n") is None
    with pytest.raises(IncompleteName):
        server_name_of(hello[:40])  # cut short: more is needed


def test_host_header_is_read_from_a_request_head() -> None:
    assert read_host_name(b"GET / HTTP/1.1\r\nHost: a.example:8080\r\n\r\n") == "a.example"
    assert read_host_name(b"GET / HTTP/1.1\r\nhOsT: b.example\r\n\r\n") == "b.example"
    assert read_host_name(b"GET / HTTP/1.0\r\n\r\n") is None
    assert read_host_name(b"\x00\x01garbage\r\n\r\n") is None
    with pytest.raises(IncompleteName):
        read_host_name(b"GET / HTTP/1.1\r\nHost: a.exa")


@pytest.mark.parametrize(
    ("options", "name", "destination", "verdict"),
    [
        # An allowed name goes where the host resolves it, not where the guest sent it.
        (
            {"allow_out": ["allowed.example"]},
            "allowed.example",
            "169.254.169.254",
            Verdict(True, resolve="allowed.example"),
        ),
        ({"allow_out": ["*.example"]}, "a.example", "1.2.3.4", Verdict(True, resolve="a.example")),
        ({"allow_out": ["allowed.example"]}, "other.example", "1.2.3.4", Verdict(False)),
        ({"allow_out": ["allowed.example"]}, None, "1.2.3.4", Verdict(False)),
        (
            {"allow_internet": True, "deny_out": ["bad.example"]},
            "bad.example",
            "1.2.3.4",
            Verdict(False),
        ),
        (
            {"allow_internet": True, "deny_out": ["bad.example"], "allow_out": ["1.2.3.4"]},
            "bad.example",
            "1.2.3.4",
            Verdict(True, address=_ip("1.2.3.4")),
        ),
        (
            {"allow_internet": True, "deny_out": ["bad.example"]},
            "good.example",
            "1.2.3.4",
            Verdict(True, address=_ip("1.2.3.4")),
        ),
        (
            {"allow_internet": True, "deny_out": ["bad.example"]},
            "good.example",
            "169.254.169.254",
            Verdict(False),
        ),
    ],
)
def test_filtered_connections_are_decided_by_name_then_address(
    options: dict[str, object], name: str | None, destination: str, verdict: Verdict
) -> None:
    policy = EgressPolicy.parse(**{"allow_internet": False, **options})  # type: ignore[arg-type]
    assert decide_connection(policy, BLOCKED, name, _ip(destination)) == verdict
