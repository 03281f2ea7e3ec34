"""Limits shared by the server, its API models and the clients, defined once here so
they cannot drift apart. Limits a node operator sets (timeouts) live in
:class:`agentenv.config.Config`; these are the fixed ones."""

from __future__ import annotations

# Children one fork request may start: they restore at once on one node, each with its
# own network slot and VMM.
MAX_FORK_CHILDREN = 20
# Longest template id or name a create names.
MAX_TEMPLATE_REF_LENGTH = 256
# Longest snapshot name.
MAX_SNAPSHOT_NAME_LENGTH = 128
# Most seconds one refresh (E2B's keep-alive) may extend a sandbox's life by.
MAX_REFRESH_DURATION_S = 3600
# Most items one page of a listing (``GET /v2/sandboxes``, ``GET /snapshots``) may hold.
MAX_PAGE_SIZE = 1000
# Sandbox metadata (POST /sandboxes, /v2/sandboxes; forks inherit it): it is stored with
# the sandbox, copied into snapshots and returned by every listing, so its size is bound.
MAX_METADATA_ENTRIES = 64
MAX_METADATA_KEY_LENGTH = 256
MAX_METADATA_VALUE_LENGTH = 4096
# Keys plus values, in UTF-8 bytes.
MAX_METADATA_BYTES = 32 * 1024
# Environment variables a create sets for every process in the sandbox (sent to envd at
# start and after each resume).
MAX_ENV_VARS = 256
MAX_ENV_VAR_NAME_LENGTH = 256
MAX_ENV_VAR_VALUE_LENGTH = 32 * 1024
# Names plus values, in UTF-8 bytes.
MAX_ENV_VARS_BYTES = 256 * 1024
