"""The end-to-end smoke run inside the KVM test host, one KVM mode per run:

    python -m tests.kvm.smoke firecracker     # AENV_VMM=firecracker
    python -m tests.kvm.smoke qemu-kvm        # AENV_VMM=qemu AENV_ACCEL=kvm

It starts the real server (which builds the ``base`` template: a cold boot of the guest
and a snapshot) and drives it with the unmodified ``e2b`` SDK: create from ``base``,
``commands.run``, ``files`` write and read, kill; then checks the node reports the mode
asked for and that no VMM is left. Then, against the same server, the rest of the core
(:mod:`tests.kvm.core`: pause and connect, snapshot, fork, PTY, the server's kill -9
and re-adoption, a template build: those the mode supports, see ``CORE_STEPS``;
``--core`` picks others, ``--core ''`` none), and again that no VMM is left. Prints
one ``SMOKE-RESULT {json}`` line with the step timings and the failed core steps; exits
0 only if every step passed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from e2b import Sandbox

from tests.helpers import ServerProcess, cleanup_host
from tests.kvm.core import STEPS, Core, run_core

MODES: dict[str, dict[str, str]] = {
    "firecracker": {"AENV_VMM": "firecracker", "AENV_ACCEL": "kvm"},
    "qemu-kvm": {"AENV_VMM": "qemu", "AENV_ACCEL": "kvm"},
}
# Firecracker's raw drives are copied (reflinked) while the machine is paused for its
# snapshot (``DiskCapture.COPY``), so both modes run every step. QEMU's fork of 4 was
# left out of the default run for a while: of seven full core runs with it, one lost the
# sandbox of the template built afterwards (a guest reset, cause not found then). On
# 2026-12-05, 16 more full core runs with it: 14 passed; the test host's own kernel died
# in one (during the fork) and in a 17th (during the base template's boot, no fork
# involved), and one nested guest triple-faulted on the code page it had just run (see
# README, KVM hosts): failures of the outer QEMU's emulated SVM, which test_nested now
# meets with one more run. Like Firecracker's, a failed fork runs once more
# (``RETRIED_STEPS``). Shutdown exits and VMMs' unexpected exits are in the result.
CORE_STEPS: dict[str, tuple[str, ...]] = {
    "firecracker": ("pause-connect", "snapshot", "fork", "pty", "kill9", "template"),
    "qemu-kvm": ("pause-connect", "snapshot", "fork", "pty", "kill9", "template"),
}
# The host's Python runs many times slower than natively (TCG), and so does every nested
# guest: the base template's cold boot took about 3 minutes to envd while the host's
# agent spun, 20-70 s since (120 s is the server's default limit), and each request
# takes seconds. A boot whose nested guest the emulation broke (a kernel oops at 0.66 s,
# its vCPUs halted for good, in a full-suite run) is given up after 300 s and tried
# again, well within the smoke's limit (test_nested.SMOKE_TIMEOUT), which it outlived
# with the 900 s allowed before.
SERVER_ENV = {
    "AENV_TEMPLATE_BOOT_TIMEOUT": "300",
    "AENV_TEMPLATE_BOOT_ATTEMPTS": "2",
    # Nested guests run at TCG speed, several at once (a fork of 4): /init can be slow.
    "AENV_ENVD_INIT_TIMEOUT": "120",
}
TEMPLATE_WAIT = 2000.0
REQUEST_TIMEOUT = 300.0
# Health polls: each one costs the host a noticeable share of a (TCG) CPU.
POLL_SECONDS = 3.0


# Where the host's kernel keeps its trace events, and KVM's exit code for a guest that
# shut down (a triple fault): SVM's SHUTDOWN exit, VMX's "triple fault" basic reason.
TRACEFS = Path("/sys/kernel/tracing")
SHUTDOWN_EXIT = {"svm": 127, "vmx": 2}


@contextlib.contextmanager
def guest_shutdowns(found: list[str]) -> Iterator[None]:
    """Record, into ``found``, every nested guest's shutdown exit (its vCPU, RIP and
    exit info) while the block runs. A nested guest once went away with its QEMU exiting
    0 and nothing logged (a reset, see README, KVM hosts); KVM sees a triple fault as
    this exit, so the next one says where the guest was. Best effort: no tracefs, no
    record."""
    event = TRACEFS / "events/kvm/kvm_exit"
    flags = Path("/proc/cpuinfo").read_text().split()
    vendor = "svm" if "svm" in flags else "vmx"
    try:
        if not event.is_dir():
            subprocess.run(["mount", "-t", "tracefs", "nodev", str(TRACEFS)], check=False)
        (TRACEFS / "trace").write_text("")
        (event / "filter").write_text(f"exit_reason == {SHUTDOWN_EXIT[vendor]}\n")
        (event / "enable").write_text("1\n")
    except OSError as exc:
        found.append(f"(no shutdown trace: {exc})")
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            (event / "enable").write_text("0\n")
            lines = (TRACEFS / "trace").read_text(errors="replace").splitlines()
            found.extend(line for line in lines if line and not line.startswith("#"))


def start_server(server: ServerProcess, limit: float) -> None:
    """Start ``server`` and wait until its base template is ready, polling its health
    every few seconds (``ServerProcess.start`` polls several times a second, which here
    takes CPU from the template boot)."""
    server.spawn()
    server.wait_ready(limit, poll_every=POLL_SECONDS, retry_every=POLL_SECONDS, request_timeout=30)


def smoke(mode: str, data_dir: Path, core_steps: list[str]) -> dict[str, Any]:
    from agentenv.guest import default_cache_dir, load_guest_image

    steps: dict[str, float] = {}

    def step(name: str, action: Callable[[], Any]) -> Any:
        print(f"smoke[{mode}]: {name}", file=sys.stderr, flush=True)
        started = time.monotonic()
        result = action()
        steps[name] = round(time.monotonic() - started, 1)
        return result

    # Fails at once, naming what is missing, rather than after the template wait.
    load_guest_image(default_cache_dir())
    # A run again in the same host (test_nested, after a nested guest's triple fault)
    # starts from nothing, as the first did.
    shutil.rmtree(data_dir / mode, ignore_errors=True)
    home = data_dir / mode / "node"
    server = ServerProcess(home=home, extra_env={**SERVER_ENV, **MODES[mode]})
    result: dict[str, Any] = {"mode": mode, "steps": steps, "guest_shutdowns": []}
    try:
        with guest_shutdowns(result["guest_shutdowns"]):
            run_steps(mode, server, core_steps, step, result)
    finally:
        with contextlib.suppress(Exception):
            with server.client() as api:
                for item in api.get("/sandboxes").json():
                    api.delete(f"/sandboxes/{item['sandboxID']}")
        server.stop()
        cleanup_host(server.home)
    result["vmm_exits"] = unexpected_exits(server.log_path)
    return result


def run_steps(
    mode: str,
    server: ServerProcess,
    core_steps: list[str],
    step: Callable[[str, Callable[[], Any]], Any],
    result: dict[str, Any],
) -> None:
    """The smoke's steps, then the core's, against ``server``."""
    step("server start and base template", lambda: start_server(server, TEMPLATE_WAIT))
    opts = check(server, mode, step, result)
    if core_steps:
        core = Core(
            srv=server,
            mode=mode,
            opts=opts,
            restart=lambda: start_server(server, TEMPLATE_WAIT),
            vmm_processes=vmm_processes,
        )
        result["failed"] = run_core(core, core_steps, step)
        result["retried"] = core.retried
        no_sandbox_left(server, "the core steps")


def check(
    srv: ServerProcess,
    mode: str,
    step: Callable[[str, Callable[[], Any]], Any],
    result: dict[str, Any],
) -> dict[str, Any]:
    """The SDK steps against the running ``srv``; returns the SDK's options for it."""
    with srv.client() as api:
        health = api.get("/health").json()
    result["health"] = {k: health.get(k) for k in ("status", "vmm", "accel", "detail")}
    want_vmm = MODES[mode]["AENV_VMM"]
    if health.get("vmm") != want_vmm or health.get("accel") != "kvm":
        raise AssertionError(f"node runs {health.get('vmm')}/{health.get('accel')}")
    opts: dict[str, Any] = {
        "api_url": srv.url,
        "sandbox_url": srv.url,
        "api_key": srv.api_key,
        "debug": False,
        "request_timeout": REQUEST_TIMEOUT,
    }
    sbx = step("create", lambda: Sandbox.create(timeout=900, **opts))
    run = step("commands.run", lambda: sbx.commands.run("uname -r; nproc", timeout=120))
    if run.exit_code != 0 or not run.stdout.strip():
        raise AssertionError(f"commands.run: {run}")
    result["guest"] = run.stdout.split()
    payload = "kvm smoke \u2713\n" * 100
    step("files.write", lambda: sbx.files.write("/home/user/smoke.txt", payload))
    read = step("files.read", lambda: sbx.files.read("/home/user/smoke.txt"))
    if read != payload:
        raise AssertionError("files.read returned other content than was written")
    owner = sbx.commands.run("stat -c %U /home/user/smoke.txt").stdout.strip()
    if owner != "user":
        raise AssertionError(f"written file owned by {owner!r}")
    step("kill", sbx.kill)
    no_sandbox_left(srv, "kill")
    return opts


def unexpected_exits(log: Path) -> list[str]:
    """The server log's lines about VMMs that exited on their own (with QEMU's stated
    reason: ``guest-reset``, ...), which a lost sandbox leaves."""
    if not log.is_file():
        return []
    lines = log.read_text(errors="replace").splitlines()
    return [line[:400] for line in lines if "not by this server" in line]


def no_sandbox_left(srv: ServerProcess, after: str) -> None:
    """No sandbox listed, and no VMM process left, ``after`` the sandboxes were killed."""
    with srv.client() as api:
        left = api.get("/sandboxes").json()
    if left:
        raise AssertionError(f"sandboxes left after {after}: {left}")
    deadline = time.monotonic() + 60
    # Nothing else in the host runs VMMs and the template's exits once its snapshot is
    # taken, so after the kill none may be left. Found by name: a jailed Firecracker's
    # command line names no path of the server's.
    while (pids := vmm_processes()) and time.monotonic() < deadline:
        time.sleep(1)
    if pids:
        raise AssertionError(f"VMM processes left after {after}: {pids}")


def vmm_processes() -> list[int]:
    """PIDs of the Firecracker and QEMU processes on this machine."""
    found = []
    for comm in Path("/proc").glob("[0-9]*/comm"):
        with contextlib.suppress(OSError):
            if comm.read_text().strip() in ("firecracker", "qemu-system-x86"):
                found.append(int(comm.parent.name))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("mode", choices=sorted(MODES))
    parser.add_argument("--data-dir", type=Path, default=Path("/data/smoke"))
    parser.add_argument(
        "--core",
        default=None,
        help=f"comma-separated core steps to run after the smoke, of {','.join(STEPS)} "
        "(default: those the mode supports)",
    )
    args = parser.parse_args()
    chosen = ",".join(CORE_STEPS[args.mode]) if args.core is None else args.core
    core_steps = [name for name in chosen.split(",") if name]
    if unknown := sorted(set(core_steps) - set(STEPS)):
        parser.error(f"unknown core steps: {', '.join(unknown)}")
    if not os.path.exists("/dev/kvm"):
        print("smoke: no /dev/kvm here", file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        result = smoke(args.mode, args.data_dir, core_steps)
        result["ok"] = not result.get("failed")
    except Exception as exc:  # reported, with the server log, as the result
        result = {"mode": args.mode, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
    if not result["ok"]:
        log = args.data_dir / args.mode / "node-server.log"
        if log.is_file():
            tail = log.read_text(errors="replace").splitlines()[-80:]
            print("\n".join(tail), file=sys.stderr)
    result["total_seconds"] = round(time.monotonic() - started, 1)
    print("SMOKE-RESULT " + json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
