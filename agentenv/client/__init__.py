"""Python client for an agentenv server: typed sync (``AgentEnv``) and async
(``AsyncAgentEnv``) clients for what the E2B SDK lacks (fork, snapshots, lineage, node
health), returning ``e2b.Sandbox`` / ``e2b.AsyncSandbox`` objects for everything that runs
in a sandbox, and the ``rollout`` helpers that fork a prepared sandbox for RL. It talks to
the server only over its HTTP API (httpx, and the ``e2b`` SDK for envd traffic); it must
not import the orchestrator, the API application or anything else that runs server-side,
only the API's Pydantic models that define the wire format.
"""

from agentenv.api.models import Health, Lineage, SandboxDetail, SnapshotInfo
from agentenv.client.async_client import AsyncAgentEnv
from agentenv.client.connection import Connection, SandboxRef
from agentenv.client.errors import (
    AgentEnvError,
    AuthError,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    UnreachableError,
)
from agentenv.client.rollout import After, RolloutResult, rollout, rollout_async
from agentenv.client.sync_client import AgentEnv
from agentenv.client.wire import SnapshotPage

__all__ = [
    "After",
    "AgentEnv",
    "AgentEnvError",
    "AsyncAgentEnv",
    "AuthError",
    "ConflictError",
    "Connection",
    "Health",
    "InvalidRequestError",
    "Lineage",
    "NotFoundError",
    "RolloutResult",
    "SandboxDetail",
    "SandboxRef",
    "SnapshotInfo",
    "SnapshotPage",
    "UnreachableError",
    "rollout",
    "rollout_async",
]
