"""``python3 -m agentenv.interpreter [--host H] [--port P] [--home DIR]``: run the
code-interpreter server (in the guest; the template's start command)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from agentenv.interpreter.server import PORT, serve


def main() -> None:
    parser = argparse.ArgumentParser(prog="python3 -m agentenv.interpreter")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=PORT)
    parser.add_argument("--home", default=os.path.expanduser("~"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(serve(args.host, args.port, args.home))


if __name__ == "__main__":
    main()
