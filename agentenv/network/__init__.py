"""Per-sandbox networking: a network namespace with a tap device for the guest, a veth
pair the host reaches the guest through, NAT rules, the enforcement of each sandbox's
egress policy (nftables rules in its namespace, and the host-name filter), and
reclamation of leftovers after a crash. The guest always sees the same address, so
restored and forked copies work unchanged. It knows nothing about VMs or sandbox records
beyond a slot number.
"""

from agentenv.network.manager import (
    NetworkError,
    NetworkManager,
    SandboxNetwork,
    pick_free_subnet,
)
from agentenv.network.policy import EgressPolicy, PolicyError

__all__ = [
    "EgressPolicy",
    "NetworkError",
    "NetworkManager",
    "PolicyError",
    "SandboxNetwork",
    "pick_free_subnet",
]
