"""Running envd: uvicorn (h11, asyncio) serving the envd application, with a clean
SIGTERM/SIGINT shutdown. Processes envd started keep running when it stops."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from types import FrameType

DEFAULT_PORT = 49983
DEFAULT_HOST = "0.0.0.0"  # reachable from the host
#: How long open streams (e.g. a running Start) may delay shutdown before being cut.
GRACEFUL_SHUTDOWN_S = 3

logger = logging.getLogger("agentenv.envd")


@dataclass(frozen=True, slots=True)
class ServerOptions:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    log_level: str = "warning"
    #: Whether /init may set the system clock and seed the kernel RNG (off outside a guest).
    manage_system: bool = True


async def serve(options: ServerOptions) -> None:
    """Serve envd until SIGTERM/SIGINT."""
    import uvicorn  # here, not at the top: keeps `--help` fast

    from .app import create_app
    from .processes import ProcessRegistry
    from .state import EnvdState

    state = EnvdState(manage_system=options.manage_system)
    registry = ProcessRegistry()
    config = uvicorn.Config(
        create_app(state, registry),
        host=options.host,
        port=options.port,
        loop="asyncio",
        http="h11",
        ws="none",
        lifespan="off",
        interface="asgi3",
        log_level=options.log_level,
        access_log=False,
        server_header=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    server = uvicorn.Server(config)
    try:
        await server.serve()
    finally:
        registry.close()


def run(options: ServerOptions) -> int:
    """Run envd in this process; returns the exit status."""
    logging.basicConfig(level=options.log_level.upper(), format="envd %(levelname)s %(message)s")
    stopped_by: list[int] = []

    def note_signal(signum: int, frame: FrameType | None) -> None:
        # uvicorn re-raises the signal that stopped it once it has shut down; with this
        # handler in place that ends in a normal exit instead of death by signal.
        stopped_by.append(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, note_signal)
    try:
        asyncio.run(serve(options))
    except OSError as e:
        logger.error("envd could not serve on %s:%d: %s", options.host, options.port, e)
        return 1
    return 0
