"""Limits shared by the server, its API models and the clients, defined once here so
they cannot drift apart. Limits a node operator sets (timeouts) live in
:class:`agentenv.config.Config`; these are the fixed ones."""

from __future__ import annotations

# Children one fork request may start: they restore at once on one node, each with its
# own network slot and VMM.
MAX_FORK_CHILDREN = 20
# Longest template or snapshot id or name: what the repository's name index holds
# (agentenv.snapshots.repository), so every name the API accepts can be stored.
MAX_TEMPLATE_REF_LENGTH = 200
# A template, snapshot or alias reference: no leading "/" (it separates the parts of a
# name, team/name) and no control characters (NUL ends C strings, ESC and others garble
# logs). Other characters are names the repository can look up (an unknown one is 404).
TEMPLATE_REF_PATTERN = r"^[^/\x00-\x1f\x7f][^\x00-\x1f\x7f]*$"
# Sandbox, build and snapshot ids: what the server makes ("i" and 20 letters and digits,
# UUIDs) and what older SDKs append ("-" and a client id), in the repository's id
# alphabet.
MAX_ID_LENGTH = 128
ID_PATTERN = r"^[A-Za-z0-9._:-]+$"
# Longest name a template build (POST /v3/templates) may take.
MAX_TEMPLATE_NAME_LENGTH = 128
# Longest snapshot name.
MAX_SNAPSHOT_NAME_LENGTH = 128
# Most seconds one refresh (E2B's keep-alive) may extend a sandbox's life by.
MAX_REFRESH_DURATION_S = 3600
# A COPY step's files hash (e2b's is a SHA-256, in hex).
MAX_FILES_HASH_LENGTH = 128
# Longest upload token and ``nextToken`` a request may carry.
MAX_TOKEN_LENGTH = 256
# Largest JSON body of a control-plane request (template file uploads and sandbox
# traffic are not bound by it): env vars and metadata at their limits fit several times.
MAX_REQUEST_BODY_BYTES = 1024 * 1024
# Network options of a create or PUT /sandboxes/{id}/network: each allowOut / denyOut
# entry is a firewall or egress-filter rule (a host name is at most 253 characters).
MAX_EGRESS_ENTRIES = 256
MAX_EGRESS_ENTRY_LENGTH = 256
MAX_DNS_SERVERS = 8
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
