"""E2B's network options on the wire, read into what the orchestrator keeps.

Creates carry ``allow_internet_access`` and ``network`` (e2b's ``SandboxNetworkOpts``);
``PUT /sandboxes/{id}/network`` carries the egress part alone. Everything given is either
enforced or refused with a 400 that names it: an option read and then ignored would
leave a sandbox more open than its creator asked.
"""

from __future__ import annotations

from pydantic import BaseModel

from agentenv.api.models import NetworkConfig, NetworkInfo, NetworkUpdate, NewSandbox
from agentenv.network.policy import EgressPolicy, PolicyError
from agentenv.orchestrator.errors import InvalidRequest
from agentenv.orchestrator.network_options import NetworkOptions, parse_mask_request_host

# Options e2b's SDK can send that nothing here implements. (``egressProxy`` tunnels
# egress through SOCKS5, ``httpsPorts`` makes the proxy speak TLS to a port.)
_UNSUPPORTED = {"egress_proxy": "egressProxy", "https_ports": "httpsPorts"}


def _refuse_unsupported(body: BaseModel, where: str) -> None:
    """:class:`InvalidRequest` naming every option of `body` that is set but not
    supported: the ones in ``_UNSUPPORTED`` (an empty value is the same as none) and
    any field this server does not know."""
    named = [
        wire
        for attr, wire in _UNSUPPORTED.items()
        if attr in type(body).model_fields and getattr(body, attr) not in (None, [], {})
    ]
    named += sorted(body.model_extra or {})
    if named:
        names = ", ".join(f"{where}{name}" for name in named)
        raise InvalidRequest(f"{names}: not supported by this server")


def _egress(
    allow_internet: bool,
    allow_out: list[str] | None,
    deny_out: list[str] | None,
    dns_servers: list[str] | None,
    rules: object,
) -> EgressPolicy:
    if dns_servers is not None and not dns_servers:
        # E2B reads an empty list as "no DNS server at all", which the host's egress
        # filter cannot express; treating it as "the default" would open what was closed.
        raise InvalidRequest("dnsServers: an empty list (no DNS server) is not supported")
    try:
        return EgressPolicy.parse(
            allow_internet=allow_internet,
            allow_out=allow_out,
            deny_out=deny_out,
            dns_servers=dns_servers,
            rules=rules,
        )
    except PolicyError as exc:
        raise InvalidRequest(str(exc)) from exc


def create_options(body: NewSandbox) -> NetworkOptions:
    """The network options a create body asks for, with E2B's defaults (internet and
    public traffic allowed) for what it leaves out."""
    network = body.network or NetworkConfig()
    _refuse_unsupported(network, "network.")
    egress = _egress(
        # E2B sandboxes reach the internet unless told otherwise.
        body.allow_internet_access is not False,
        network.allow_out,
        network.deny_out,
        network.dns_servers,
        network.rules,
    )
    mask = network.mask_request_host
    if mask is not None:
        try:
            mask = parse_mask_request_host(mask)
        except PolicyError as exc:
            raise InvalidRequest(str(exc)) from exc
    return NetworkOptions(
        egress=egress,
        allow_public_traffic=network.allow_public_traffic is not False,
        mask_request_host=mask,
    )


def updated_egress(body: NetworkUpdate) -> EgressPolicy:
    """The egress policy an update asks for. It replaces the old one whole, so what it
    leaves out goes back to E2B's default (``allow_internet_access`` too)."""
    _refuse_unsupported(body, "")
    return _egress(
        body.allow_internet_access is not False,
        body.allow_out,
        body.deny_out,
        body.dns_servers,
        body.rules,
    )


def network_info(options: NetworkOptions) -> NetworkInfo:
    """The ``network`` a sandbox's detail shows."""
    egress = options.egress
    return NetworkInfo(
        allowPublicTraffic=options.allow_public_traffic,
        allowOut=[str(rule) for rule in egress.allow_out],
        denyOut=[str(rule) for rule in egress.deny_out],
        dnsServers=[str(server) for server in egress.dns_servers] or None,
        maskRequestHost=options.mask_request_host,
        rules=egress.rules_dict() or None,
    )
