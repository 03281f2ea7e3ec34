"""Start, stop and talk to the KVM test host.

The host is QEMU ``-M microvm -accel tcg -cpu max`` (TCG emulates AMD SVM with nested
paging, so ``kvm_amd`` loads inside and ``/dev/kvm`` works), booting the guest image's
kernel and initramfs unchanged, with three disks:

- ``vda``: a qcow2 overlay over the cached host root filesystem (:mod:`tests.kvm.image`);
- ``vdb``: the payload, an ext4 image made at every start, which the initramfs mounts at
  ``/.aenv`` and whose ``bin/aenv-init`` (``init.sh``) the initramfs runs;
- ``vdc``: the data disk, XFS with ``reflink=1``, mounted at ``/data`` (``/tmp`` too).

How the project gets in: the guest kernel has no 9p (``CONFIG_NET_9P`` is off in Debian's
cloud kernel) and virtio-fs needs a ``virtiofsd`` daemon this machine does not install, so
the checkout (tracked and untracked-but-not-ignored files), the ``.venv``, the Firecracker
binaries and the current guest image are copied into the payload disk at their absolute
paths and bind-mounted there inside. That is a snapshot taken at ``start``: the host sees
later edits only after a restart, and what it writes never reaches the outside.

Commands run through the agent (:mod:`tests.kvm.agent`) on virtio-serial ports whose
outer ends are ``agent0.sock`` and ``agent1.sock`` in the state directory; each serves
one command at a time (``agent<N>.lock``), so two can run at once.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from agentenv.guest import build_guest_image, default_cache_dir, kernel_cmdline
from agentenv.guest.host import STATIC_INIT
from agentenv.guest.image import CURRENT_LINK, IMAGES_DIR
from agentenv.vmm.firecracker_binary import find_firecracker, find_jailer
from tests.kvm.agent import PORT_NAMES
from tests.kvm.image import ROOT, build_host_image, tree_bytes

DEFAULT_STATE_DIR = Path(os.environ.get("AENV_KVM_HOST_DIR") or "/var/tmp/agentenv-kvm-host")
VCPUS = 2
MEMORY = "4G"
DATA_DISK_BYTES = 32 << 30
BOOT_TIMEOUT = 600.0
QMP_PROBE = ("qemu-system-x86_64", "-M", "none", "-accel", "tcg", "-display", "none")
HERE = Path(__file__).resolve().parent


class KvmHostError(Exception):
    """The test host could not be started or reached."""


@dataclass(frozen=True)
class HostPaths:
    """Files of one test host, all in its state directory."""

    state: Path

    @property
    def pidfile(self) -> Path:
        return self.state / "qemu.pid"

    @property
    def sockets(self) -> list[Path]:
        return [self.state / f"agent{index}.sock" for index in range(len(PORT_NAMES))]

    @property
    def console(self) -> Path:
        return self.state / "console.log"

    @property
    def info(self) -> Path:
        return self.state / "host.json"

    @property
    def locks(self) -> list[Path]:
        return [self.state / f"agent{index}.lock" for index in range(len(PORT_NAMES))]


def emulated_svm() -> tuple[bool, str]:
    """Whether this machine's QEMU emulates AMD SVM with nested paging under TCG (what
    the host needs for a working ``/dev/kvm`` inside), and why not. Asked of QEMU itself,
    through QMP's CPU model expansion of ``max``, without booting anything."""
    if shutil.which("qemu-system-x86_64") is None:
        return False, "qemu-system-x86_64 is not installed"
    commands = [
        {"execute": "qmp_capabilities"},
        {
            "execute": "query-cpu-model-expansion",
            "arguments": {"type": "full", "model": {"name": "max"}},
        },
        {"execute": "quit"},
    ]
    try:
        out = subprocess.run(
            [*QMP_PROBE, "-nodefaults", "-qmp", "stdio"],
            input="".join(json.dumps(c) + "\n" for c in commands),
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
    except subprocess.TimeoutExpired:
        return False, "QEMU did not answer the CPU model query"
    for line in out.splitlines():
        with contextlib.suppress(ValueError):
            answer = json.loads(line).get("return")
            if isinstance(answer, dict) and "model" in answer:
                props = answer["model"].get("props", {})
                if props.get("svm") and props.get("npt"):
                    return True, "TCG's max CPU has svm and npt"
                return False, "QEMU's TCG max CPU has no svm with npt (nested KVM impossible)"
    return False, f"QEMU gave no CPU model expansion: {out[-300:]!r}"


def qemu_pid(paths: HostPaths) -> int | None:
    """The running QEMU's pid, or None."""
    try:
        pid = int(paths.pidfile.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    return pid if str(paths.state).encode() in cmdline else None


def _checkout_files(root: Path) -> list[str]:
    out = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True,
        capture_output=True,
    ).stdout
    return [name for name in out.decode().split("\0") if name]


def _link_or_copy(source: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    if source.is_symlink():
        dest.symlink_to(os.readlink(source))
        return
    try:
        os.link(source, dest)
    except OSError:
        shutil.copy2(source, dest)


def _link_tree(source: Path, dest: Path) -> None:
    """Hard links where possible (the staging tree is only read, by mkfs), else copies."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["cp", "-al", str(source), str(dest)], capture_output=True).returncode:
        shutil.rmtree(dest, ignore_errors=True)
        subprocess.run(["cp", "-a", str(source), str(dest)], check=True)


def _guest_image_parts(cache_dir: Path) -> list[Path]:
    """The current guest image: its manifest and the component directories it names."""
    current = cache_dir / CURRENT_LINK
    manifest = json.loads((current / "manifest.json").read_text())
    parts = [current, cache_dir / IMAGES_DIR / current.resolve().name]
    parts += [Path(path).parent for path in manifest["files"].values()]
    return parts


def build_payload_tree(tree: Path, cache_dir: Path, venv: Path) -> list[str]:
    """Fill ``tree`` with the payload; return the absolute paths to bind inside."""
    (tree / "bin").mkdir(parents=True)
    # The guest image's initramfs hands over to the tools drive's PID 1 by this name.
    shutil.copy2(STATIC_INIT, tree / "bin/catatonit")
    shutil.copy2(HERE / "init.sh", tree / "bin/aenv-init")
    (tree / "bin/aenv-init").chmod(0o755)
    shutil.copy2(HERE / "agent.py", tree / "agent.py")
    inside = tree / "root"
    binds = [ROOT]
    for name in _checkout_files(ROOT):
        if (ROOT / name).is_file() or (ROOT / name).is_symlink():
            _link_or_copy(ROOT / name, inside / ROOT.relative_to("/") / name)
    # The virtualenv is ignored by git; it goes in at its real path (a worktree's .venv
    # is a symlink to the main checkout's), the symlink beside the checkout.
    real_venv = venv.resolve()
    if venv.is_symlink():
        _link_or_copy(venv, inside / venv.relative_to("/"))
    binds.append(real_venv)
    _link_tree(real_venv, inside / real_venv.relative_to("/"))
    firecracker = find_firecracker()
    if firecracker is not None:
        binds.append(firecracker.parent)
        for binary in (firecracker, find_jailer(firecracker)):
            if binary is not None:
                _link_or_copy(binary, inside / binary.relative_to("/"))
    binds.append(cache_dir)
    for part in _guest_image_parts(cache_dir):
        # A cache seeded from another may name components in that one (absolute paths).
        binds.append(part.parent if part.is_symlink() else part)
        target = inside / part.relative_to("/")
        if part.is_symlink():
            _link_or_copy(part, target)
        else:
            _link_tree(part, target)
    # A path inside another bound path is already in that one's tree.
    unique = sorted({str(p) for p in binds})
    kept = [p for p in unique if not any(p.startswith(q + "/") for q in unique if q != p)]
    (tree / "binds").write_text("".join(f"{p}\n" for p in kept))
    return kept


def _run(argv: Sequence[str | Path], **kwargs: Any) -> None:
    result = subprocess.run([str(a) for a in argv], capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise KvmHostError(f"{' '.join(map(str, argv))} failed: {result.stderr.strip()}")


def qemu_argv(paths: HostPaths, kernel: Path, initrd: Path) -> list[str]:
    state = paths.state
    disks = [
        ("root", state / "root.qcow2", "qcow2"),
        ("payload", state / "payload.ext4", "raw"),
        ("data", state / "data.xfs", "raw"),
    ]
    argv = [
        "qemu-system-x86_64",
        "-M",
        "microvm",
        # SVM with nested paging is emulated by TCG's "max" CPU: the point of this VM.
        "-accel",
        "tcg,thread=multi,tb-size=512",
        "-cpu",
        "max",
        "-smp",
        str(VCPUS),
        "-m",
        MEMORY,
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-no-reboot",
        "-kernel",
        str(kernel),
        "-initrd",
        str(initrd),
        "-append",
        kernel_cmdline({"aenv.kvmhost": "1"}),
    ]
    for name, path, fmt in disks:
        argv += [
            "-drive",
            f"id={name},file={path},format={fmt},if=none,discard=unmap,cache=unsafe",
            "-device",
            f"virtio-blk-device,drive={name}",
        ]
    argv += ["-device", "virtio-serial-device"]
    for index, (socket_path, name) in enumerate(zip(paths.sockets, PORT_NAMES, strict=True)):
        argv += [
            "-chardev",
            f"socket,id=agent{index},path={socket_path},server=on,wait=off",
            "-device",
            f"virtserialport,chardev=agent{index},name={name}",
        ]
    argv += [
        "-chardev",
        f"file,id=console,path={paths.console}",
        "-serial",
        "chardev:console",
        "-pidfile",
        str(paths.pidfile),
        "-daemonize",
    ]
    return argv


def start(
    state: Path = DEFAULT_STATE_DIR,
    *,
    cache_dir: Path | None = None,
    venv: Path = ROOT / ".venv",
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Build what is missing, boot the host and wait for its agent; return its info."""
    paths = HostPaths(state)
    if qemu_pid(paths) is not None:
        raise KvmHostError(f"a test host is already running in {state}; stop it first")
    cache = cache_dir or default_cache_dir()
    started = time.monotonic()
    guest = asyncio.run(build_guest_image(cache, log=log))
    host_image = asyncio.run(build_host_image(cache, guest, venv, log=log))
    clear(paths)
    state.mkdir(parents=True, exist_ok=True)
    tree = state / "payload-tree"
    try:
        binds = build_payload_tree(tree, cache, venv)
        size_mib = (tree_bytes(tree) + (2 << 30)) >> 20
        log(f"kvm host: payload {size_mib} MiB ({', '.join(binds)})")
        _run(
            [
                "mkfs.ext4",
                "-q",
                "-F",
                "-L",
                "aenv-kvmpayload",
                "-d",
                tree,
                "-E",
                "root_owner=0:0",
                state / "payload.ext4",
                f"{size_mib}M",
            ]
        )
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    with open(state / "data.xfs", "wb") as data:
        data.truncate(DATA_DISK_BYTES)
    _run(["mkfs.xfs", "-q", "-f", "-m", "reflink=1", state / "data.xfs"])
    _run(
        [
            "qemu-img",
            "create",
            "-q",
            "-f",
            "qcow2",
            "-F",
            "raw",
            "-b",
            host_image.rootfs,
            state / "root.qcow2",
        ]
    )
    prepared = time.monotonic()
    _run(qemu_argv(paths, guest.kernel, guest.initrd))
    pid = qemu_pid(paths)
    if pid is None:
        raise KvmHostError(f"QEMU did not start; console:\n{console_tail(paths)}")
    deadline = time.monotonic() + BOOT_TIMEOUT
    while not ping(paths):
        if qemu_pid(paths) is None:
            raise KvmHostError(f"the test host exited during boot; console:\n{console_tail(paths)}")
        if time.monotonic() > deadline:
            raise KvmHostError(f"no agent after {BOOT_TIMEOUT:.0f} s:\n{console_tail(paths)}")
        time.sleep(1)
    info = {
        "pid": pid,
        "state": str(state),
        "image": host_image.key,
        "guest_image": guest.digest,
        "image_cache": str(cache),
        "checkout": str(ROOT),
        "prepare_seconds": round(prepared - started, 1),
        "boot_seconds": round(time.monotonic() - prepared, 1),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    paths.info.write_text(json.dumps(info, indent=1) + "\n")
    return info


def clear(paths: HostPaths) -> None:
    """Remove a stopped host's disks (its console log stays for a post-mortem)."""
    for name in ("root.qcow2", "payload.ext4", "data.xfs", "qemu.pid", "host.json"):
        (paths.state / name).unlink(missing_ok=True)
    for path in paths.sockets + paths.locks:
        path.unlink(missing_ok=True)
    shutil.rmtree(paths.state / "payload-tree", ignore_errors=True)


def stop(state: Path = DEFAULT_STATE_DIR, timeout: float = 30.0) -> bool:
    """Stop the host (it has nothing to save: every disk is thrown away); True if one ran."""
    paths = HostPaths(state)
    pid = qemu_pid(paths)
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while qemu_pid(paths) is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        if qemu_pid(paths) is not None:
            os.kill(pid, signal.SIGKILL)
            while qemu_pid(paths) is not None:
                time.sleep(0.1)
    clear(paths)
    return pid is not None


def status(state: Path = DEFAULT_STATE_DIR) -> dict[str, Any]:
    paths = HostPaths(state)
    pid = qemu_pid(paths)
    info: dict[str, Any] = {"running": pid is not None, "state": str(state)}
    if pid is not None:
        with contextlib.suppress(OSError, ValueError):
            info.update(json.loads(paths.info.read_text()))
        info["agent"] = ping(paths, wait=False)
    return info


def console_tail(paths: HostPaths, lines: int = 40) -> str:
    try:
        text = paths.console.read_text(errors="replace")
    except OSError:
        return "(no console log)"
    return "\n".join(text.splitlines()[-lines:])


class AgentBusy(KvmHostError):
    """Another command holds the agent."""


@contextlib.contextmanager
def _connection(
    paths: HostPaths, timeout: float | None, *, wait: bool = True
) -> Iterator[socket.socket]:
    """A connection to a free agent port (each port serves one command at a time);
    when all are busy, wait for the first one, or with ``wait`` off raise
    :class:`AgentBusy`."""
    with contextlib.ExitStack() as stack:
        chosen = None
        for index, lock_path in enumerate(paths.locks):
            lock = stack.enter_context(lock_path.open("w"))
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            chosen = index
            break
        if chosen is None:
            if not wait:
                raise AgentBusy("every agent port is running a command")
            lock = stack.enter_context(paths.locks[0].open("w"))
            fcntl.flock(lock, fcntl.LOCK_EX)
            chosen = 0
        conn = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        conn.settimeout(timeout)
        conn.connect(str(paths.sockets[chosen]))
        yield conn


class _Reader:
    """JSON-line messages from the agent; a partial line is kept across timeouts."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.buffer = b""
        self.ready: list[dict[str, Any]] = []

    def next(self) -> dict[str, Any]:
        """The next message; :class:`TimeoutError` after the socket's timeout."""
        while not self.ready:
            chunk = self.conn.recv(65536)
            if not chunk:
                raise KvmHostError("the agent channel closed")
            self.buffer += chunk
            *lines, self.buffer = self.buffer.split(b"\n")
            self.ready += [json.loads(line) for line in lines if line.strip()]
        return self.ready.pop(0)


def ping(paths: HostPaths, timeout: float = 5.0, *, wait: bool = True) -> bool:
    """Whether the agent answers; with ``wait`` off, a busy agent counts as alive."""
    try:
        with _connection(paths, timeout, wait=wait) as conn:
            conn.sendall(b'{"op": "ping"}\n')
            reader = _Reader(conn)
            while reader.next().get("op") != "pong":
                pass
            return True
    except AgentBusy:
        return True
    except (OSError, KvmHostError, ValueError):
        return False


def default_env(paths: HostPaths) -> dict[str, str]:
    """What a command inside gets besides PATH and HOME: the guest image it was started
    with, and test data on the reflink-capable data disk."""
    env = {"AENV_TEST_DIR": "/data/tests"}
    with contextlib.suppress(OSError, ValueError, KeyError):
        env["AENV_IMAGE_CACHE"] = json.loads(paths.info.read_text())["image_cache"]
    return env


def run(
    argv: Sequence[str],
    state: Path = DEFAULT_STATE_DIR,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float | None = None,
    stdout: IO[bytes] | None = None,
    stderr: IO[bytes] | None = None,
) -> int:
    """Run ``argv`` inside the host; stream its output (to this process's by default)
    and return its exit code. On ``timeout`` (seconds) the command is killed inside and
    :class:`TimeoutError` raised."""
    paths = HostPaths(state)
    if qemu_pid(paths) is None:
        raise KvmHostError(f"no test host is running in {state}")
    outputs = {1: stdout or sys.stdout.buffer, 2: stderr or sys.stderr.buffer}
    request = {
        "op": "run",
        "argv": list(argv),
        "env": {**default_env(paths), **(env or {})},
        "cwd": str(cwd or ROOT),
    }
    deadline = None if timeout is None else time.monotonic() + timeout
    with _connection(paths, 30.0) as conn:
        conn.sendall(json.dumps(request).encode() + b"\n")
        conn.settimeout(5.0)
        reader = _Reader(conn)
        while True:
            try:
                message = reader.next()
            except TimeoutError:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"{argv} ran longer than {timeout} s") from None
                if qemu_pid(paths) is None:
                    raise KvmHostError("the test host exited") from None
                continue
            if "data" in message:
                out = outputs[int(message["fd"])]
                out.write(base64.b64decode(message["data"]))
                out.flush()
            elif "exit" in message:
                return int(message["exit"])
            elif "error" in message:
                raise KvmHostError(str(message["error"]))
