"""Building the orchestrator's components and wiring them together.

:func:`build_components` makes every component the facade (:mod:`.orchestrator`)
drives, each given what it needs in its constructor (never the facade), and returns
them as :class:`Components`. It owns only the order of construction and which
component gets which; it holds no state and starts nothing (no store opened, no
background task, no directory made: :meth:`Orchestrator.startup` does that), and it
must not call components' operations.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import httpx

from agentenv.config import Config
from agentenv.network import NetworkManager
from agentenv.orchestrator.capture import Capture, Resharing
from agentenv.orchestrator.catalog import Catalog
from agentenv.orchestrator.diskspace import FreeSpaceFloor
from agentenv.orchestrator.lifecycle import Lifecycle, Timeouts
from agentenv.orchestrator.liveness import VmmLiveness
from agentenv.orchestrator.machines import Machines
from agentenv.orchestrator.metrics import MetricsHistory
from agentenv.orchestrator.modes import Mode
from agentenv.orchestrator.operations import SandboxOperations
from agentenv.orchestrator.queries import Queries
from agentenv.orchestrator.recovery import Recovery
from agentenv.orchestrator.resources import (
    START_WAIT_S,
    FilePins,
    MemoryBudget,
    NetworkLeases,
    Slots,
    StartGate,
    resolve_subnet,
)
from agentenv.orchestrator.secrets import Secrets
from agentenv.orchestrator.snapshotting import Snapshotting
from agentenv.orchestrator.sources import Sources
from agentenv.orchestrator.starts import SandboxStarts
from agentenv.orchestrator.store import SandboxEvent, Store
from agentenv.orchestrator.supervisor import Supervisor
from agentenv.orchestrator.sync import RepositorySync
from agentenv.orchestrator.tags import TemplateTags
from agentenv.orchestrator.templates import TemplateManager
from agentenv.orchestrator.tokens import EnvdTokens
from agentenv.orchestrator.volumes import Volumes
from agentenv.vmm.base import VMMDriver

log = logging.getLogger("agentenv.orchestrator")


@dataclass(frozen=True)
class Components:
    """Every component of one node's orchestrator, wired."""

    store: Store
    network: NetworkManager
    http: httpx.AsyncClient
    timeouts: Timeouts
    free_space: FreeSpaceFloor
    operations: SandboxOperations
    supervisor: Supervisor
    machines: Machines
    slots: Slots
    leases: NetworkLeases
    pins: FilePins
    catalog: Catalog
    tags: TemplateTags
    secrets: Secrets
    volumes: Volumes
    templates: TemplateManager
    sources: Sources
    resharing: Resharing
    sync: RepositorySync
    lifecycle: Lifecycle
    liveness: VmmLiveness
    recovery: Recovery
    starts: SandboxStarts
    snapshotting: Snapshotting
    queries: Queries


def build_components(
    config: Config,
    driver: VMMDriver,
    accel: Literal["tcg", "kvm"],
    mode: Mode,
    given_network: NetworkManager | None,
    given_store: Store | None,
    given_http: httpx.AsyncClient | None,
    *,
    mode_reason: str,
) -> Components:
    """The components of a node restoring sandboxes in ``mode`` (``driver`` under
    ``accel``); the network, store and http client (to guests' envd) default to the
    real ones."""
    store = given_store or Store(
        config.db_path, EnvdTokens.configured(config.envd_token_key, config.envd_token_key_path)
    )
    store.listen(_log_event)
    network = given_network or NetworkManager(
        prefix=f"ae{config.instance_tag}", subnet=resolve_subnet(config)
    )
    # No keep-alive: guest addresses are reused with network slots, so a pooled
    # connection could outlive its sandbox and reach the next one.
    http = given_http or httpx.AsyncClient(
        trust_env=False, limits=httpx.Limits(max_keepalive_connections=0)
    )
    timeouts = Timeouts(config.default_timeout, config.max_timeout)
    free_space = FreeSpaceFloor(config)
    operations = SandboxOperations()
    supervisor = Supervisor()
    machines = Machines(driver, network, store, accel)
    metrics = MetricsHistory(store, http, machines.current, config.metrics_interval)
    slots = Slots(store, network)
    leases = NetworkLeases(network, store, operations, config.network_linger)
    pins = FilePins(store)
    catalog = Catalog(config, lambda: pins.pinned_keys(catalog.cache))
    # Template tags (assign, remove, list): the catalog's, for every node.
    tags = TemplateTags(catalog)
    secrets = Secrets(config, catalog)
    # Network rules' ${e2b.secrets.<name>} placeholders are resolved by the egress
    # filter, on the host, per request.
    network.resolve_secrets_with(secrets.value)
    volumes = Volumes(
        config.home / "volumes",
        config.node_name,
        catalog,
        store,
        http,
        lambda slot: network.describe(slot).guest_address,
    )
    templates = TemplateManager(
        config, store, driver, accel, network, slots.reserve, slots.release, http
    )
    sources = Sources(config.templates_dir, store, templates, catalog, pins, mode)
    resharing = Resharing(sources, supervisor)
    capture = Capture(config.snapshots_dir, store, machines, sources, pins, resharing, supervisor)
    sync = RepositorySync(
        config.sandboxes_dir,
        store,
        catalog,
        sources,
        pins,
        slots,
        leases,
        machines,
        operations,
        supervisor,
        publishes_paused_state=driver.publishes_paused_state,
        mode=mode,
        commit_wait=config.commit_wait,
    )
    lifecycle = Lifecycle(
        config.sandboxes_dir,
        store,
        driver,
        network,
        machines,
        slots,
        leases,
        pins,
        sources,
        resharing,
        sync,
        http,
        volumes,
        boot_timeout=config.template_boot_timeout,
        memory=MemoryBudget(
            store,
            config.memory_overcommit,
            reserve_mib=config.memory_reserve_mib,
            pressure_limit_pct=config.memory_pressure_limit,
        ),
        starts=StartGate(config.start_places, START_WAIT_S),
        mode=mode,
        envd_init_timeout=config.envd_init_timeout,
    )
    liveness = VmmLiveness(store, machines, operations, lifecycle, free_space)
    recovery = Recovery(
        config.sandboxes_dir,
        config.snapshots_dir,
        store,
        driver,
        network,
        machines,
        lifecycle,
        pins,
    )
    starts = SandboxStarts(operations, lifecycle, free_space)
    snapshotting = Snapshotting(
        store,
        catalog,
        network,
        http,
        volumes,
        operations,
        lifecycle,
        liveness,
        capture,
        sync,
        pins,
        starts,
        free_space,
        timeouts,
    )
    queries = Queries(
        store,
        catalog,
        templates,
        lifecycle,
        liveness,
        machines,
        sync,
        free_space,
        metrics,
        http,
        mode=mode,
        mode_reason=mode_reason,
        metrics_interval=config.metrics_interval,
    )
    return Components(
        store=store,
        network=network,
        http=http,
        timeouts=timeouts,
        free_space=free_space,
        operations=operations,
        supervisor=supervisor,
        machines=machines,
        slots=slots,
        leases=leases,
        pins=pins,
        catalog=catalog,
        tags=tags,
        secrets=secrets,
        volumes=volumes,
        templates=templates,
        sources=sources,
        resharing=resharing,
        sync=sync,
        lifecycle=lifecycle,
        liveness=liveness,
        recovery=recovery,
        starts=starts,
        snapshotting=snapshotting,
        queries=queries,
    )


def _log_event(event: SandboxEvent) -> None:
    log.debug("sandbox %s: %s -> %s", event.sandbox_id, event.old or "new", event.new or "gone")
