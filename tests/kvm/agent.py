"""The KVM test host's command agent. It runs inside the host (started by ``init.sh``,
with the Debian ``python3``, so it uses the standard library only) and serves one command
at a time on each of two virtio-serial ports, whose other ends are Unix sockets of the
outer QEMU.

Virtio-serial ports rather than ssh: no network, keys or sshd are needed in the host,
and the channel exists as soon as the VM does. The protocol is JSON lines. The client
sends ``{"op": "ping"}`` (answered ``{"op": "pong"}``) or ``{"op": "run", "argv": [...],
"env": {...}, "cwd": "..."}``; the agent streams ``{"fd": 1|2, "data": "<base64>"}`` and
ends with ``{"exit": CODE}``. A client that disconnects while its command runs has that
command's process group killed, so an interrupted ``scripts/kvm-host run`` leaves nothing
behind.
"""

from __future__ import annotations

import base64
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

# Two ports, each served by its own thread, so a second command (a look at a log, say)
# can run while a long one holds the first.
PORT_NAMES = ("org.agentenv.kvmhost.0", "org.agentenv.kvmhost.1")
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "TERM": "dumb",
}


class Disconnected(Exception):
    """The client end of the port went away."""


def find_port(name: str) -> Path:
    for entry in Path("/sys/class/virtio-ports").glob("*"):
        if (entry / "name").read_text().strip() == name:
            return Path("/dev") / entry.name
    raise SystemExit(f"kvmhost agent: no virtio-serial port named {name}")


class Channel:
    """The port: reads split into lines; a hang-up (no client) is seen through poll()."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        self.buffer = b""

    def send(self, message: dict[str, object]) -> None:
        data = json.dumps(message).encode() + b"\n"
        while data:
            try:
                written = os.write(self.fd, data)
            except BlockingIOError:
                select.select([], [self.fd], [], 1.0)
                continue
            except OSError as exc:
                raise Disconnected(str(exc)) from exc
            data = data[written:]

    def poll(self, timeout: float) -> tuple[bool, bool]:
        """(readable, hung up) after waiting at most ``timeout`` seconds."""
        poller = select.poll()
        poller.register(self.fd, select.POLLIN | select.POLLHUP)
        events = poller.poll(timeout * 1000)
        flags = events[0][1] if events else 0
        return bool(flags & select.POLLIN), bool(flags & select.POLLHUP)

    def read_lines(self) -> list[bytes]:
        try:
            chunk = os.read(self.fd, 65536)
        except BlockingIOError:
            return []
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        return [line for line in lines if line.strip()]


def run_command(channel: Channel, request: dict[str, object]) -> None:
    argv = [str(a) for a in request["argv"]]  # type: ignore[attr-defined]
    env = {**BASE_ENV, **{str(k): str(v) for k, v in dict(request.get("env") or {}).items()}}  # type: ignore[call-overload]
    try:
        proc = subprocess.Popen(
            argv,
            cwd=str(request.get("cwd") or "/"),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:
        channel.send({"fd": 2, "data": base64.b64encode(f"{exc}\n".encode()).decode()})
        channel.send({"exit": 127})
        return
    assert proc.stdout is not None and proc.stderr is not None
    streams = {proc.stdout.fileno(): 1, proc.stderr.fileno(): 2}
    try:
        while streams:
            ready, _, _ = select.select(list(streams), [], [], 1.0)
            for fd in ready:
                data = os.read(fd, 65536)
                if not data:
                    del streams[fd]
                    continue
                channel.send({"fd": streams[fd], "data": base64.b64encode(data).decode()})
            if not ready and channel.poll(0)[1]:
                raise Disconnected("client hung up")
        code = proc.wait()
        channel.send({"exit": code if code >= 0 else 128 - code})
    except Disconnected:
        with_group(proc.pid, signal.SIGKILL)
        proc.wait()
        channel.buffer = b""


def with_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def serve(channel: Channel) -> None:
    while True:
        readable, hung_up = channel.poll(1.0)
        if hung_up:
            # No client. A virtio port without one polls readable too (its reads give
            # end of file at once), so this comes first: taken as a request to read, it
            # spun a vCPU of the host (80 % of one, for the whole of a nested run).
            channel.buffer = b""
            time.sleep(0.2)
            continue
        if not readable:
            continue
        for line in channel.read_lines():
            try:
                request = json.loads(line)
                if request.get("op") == "ping":
                    channel.send({"op": "pong"})
                elif request.get("op") == "run":
                    run_command(channel, request)
            except Disconnected:
                channel.buffer = b""
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                try:
                    channel.send({"error": f"bad request: {exc}"})
                except Disconnected:
                    pass


def main() -> None:
    channels = [Channel(find_port(name)) for name in PORT_NAMES]
    threads = [threading.Thread(target=serve, args=(c,), daemon=True) for c in channels]
    for thread in threads:
        thread.start()
    print("KVMHOST-AGENT: ready", file=sys.stderr, flush=True)
    for thread in threads:
        thread.join()


if __name__ == "__main__":
    main()
