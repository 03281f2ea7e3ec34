"""``aenv-gateway``'s command line: settings from arguments and the environment, then
:class:`~agentenv.cluster.gateway.Gateway` served behind its front (``gateway_server``; over
TLS with a certificate and key: then clients set ``E2B_DOMAIN`` to the gateway's domain
alone)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import uvloop

from agentenv.cluster.gateway import DEFAULT_LISTEN, Gateway
from agentenv.cluster.gateway_server import GatewayServer, serve, server_tls
from agentenv.cluster.node_transport import AiohttpNodeTransport
from agentenv.cluster.scheduler_client import SchedulerClient
from agentenv.cluster.tls import (
    TlsSetupError,
    add_server_arguments,
    check_server_arguments,
    client_context,
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="aenv-gateway", description="the cluster gateway: the one URL clients use"
    )
    parser.add_argument("--listen", default=DEFAULT_LISTEN, help=f"host:port ({DEFAULT_LISTEN})")
    parser.add_argument(
        "--scheduler",
        default=os.environ.get("AENV_SCHEDULER_URL"),
        help="the scheduler's URL, or its replicas' comma-separated (env AENV_SCHEDULER_URL)",
    )
    parser.add_argument(
        "--ca-file",
        default=os.environ.get("AENV_CA_FILE"),
        help="CA bundle (PEM) https:// nodes and schedulers are verified with "
        "(env AENV_CA_FILE; default: the system's trusted certificates)",
    )
    add_server_arguments(parser, "for E2B_DOMAIN alone it names the domain and *.domain")
    parser.add_argument(
        "--domain",
        default=os.environ.get("AENV_DOMAIN"),
        help="the nodes' AENV_DOMAIN: `{port}-{id}.{domain}` hosts route to sandboxes",
    )
    parser.add_argument(
        "--route-cache",
        type=float,
        default=1.0,
        help="seconds a sandbox's node is remembered for its traffic, and as long again "
        "while it is looked up anew (default 1; 0: never)",
    )
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    api_key = os.environ.get("AENV_API_KEY")
    if not api_key or not args.scheduler:
        sys.exit("aenv-gateway: set AENV_API_KEY and --scheduler (or AENV_SCHEDULER_URL)")
    check_server_arguments("aenv-gateway", args)
    try:
        client_context(args.ca_file)
    except TlsSetupError as exc:
        sys.exit(f"aenv-gateway: {exc}")
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("httpx", "httpcore", "aiohttp"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # The scheduler is asked for each sandbox's node about once a second while it has
    # traffic (the route cache's refresh): through aiohttp's pool, as nodes are, that
    # costs the gateway a fraction of what httpcore's did (bench/cluster.py).
    scheduler_transport = AiohttpNodeTransport(client_context(args.ca_file))
    gateway = Gateway(
        SchedulerClient(
            args.scheduler, api_key, ca_file=args.ca_file, transport=scheduler_transport
        ),
        api_key,
        args.domain,
        route_cache_s=args.route_cache,
        ca_file=args.ca_file,
    )
    host, _, port = args.listen.rpartition(":")
    tls = server_tls(args.tls_cert, args.tls_key) if args.tls_cert else None
    # uvloop, as the app was served before: the front's callbacks run in its C loop.
    uvloop.run(serve(GatewayServer(gateway, host, int(port), tls=tls)))


if __name__ == "__main__":
    main()
