"""Addresses every guest sees. They are identical in every sandbox so that a snapshot
restored or forked into a new network namespace works without reconfiguring the guest."""

GUEST_IP = "169.254.0.21"
GUEST_GATEWAY = "169.254.0.22"
GUEST_PREFIX = 30
GUEST_MAC = "02:fc:00:00:00:05"
# The tap (the guest's gateway) has a fixed MAC too, so restored guests' ARP caches stay valid.
GATEWAY_MAC = "02:fc:00:00:00:06"
TAP_NAME = "tap0"
ENVD_PORT = 49983
# envd's control port: /init (token, clock, entropy) is served here and nowhere else. The
# node reaches it directly; the proxy never forwards to it.
ENVD_CONTROL_PORT = 49984
