"""The ``aenv`` command line: talks to the HTTP API only, never to internals."""

from agentenv.cli.main import main

__all__ = ["main"]
