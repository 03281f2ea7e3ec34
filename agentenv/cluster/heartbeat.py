"""A node's heartbeats to the scheduler (``AENV_SCHEDULER_URL``, one URL or replicas
comma-separated; ``AENV_CA_FILE`` verifies an https one; off without it): every
``heartbeat_interval`` seconds, its capacity, allocations, roster and ready templates.
Read-only on the node: it reports through the orchestrator's public views and changes
nothing. A scheduler that cannot be reached is logged (once per outage) and tried again;
the node keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable

from agentenv import __version__
from agentenv.api.nodes import Node
from agentenv.cluster.models import NodeReport
from agentenv.cluster.scheduler_client import (
    SchedulerClient,
    SchedulerRefused,
    SchedulerUnavailable,
)
from agentenv.config import Config
from agentenv.orchestrator.orchestrator import Orchestrator
from agentenv.orchestrator.resources import host_ram_mib

log = logging.getLogger("agentenv.cluster.heartbeat")


def node_report(
    orchestrator: Orchestrator, config: Config, describe: Callable[[], Node] | None = None
) -> NodeReport:
    status = orchestrator.node_status()
    sandboxes = orchestrator.list_sandboxes()
    paused = [view.record for view in sandboxes if view.state == "paused"]
    return NodeReport(
        nodeID=status.node,
        url=config.node_url or config.url,
        version=__version__,
        cpuCount=os.cpu_count() or 1,
        memoryMib=host_ram_mib(),
        allocatedVcpus=status.allocated_vcpus,
        allocatedMemoryMib=status.allocated_memory_mib,
        pausedVcpus=sum(rec.vcpus for rec in paused),
        pausedMemoryMib=sum(rec.memory_mib for rec in paused),
        sandboxVcpus=config.vcpus,
        sandboxMemoryMib=config.memory_mib,
        sandboxes=[view.sandbox_id for view in sandboxes],
        templates=sorted(t for t, state in status.templates.items() if state == "ready"),
        problem=status.problem,
        e2bNode=describe() if describe is not None else None,
    )


class Heartbeat:
    def __init__(
        self,
        orchestrator: Orchestrator,
        config: Config,
        api_key: str,
        describe: Callable[[], Node] | None = None,
    ) -> None:
        if config.scheduler_url is None:
            raise ValueError("heartbeats need a scheduler_url")
        self.orchestrator = orchestrator
        self.config = config
        # The node as GET /nodes describes it, sent along so the gateway can list nodes.
        self.describe = describe
        self.client = SchedulerClient(config.scheduler_url, api_key, ca_file=config.ca_file)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.client.aclose()

    async def beat(self) -> None:
        await self.client.heartbeat(node_report(self.orchestrator, self.config, self.describe))

    async def _run(self) -> None:
        failing = False
        while True:
            try:
                await self.beat()
            except (SchedulerUnavailable, SchedulerRefused) as exc:
                if not failing:
                    log.warning("heartbeat failed (retrying every %ss): %s", self.interval, exc)
                failing = True
            except Exception:
                # A bug here must not end heartbeats for good (the node would go down
                # in the scheduler while it serves): logged, and tried again.
                if not failing:
                    log.exception("heartbeat failed (retrying every %ss)", self.interval)
                failing = True
            else:
                if failing:
                    log.info("heartbeats reach the scheduler again")
                failing = False
            await asyncio.sleep(self.interval)

    @property
    def interval(self) -> float:
        return self.config.heartbeat_interval
