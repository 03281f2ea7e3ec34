"""The read-only tools drive mounted at /.aenv in every guest: catatonit (PID 1), busybox,
aenv-init, envd with a self-contained CPython 3.11 built from Debian .debs, and the kernel
modules."""

from __future__ import annotations

import os
import shutil
import sys
import tomllib
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import agentenv
from agentenv.guest.cache import hash_files, sha256_file
from agentenv.guest.debian import DebPackage, download, extract
from agentenv.guest.errors import GuestImageError
from agentenv.guest.host import STATIC_BUSYBOX, STATIC_INIT, host_env, run
from agentenv.network.addresses import ENVD_CONTROL_PORT, ENVD_PORT

TOOLS_BUILD_VERSION = 1
PYTHON_ROOTS: tuple[str, ...] = (
    "python3.11-minimal",
    "libpython3.11-minimal",
    "libpython3.11-stdlib",
)
# Native wheels (protobuf-py-ext, pyqwest) may link against the C++/GCC runtimes.
PYTHON_EXTRA_PACKAGES: tuple[str, ...] = ("libgcc-s1", "libstdc++6")
LIBRARY_DIRS: tuple[str, ...] = ("lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu")
# Used when agentenv runs from an installed wheel rather than the repository.
DEFAULT_ENVD_REQUIREMENTS: tuple[str, ...] = (
    "connectrpc>=0.12.1,<0.13",
    "protobuf-py>=0.6,<0.7",
    "uvicorn>=0.29",
)
# Loaded by aenv-init for container, FUSE and firewall workloads (virtio ones are in initrd).
WORKLOAD_MODULES: tuple[str, ...] = (
    "overlay",
    "fuse",
    "tun",
    "veth",
    "bridge",
    "br_netfilter",
    "nf_tables",
    "nf_nat",
    "nft_chain_nat",
    "nft_masq",
    "nft_ct",
    "nft_compat",
    "ip_tables",
    "iptable_filter",
    "iptable_nat",
    "xt_MASQUERADE",
    "xt_conntrack",
    "xt_addrtype",
)
IMPORT_CHECK = (
    "import agentenv, agentenv.envd, connectrpc, uvicorn, h11, click, protobuf, ssl, sqlite3, "
    "ctypes, uuid, zlib, lzma, bz2, json, asyncio, hashlib; "
    "assert hashlib.sha256(b'').hexdigest().startswith('e3b0'); print('aenv-python-ok')"
)
_DOC_DIRS = (
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "usr/share/lintian",
    "usr/share/locale",
    "usr/share/bug",
)


def is_shared_library_package(name: str) -> bool:
    """Dependencies followed when bundling Python: runtime libraries only (Debian names them
    lib<soname>, with zlib1g the historical exception)."""
    if name == "zlib1g":
        return True
    return name.startswith("lib") and not name.endswith(("-bin", "-common", "-data", "-dev"))


def repo_root() -> Path:
    return Path(agentenv.__file__).resolve().parent.parent


def envd_requirements() -> list[str]:
    """The ``envd`` extra of pyproject.toml (the guest agent's dependencies)."""
    pyproject = repo_root() / "pyproject.toml"
    if pyproject.is_file():
        data = tomllib.loads(pyproject.read_text())
        extra = data.get("project", {}).get("optional-dependencies", {}).get("envd")
        if extra:
            return sorted(str(r) for r in extra)
    return sorted(DEFAULT_ENVD_REQUIREMENTS)


def envd_source_files() -> list[Path]:
    """``agentenv/__init__.py`` plus the whole ``agentenv/envd`` package, as it is now."""
    package = Path(agentenv.__file__).resolve().parent
    files = [package / "__init__.py"]
    envd = package / "envd"
    if envd.is_dir():
        files += [
            p
            for p in envd.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
        ]
    return sorted(files)


def template(name: str) -> str:
    return resources.files("agentenv.guest").joinpath(f"files/{name}").read_text()


def tools_inputs(
    python_debs: list[DebPackage], kernel_key: str, kernel_release: str
) -> dict[str, Any]:
    package = Path(agentenv.__file__).resolve().parent
    files_dir = Path(__file__).resolve().parent / "files"
    return {
        "build_version": TOOLS_BUILD_VERSION,
        "python_debs": {p.name: [p.version, p.sha256] for p in python_debs},
        "requirements": envd_requirements(),
        "envd_sources": hash_files(envd_source_files(), package.parent),
        "templates": hash_files(sorted(files_dir.glob("*.sh")), files_dir),
        "busybox": sha256_file(STATIC_BUSYBOX),
        "init": sha256_file(STATIC_INIT),
        "kernel": [kernel_key, kernel_release],
        "workload_modules": list(WORKLOAD_MODULES),
        "envd_port": ENVD_PORT,
        "envd_control_port": ENVD_CONTROL_PORT,
    }


def _relativise_symlinks(tree: Path) -> None:
    """Absolute symlinks from the .debs (e.g. /lib64/ld-linux-x86-64.so.2) would resolve in
    the guest's root filesystem; point them inside the bundle instead."""
    for path in tree.rglob("*"):
        if path.is_symlink():
            target = os.readlink(path)
            if target.startswith("/"):
                path.unlink()
                path.symlink_to(os.path.relpath(tree / target.lstrip("/"), path.parent))


def _install_file(src: Path | str, dest: Path, mode: int) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(src, Path):
        shutil.copyfile(src, dest)
    else:
        dest.write_text(src)
    dest.chmod(mode)


def _glibc_minor(python_debs: list[DebPackage]) -> int:
    (libc,) = [p for p in python_debs if p.name == "libc6"]
    return int(libc.version.split("-")[0].split(".")[1])


async def _pip_install(target: Path, requirements: list[str], glibc_minor: int) -> None:
    """Wheels for CPython 3.11 on the bundled glibc, independent of the build host's."""
    platforms: list[str] = []
    for minor in range(glibc_minor, 16, -1):
        platforms += ["--platform", f"manylinux_2_{minor}_x86_64"]
    platforms += ["--platform", "manylinux2014_x86_64"]
    await run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-input",
            "--no-compile",
            "--target",
            target,
            "--only-binary=:all:",
            "--python-version",
            "3.11",
            "--implementation",
            "cp",
            "--abi",
            "cp311",
            "--abi",
            "abi3",
            "--abi",
            "none",
            *platforms,
            *requirements,
        ],
        env=host_env({"PIP_NO_WARN_SCRIPT_LOCATION": "1"}),
    )


async def _check_libraries(tree: Path) -> None:
    """Every ELF the bundled Python loads must resolve its libraries inside the bundle."""
    py = tree / "python"
    loader = py / "lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
    library_path = ":".join(str(py / d) for d in LIBRARY_DIRS)
    elves = [py / "usr/bin/python3.11"]
    elves += sorted((py / "usr/lib/python3.11/lib-dynload").glob("*.so"))
    elves += sorted((tree / "site-packages").rglob("*.so"))
    problems: list[str] = []
    for elf in elves:
        out = await run(
            [loader, "--inhibit-cache", "--library-path", library_path, "--list", elf], env={}
        )
        for line in out.splitlines():
            if "=>" not in line:
                continue
            name, _, where = line.strip().partition(" => ")
            resolved = where.split(" (")[0].strip()
            if "not found" in where or not resolved.startswith(str(tree)):
                problems.append(f"{elf.relative_to(tree)}: {name} -> {where.strip()}")
    if problems:
        raise GuestImageError(
            "bundled Python needs libraries outside the bundle:\n" + "\n".join(problems[:30])
        )


async def _check_python(tree: Path) -> str:
    """Run the bundled interpreter with an empty environment, as aenv-init will."""
    busybox = tree / "bin/busybox"
    out = await run([busybox, "sh", tree / "bin/python", "-c", IMPORT_CHECK], env={})
    if "aenv-python-ok" not in out:
        raise GuestImageError(f"bundled Python import check printed {out!r}")
    version = await run(
        [busybox, "sh", tree / "bin/python", "-c", "import sys; print(sys.version.split()[0])"],
        env={},
    )
    if (tree / "site-packages/agentenv/envd/__main__.py").is_file():
        await run(["timeout", "60", busybox, "sh", tree / "bin/envd", "--help"], env={})
    return version.strip()


async def _tree_bytes(tree: Path) -> int:
    out = await run(["du", "-s", "--block-size=1", tree])
    return int(out.split()[0])


async def build_tools(
    out: Path,
    python_debs: list[DebPackage],
    kernel_dir: Path,
    kernel_release: str,
    deb_dir: Path,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Fill ``out`` with ``tools.ext4`` (label aenv-tools)."""
    tree = out.parent / "tree"
    busybox = tree / "bin/busybox"
    _install_file(STATIC_BUSYBOX, busybox, 0o755)
    _install_file(STATIC_INIT, tree / "bin/catatonit", 0o755)
    aenv_init = template("aenv-init.sh").replace("@WORKLOAD_MODULES@", " ".join(WORKLOAD_MODULES))
    _install_file(aenv_init, tree / "bin/aenv-init", 0o755)
    library_path = ":".join(f"$py/{d}" for d in LIBRARY_DIRS)
    _install_file(
        template("python.sh").replace("@LIBRARY_PATH@", library_path), tree / "bin/python", 0o755
    )
    _install_file(
        template("envd.sh")
        .replace("@ENVD_PORT@", str(ENVD_PORT))
        .replace("@ENVD_CONTROL_PORT@", str(ENVD_CONTROL_PORT)),
        tree / "bin/envd",
        0o755,
    )
    applets = (await run([busybox, "--list"])).split()
    (tree / "busybox").mkdir()
    for applet in applets:
        (tree / "busybox" / applet).symlink_to("../bin/busybox")

    log(f"tools: bundling Python from {len(python_debs)} .debs")
    for deb in await download(python_debs, deb_dir):
        await extract(deb, tree / "python")
    for doc in _DOC_DIRS:
        shutil.rmtree(tree / "python" / doc, ignore_errors=True)
    _relativise_symlinks(tree / "python")

    requirements = envd_requirements()
    log(f"tools: pip install --target site-packages {' '.join(requirements)}")
    site = tree / "site-packages"
    await _pip_install(site, requirements, _glibc_minor(python_debs))
    shutil.rmtree(site / "bin", ignore_errors=True)  # console scripts with host shebangs
    package = Path(agentenv.__file__).resolve().parent
    for src in envd_source_files():
        _install_file(src, site / "agentenv" / src.relative_to(package), 0o644)

    log("tools: compiling bytecode and checking the bundled runtime")
    await _check_libraries(tree)
    await run(
        [
            busybox,
            "sh",
            tree / "bin/python",
            "-m",
            "compileall",
            "-q",
            "-j",
            "0",
            "--invalidation-mode",
            "unchecked-hash",
            "-x",
            r"/(test|tests|idlelib)/",
            tree / "python/usr/lib/python3.11",
            site,
        ],
        env={},
    )
    python_version = await _check_python(tree)

    modules = tree / "lib/modules" / kernel_release
    shutil.copytree(
        kernel_dir / "lib/modules" / kernel_release, modules, symlinks=True, copy_function=os.link
    )

    content = await _tree_bytes(tree)
    size_mib = (content * 23 // 20 + (32 << 20)) >> 20
    image = out / "tools.ext4"
    await run(
        [
            "mkfs.ext4",
            "-q",
            "-F",
            "-L",
            "aenv-tools",
            "-d",
            tree,
            "-m",
            "0",
            "-O",
            "^has_journal",
            "-E",
            "root_owner=0:0",
            image,
            f"{size_mib}M",
        ]
    )
    image.chmod(0o444)
    return {
        "file": image.name,
        "python_version": python_version,
        "python_debs": {p.name: p.version for p in python_debs},
        "requirements": requirements,
        "envd_files": [str(p.relative_to(package.parent)) for p in envd_source_files()],
        "content_bytes": content,
        "image_bytes": size_mib << 20,
    }
