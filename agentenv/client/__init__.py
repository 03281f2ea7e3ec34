"""Python client for an agentenv server: typed sync (``AgentEnv``) and async
(``AsyncAgentEnv``) clients for what the E2B SDK lacks (fork, snapshots, lineage, node
health, the control-plane routes the ``aenv`` CLI is built on), returning ``e2b.Sandbox`` /
``e2b.AsyncSandbox`` objects for everything that runs in a sandbox, and the ``rollout``
helpers that fork a prepared sandbox for RL. It is the one HTTP layer to the control-plane
API. It talks to the server only over that API (httpx, and the ``e2b`` SDK for envd
traffic, imported only once an SDK object is made); it must not import the orchestrator,
the API application or anything else that runs server-side, only the API's Pydantic
models that define the wire format.
"""

from agentenv.api.models import (
    ForkResult,
    Health,
    Lineage,
    SandboxDetail,
    SnapshotInfo,
    TemplateInfo,
)
from agentenv.client.async_client import AsyncAgentEnv
from agentenv.client.connection import Connection, SandboxRef
from agentenv.client.errors import (
    AgentEnvError,
    AuthError,
    ConflictError,
    InvalidRequestError,
    NoAnswerError,
    NotFoundError,
    NotSupportedError,
    UnreachableError,
)
from agentenv.client.rollout import After, RolloutResult, rollout, rollout_async
from agentenv.client.sync_client import AgentEnv
from agentenv.client.wire import ResumeResult, SandboxPage, SnapshotPage

__all__ = [
    "After",
    "AgentEnv",
    "AgentEnvError",
    "AsyncAgentEnv",
    "AuthError",
    "ConflictError",
    "Connection",
    "ForkResult",
    "Health",
    "InvalidRequestError",
    "Lineage",
    "NoAnswerError",
    "NotFoundError",
    "NotSupportedError",
    "ResumeResult",
    "RolloutResult",
    "SandboxDetail",
    "SandboxPage",
    "SandboxRef",
    "SnapshotInfo",
    "SnapshotPage",
    "TemplateInfo",
    "UnreachableError",
    "rollout",
    "rollout_async",
]
