"""The ``aenv`` command line. It owns the user's side of the platform: credentials in
the user's config directory, terminal handling and output formats. It talks to a server
only over HTTP, through the control-plane routes (``agentenv.client``, the one HTTP layer
to them) and the ``e2b`` SDK (commands, PTYs and files through the sandbox proxy), and
must not touch the orchestrator, VMMs, the data directory or any other server internals;
``aenv server`` merely starts one.
"""

from agentenv.cli.main import main

__all__ = ["main"]
