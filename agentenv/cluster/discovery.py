"""Which nodes should exist, for the scheduler: a static list of node URLs, or the
EndpointSlices of a Kubernetes headless Service (the node DaemonSet's), read with the
official ``kubernetes`` client (the ``kubernetes`` extra).

Heartbeats are what register a node and keep it up; discovery adds the other half: a
node whose URL leaves the list (its pod was deleted, its endpoint stopped being ready)
is marked down at the next look instead of after ``node_timeout`` of silence, so its
committed paused sandboxes move and its running ones answer "node unavailable" at once.
A node it lists that never sent a heartbeat is only reported (``/health``'s
``discovered``), never placed on.

``--discovery`` takes ``static:URL[,URL...]`` or ``kubernetes:NAMESPACE/SERVICE[:PORT]``
(port: the slice's port named ``api``, else its first one). In Kubernetes the scheduler's
ServiceAccount needs ``list`` on ``endpointslices.discovery.k8s.io`` in that namespace
(deploy/kubernetes/rbac.yaml).
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol


class DiscoveryError(Exception):
    """The node list could not be read (the API server refused or was unreachable)."""


class Discovery(Protocol):
    async def node_urls(self) -> set[str]:
        """The URLs nodes should be reached at (as their heartbeats report them)."""
        ...


class StaticDiscovery:
    def __init__(self, urls: list[str]) -> None:
        self.urls = {url.rstrip("/") for url in urls if url}

    async def node_urls(self) -> set[str]:
        return set(self.urls)


class EndpointSliceDiscovery:
    """The ready endpoints of ``service``'s EndpointSlices in ``namespace``."""

    def __init__(
        self, namespace: str, service: str, port: int | None = None, api: Any = None
    ) -> None:
        self.namespace = namespace
        self.service = service
        self.port = port
        # A kubernetes.client.DiscoveryV1Api; made on first use (in-cluster config, else
        # the kubeconfig), so a scheduler without the extra fails only when asked to.
        self._api = api

    def _client(self) -> Any:
        if self._api is None:
            from kubernetes import client, config  # the `kubernetes` extra

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            self._api = client.DiscoveryV1Api()
        return self._api

    def _list(self) -> set[str]:
        try:
            slices = self._client().list_namespaced_endpoint_slice(
                self.namespace, label_selector=f"kubernetes.io/service-name={self.service}"
            )
        except Exception as exc:  # the client raises ApiException, urllib3 and OS errors
            raise DiscoveryError(
                f"listing EndpointSlices of {self.namespace}/{self.service}: {exc}"
            ) from exc
        urls = set()
        for item in slices.items or []:
            port = self.port or _slice_port(item)
            if port is None:
                continue
            for endpoint in item.endpoints or []:
                conditions = endpoint.conditions
                if conditions is not None and conditions.ready is False:
                    continue
                for address in endpoint.addresses or []:
                    host = f"[{address}]" if ":" in address else address
                    urls.add(f"http://{host}:{port}")
        return urls

    async def node_urls(self) -> set[str]:
        return await asyncio.to_thread(self._list)


def _slice_port(item: Any) -> int | None:
    ports = item.ports or []
    for port in ports:
        if port.name == "api" and port.port:
            return int(port.port)
    return int(ports[0].port) if ports and ports[0].port else None


def open_discovery(spec: str | None) -> Discovery | None:
    """The discovery ``spec`` names (see the module docstring); None for none."""
    if not spec:
        return None
    kind, _, rest = spec.partition(":")
    if kind == "static":
        return StaticDiscovery(rest.split(","))
    if kind == "kubernetes":
        where, _, port = rest.partition(":")
        namespace, _, service = where.partition("/")
        if not namespace or not service or (port and not port.isdigit()):
            raise ValueError(f"expected kubernetes:NAMESPACE/SERVICE[:PORT], got {spec!r}")
        return EndpointSliceDiscovery(namespace, service, int(port) if port else None)
    raise ValueError(f"unknown discovery {spec!r}: static:URL,... or kubernetes:NS/SERVICE")
