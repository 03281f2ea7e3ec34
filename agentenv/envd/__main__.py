"""``python -m agentenv.envd``: start the in-guest agent."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .server import DEFAULT_CONTROL_PORT, DEFAULT_HOST, DEFAULT_PORT, ServerOptions, run


def parse_args(argv: list[str] | None = None) -> ServerOptions:
    parser = argparse.ArgumentParser(
        prog="python -m agentenv.envd",
        description="envd: the agent inside every agentenv guest. Speaks E2B's envd "
        "protocol (Connect RPC process.Process / filesystem.Filesystem, /health, /init).",
    )
    parser.add_argument("--host", default=DEFAULT_HOST, help="address to listen on")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="public port (E2B's envd)")
    parser.add_argument(
        "--control-port",
        type=int,
        default=DEFAULT_CONTROL_PORT,
        help="port serving /init, for the node only (never proxied)",
    )
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="log verbosity (stderr)",
    )
    parser.add_argument(
        "--no-system-changes",
        action="store_true",
        help="never set the clock or seed the kernel RNG from /init "
        "(for running envd outside a guest, e.g. in tests)",
    )
    parser.add_argument(
        "--state-file",
        type=Path,
        help="keep /init's configuration (token, user, env vars) in this file, root-only, "
        "so an envd restarted after a crash comes back configured",
    )
    args = parser.parse_args(argv)
    for flag, port in (("--port", args.port), ("--control-port", args.control_port)):
        if not 0 < port < 65536:
            parser.error(f"{flag} {port} is not a TCP port")
    if args.port == args.control_port:
        parser.error("--port and --control-port must differ")
    return ServerOptions(
        host=args.host,
        port=args.port,
        control_port=args.control_port,
        log_level=args.log_level,
        manage_system=not args.no_system_changes,
        state_file=args.state_file,
    )


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
