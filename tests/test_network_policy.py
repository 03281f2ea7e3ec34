"""EgressPolicy parsing: what the API accepts as egress options, and what it refuses."""

from __future__ import annotations

import ipaddress

import pytest

from agentenv.network.policy import EgressPolicy, PolicyError, parse_rule


def test_entries_are_networks_or_host_names() -> None:
    policy = EgressPolicy.parse(
        allow_internet=False,
        allow_out=["1.2.3.4", "10.0.0.0/8", "Example.COM.", "*.pypi.org"],
        deny_out=["0.0.0.0/0"],
        dns_servers=["9.9.9.9"],
    )
    assert [str(rule) for rule in policy.allow_out] == [
        "1.2.3.4/32",
        "10.0.0.0/8",
        "example.com",
        "*.pypi.org",
    ]
    assert policy.allow_out[1].network == ipaddress.IPv4Network("10.0.0.0/8")
    assert policy.has_hostname_rules
    assert policy.dns_servers == (ipaddress.IPv4Address("9.9.9.9"),)
    assert EgressPolicy.from_dict(policy.to_dict()) == policy


def test_wildcards_match_subdomains_only() -> None:
    rule = parse_rule("*.example.com", "allowOut")
    assert rule.matches_host("api.example.com")
    assert rule.matches_host("A.B.Example.com.")
    assert not rule.matches_host("example.com")
    assert not rule.matches_host("badexample.com")
    exact = parse_rule("example.com", "allowOut")
    assert exact.matches_host("EXAMPLE.com") and not exact.matches_host("x.example.com")


@pytest.mark.parametrize(
    ("field", "options", "named"),
    [
        ("allowOut", {"allow_out": ["not a host!"]}, "not a host!"),
        ("allowOut", {"allow_out": ["::1"]}, "IPv6"),
        ("denyOut", {"deny_out": [""]}, "not an address"),
        ("denyOut", {"deny_out": ["-bad.example"]}, "-bad.example"),
        ("dnsServers", {"dns_servers": ["dns.google"]}, "dns.google"),
        ("allowOut", {"allow_out": [f"10.0.{i // 256}.{i % 256}" for i in range(300)]}, "at most"),
    ],
)
def test_bad_entries_name_their_option(
    field: str, options: dict[str, list[str]], named: str
) -> None:
    with pytest.raises(PolicyError) as caught:
        EgressPolicy.parse(allow_internet=True, **options)
    assert caught.value.field == field
    assert named in str(caught.value)


def test_default_policy_lets_nothing_out() -> None:
    policy = EgressPolicy()
    assert not policy.allow_internet and not policy.allow_out and not policy.has_hostname_rules
