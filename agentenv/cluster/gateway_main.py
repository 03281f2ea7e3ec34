"""``aenv-gateway``'s command line: settings from arguments and the environment, then
:class:`~agentenv.cluster.gateway.Gateway` served by uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import uvicorn

from agentenv.cluster.gateway import DEFAULT_LISTEN, KEEP_ALIVE_S, Gateway
from agentenv.cluster.scheduler_client import SchedulerClient


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="aenv-gateway", description="the cluster gateway: the one URL clients use"
    )
    parser.add_argument("--listen", default=DEFAULT_LISTEN, help=f"host:port ({DEFAULT_LISTEN})")
    parser.add_argument(
        "--scheduler",
        default=os.environ.get("AENV_SCHEDULER_URL"),
        help="the scheduler's URL (env AENV_SCHEDULER_URL)",
    )
    parser.add_argument(
        "--domain",
        default=os.environ.get("AENV_DOMAIN"),
        help="the nodes' AENV_DOMAIN: `{port}-{id}.{domain}` hosts route to sandboxes",
    )
    parser.add_argument(
        "--route-cache",
        type=float,
        default=1.0,
        help="seconds a sandbox's node is remembered for its traffic (default 1; 0: never)",
    )
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    api_key = os.environ.get("AENV_API_KEY")
    if not api_key or not args.scheduler:
        sys.exit("aenv-gateway: set AENV_API_KEY and --scheduler (or AENV_SCHEDULER_URL)")
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    gateway = Gateway(
        SchedulerClient(args.scheduler, api_key),
        api_key,
        args.domain,
        route_cache_s=args.route_cache,
    )
    host, _, port = args.listen.rpartition(":")
    uvicorn.run(
        gateway,
        host=host,
        port=int(port),
        log_level="warning",
        timeout_keep_alive=KEEP_ALIVE_S,
        h11_max_incomplete_event_size=1024 * 1024,
    )


if __name__ == "__main__":
    main()
