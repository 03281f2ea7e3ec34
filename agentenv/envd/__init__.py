"""envd: the agent that runs inside every guest on port 49983 and speaks E2B's envd
protocol (Connect RPC ``process.Process`` / ``filesystem.Filesystem``, ``/health``,
``/init``). It runs on the guest's tools drive under its own Python, so it must import
nothing from agentenv outside this package and only what the ``envd`` extra installs.
"""
