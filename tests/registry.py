"""A local OCI registry (Debian's ``docker-registry``) and a small test image built
from the guest image's Debian rootfs without Docker (``umoci`` + ``skopeo``).

The test image has two layers: the first is the guest rootfs minus docs, locales and
man pages, without ``/.aenv`` or the ``user`` account (so a pull must add them), plus
``/etc/agentenv-test/{keep,layer1-only}.txt``; the second deletes ``layer1-only.txt`` (a
whiteout) and adds ``/opt/agentenv-test/layer2.txt``. Its OCI layout is cached under
``/var/tmp/agentenv-test-images/<guest image digest>/`` across sessions.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from tests.helpers import free_port

GUEST_CACHE = Path("/var/cache/agentenv/images")
TEST_IMAGE_CACHE = Path("/var/tmp/agentenv-test-images")
# Bump when the recipe below changes, so cached layouts are rebuilt.
RECIPE_VERSION = "1"
LAYOUT_TAG = "test"
LAYER2_TEXT = "hello from layer 2\n"
IMAGE_ENV = {
    "AENV_IMAGE_MARKER": "from-image",
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
}
IMAGE_WORKDIR = "/opt/agentenv-test"
WHITED_OUT = "/etc/agentenv-test/layer1-only.txt"
KEPT = "/etc/agentenv-test/keep.txt"
LAYER2_FILE = "/opt/agentenv-test/layer2.txt"
_STRIP = ("usr/share/doc", "usr/share/locale", "usr/share/man", "usr/share/info",
          "usr/share/i18n", "var/cache/apt", "var/lib/apt/lists", "lost+found")  # fmt: skip


class LocalRegistry:
    """``docker-registry serve`` on 127.0.0.1:<free port>, storing in ``tmp``, no auth,
    in its own process session."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.tmp / "registry.log"

    def start(self, timeout: float = 30.0) -> None:
        self.tmp.mkdir(parents=True, exist_ok=True)
        storage = self.tmp / "storage"
        storage.mkdir(exist_ok=True)
        config = self.tmp / "config.yml"
        config.write_text(
            "version: 0.1\n"
            "log:\n  level: warn\n"
            "storage:\n"
            f"  filesystem:\n    rootdirectory: {storage}\n"
            "  delete:\n    enabled: true\n"
            f"http:\n  addr: {self.host}\n"
        )
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                ["/usr/bin/docker-registry", "serve", str(config)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"docker-registry exited: {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://{self.host}/v2/", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"docker-registry did not answer on {self.host}")
            time.sleep(0.1)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def start_registry(tmp: Path) -> Iterator[LocalRegistry]:
    registry = LocalRegistry(tmp)
    registry.start()
    try:
        yield registry
    finally:
        registry.stop()


def _run(*args: str) -> None:
    result = subprocess.run(args, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {result.stderr.strip()[-2000:]}")


def _drop_user(etc: Path) -> None:
    """Remove the ``user`` account (a pull adds it back)."""
    for name in ("passwd", "group", "shadow", "gshadow"):
        path = etc / name
        if not path.exists():
            continue
        lines = path.read_text().splitlines()
        kept = []
        for line in lines:
            fields = line.split(":")
            if fields[0] == "user":
                continue
            if name in ("group", "gshadow") and len(fields) >= 4:
                members = [m for m in fields[-1].split(",") if m and m != "user"]
                fields[-1] = ",".join(members)
            kept.append(":".join(fields))
        path.write_text("\n".join(kept) + "\n")


def _build_layout(guest_rootfs: Path, work: Path) -> Path:
    layout = work / "oci"
    bundle = work / "bundle"
    mnt = work / "mnt"
    _run("umoci", "init", "--layout", str(layout))
    _run("umoci", "new", "--image", f"{layout}:{LAYOUT_TAG}")
    _run("umoci", "unpack", "--image", f"{layout}:{LAYOUT_TAG}", str(bundle))
    rootfs = bundle / "rootfs"

    # Layer 1: the guest's Debian rootfs, trimmed.
    mnt.mkdir()
    _run("mount", "-o", "ro,loop", str(guest_rootfs), str(mnt))
    try:
        _run("cp", "-a", f"{mnt}/.", f"{rootfs}/")
    finally:
        _run("umount", str(mnt))
    for rel in _STRIP:
        shutil.rmtree(rootfs / rel, ignore_errors=True)
    shutil.rmtree(rootfs / ".aenv", ignore_errors=True)
    shutil.rmtree(rootfs / "home/user", ignore_errors=True)
    _drop_user(rootfs / "etc")
    (rootfs / "etc/agentenv-test").mkdir()
    (rootfs / WHITED_OUT.lstrip("/")).write_text("only in layer 1\n")
    (rootfs / KEPT.lstrip("/")).write_text("kept from layer 1\n")
    _run("umoci", "repack", "--refresh-bundle", "--image", f"{layout}:{LAYOUT_TAG}", str(bundle))

    # Layer 2: a deletion (whiteout) and a new file.
    (rootfs / WHITED_OUT.lstrip("/")).unlink()
    (rootfs / LAYER2_FILE.lstrip("/")).parent.mkdir(parents=True)
    (rootfs / LAYER2_FILE.lstrip("/")).write_text(LAYER2_TEXT)
    _run("umoci", "repack", "--image", f"{layout}:{LAYOUT_TAG}", str(bundle))

    config = ["umoci", "config", "--image", f"{layout}:{LAYOUT_TAG}", "--clear=config.env"]
    for key, value in IMAGE_ENV.items():
        config += ["--config.env", f"{key}={value}"]
    config += ["--config.workingdir", IMAGE_WORKDIR, "--config.user", "root"]
    config += ["--config.cmd", "/bin/bash", "--architecture", "amd64", "--os", "linux"]
    _run(*config)
    _run("umoci", "gc", "--layout", str(layout))
    return layout


def build_test_layout() -> Path:
    """The test image's OCI layout (tag ``test``), built once per guest rootfs."""
    from agentenv.guest import load_guest_image

    guest = load_guest_image(GUEST_CACHE)
    base = TEST_IMAGE_CACHE / guest.digest
    final = base / f"oci-v{RECIPE_VERSION}"
    if (final / "index.json").exists():
        return final
    base.mkdir(parents=True, exist_ok=True)
    with open(base / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / "index.json").exists():
            return final
        work = Path(tempfile.mkdtemp(prefix=".build-", dir=base))
        try:
            layout = _build_layout(guest.rootfs, work)
            os.rename(layout, final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final


def push_test_image(
    registry: LocalRegistry, name: str = "agentenv/test-debian", tag: str = "1"
) -> str:
    """Push the test image to ``registry``; returns its reference (``host/name:tag``)."""
    layout = build_test_layout()
    reference = f"{registry.host}/{name}:{tag}"
    _run(
        "skopeo", "copy", "--quiet", "--dest-tls-verify=false",
        f"oci:{layout}:{LAYOUT_TAG}", f"docker://{reference}",
    )  # fmt: skip
    return reference


def layout_manifest_digest(layout: Path) -> str:
    """The digest of the test image's manifest, as the registry will report it."""
    index = json.loads((layout / "index.json").read_text())
    for desc in index["manifests"]:
        if desc.get("annotations", {}).get("org.opencontainers.image.ref.name") == LAYOUT_TAG:
            return str(desc["digest"])
    raise KeyError(LAYOUT_TAG)
