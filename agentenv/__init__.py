"""agentenv: self-hosted, E2B-compatible microVM sandboxes.

The folders are the architecture: ``api`` (HTTP control plane), ``proxy`` (traffic into
sandboxes), ``orchestrator`` (sole owner of sandbox state), ``vmm`` (QEMU and Firecracker
drivers), ``envd`` (the in-guest agent), ``guest`` (guest image pipeline), ``storage``,
``snapshots``, ``network``, ``cluster`` and ``cli``. This module must stay import-light:
the in-guest envd imports it.
"""

__version__ = "0.1.0"
