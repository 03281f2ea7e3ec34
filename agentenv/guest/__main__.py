"""``python -m agentenv.guest build|show|cmdline``."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from agentenv.guest.cmdline import kernel_cmdline
from agentenv.guest.errors import GuestImageError
from agentenv.guest.host import APT_PACKAGES
from agentenv.guest.image import build_guest_image, default_cache_dir, load_guest_image


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m agentenv.guest", description="Build or inspect the agentenv guest image."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("build", "build the image (cached components are reused)"),
        ("show", "print the manifest of the most recent image"),
    ):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument(
            "--cache-dir",
            type=Path,
            default=None,
            help="default: $AENV_IMAGE_CACHE or /var/cache/agentenv/images",
        )
    sub.add_parser("cmdline", help="print the guest kernel command line for this host")
    sub.add_parser("apt-packages", help="print the Debian packages the build host needs")
    args = parser.parse_args(argv)

    try:
        if args.command == "cmdline":
            print(kernel_cmdline())
        elif args.command == "apt-packages":
            print(" ".join(APT_PACKAGES))
        else:
            cache_dir = args.cache_dir or default_cache_dir()
            if args.command == "build":
                # The log already says what was built; the manifest is `show`'s job.
                image = asyncio.run(build_guest_image(cache_dir, log=_log))
                print(f"guest image {image.digest} in {cache_dir}")
            else:
                image = load_guest_image(cache_dir)
                print(json.dumps(image.manifest(), indent=2, sort_keys=True))
    except GuestImageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
