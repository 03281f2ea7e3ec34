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
