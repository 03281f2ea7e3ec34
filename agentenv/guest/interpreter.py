"""The code-interpreter root filesystem: the guest image's root filesystem plus a Python
scientific stack (numpy, pandas, matplotlib, ipykernel) and the in-guest interpreter
server (``agentenv/interpreter``), for the ``code-interpreter-v1`` template.

The packages are fetched on the host with the host's pip and its configuration (index,
mirrors, constraints), as wheels for the guest's Python (Debian 12's 3.11, glibc 2.36,
x86_64); the guest never reaches a network for them. Everything is content-addressed in
the image cache:

- ``interpreter-wheels/<sha256>/<file>.whl``: each downloaded wheel, by its hash;
- ``interpreter-resolved/<key>.json``: which wheels the requirements resolved to, kept so
  an unchanged rebuild asks no index (delete it to pick up newer releases);
- ``interpreter-rootfs/<key>/rootfs.ext4``: the base root filesystem with the wheels
  installed and byte-compiled under ``/opt/aenv-interpreter`` (made visible to every
  ``python3`` by a ``.pth`` file), written with ``debugfs`` into a copy of the base image,
  so nothing is mounted. Its key covers the base root filesystem, the wheels and the
  server's sources.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agentenv.guest.cache import ComponentCache, build_lock, content_key, hash_files, sha256_file
from agentenv.guest.errors import GuestImageError
from agentenv.guest.host import host_env, run
from agentenv.guest.image import GuestImage

# Bump when the steps below change the produced filesystem.
BUILD_VERSION = 2
REQUIREMENTS: tuple[str, ...] = (
    "numpy",
    "pandas",
    "matplotlib",
    "ipykernel",
    "jupyter_client",
    "tornado",
)
# Debian 12's python3 and C library: wheels must be built for these.
GUEST_PYTHON = "3.11"
GUEST_ABI = "cp311"
GUEST_GLIBC_MINOR = 36
INSTALL_DIR = "/opt/aenv-interpreter"
SITE_DIR = f"{INSTALL_DIR}/site"
APP_DIR = f"{INSTALL_DIR}/app"
# Read by every python3 of the guest at start-up: puts SITE_DIR on sys.path.
PTH_FILE = "/usr/lib/python3/dist-packages/aenv-interpreter.pth"
SOURCE_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class InterpreterRootfs:
    path: Path
    key: str
    meta: dict[str, object]


def _platform_args() -> list[str]:
    # pip takes platform tags literally: every manylinux level the guest's glibc accepts.
    tags = [f"manylinux_2_{minor}_x86_64" for minor in range(GUEST_GLIBC_MINOR, 16, -1)]
    tags += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
    args = ["--only-binary=:all:", "--implementation", "cp", "--abi", GUEST_ABI]
    args += ["--python-version", GUEST_PYTHON]
    for tag in tags:
        args += ["--platform", tag]
    return args


def _server_sources() -> list[Path]:
    package = SOURCE_ROOT / "interpreter"
    return [SOURCE_ROOT / "__init__.py", *sorted(package.glob("*.py"))]


async def _resolve_wheels(cache: Path, log: Callable[[str], None]) -> list[Path]:
    """The wheels ``REQUIREMENTS`` resolve to, downloading them once."""
    inputs = {"requirements": list(REQUIREMENTS), "platform": _platform_args()}
    resolved = cache / "interpreter-resolved" / f"{content_key(inputs)}.json"
    store = cache / "interpreter-wheels"
    if resolved.is_file():
        entries = json.loads(resolved.read_text())
        paths = [store / e["sha256"] / e["file"] for e in entries]
        if all(p.is_file() for p in paths):
            return paths
    log(f"code interpreter: pip download {' '.join(REQUIREMENTS)} for Python {GUEST_PYTHON}")
    (cache / "tmp").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="wheels-", dir=cache / "tmp") as tmp:
        await run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "-d",
                tmp,
                *_platform_args(),
                *REQUIREMENTS,
            ],
            env=_pip_env(),
        )
        entries = []
        for wheel in sorted(Path(tmp).glob("*.whl")):
            digest = sha256_file(wheel)
            target = store / digest / wheel.name
            if not target.is_file():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(wheel, target)
            entries.append({"file": wheel.name, "sha256": digest})
    if not entries:
        raise GuestImageError("pip download produced no wheels for the code interpreter")
    resolved.parent.mkdir(parents=True, exist_ok=True)
    resolved.write_text(json.dumps(entries, indent=1) + "\n")
    return [store / e["sha256"] / e["file"] for e in entries]


def _pip_env() -> dict[str, str]:
    """The host's environment for pip (its PIP_* settings are part of its configuration)."""
    env = host_env()
    env.update({k: v for k, v in os.environ.items() if k.startswith("PIP_")})
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    return env


async def ensure_interpreter_rootfs(
    cache_dir: Path, image: GuestImage, log: Callable[[str], None] = lambda _m: None
) -> InterpreterRootfs:
    """The code-interpreter root filesystem for ``image``, built if not cached."""
    async with build_lock(cache_dir, log):
        wheels = await _resolve_wheels(cache_dir, log)
        sources = _server_sources()
        inputs = {
            "base_rootfs": image.rootfs.parent.name,
            "wheels": sorted(w.parent.name for w in wheels),
            "server": hash_files(sources, SOURCE_ROOT.parent),
            "build_version": BUILD_VERSION,
            "python": GUEST_PYTHON,
        }
        key = content_key(inputs)

        async def build(out: Path) -> dict[str, object]:
            return await _build(out, image.rootfs, wheels, sources, log)

        path, meta = await ComponentCache(cache_dir).ensure(
            "interpreter-rootfs", key, inputs, build, log
        )
        return InterpreterRootfs(path / "rootfs.ext4", key, meta)


async def _build(
    out: Path, base: Path, wheels: list[Path], sources: list[Path], log: Callable[[str], None]
) -> dict[str, object]:
    tree = out.parent / "tree"
    site = tree / "site"
    started = time.monotonic()
    await run(
        [
            sys.executable,
            *("-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"),
            *("--target", site),
            *_platform_args(),
            *wheels,
        ],
        env=_pip_env(),
    )
    # Console scripts name the host's interpreter; in the guest it is /usr/bin/python3.
    for script in sorted((site / "bin").glob("*")) if (site / "bin").is_dir() else []:
        text = script.read_bytes()
        if text.startswith(b"#!") and b"python" in text.split(b"\n", 1)[0]:
            script.write_bytes(b"#!/usr/bin/python3" + text[text.index(b"\n") :])
    app = tree / "app" / "agentenv"
    (app / "interpreter").mkdir(parents=True)
    for source in sources:
        shutil.copy(source, app / source.relative_to(SOURCE_ROOT))
    install_seconds = round(time.monotonic() - started, 1)
    # Byte-compiled here, with pycs the guest uses without checking sources: the guest's
    # user cannot write them into this root-owned tree, and compiling costs ~20x under TCG.
    await run(
        [
            sys.executable,
            *("-m", "compileall", "-q", "-j0", "--invalidation-mode", "unchecked-hash"),
            *(tree / "site", tree / "app"),
        ],
        env=host_env(),
    )
    pth = out.parent / "aenv-interpreter.pth"
    pth.write_text(SITE_DIR + "\n")
    _readable_by_all(tree, pth)
    image = out / "rootfs.ext4"
    await run(["cp", "--reflink=auto", "--sparse=always", base, image])
    image.chmod(0o644)
    script = out.parent / "debugfs.cmds"
    script.write_text(_debugfs_script(tree, INSTALL_DIR) + f'write "{pth}" "{PTH_FILE}"\n')
    started_write = time.monotonic()
    # debugfs reports a failed command on stderr and still exits 0: read both.
    output = await run(
        ["sh", "-c", 'debugfs -w -f "$1" "$2" 2>&1', "sh", script, image], env=host_env()
    )
    problems = [
        line
        for line in output.splitlines()
        if line and not line.startswith(("debugfs", "Allocated inode"))
    ]
    if problems:
        raise GuestImageError(f"writing the interpreter into the root filesystem: {problems[:5]}")
    await run(["e2fsck", "-fn", image], env=host_env())
    image.chmod(0o444)
    out.chmod(0o755)  # confined VMMs run as other users (the server may run under umask 077)
    log(f"code interpreter: root filesystem written in {time.monotonic() - started:.1f} s")
    return {
        "file": image.name,
        "wheels": [w.name for w in wheels],
        "install_seconds": install_seconds,
        "write_seconds": round(time.monotonic() - started_write, 1),
        "tree_bytes": sum(p.stat().st_size for p in tree.rglob("*") if p.is_file()),
    }


def _readable_by_all(tree: Path, *files: Path) -> None:
    """debugfs copies each file's mode into the image: whatever umask the build ran
    under, the guest's users must read everything and run what is executable."""
    for path in [tree, *tree.rglob("*"), *files]:
        if path.is_symlink():
            continue
        mode = path.stat().st_mode
        if path.is_dir() or mode & 0o111:
            path.chmod(0o755)
        else:
            path.chmod(0o644)


def _debugfs_script(tree: Path, dest: str) -> str:
    """debugfs commands creating ``dest`` with the contents of ``tree``."""

    def quoted(path: str) -> str:
        if '"' in path or "\n" in path:
            raise GuestImageError(f"cannot write a file named {path!r} with debugfs")
        return f'"{path}"'

    lines = [f"mkdir {quoted(dest)}"]
    for directory, dirs, files in os.walk(tree):
        rel = os.path.relpath(directory, tree)
        target = dest if rel == "." else f"{dest}/{rel}"
        for name in sorted(dirs) + sorted(files):
            source = os.path.join(directory, name)
            where = quoted(f"{target}/{name}")
            if os.path.islink(source):
                lines.append(f"symlink {where} {quoted(os.readlink(source))}")
            elif name in dirs:
                lines.append(f"mkdir {where}")
            else:
                lines.append(f"write {quoted(source)} {where}")
    return "\n".join(lines) + "\n"
