"""What a sandbox's guest may reach: the egress policy the host enforces.

An :class:`EgressPolicy` is plain data. The API builds it from E2B's network options
(``allow_internet_access``, ``network.allowOut``, ``denyOut``, ``dnsServers``), the
orchestrator stores it with the sandbox, and :class:`~agentenv.network.NetworkManager`
turns it into rules in the sandbox's namespace and the host's egress filter, where the
guest cannot change them. This module only parses and validates; it enforces nothing.

How a destination is decided (E2B's semantics, plus the ranges no guest reaches by
default):

1. An ``allow_out`` entry that matches (an address in one of its networks, or a host name
   matched on TLS SNI or the HTTP ``Host`` header) allows it. ``allow_out`` wins over
   ``deny_out``.
2. Otherwise the host's own addresses and networks, link-local (cloud metadata),
   loopback, RFC 1918, RFC 6598 (shared address space) and multicast are refused. Only an
   ``allow_out`` network entry that covers the destination opens them; ``0.0.0.0/0`` in
   ``allow_out`` does not count as naming them.
3. Otherwise a matching ``deny_out`` entry refuses it.
4. Otherwise ``allow_internet`` decides. ``allow_internet=False`` behaves as a
   ``deny_out`` of ``0.0.0.0/0``.

``rules`` (E2B's per-host transforms) add headers to plain-HTTP requests the egress filter
relays (:class:`HeaderRule`); their values may name secrets as ``${e2b.secrets.<name>}``,
which the filter resolves on the host, so the guest never holds them. A rule's target must
also be allowed by ``allow_out`` (a host name by a host-name entry, a network by a network
entry): the filter only adds headers to a connection it resolved the name of itself, or
whose destination the rule names, never on the guest's word alone.

DNS (UDP and TCP port 53) goes only to ``dns_servers`` when any are given (even inside
the blocked ranges: naming a server is explicit). Otherwise it is decided like any other
traffic, except that a policy with host-name rules also lets DNS out to the guest's
default resolver (8.8.8.8), as E2B does, so allowed names can be resolved.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ALWAYS_BLOCKED",
    "EgressPolicy",
    "EgressRule",
    "HeaderRule",
    "PolicyError",
    "parse_rule",
    "render_header_value",
]

# Refused unless an allow_out network entry names them (rule 2 above). The host's own
# addresses and connected networks are added by the enforcer, which knows them.
ALWAYS_BLOCKED: tuple[ipaddress.IPv4Network, ...] = tuple(
    ipaddress.IPv4Network(net)
    for net in (
        "0.0.0.0/8",  # "this network"
        "10.0.0.0/8",  # RFC 1918
        "100.64.0.0/10",  # RFC 6598 shared address space (carrier-grade NAT)
        "127.0.0.0/8",  # loopback
        "169.254.0.0/16",  # link-local, where cloud metadata services answer
        "172.16.0.0/12",  # RFC 1918
        "192.168.0.0/16",  # RFC 1918
        "224.0.0.0/4",  # multicast
        "240.0.0.0/4",  # reserved, and broadcast
    )
)

# A DNS name: labels of letters, digits and hyphens, optionally "*." in front to match
# every subdomain (not the name itself). A trailing dot is accepted and dropped.
_LABEL = r"(?!-)[a-z0-9-]{1,63}(?<!-)"
_HOSTNAME = re.compile(rf"^(\*\.)?{_LABEL}(\.{_LABEL})*$")
_MAX_HOSTNAME = 253
MAX_RULES = 256  # per list: each entry becomes a rule the kernel or the filter checks


class PolicyError(ValueError):
    """An option cannot be enforced as given. ``field`` names the option (as the API
    spells it) so the answer can say which."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class EgressRule:
    """One ``allow_out``/``deny_out`` entry: a network, or a host name (``*.`` prefix
    for every subdomain)."""

    network: ipaddress.IPv4Network | None = None
    hostname: str | None = None

    def __str__(self) -> str:
        return str(self.network) if self.network is not None else str(self.hostname)

    def matches_host(self, name: str) -> bool:
        """Whether host name `name` (as sent in SNI or ``Host``) falls under this rule."""
        if self.hostname is None:
            return False
        name = name.lower().rstrip(".")
        if self.hostname.startswith("*."):
            return name.endswith(self.hostname[1:])
        return name == self.hostname


def parse_rule(entry: str, field: str) -> EgressRule:
    """One entry of `field`, or :class:`PolicyError` saying why it is not one."""
    if not isinstance(entry, str) or not entry.strip():
        raise PolicyError(field, f"entry {entry!r} is not an address, network or host name")
    text = entry.strip()
    try:
        address = ipaddress.ip_network(text, strict=False)
    except ValueError:
        pass
    else:
        if address.version != 4:
            # Guests have no IPv6 route at all, so an IPv6 rule would mean nothing.
            raise PolicyError(field, f"IPv6 entry {text!r} is not supported (guests have no IPv6)")
        return EgressRule(network=ipaddress.IPv4Network(address))
    name = text.lower().rstrip(".")
    if len(name) > _MAX_HOSTNAME or not _HOSTNAME.fullmatch(name):
        raise PolicyError(field, f"entry {text!r} is not an address, network or host name")
    return EgressRule(hostname=name)


def _parse_rules(entries: Iterable[str] | None, field: str) -> tuple[EgressRule, ...]:
    rules = tuple(parse_rule(entry, field) for entry in entries or ())
    if len(rules) > MAX_RULES:
        raise PolicyError(field, f"at most {MAX_RULES} entries")
    return rules


# -- rules: header transforms ------------------------------------------------------------

# An HTTP field name (RFC 9110 token).
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}")
# Headers that frame the request or the connection: the filter relays the body as the
# guest framed it, so these stay the guest's.
_FRAMING_HEADERS = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade", "te"}
)
_MAX_HEADER_VALUE = 8192
MAX_HEADER_RULES = 64
# ${e2b.<kind>.<name>}: a placeholder the filter resolves; only secrets are supported.
_PLACEHOLDER = re.compile(r"\$\{e2b\.([a-z]+)\.([^}]*)\}")
_SECRET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True)
class HeaderRule:
    """One transform of ``rules``: headers set on plain-HTTP requests to `target` (a
    host name, ``*.`` for subdomains, or a network), replacing the guest's headers of
    the same names. Values are kept with their placeholders unresolved."""

    target: EgressRule
    headers: tuple[tuple[str, str], ...]

    @property
    def secret_names(self) -> tuple[str, ...]:
        return tuple(
            match.group(2) for _, value in self.headers for match in _PLACEHOLDER.finditer(value)
        )


async def render_header_value(template: str, secret: Callable[[str], Awaitable[str]]) -> str:
    """`template` with every ``${e2b.secrets.<name>}`` replaced by ``await secret(name)``."""
    parts: list[str] = []
    last = 0
    for match in _PLACEHOLDER.finditer(template):
        parts.append(template[last : match.start()])
        parts.append(await secret(match.group(2)))
        last = match.end()
    parts.append(template[last:])
    return "".join(parts)


def _parse_header_value(value: object, where: str) -> str:
    if not isinstance(value, str) or len(value) > _MAX_HEADER_VALUE:
        raise PolicyError("rules", f"{where}: a string of at most {_MAX_HEADER_VALUE} characters")
    try:
        value.encode()
    except UnicodeEncodeError:
        raise PolicyError("rules", f"{where}: not valid Unicode text") from None
    if any((ord(ch) < 0x20 and ch != "\t") or ord(ch) == 0x7F for ch in value):
        raise PolicyError("rules", f"{where}: control characters cannot go into a header")
    for match in _PLACEHOLDER.finditer(value):
        kind, name = match.groups()
        if kind == "identity":
            raise PolicyError(
                "rules", f"{where}: workload identity tokens (e2b.identity) are not supported"
            )
        if kind != "secrets" or not _SECRET_NAME.fullmatch(name):
            raise PolicyError("rules", f"{where}: {match.group(0)!r} is not a secret placeholder")
    return value


def _parse_header_rules(rules: object) -> tuple[HeaderRule, ...]:
    """``rules`` as the API gives it: ``{target: [{"transform": {"headers": {...}}}]}``."""
    if rules is None:
        return ()
    if not isinstance(rules, Mapping):
        raise PolicyError("rules", "must map host names or networks to lists of rules")
    parsed: list[HeaderRule] = []
    for key, entries in rules.items():
        target = parse_rule(key, "rules")
        if not isinstance(entries, list):
            raise PolicyError("rules", f"{key}: must be a list of rules")
        for entry in entries:
            if not isinstance(entry, Mapping) or set(entry) - {"transform"}:
                raise PolicyError("rules", f"{key}: a rule has only a 'transform'")
            transform = entry.get("transform") or {}
            if not isinstance(transform, Mapping) or set(transform) - {"headers"}:
                raise PolicyError("rules", f"{key}: a transform has only 'headers'")
            headers = transform.get("headers") or {}
            if not isinstance(headers, Mapping):
                raise PolicyError("rules", f"{key}: headers must map names to values")
            pairs = []
            for name, value in headers.items():
                if not isinstance(name, str) or not _HEADER_NAME.fullmatch(name):
                    raise PolicyError("rules", f"{key}: {name!r} is not a header name")
                if name.lower() in _FRAMING_HEADERS:
                    raise PolicyError("rules", f"{key}: header {name!r} cannot be set")
                pairs.append((name, _parse_header_value(value, f"{key}: header {name!r}")))
            if pairs:
                parsed.append(HeaderRule(target, tuple(pairs)))
    if len(parsed) > MAX_HEADER_RULES:
        raise PolicyError("rules", f"at most {MAX_HEADER_RULES} transforms")
    return tuple(parsed)


def _allowed_target(target: EgressRule, allow_out: tuple[EgressRule, ...]) -> bool:
    """Whether ``allow_out`` lets the filter trust connections to `target`: a host name
    covered by a host-name entry, a network inside a network entry."""
    if target.network is not None:
        return any(
            rule.network is not None and target.network.subnet_of(rule.network)
            for rule in allow_out
        )
    assert target.hostname is not None
    bare = target.hostname.removeprefix("*.")
    return any(
        rule.hostname == target.hostname
        or ((rule.hostname or "").startswith("*.") and rule.matches_host(bare))
        for rule in allow_out
    )


def _parse_dns_servers(entries: Iterable[str] | None) -> tuple[ipaddress.IPv4Address, ...]:
    servers = []
    for entry in entries or ():
        try:
            address = ipaddress.ip_address(str(entry).strip())
        except ValueError as exc:
            raise PolicyError("dnsServers", f"{entry!r} is not an IP address") from exc
        if address.version != 4:
            raise PolicyError("dnsServers", f"IPv6 server {entry!r} is not supported")
        servers.append(ipaddress.IPv4Address(address))
    if len(servers) > 8:
        raise PolicyError("dnsServers", "at most 8 servers")
    return tuple(servers)


@dataclass(frozen=True)
class EgressPolicy:
    """Where one sandbox's guest may connect to (see the module docstring for the order
    in which the parts decide). The default refuses everything."""

    allow_internet: bool = False
    allow_out: tuple[EgressRule, ...] = ()
    deny_out: tuple[EgressRule, ...] = ()
    dns_servers: tuple[ipaddress.IPv4Address, ...] = field(default=())
    header_rules: tuple[HeaderRule, ...] = ()

    @classmethod
    def parse(
        cls,
        *,
        allow_internet: bool,
        allow_out: Iterable[str] | None = None,
        deny_out: Iterable[str] | None = None,
        dns_servers: Iterable[str] | None = None,
        rules: object = None,
    ) -> EgressPolicy:
        """The policy the API options describe; :class:`PolicyError` names the first
        option that cannot be enforced."""
        allowed = _parse_rules(allow_out, "allowOut")
        header_rules = _parse_header_rules(rules)
        for rule in header_rules:
            if not _allowed_target(rule.target, allowed):
                raise PolicyError(
                    "rules",
                    f"{rule.target}: must also be allowed by allowOut (a host name by a host "
                    "name entry, a network by a network entry) for headers to be added",
                )
        return cls(
            allow_internet=allow_internet,
            allow_out=allowed,
            deny_out=_parse_rules(deny_out, "denyOut"),
            dns_servers=_parse_dns_servers(dns_servers),
            header_rules=header_rules,
        )

    @property
    def has_hostname_rules(self) -> bool:
        """Whether deciding needs the host name a connection is for (SNI or ``Host``)."""
        return any(rule.hostname is not None for rule in (*self.allow_out, *self.deny_out))

    @property
    def needs_filter(self) -> bool:
        """Whether guest web traffic goes through the host's egress filter: to decide
        it by host name, or to add ``rules`` headers to it."""
        return self.has_hostname_rules or bool(self.header_rules)

    @property
    def secret_names(self) -> tuple[str, ...]:
        """The secrets ``rules`` name, in order, without repeats."""
        return tuple(dict.fromkeys(n for rule in self.header_rules for n in rule.secret_names))

    def rules_dict(self) -> dict[str, list[dict[str, Any]]]:
        """``rules`` as the API spells it (placeholders unresolved)."""
        rules: dict[str, list[dict[str, Any]]] = {}
        for rule in self.header_rules:
            key = str(rule.target) if rule.target.hostname else _network_key(rule)
            rules.setdefault(key, []).append({"transform": {"headers": dict(rule.headers)}})
        return rules

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, for the sandbox record and repository records."""
        return {
            "allowInternet": self.allow_internet,
            "allowOut": [str(rule) for rule in self.allow_out],
            "denyOut": [str(rule) for rule in self.deny_out],
            "dnsServers": [str(server) for server in self.dns_servers],
            **({"rules": self.rules_dict()} if self.header_rules else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EgressPolicy:
        return cls.parse(
            allow_internet=bool(data.get("allowInternet", False)),
            allow_out=data.get("allowOut") or (),
            deny_out=data.get("denyOut") or (),
            dns_servers=data.get("dnsServers") or (),
            rules=data.get("rules"),
        )


def _network_key(rule: HeaderRule) -> str:
    assert rule.target.network is not None
    network = rule.target.network
    return str(network.network_address) if network.prefixlen == 32 else str(network)
