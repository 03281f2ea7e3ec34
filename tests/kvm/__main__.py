"""``python -m tests.kvm start|run CMD...|stop|status`` (what ``scripts/kvm-host`` runs).

``run`` exits with the command's exit code; its output is streamed as it comes.
``--dir`` (or ``$AENV_KVM_HOST_DIR``) picks the state directory, so several hosts can coexist.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tests.kvm import machine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/kvm-host", description=__doc__)
    parser.add_argument("--dir", type=Path, default=machine.DEFAULT_STATE_DIR)
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("start", help="build what is missing and boot the host")
    run = sub.add_parser("run", help="run a command inside (default cwd: the checkout)")
    run.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    run.add_argument("--cwd", type=Path, default=None)
    run.add_argument("--timeout", type=float, default=None)
    run.add_argument("command", nargs=argparse.REMAINDER)
    sub.add_parser("stop", help="stop the host and delete its disks")
    sub.add_parser("status", help="print whether it runs, as JSON")
    args = parser.parse_args(argv)
    try:
        if args.action == "start":
            print(json.dumps(machine.start(args.dir, log=lambda m: print(m, file=sys.stderr))))
        elif args.action == "run":
            command = args.command[1:] if args.command[:1] == ["--"] else args.command
            if not command:
                parser.error("run needs a command")
            env = dict(item.split("=", 1) for item in args.env)
            return machine.run(command, args.dir, env=env, cwd=args.cwd, timeout=args.timeout)
        elif args.action == "stop":
            print("stopped" if machine.stop(args.dir) else "not running")
        else:
            info = machine.status(args.dir)
            print(json.dumps(info))
            return 0 if info["running"] else 3
    except (machine.KvmHostError, TimeoutError) as exc:
        print(f"kvm-host: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
