"""Sandbox lifecycle latency through the HTTP API, against bare QEMU in the same run.

Measures, for N sandboxes created one after another from the ``base`` template:
  create → running      POST /sandboxes until 201 (restore + network + envd /init)
  create → first output POST /sandboxes, then ``echo`` through the proxy until its output
  kill                  DELETE /sandboxes/{id} until 204 (VMM, netns, files released)
and, as the baseline, the same snapshot restored with a bare ``qemu-system-x86_64`` process
driven by raw QMP (no agentenv code on the path): process start → ``cont`` returned, and
SIGKILL → reaped.

Usage (as root):  .venv/bin/python bench/lifecycle.py [--runs 20] [--json out.json]
It starts its own server in a temporary data directory unless --url/--key are given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agentenv.network import NetworkManager
from tests.helpers import ServerProcess, live_server, run_command, vmm_pids


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def summarize(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50_ms": statistics.median(values) * 1000,
        "p90_ms": percentile(values, 0.9) * 1000,
        "min_ms": min(values) * 1000,
        "max_ms": max(values) * 1000,
    }


# -- through agentenv -------------------------------------------------------------------
def bench_api(url: str, key: str, runs: int) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {
        "create_to_running": [],
        "create_to_first_output": [],
        "kill": [],
    }
    with httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=120, trust_env=False) as c:
        # Warm-up: the first restore after a template build reads the RAM image from disk.
        warm = c.post("/sandboxes", json={"templateID": "base", "timeout": 120}).json()
        c.delete(f"/sandboxes/{warm['sandboxID']}")
        for _ in range(runs):
            t0 = time.perf_counter()
            response = c.post("/sandboxes", json={"templateID": "base", "timeout": 120})
            t1 = time.perf_counter()
            response.raise_for_status()
            sandbox_id = response.json()["sandboxID"]
            result = run_command(url, sandbox_id, "echo ready")
            t2 = time.perf_counter()
            assert result.stdout == "ready\n", result
            k0 = time.perf_counter()
            c.delete(f"/sandboxes/{sandbox_id}").raise_for_status()
            k1 = time.perf_counter()
            results["create_to_running"].append(t1 - t0)
            results["create_to_first_output"].append(t2 - t0)
            results["kill"].append(k1 - k0)
    return results


# -- bare QEMU baseline -----------------------------------------------------------------
async def _qmp(path: Path, deadline: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    while True:
        try:
            reader, writer = await asyncio.open_unix_connection(str(path))
            break
        except (FileNotFoundError, ConnectionRefusedError):
            if time.perf_counter() > deadline:
                raise
            await asyncio.sleep(0.001)
    await reader.readline()  # greeting
    return reader, writer


async def _execute(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    command: str,
    arguments: dict[str, Any] | None = None,
) -> Any:
    msg: dict[str, Any] = {"execute": command}
    if arguments:
        msg["arguments"] = arguments
    writer.write(json.dumps(msg).encode() + b"\n")
    await writer.drain()
    while True:
        reply = json.loads(await reader.readline())
        if "return" in reply:
            return reply["return"]
        if "error" in reply:
            raise RuntimeError(f"{command}: {reply['error']}")


async def bare_restore_once(snapshot_dir: Path, workdir: Path, netns: str) -> tuple[float, float]:
    manifest = json.loads((snapshot_dir / "snapshot.json").read_text())
    files = manifest["files"]
    shape = files["shape"]
    overlay = workdir / "disk.qcow2"
    qmp = workdir / "qmp.sock"
    t0 = time.perf_counter()
    subprocess.run(
        [
            "qemu-img",
            "create",
            "-q",
            "-f",
            "qcow2",
            "-b",
            str(snapshot_dir / manifest["disk"]),
            "-F",
            "qcow2",
            str(overlay),
        ],
        check=True,
    )
    accel = files["accel"]
    argv = [
        "nsenter",
        f"--net=/run/netns/{netns}",
        "--",
        "qemu-system-x86_64",
        "-M",
        "microvm,memory-backend=mem0",
        "-accel",
        "tcg,tb-size=64" if accel == "tcg" else "kvm",
        "-cpu",
        "max" if accel == "tcg" else "host,-arch-capabilities",
        "-smp",
        str(manifest["vcpus"]),
        "-m",
        f"{manifest['memory_mib']}M",
        "-object",
        f"memory-backend-file,id=mem0,size={manifest['memory_mib']}M,"
        f"mem-path={files['memory_file']},share=off",
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-kernel",
        manifest["kernel"],
        "-append",
        manifest["cmdline"],
        "-drive",
        f"id=root,file={overlay},format=qcow2,if=none",
        "-device",
        "virtio-blk-device,drive=root",
        "-drive",
        f"id=tools,file={manifest['tools_drive']},format=raw,if=none,readonly=on",
        "-device",
        "virtio-blk-device,drive=tools",
        "-serial",
        "null",
        "-qmp",
        f"unix:{qmp},server=on,wait=off",
        "-incoming",
        "defer",
    ]
    if manifest.get("initrd"):
        argv += ["-initrd", manifest["initrd"]]
    if shape.get("net"):
        argv += [
            "-netdev",
            "tap,id=n0,ifname=tap0,script=no,downscript=no",
            "-device",
            "virtio-net-device,netdev=n0,mac=02:fc:00:00:00:05",
        ]
    argv += ["-device", "virtio-balloon-device"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        reader, writer = await _qmp(qmp, time.perf_counter() + 10)
        await _execute(reader, writer, "qmp_capabilities")
        await _execute(
            reader,
            writer,
            "migrate-set-capabilities",
            {"capabilities": [{"capability": "x-ignore-shared", "state": True}]},
        )
        await _execute(
            reader, writer, "migrate-incoming", {"uri": f"exec:cat {files['state_file']}"}
        )
        while True:
            status = (await _execute(reader, writer, "query-migrate")).get("status")
            if status == "completed":
                break
            if status in ("failed", "cancelled"):
                raise RuntimeError(f"bare restore failed: {status}")
            await asyncio.sleep(0.001)
        await _execute(reader, writer, "cont")
        t1 = time.perf_counter()
        writer.close()
    finally:
        k0 = time.perf_counter()
        proc.kill()
        proc.wait()
        k1 = time.perf_counter()
    overlay.unlink(missing_ok=True)
    qmp.unlink(missing_ok=True)
    if proc.returncode not in (-9, 0):
        raise RuntimeError(proc.stderr.read().decode() if proc.stderr else "qemu failed")
    return t1 - t0, k1 - k0


def bench_bare(snapshot_dir: Path, runs: int) -> dict[str, list[float]]:
    """The snapshot's virtio-net device was saved with a tap backend, so the baseline
    needs a tap too: one namespace with one, made once and outside the timed path."""
    results: dict[str, list[float]] = {"bare_restore_to_running": [], "bare_kill": []}
    network = NetworkManager(prefix="aebase", subnet="10.254.0.0/24")
    net = asyncio.run(network.create(0))
    try:
        with tempfile.TemporaryDirectory(prefix="aenv-bare-") as tmp:
            asyncio.run(bare_restore_once(snapshot_dir, Path(tmp), net.netns))  # warm-up
            for _ in range(runs):
                running, killed = asyncio.run(bare_restore_once(snapshot_dir, Path(tmp), net.netns))
                results["bare_restore_to_running"].append(running)
                results["bare_kill"].append(killed)
    finally:
        asyncio.run(network.destroy(0))
    return results


def _pss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return 0


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def idle_cost(server: ServerProcess, seconds: float = 5.0) -> dict[str, float]:
    """Host memory (PSS) and CPU of one idle sandbox's VMM."""
    with httpx.Client(
        base_url=server.url, headers={"X-API-Key": server.api_key}, timeout=120, trust_env=False
    ) as c:
        sandbox_id = c.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
        try:
            run_command(server.url, sandbox_id, "true")
            (pid,) = vmm_pids(f"/sandboxes/{sandbox_id}/")
            ticks0, t0 = _cpu_ticks(pid), time.monotonic()
            time.sleep(seconds)
            ticks1, t1 = _cpu_ticks(pid), time.monotonic()
            hz = os.sysconf("SC_CLK_TCK")
            return {
                "idle_vmm_pss_mib": _pss_kib(pid) / 1024,
                "idle_vmm_cpu_percent": 100 * (ticks1 - ticks0) / hz / (t1 - t0),
            }
        finally:
            c.delete(f"/sandboxes/{sandbox_id}")


def print_table(summary: dict[str, dict[str, float]], baseline: dict[str, str]) -> None:
    header = f"{'metric':<28}{'n':>4}{'p50 ms':>10}{'p90 ms':>10}{'min':>9}{'max':>9}  ratio"
    print(header)
    print("-" * len(header))
    for name, s in summary.items():
        ratio = ""
        if name in baseline:
            ratio = f"{s['p50_ms'] / summary[baseline[name]]['p50_ms']:.2f}x {baseline[name]}"
        print(
            f"{name:<28}{s['n']:>4}{s['p50_ms']:>10.1f}{s['p90_ms']:>10.1f}"
            f"{s['min_ms']:>9.1f}{s['max_ms']:>9.1f}  {ratio}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--json", type=Path, default=Path("bench/results/lifecycle.json"))
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/lifecycle.py must run as root")
    home = Path(tempfile.mkdtemp(prefix="aenv-bench-", dir="/var/tmp"))
    try:
        with live_server(ServerProcess(home=home / "node")) as server:
            api = bench_api(server.url, server.api_key, args.runs)
            snapshot_dirs = sorted((server.home / "templates" / "base").iterdir())
            bare = bench_bare(snapshot_dirs[-1], args.runs)
            idle = idle_cost(server)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    summary = {name: summarize(values) for name, values in {**api, **bare}.items()}
    baseline = {"create_to_running": "bare_restore_to_running", "kill": "bare_kill"}
    print_table(summary, baseline)
    print(
        f"\nidle sandbox: VMM PSS {idle['idle_vmm_pss_mib']:.0f} MiB, "
        f"CPU {idle['idle_vmm_cpu_percent']:.1f}% of one core"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {"runs": args.runs, "summary": summary, "idle": idle, "raw_seconds": {**api, **bare}},
            indent=2,
        )
    )
    print(f"\nwritten {args.json}")


if __name__ == "__main__":
    main()
