"""Typed errors of the guest image pipeline."""

from __future__ import annotations

from collections.abc import Sequence


class GuestImageError(Exception):
    """Building or loading the guest image failed."""


class GuestImageMissing(GuestImageError):
    """No guest image has been built in this cache directory yet."""


class HostToolMissing(GuestImageError):
    """Host programs the pipeline needs are not installed."""

    def __init__(self, missing: dict[str, str]) -> None:
        self.missing = dict(missing)
        packages = " ".join(sorted(set(missing.values())))
        tools = ", ".join(sorted(missing))
        super().__init__(
            f"missing host tools: {tools}; install them with: apt-get install -y {packages}"
        )


class CommandFailed(GuestImageError):
    """A host command exited non-zero; carries its captured stderr."""

    def __init__(self, argv: Sequence[str], returncode: int, stderr: str) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        tail = "\n".join(stderr.strip().splitlines()[-25:])
        super().__init__(f"command failed (exit {returncode}): {' '.join(self.argv)}\n{tail}")
