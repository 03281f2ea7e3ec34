"""A sandbox's network options as E2B's API gives them, and its traffic access token.

:class:`NetworkOptions` is what the sandbox record keeps: the egress policy the host
enforces (:class:`~agentenv.network.EgressPolicy`) and the two options the sandbox proxy
applies to traffic *into* the sandbox (``allowPublicTraffic``, ``maskRequestHost``). It
is plain data with a JSON form for the store and repository records; it survives pause,
resume, restart, fork (children inherit it) and handoff to another node.

A sandbox that refuses public traffic has a traffic access token, derived from the node
key like its envd token (:meth:`~agentenv.orchestrator.tokens.EnvdTokens.traffic_token`)
and stored only as a digest; :func:`traffic_token_matches` is the one place it is checked.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agentenv.network.policy import EgressPolicy, PolicyError

__all__ = [
    "MAX_MASK_LENGTH",
    "NetworkOptions",
    "parse_mask_request_host",
    "traffic_token_matches",
]

# A Host header value is at most a DNS name (253) plus ":port"; room for ${PORT}.
MAX_MASK_LENGTH = 260
_PORT_VARIABLE = "${PORT}"


@dataclass(frozen=True)
class NetworkOptions:
    """Everything a sandbox was told about its network. The default is the most closed
    one (nothing leaves but DNS, public traffic allowed as E2B does by default); the API
    fills in E2B's defaults (internet allowed) before it gets here."""

    egress: EgressPolicy = field(default_factory=EgressPolicy)
    # False: every port but envd's needs the sandbox's traffic access token.
    allow_public_traffic: bool = True
    # The Host header forwarded to the sandbox's ports, ``${PORT}`` replaced by the port.
    mask_request_host: str | None = None

    def with_egress(self, egress: EgressPolicy) -> NetworkOptions:
        return NetworkOptions(egress, self.allow_public_traffic, self.mask_request_host)

    def forwarded_host(self, port: int) -> str | None:
        """The Host header to send to `port` in the sandbox; None keeps the client's."""
        if self.mask_request_host is None:
            return None
        return self.mask_request_host.replace(_PORT_VARIABLE, str(port))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, for the sandbox record and repository records."""
        return {
            "egress": self.egress.to_dict(),
            "allowPublicTraffic": self.allow_public_traffic,
            "maskRequestHost": self.mask_request_host,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NetworkOptions:
        mask = data.get("maskRequestHost")
        return cls(
            egress=EgressPolicy.from_dict(data.get("egress") or {}),
            allow_public_traffic=bool(data.get("allowPublicTraffic", True)),
            mask_request_host=str(mask) if mask is not None else None,
        )


def parse_mask_request_host(mask: str) -> str:
    """`mask` if it can be sent as a Host header (after ``${PORT}`` is replaced), or
    :class:`PolicyError` naming ``maskRequestHost``."""
    if not mask or len(mask) > MAX_MASK_LENGTH:
        raise PolicyError("maskRequestHost", f"must be 1 to {MAX_MASK_LENGTH} characters")
    sample = mask.replace(_PORT_VARIABLE, "1")
    # A Host header is a host name or address and an optional port: no spaces, control
    # characters, paths or user info, which would let a mask smuggle header content.
    if not all(ch.isascii() and (ch.isalnum() or ch in "-._:[]") for ch in sample):
        raise PolicyError("maskRequestHost", f"{mask!r} is not a host name with an optional port")
    return mask


def traffic_token_matches(expected: str | None, presented: str | None) -> bool:
    """Whether `presented` is the sandbox's traffic access token (constant time). A
    sandbox without a token accepts nothing, so a missing token never opens it."""
    if not expected or not presented:
        return False
    return hmac.compare_digest(presented.encode(), expected.encode())
