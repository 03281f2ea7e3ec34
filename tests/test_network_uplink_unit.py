"""Creates without a default route on the host (issue #18): a sandbox asking for internet
access starts, its egress fails as the host's would, and the server says so once."""

from __future__ import annotations

import logging

import pytest

from agentenv.network import NetworkManager
from agentenv.network.uplink import internet_access_rules


def test_rules_with_a_default_route_forward_and_masquerade_through_it() -> None:
    script = internet_access_rules("agentenv_t", "th*", {3: "10.250.0.12/30"}, "eth0")
    assert 'forward iifname "th*" oifname "eth0" accept' in script
    assert 'slot3 ip saddr 10.250.0.12/30 oifname "eth0" masquerade' in script


def test_rules_without_a_default_route_let_nothing_out_but_mark_the_slot() -> None:
    script = internet_access_rules("agentenv_t", "th*", {3: "10.250.0.12/30"}, None)
    assert "accept" not in script and "masquerade" not in script and "None" not in script
    # The slot's chain is made all the same: it is how the slot is known (and removed).
    assert "add chain ip agentenv_t slot3" in script
    assert 'forward iifname "th*" drop' in script
    assert 'input iifname "th*" ct state new drop' in script


def test_rules_for_several_slots_make_one_chain_each_and_the_shared_chains_once() -> None:
    blocks = {3: "10.250.0.12/30", 5: "10.250.0.20/30"}
    script = internet_access_rules("agentenv_t", "th*", blocks, "eth0")
    assert script.count("add chain ip agentenv_t forward") == 1
    assert script.count("add chain ip agentenv_t input") == 1
    assert 'slot3 ip saddr 10.250.0.12/30 oifname "eth0" masquerade' in script
    assert 'slot5 ip saddr 10.250.0.20/30 oifname "eth0" masquerade' in script


def test_no_default_route_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    manager = NetworkManager("tuplink", "10.250.0.0/16", max_slots=4)
    with caplog.at_level(logging.WARNING, logger="agentenv.network.manager"):
        manager.warn_if_no_default_route("eth0")
        assert not caplog.records
        for _ in range(3):  # start-up, then creates
            manager.warn_if_no_default_route(None)
    assert len(caplog.records) == 1
    assert "no IPv4 default route" in caplog.records[0].getMessage()
