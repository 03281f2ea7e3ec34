"""Running envd: uvicorn (h11, asyncio) serving the envd application on two ports, with a
clean SIGTERM/SIGINT shutdown. Processes envd started keep running when it stops.

The public port (49983) serves E2B's envd protocol; the control port (49984) serves
``/init`` only. The node's proxy forwards to the public port and never to the control
port, so ``/init`` (which sets the access token and the default user) is reachable by the
orchestrator alone, whatever path tricks a client tries on the public port.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

DEFAULT_PORT = 49983
DEFAULT_CONTROL_PORT = 49984
DEFAULT_HOST = "0.0.0.0"  # reachable from the host
#: How long open streams (e.g. a running Start) may delay shutdown before being cut.
GRACEFUL_SHUTDOWN_S = 3

logger = logging.getLogger("agentenv.envd")


@dataclass(frozen=True, slots=True)
class ServerOptions:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    control_port: int = DEFAULT_CONTROL_PORT
    log_level: str = "warning"
    #: Whether /init may set the system clock and seed the kernel RNG (off outside a guest).
    manage_system: bool = True
    #: Where /init's configuration is kept for an envd restarted after a crash.
    state_file: Path | None = None


async def serve(options: ServerOptions) -> None:
    """Serve envd until SIGTERM/SIGINT."""
    import uvicorn  # here, not at the top: keeps `--help` fast

    from .app import create_app
    from .processes import ProcessRegistry
    from .quiet import QuietServer
    from .state import EnvdState

    state = (
        EnvdState.restore(options.state_file, manage_system=options.manage_system)
        if options.state_file is not None
        else EnvdState(manage_system=options.manage_system)
    )
    registry = ProcessRegistry()
    sockets = [_listen(options.host, options.port), _listen(options.host, options.control_port)]
    config = uvicorn.Config(
        create_app(state, registry, control_port=options.control_port),
        loop="asyncio",
        http="h11",
        ws="none",
        lifespan="off",
        interface="asgi3",
        log_level=options.log_level,
        access_log=False,
        server_header=False,
        date_header=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    server = QuietServer(config)
    try:
        await server.serve(sockets=sockets)
    finally:
        registry.close()
        for sock in sockets:
            sock.close()


def _listen(host: str, port: int) -> socket.socket:
    # IPPROTO_TCP named explicitly: asyncio turns Nagle off (TCP_NODELAY) only on sockets
    # whose proto says TCP, and accepted sockets inherit proto 0 from a listener made
    # without it. With Nagle on, a response written in pieces waits for the client's
    # delayed ACK: a 1 MiB upload through the proxy took 45 ms longer.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    return sock


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
        logger.error(
            "envd could not serve on %s ports %d and %d: %s",
            options.host,
            options.port,
            options.control_port,
            e,
        )
        return 1
    return 0
