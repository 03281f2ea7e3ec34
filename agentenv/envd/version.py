"""The envd protocol version this envd implements.

The E2B SDK gates features on the ``envdVersion`` a sandbox advertises (protocol
reference, section 4.9). Everything up to 0.6.4 is implemented here: recursive watches,
metrics, stdin control, the default user, CloseStdin, octet-stream and gzip uploads,
file metadata, watch events with entries and ``allowNetworkMounts`` on watches.
"""

ENVD_VERSION = "0.6.4"
