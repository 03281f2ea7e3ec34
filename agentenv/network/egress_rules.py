"""The nftables rules that enforce an :class:`~agentenv.network.policy.EgressPolicy` inside
a sandbox's namespace, as text for ``nft -f``. Pure computation: no kernel access.

The namespace table holds two chains the policy owns, rebuilt whole on every change:

* ``egress`` (filter, jumped to from ``forward`` for guest-originated traffic leaving
  through the veth) decides each new connection in the policy's order: DNS, the
  ``allow_out`` networks that name blocked ranges, the blocked ranges, the other
  ``allow_out`` networks, ``deny_out``, then ``allow_internet``. A refusal answers with
  ICMP "administratively prohibited", so guest programs fail at once instead of timing
  out.
* ``intercept`` (nat, jumped to from ``prerouting`` for traffic arriving from the guest)
  redirects TCP to :data:`FILTERED_PORTS` to the host-name filter's listener when the
  policy has host-name rules.

and one chain fixed at creation, ``guard`` (filter, on ``output``): connections the
host-name filter opens from inside the namespace to the destination never reach the
blocked ranges either, whatever the filter decided.

Established connections are accepted before ``egress`` is consulted, so a policy change
applies to new connections; connections already open continue.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence

from agentenv.network.addresses import GUEST_IP
from agentenv.network.policy import ALWAYS_BLOCKED, EgressPolicy

__all__ = [
    "DEFAULT_GUEST_RESOLVER",
    "FILTERED_PORTS",
    "FILTER_PORT",
    "NAMESPACE_TABLE",
    "BlockedRanges",
    "policy_chains",
    "policy_update_script",
]

NAMESPACE_TABLE = "agentenv"
# Where a guest's resolver points unless its kernel command line says otherwise
# (aenv-init writes it to /etc/resolv.conf). A policy with host-name rules lets DNS to it
# out, as E2B does, so the guest can still resolve the names it is allowed to reach.
DEFAULT_GUEST_RESOLVER = ipaddress.IPv4Address("8.8.8.8")
# Guest TCP ports whose connections the host-name filter sees when a policy has host-name
# rules: HTTP (Host header) and HTTPS (TLS SNI), as E2B filters. Other ports are decided
# by address alone.
FILTERED_PORTS = (80, 443)
# The filter's listening port inside each sandbox namespace (its own port space).
FILTER_PORT = 15001
_REFUSE = "reject with icmp type admin-prohibited"


class BlockedRanges:
    """The networks no guest reaches unless an ``allow_out`` network names them: the
    fixed :data:`ALWAYS_BLOCKED` ranges plus the host's own addresses and connected
    networks (including the sandbox subnet)."""

    def __init__(self, host_networks: Iterable[ipaddress.IPv4Network] = ()) -> None:
        self.networks: tuple[ipaddress.IPv4Network, ...] = tuple(
            ipaddress.collapse_addresses([*ALWAYS_BLOCKED, *host_networks])
        )

    def contains(self, address: ipaddress.IPv4Address) -> bool:
        return any(address in net for net in self.networks)

    def opened_by(self, policy: EgressPolicy) -> tuple[ipaddress.IPv4Network, ...]:
        """The ``allow_out`` networks that name part of a blocked range: each lies inside
        one, so it names it explicitly (``0.0.0.0/0`` or any wider network does not)."""
        return _collapse(
            rule.network
            for rule in policy.allow_out
            if rule.network is not None
            and any(rule.network.subnet_of(blocked) for blocked in self.networks)
        )

    def permits(self, policy: EgressPolicy, address: ipaddress.IPv4Address) -> bool:
        """Whether blocking lets `address` through under `policy` (it is outside the
        blocked ranges, or an ``allow_out`` network opens it)."""
        return not self.contains(address) or any(address in net for net in self.opened_by(policy))


def decide_address(
    policy: EgressPolicy, blocked: BlockedRanges, address: ipaddress.IPv4Address
) -> bool:
    """Whether `policy` lets a new connection to `address` out, deciding by address alone
    (what the ``egress`` chain does for everything but DNS)."""
    if any(address in net for net in blocked.opened_by(policy)):
        return True
    if blocked.contains(address):
        return False
    if any(rule.network is not None and address in rule.network for rule in policy.allow_out):
        return True
    if any(rule.network is not None and address in rule.network for rule in policy.deny_out):
        return False
    return policy.allow_internet


def needs_uplink(policy: EgressPolicy) -> bool:
    """Whether anything at all may leave under `policy`, i.e. whether the host must
    forward and masquerade the sandbox's traffic."""
    return bool(
        policy.allow_internet
        or policy.dns_servers
        or policy.needs_filter
        or any(rule.network is not None for rule in policy.allow_out)
    )


def _collapse(
    networks: Iterable[ipaddress.IPv4Network | None],
) -> tuple[ipaddress.IPv4Network, ...]:
    return tuple(ipaddress.collapse_addresses(net for net in networks if net is not None))


def _set(items: Sequence[object]) -> str:
    return "{ " + ", ".join(str(item) for item in items) + " }"


def egress_rules(policy: EgressPolicy, blocked: BlockedRanges) -> list[str]:
    """The rules of the ``egress`` chain, in order (see the module docstring)."""
    rules: list[str] = []
    dns = "meta l4proto { tcp, udp } th dport 53"
    if policy.dns_servers:
        # Named explicitly: they are reachable on port 53 even inside blocked ranges.
        rules.append(f"{dns} ip daddr {_set(policy.dns_servers)} accept")
        rules.append(f"{dns} {_REFUSE}")
    elif policy.has_hostname_rules:
        rules.append(f"{dns} ip daddr {DEFAULT_GUEST_RESOLVER} accept")
    opened = blocked.opened_by(policy)
    if opened:
        rules.append(f"ip daddr {_set(opened)} accept")
    rules.append(f"ip daddr {_set(blocked.networks)} {_REFUSE}")
    allowed = _collapse(rule.network for rule in policy.allow_out)
    if allowed:
        rules.append(f"ip daddr {_set(allowed)} accept")
    denied = _collapse(rule.network for rule in policy.deny_out)
    if denied:
        rules.append(f"ip daddr {_set(denied)} {_REFUSE}")
    rules.append("accept" if policy.allow_internet else _REFUSE)
    return rules


def intercept_rules(policy: EgressPolicy) -> list[str]:
    """The rules of the ``intercept`` chain: guest TCP to :data:`FILTERED_PORTS` goes to
    the host-name filter when the policy needs one, else nothing is redirected."""
    if not policy.needs_filter:
        return []
    ports = _set(FILTERED_PORTS)
    return [f"ip saddr {GUEST_IP} tcp dport {ports} redirect to :{FILTER_PORT}"]


def guard_rules(policy: EgressPolicy, blocked: BlockedRanges) -> list[str]:
    """The rules of the ``guard`` chain, on what the namespace itself sends out of the
    veth (only the host-name filter's connections): blocked ranges stay blocked."""
    opened = blocked.opened_by(policy)
    rules = [f"ip daddr {_set(opened)} accept"] if opened else []
    rules.append(f"ip daddr {_set(blocked.networks)} {_REFUSE}")
    return rules


def policy_chains(policy: EgressPolicy, blocked: BlockedRanges) -> str:
    """The policy's chains as they appear inside ``table ip agentenv { ... }``, for the
    ruleset a namespace is created with."""
    parts = []
    for name, rules in (
        ("egress", egress_rules(policy, blocked)),
        ("intercept", intercept_rules(policy)),
        ("guard", guard_rules(policy, blocked)),
    ):
        body = "".join(f"        {rule}\n" for rule in rules)
        parts.append(f"    chain {name} {{\n{body}    }}\n")
    return "".join(parts)


def policy_update_script(policy: EgressPolicy, blocked: BlockedRanges) -> str:
    """One ``nft -f`` transaction replacing the policy's chains of a live namespace:
    every new connection is decided by the old rules or the new ones, never a mix."""
    lines = []
    for name, rules in (
        ("egress", egress_rules(policy, blocked)),
        ("intercept", intercept_rules(policy)),
        ("guard", guard_rules(policy, blocked)),
    ):
        lines.append(f"flush chain ip {NAMESPACE_TABLE} {name}")
        lines.extend(f"add rule ip {NAMESPACE_TABLE} {name} {rule}" for rule in rules)
    return "\n".join(lines) + "\n"
