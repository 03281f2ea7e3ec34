"""Guest image pipeline: pure parts (command line, cache keys, parsers, module order, cache
atomicity) plus one `vm` test that runs the built tools drive's Python."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agentenv.guest import (
    GuestImage,
    GuestImageError,
    GuestImageMissing,
    default_cache_dir,
    kernel_cmdline,
    load_guest_image,
)
from agentenv.guest.cache import ComponentCache, content_key, hash_files
from agentenv.guest.cmdline import tsc_khz_from_cpuinfo
from agentenv.guest.debian import DebPackage, debian_mirror, parse_depends
from agentenv.guest.image import _publish
from agentenv.guest.kernel import (
    check_kernel_config,
    extract_vmlinux_payload,
    initrd_module_order,
    parse_kernel_config,
)
from agentenv.guest.tools import is_shared_library_package, tools_inputs
from agentenv.network.addresses import GUEST_GATEWAY, GUEST_IP, GUEST_PREFIX


def _params(cmdline: str) -> dict[str, str]:
    params: dict[str, str] = {}
    for word in cmdline.split():
        key, _, value = word.partition("=")
        params[key] = value
    return params


def test_cmdline_has_guest_addresses_tsc_and_panic_exit() -> None:
    params = _params(kernel_cmdline(tsc_khz=2596122))
    assert params["aenv.ip"] == f"{GUEST_IP}/{GUEST_PREFIX}"
    assert params["aenv.gw"] == GUEST_GATEWAY
    assert params["tsc_early_khz"] == "2596122"
    assert params["console"] == "ttyS0"
    assert params["root"] == "/dev/vda"
    assert params["panic"] == "-1"
    assert params["reboot"] == "t"
    assert params["random.trust_cpu"] == "on"
    assert params["nowatchdog"] == ""
    assert params["psi"] == "0"
    assert "rw" in params and params["rw"] == ""


def test_cmdline_extra_overrides_and_adds_flags() -> None:
    cmdline = kernel_cmdline(
        {"aenv.debug_shell": "1", "console": "hvc0", "nokaslr": ""}, tsc_khz=1000
    )
    words = cmdline.split()
    assert "aenv.debug_shell=1" in words
    assert "console=hvc0" in words and "console=ttyS0" not in words
    assert "nokaslr" in words


@pytest.mark.parametrize("key,value", [("bad key", "1"), ("a=b", "1"), ("x", "two words")])
def test_cmdline_rejects_malformed_parameters(key: str, value: str) -> None:
    with pytest.raises(ValueError):
        kernel_cmdline({key: value}, tsc_khz=1000)


def test_tsc_khz_from_cpuinfo_rounds_to_khz() -> None:
    cpuinfo = (
        "processor\t: 0\nmodel name\t: AMD EPYC\ncpu MHz\t\t: 2596.094\ncache size\t: 512 KB\n"
    )
    assert tsc_khz_from_cpuinfo(cpuinfo) == 2596094
    assert tsc_khz_from_cpuinfo("processor\t: 0\nBogoMIPS\t: 50.00\n") is None


def test_content_key_ignores_dict_order_and_tracks_values() -> None:
    a = {"suite": "bookworm", "packages": ["bash", "curl"], "n": 1}
    b = {"n": 1, "packages": ["bash", "curl"], "suite": "bookworm"}
    assert content_key(a) == content_key(b)
    assert content_key(a) != content_key({**a, "n": 2})
    assert content_key(a) != content_key({**a, "packages": ["bash"]})


def test_hash_files_tracks_names_and_contents(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    files = sorted(tmp_path.glob("*.py"))
    first = hash_files(files, tmp_path)
    assert hash_files(list(reversed(files)), tmp_path) == first
    (tmp_path / "b.py").write_text("y = 3\n")
    assert hash_files(files, tmp_path) != first


def _deb(name: str, version: str) -> DebPackage:
    return DebPackage(name, version, f"{name}_{version}_amd64.deb", "0" * 64, "http://x/" + name)


def test_tools_key_stable_and_tracks_python_deb_versions() -> None:
    debs = [_deb("libc6", "2.36-9"), _deb("python3.11-minimal", "3.11.2-6")]
    key = content_key(tools_inputs(debs, "kkey", "6.1.0-57-cloud-amd64"))
    assert content_key(tools_inputs(list(reversed(debs)), "kkey", "6.1.0-57-cloud-amd64")) == key
    bumped = [_deb("libc6", "2.36-10"), debs[1]]
    assert content_key(tools_inputs(bumped, "kkey", "6.1.0-57-cloud-amd64")) != key
    assert content_key(tools_inputs(debs, "other", "6.1.0-57-cloud-amd64")) != key


def test_parse_depends_takes_first_alternative_and_drops_virtual() -> None:
    out = (
        "libpython3.11-stdlib\n"
        "  Depends: libpython3.11-minimal\n"
        " |Depends: media-types\n"
        "  Depends: mime-support\n"
        "  Depends: libbz2-1.0\n"
        "  Depends: <libvirtual>\n"
        "  Recommends: ca-certificates\n"
        "zlib1g\n"
        "  PreDepends: libc6\n"
    )
    deps = parse_depends(out)
    assert deps["libpython3.11-stdlib"] == ["libpython3.11-minimal", "media-types", "libbz2-1.0"]
    assert deps["zlib1g"] == ["libc6"]


def test_shared_library_filter() -> None:
    assert is_shared_library_package("libssl3")
    assert is_shared_library_package("zlib1g")
    assert not is_shared_library_package("libc-bin") and not is_shared_library_package("perl")
    assert not is_shared_library_package("libtirpc-common")


def test_debian_mirror_from_deb822_and_legacy_sources(tmp_path: Path) -> None:
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d/debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\n"
        "Components: main\n\nTypes: deb\nURIs: http://mirror.example/security\n"
        "Suites: bookworm-security\nComponents: main\n"
    )
    assert debian_mirror("bookworm", tmp_path) == "http://mirror.example/debian"
    (tmp_path / "sources.list.d/debian.sources").unlink()
    (tmp_path / "sources.list").write_text(
        "# comment\ndeb [arch=amd64] http://legacy/debian trixie main\n"
    )
    assert debian_mirror("trixie", tmp_path) == "http://legacy/debian"
    with pytest.raises(GuestImageError):
        debian_mirror("bookworm", tmp_path)


def test_kernel_config_check() -> None:
    config = parse_kernel_config(
        "CONFIG_SMP=y\nCONFIG_CGROUPS=y\nCONFIG_NAMESPACES=y\nCONFIG_OVERLAY_FS=m\n"
        "CONFIG_FUSE_FS=m\nCONFIG_NF_TABLES=m\nCONFIG_VIRTIO_BALLOON=m\n# CONFIG_FOO is not set\n"
    )
    assert config["FOO"] == "n"
    assert check_kernel_config(config)["OVERLAY_FS"] == "m"
    with pytest.raises(GuestImageError, match="FUSE_FS"):
        check_kernel_config({**config, "FUSE_FS": "n"})


def test_vmlinux_payload_search_finds_every_lz4_magic() -> None:
    blob = b"header" + b"\x02\x21\x4c\x18" + b"AAAA" + b"\x02\x21\x4c\x18" + b"BB"
    payloads = list(extract_vmlinux_payload(blob))
    assert [p[4:6] for p in payloads] == [b"AA", b"BB"]


def test_initrd_module_order_puts_dependencies_first(tmp_path: Path) -> None:
    v = "kernel/drivers/virtio"
    (tmp_path / "modules.dep").write_text(
        f"{v}/virtio_ring.ko:\n"
        f"{v}/virtio.ko: {v}/virtio_ring.ko\n"
        f"{v}/virtio_mmio.ko: {v}/virtio.ko {v}/virtio_ring.ko\n"
        "kernel/drivers/block/virtio_blk.ko: "
        f"{v}/virtio.ko {v}/virtio_ring.ko\n"
    )
    (tmp_path / "modules.builtin").write_text("kernel/fs/ext4/ext4.ko\n")
    order = initrd_module_order(tmp_path, ["virtio_blk", "virtio_mmio", "ext4"])
    names = [Path(p).stem for p in order]
    assert names == ["virtio_ring", "virtio", "virtio_blk", "virtio_mmio"]
    with pytest.raises(GuestImageError, match="nosuch"):
        initrd_module_order(tmp_path, ["nosuch"])


async def test_component_cache_builds_once_and_leaves_nothing_on_failure(
    tmp_path: Path,
) -> None:
    cache = ComponentCache(tmp_path)
    calls: list[Path] = []

    async def build(out: Path) -> dict[str, Any]:
        calls.append(out)
        (out / "file").write_text("payload")
        return {"fact": 1}

    first, meta = await cache.ensure("thing", "k1", {"x": 1}, build, lambda _: None)
    again, meta2 = await cache.ensure("thing", "k1", {"x": 1}, build, lambda _: None)
    assert first == again == tmp_path / "thing/k1"
    assert len(calls) == 1
    assert (first / "file").read_text() == "payload"
    assert meta["fact"] == meta2["fact"] == 1

    async def broken(out: Path) -> dict[str, Any]:
        (out / "partial").write_text("half")
        raise GuestImageError("boom")

    with pytest.raises(GuestImageError, match="boom"):
        await cache.ensure("thing", "k2", {"x": 2}, broken, lambda _: None)
    assert not (tmp_path / "thing/k2").exists()
    assert list((tmp_path / "tmp").iterdir()) == []


async def test_component_directories_are_traversable_whatever_the_umask(
    tmp_path: Path,
) -> None:
    """The server builds the code interpreter's root filesystem under umask 077, and the
    confined VMMs that open it run as other users: its kind's directory came out 0700 and
    every restore of the template failed with "Permission denied"."""

    async def build(out: Path) -> dict[str, Any]:
        (out / "image").write_text("payload")
        (out / "image").chmod(0o444)
        return {}

    previous = os.umask(0o077)
    try:
        (tmp_path / "left-private").mkdir(mode=0o700)  # as a build before this fix left it
        for kind in ("fresh", "left-private"):
            found, _ = await ComponentCache(tmp_path).ensure(kind, "k", {}, build, lambda _: None)
            assert (found.parent.stat().st_mode & 0o777) == 0o755, kind
            assert (found.stat().st_mode & 0o777) == 0o755, kind
        # Also when the component was already there.
        (tmp_path / "fresh").chmod(0o700)
        await ComponentCache(tmp_path).ensure("fresh", "k", {}, build, lambda _: None)
        assert ((tmp_path / "fresh").stat().st_mode & 0o777) == 0o755
    finally:
        os.umask(previous)


def test_load_guest_image_missing_names_the_build_command(tmp_path: Path) -> None:
    with pytest.raises(GuestImageMissing, match=r"python -m agentenv\.guest build"):
        load_guest_image(tmp_path)


def test_publish_then_load_round_trip(tmp_path: Path) -> None:
    files = {}
    for name in ("kernel", "initrd", "rootfs", "tools"):
        files[name] = str(tmp_path / name)
        (tmp_path / name).write_text(name)
    manifest = {
        "digest": "d1",
        "kernel_version": "6.1.0-57-cloud-amd64",
        "files": files,
        "components": {"kernel": {"release": "6.1.0-57-cloud-amd64"}},
    }
    _publish(tmp_path, "d1", manifest)
    image = load_guest_image(tmp_path)
    assert image == GuestImage(
        "d1",
        Path(files["kernel"]),
        Path(files["initrd"]),
        Path(files["rootfs"]),
        Path(files["tools"]),
        "6.1.0-57-cloud-amd64",
    )
    assert image.manifest()["components"]["kernel"]["release"] == "6.1.0-57-cloud-amd64"
    (tmp_path / "tools").unlink()
    with pytest.raises(GuestImageMissing, match="incomplete"):
        load_guest_image(tmp_path)


def test_default_cache_dir_honours_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AENV_IMAGE_CACHE", "/somewhere/else")
    assert default_cache_dir() == Path("/somewhere/else")
    monkeypatch.delenv("AENV_IMAGE_CACHE")
    assert default_cache_dir() == Path("/var/cache/agentenv/images")


@pytest.mark.vm
def test_built_image_tools_python_imports_envd(tmp_path: Path) -> None:
    """The built tools drive's own Python, run with an empty environment from a copy of the
    drive (debugfs, no mount), imports envd and its dependencies."""
    image = load_guest_image(default_cache_dir())
    for path in (image.kernel, image.initrd, image.rootfs, image.tools):
        assert path.stat().st_size > 0
    with image.kernel.open("rb") as f:
        assert f.read(4) == b"\x7fELF"
    debugfs = shutil.which("debugfs") or "/usr/sbin/debugfs"
    subprocess.run(
        [debugfs, "-R", f"rdump /bin /python /site-packages {tmp_path}", str(image.tools)],
        check=True,
        capture_output=True,
    )
    probe = (
        "import sys, agentenv.envd, connectrpc, uvicorn, json; "
        "print(json.dumps([sys.version_info[:2], sys.prefix]))"
    )
    result = subprocess.run(
        [
            "env",
            "-i",
            str(tmp_path / "bin/busybox"),
            "sh",
            str(tmp_path / "bin/python"),
            "-c",
            probe,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    version, prefix = json.loads(result.stdout)
    assert version == [3, 11]
    assert prefix.startswith(str(tmp_path))


async def test_build_lock_serialises_builders(tmp_path: Path) -> None:
    import asyncio

    from agentenv.guest.cache import build_lock

    order: list[str] = []
    first_holds = asyncio.Event()
    release_first = asyncio.Event()

    async def first() -> None:
        async with build_lock(tmp_path, lambda _: None):
            order.append("first-in")
            first_holds.set()
            await release_first.wait()
            order.append("first-out")

    async def second(log: Callable[[str], None]) -> None:
        await first_holds.wait()
        async with build_lock(tmp_path, log):
            order.append("second-in")

    waits: list[str] = []
    second_waits = asyncio.Event()

    def on_log(line: str) -> None:
        waits.append(line)
        second_waits.set()

    task_a = asyncio.create_task(first())
    task_b = asyncio.create_task(second(on_log))
    await second_waits.wait()  # the second builder reports that it is waiting
    assert order == ["first-in"]
    release_first.set()
    await asyncio.gather(task_a, task_b)
    assert order == ["first-in", "first-out", "second-in"]
    assert "waiting for another build" in waits[0]
