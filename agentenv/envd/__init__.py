"""envd: the agent that runs inside every guest and speaks E2B's envd protocol on port
49983 (Connect RPC ``process.Process`` / ``filesystem.Filesystem``, ``/health``,
``/files``), with ``/init`` on a control port (49984) that only the node reaches. It runs
on the guest's tools drive under its own Python, so it must import nothing from agentenv
outside this package and only what the ``envd`` extra installs.
"""
