"""Sandbox lifecycle latency through the HTTP API, against bare QEMU in the same run.

Measures, through the API of a live server (``--runs`` times unless noted):
  create → running         POST /sandboxes until 201 (restore + network + envd /init)
  create → first output    POST /sandboxes, then ``echo`` through the proxy until its output
  kill                     DELETE /sandboxes/{id} until 204 (VMM, netns, files released)
  pause                    POST /sandboxes/{id}/pause until 204, on one running sandbox
  resume → running         POST /sandboxes/{id}/connect until 201 (it was paused)
  resume → first command   that connect, then ``echo`` through the proxy until its output
                           (back-to-back cycles: the server keeps a paused sandbox's network
                           namespace for AENV_NETWORK_LINGER s; set it to 0 in the
                           environment to measure the path that rebuilds it)
  snapshot after 0 bytes   POST /sandboxes/{id}/snapshots until 201, nothing written since
                           the previous one (each snapshot is deleted afterwards)
  snapshot after 1 GiB     the same, right after ``dd`` wrote 1 GiB of new data to the
                           guest's disk (``--big-runs`` times; the dd itself is reported too)
  fork → API               POST /sandboxes/{id}/fork {"count": N} until 201
  fork → all answering     that fork, then ``echo`` in all N children at once until every
                           one answered (``--fork-runs`` times, N = ``--fork-count``)
  memory                   PSS of the N idle children's VMMs (~3 s after the fork) per
                           child, against one sandbox created from the template
and, as the baseline, the same snapshot restored with bare VMM processes of the node's
mode (``GET /health``): under QEMU (TCG or KVM, the node's accelerator, which the
template's snapshot records) bare ``qemu-system-x86_64`` processes driven by raw QMP (no
agentenv code on the path; ``bench/bare_qemu.py``):
  bare restore → running   process start → ``cont`` returned (RAM: the template's file
                           mapped private, as create does); baseline of create
  bare kill                SIGKILL → reaped
  bare resume → running    the same restore with RAM mapped shared from a file of its own
                           (a reflink of the template's) and the disk overlay made
                           beforehand, as a paused sandbox's resume
  bare pause               on that process: ``stop`` + ``migrate`` (``x-ignore-shared``:
                           device state only) to a file passed by SCM_RIGHTS until
                           ``query-migrate`` says completed, then SIGKILL → reaped
  bare fork → running      N restores at once, each with its own qcow2 overlay, private
                           RAM mapping and network namespace, until all returned ``cont``
and under Firecracker bare ``firecracker`` processes loading the template's snapshot
through their API, the same five figures (``bench/bare_firecracker.py``). A step the
node's VMM cannot do (the API answers 501, or names the VMM as unable) is a "not
supported" row, not a failure.
The table shows each metric's median against its baseline and against the issue's
targets (resume → running ≤ 35 ms, pause ≤ 50 ms, snapshot after 1 GiB ≤ 100 ms,
fork of 16 → all answering ≤ 400 ms); a miss is reported, never asserted.

Usage (as root):
  .venv/bin/python bench/lifecycle.py [--runs 20] [--big-runs 3] [--fork-runs 3]
      [--fork-count 16] [--json bench/results/lifecycle.json] [--server-wait 600]
The server runs the mode its environment picks (``AENV_VMM``, ``AENV_ACCEL``; QEMU TCG
on this repository's machine). In the nested KVM test host, with small counts (the
host runs at TCG speed) and the JSON printed, since the host's files stay inside:
  scripts/kvm-host run --env AENV_VMM=firecracker --env AENV_ACCEL=kvm \\
      --env AENV_TEMPLATE_BOOT_TIMEOUT=900 -- sh -c '.venv/bin/python bench/lifecycle.py \\
      --runs 3 --big-runs 0 --fork-runs 1 --fork-count 2 --server-wait 1800 \\
      --json bench/results/fc.json; cat bench/results/fc.json'
It starts its own server in a temporary directory under --data-dir (made reflink-capable
with scripts/data-fs, as the test suite's is) unless --url/--key are given; the bare
baselines then need --server-home (the server's data directory) to find the template.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agentenv.config import Config
from bench.bare_firecracker import bench_bare_firecracker
from bench.bare_qemu import bench_bare
from tests.helpers import ServerProcess, cleanup_host, netns_names, run_command, vmm_pids

ROOT = Path(__file__).resolve().parent.parent

# The targets for the median, in ms (the fork one is for 16 children).
TARGETS_MS: dict[str, float] = {
    "resume_to_running": 35,
    "pause": 50,
    "snapshot_after_1gib": 100,
    "fork_to_all_answering": 400,
}
TARGET_FORK_COUNT = 16
# The metrics each step of run_all measures (a step the VMM cannot do has none of them).
STEP_METRICS: dict[str, tuple[str, ...]] = {
    "snapshots": ("snapshot_after_0_bytes", "write_1gib_in_guest", "snapshot_after_1gib"),
    "fork": ("fork_api", "fork_to_all_answering"),
}
BIG_WRITE_MIB = 1024


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
def api_client(url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=900, trust_env=False)


class NotSupported(RuntimeError):
    """The node's VMM cannot do what was asked, as the API said."""


# How the API says a VMM cannot do something: 501, or (until every such refusal is one)
# a 500 naming what the VMM lacks, as "snapshots and forks need a VMM that can seal a
# running disk; firecracker cannot".
_UNSUPPORTED_PHRASE = "need a VMM that can"


def expect(response: httpx.Response, status: int) -> httpx.Response:
    """``response`` if it has ``status``; anything else (an error, or 200 for a connect
    that did not resume) aborts the bench with the server's answer, as
    :class:`NotSupported` when it says the VMM cannot do it."""
    if response.status_code != status:
        request = response.request
        if response.status_code == 501 or (
            response.status_code >= 500 and _UNSUPPORTED_PHRASE in response.text
        ):
            raise NotSupported(f"{response.status_code} {response.text}")
        raise RuntimeError(
            f"{request.method} {request.url.path}: expected {status}, "
            f"got {response.status_code} {response.text}"
        )
    return response


def create_sandbox(c: httpx.Client, timeout: int = 3600) -> dict[str, Any]:
    body: dict[str, Any] = expect(
        c.post("/sandboxes", json={"templateID": "base", "timeout": timeout}), 201
    ).json()
    return body


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
            token = response.json().get("envdAccessToken") or ""
            result = run_command(url, sandbox_id, "echo ready", token=token)
            t2 = time.perf_counter()
            assert result.stdout == "ready\n", result
            k0 = time.perf_counter()
            c.delete(f"/sandboxes/{sandbox_id}").raise_for_status()
            k1 = time.perf_counter()
            results["create_to_running"].append(t1 - t0)
            results["create_to_first_output"].append(t2 - t0)
            results["kill"].append(k1 - k0)
    return results


def bench_pause_resume(url: str, key: str, runs: int) -> dict[str, list[float]]:
    """Pause/resume cycles on one sandbox: pause, connect (resumes), echo."""
    results: dict[str, list[float]] = {
        "pause": [],
        "resume_to_running": [],
        "resume_to_first_command": [],
    }
    with api_client(url, key) as c:
        sandbox = create_sandbox(c)
        sandbox_id, token = sandbox["sandboxID"], sandbox.get("envdAccessToken")
        try:
            run_command(url, sandbox_id, "echo ready", token=token)
            for _ in range(runs):
                p0 = time.perf_counter()
                expect(c.post(f"/sandboxes/{sandbox_id}/pause"), 204)
                p1 = time.perf_counter()
                r0 = time.perf_counter()
                expect(c.post(f"/sandboxes/{sandbox_id}/connect", json={"timeout": 300}), 201)
                r1 = time.perf_counter()
                result = run_command(url, sandbox_id, "echo hi", token=token)
                r2 = time.perf_counter()
                assert result.stdout == "hi\n", result
                results["pause"].append(p1 - p0)
                results["resume_to_running"].append(r1 - r0)
                results["resume_to_first_command"].append(r2 - r0)
        finally:
            c.delete(f"/sandboxes/{sandbox_id}")
    return results


def _snapshot(c: httpx.Client, sandbox_id: str) -> float:
    """Seconds to take a snapshot of ``sandbox_id``; the snapshot is deleted (untimed)."""
    t0 = time.perf_counter()
    response = expect(c.post(f"/sandboxes/{sandbox_id}/snapshots", json={}), 201)
    t1 = time.perf_counter()
    expect(c.delete(f"/snapshots/{response.json()['snapshotID']}"), 204)
    return t1 - t0


def bench_snapshots(url: str, key: str, runs: int, big_runs: int) -> dict[str, list[float]]:
    """Snapshots with nothing written since the previous one (``runs``, one sandbox), and
    right after writing 1 GiB of new data to the disk (``big_runs``, another sandbox)."""
    results: dict[str, list[float]] = {
        "snapshot_after_0_bytes": [],
        "write_1gib_in_guest": [],
        "snapshot_after_1gib": [],
    }
    with api_client(url, key) as c:
        sandbox = create_sandbox(c)
        sandbox_id, token = sandbox["sandboxID"], sandbox.get("envdAccessToken")
        try:
            run_command(url, sandbox_id, "echo ready", token=token)
            for _ in range(runs):
                results["snapshot_after_0_bytes"].append(_snapshot(c, sandbox_id))
        finally:
            c.delete(f"/sandboxes/{sandbox_id}")
        if big_runs < 1:
            return results
        sandbox = create_sandbox(c)
        sandbox_id, token = sandbox["sandboxID"], sandbox.get("envdAccessToken")
        try:
            for i in range(big_runs):
                # A new file each run (the previous one removed first, so the disk has
                # room): 1 GiB of blocks the snapshot before did not have.
                command = (
                    "rm -f /home/user/big-* && "
                    f"dd if=/dev/zero of=/home/user/big-{i} bs=1M count={BIG_WRITE_MIB} "
                    "conv=fsync status=none && echo written"
                )
                w0 = time.perf_counter()
                result = run_command(url, sandbox_id, command, token=token, timeout=900)
                w1 = time.perf_counter()
                if result.stdout != "written\n":
                    raise RuntimeError(f"writing 1 GiB in the guest failed: {result}")
                results["write_1gib_in_guest"].append(w1 - w0)
                results["snapshot_after_1gib"].append(_snapshot(c, sandbox_id))
        finally:
            c.delete(f"/sandboxes/{sandbox_id}")
    return results


def sandbox_vmm_pids(home: Path | None, sandbox_id: str) -> list[int]:
    """The VMM process of ``sandbox_id``: the pid its driver recorded in the sandbox's
    ``vm.json`` (a jailed Firecracker's command line names no path of the server's), else
    the VMM whose command line names the sandbox's directory."""
    if home is not None:
        pids = []
        for record in (home / "sandboxes" / sandbox_id).glob("**/vm.json"):
            try:
                pid = int(json.loads(record.read_text())["pid"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if Path(f"/proc/{pid}").exists():
                pids.append(pid)
        if pids:
            return pids
    return vmm_pids(f"/sandboxes/{sandbox_id}/")


def _children_pss_kib(home: Path | None, children: list[str]) -> int:
    return sum(_pss_kib(pid) for child in children for pid in sandbox_vmm_pids(home, child))


def _answer(url: str, child: dict[str, Any]) -> tuple[str, float]:
    """``echo hi`` in a fork child: its output and when it arrived."""
    token = child.get("envdAccessToken")
    # Generous: N cold children share two cores under TCG.
    result = run_command(url, child["sandboxID"], "echo hi", token=token, timeout=300)
    return result.stdout, time.perf_counter()


def bench_fork(
    url: str, key: str, home: Path | None, runs: int, count: int, settle: float = 3.0
) -> tuple[dict[str, list[float]], dict[str, list[float]], list[str]]:
    """Fork one running sandbox into ``count`` children, ``runs`` times. Returns the
    latencies, the children's memory (PSS per idle child, MiB) and the errors of
    children that did not start."""
    results: dict[str, list[float]] = {"fork_api": [], "fork_to_all_answering": []}
    memory: dict[str, list[float]] = {
        "fork_child_pss_mib": [],
        "fork_children_pss_mib": [],
        # Seconds from the fork request until each child answered (sorted per run).
        "fork_child_answered_s": [],
    }
    errors: list[str] = []
    with api_client(url, key) as c:
        parent = create_sandbox(c)
        parent_id = parent["sandboxID"]
        try:
            run_command(url, parent_id, "echo ready", token=parent.get("envdAccessToken"))
            for _ in range(runs):
                t0 = time.perf_counter()
                response = expect(
                    c.post(f"/sandboxes/{parent_id}/fork", json={"count": count}), 201
                )
                t1 = time.perf_counter()
                items = response.json()
                children = [item["sandbox"] for item in items if item.get("sandbox")]
                errors += [str(item["error"]) for item in items if item.get("error")]
                try:
                    with ThreadPoolExecutor(max_workers=max(1, len(children))) as pool:
                        answers = list(pool.map(lambda child: _answer(url, child), children))
                    t2 = time.perf_counter()
                    assert [out for out, _ in answers] == ["hi\n"] * len(children), answers
                    memory["fork_child_answered_s"] += sorted(at - t0 for _, at in answers)
                    results["fork_api"].append(t1 - t0)
                    if len(children) == count:
                        results["fork_to_all_answering"].append(t2 - t0)
                    if children:
                        time.sleep(settle)
                        total = _children_pss_kib(home, [ch["sandboxID"] for ch in children]) / 1024
                        memory["fork_children_pss_mib"].append(total)
                        memory["fork_child_pss_mib"].append(total / len(children))
                finally:
                    for child in children:
                        c.delete(f"/sandboxes/{child['sandboxID']}")
        finally:
            c.delete(f"/sandboxes/{parent_id}")
    return results, memory, errors


def _pss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return 0


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def idle_cost(url: str, key: str, home: Path | None, seconds: float = 5.0) -> dict[str, float]:
    """Host memory (PSS) and CPU of one idle sandbox's VMM."""
    with httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=120, trust_env=False) as c:
        sandbox_id = c.post("/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
        try:
            run_command(url, sandbox_id, "true")
            (pid,) = sandbox_vmm_pids(home, sandbox_id)
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


def leftovers(url: str, key: str, home: Path | None) -> dict[str, Any]:
    """What is still there after the bench deleted everything it made."""
    with api_client(url, key) as c:
        sandboxes = [s["sandboxID"] for s in c.get("/sandboxes").json()]
        snapshots = [s["snapshotID"] for s in c.get("/snapshots").json()]
    found: dict[str, Any] = {"sandboxes": sandboxes, "snapshots": snapshots}
    if home is not None:
        found["vmm_pids"] = vmm_pids(str(home))
        prefix = f"ae{Config.load(env={}, home=home).instance_tag}-"
        found["netns"] = sorted(n for n in netns_names() if n.startswith(prefix))
        for name in ("sandboxes", "snapshots"):
            directory = home / name
            found[f"{name}_dir_entries"] = (
                sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
            )
    return found


def log_problems(log: Path, limit: int = 50) -> list[str]:
    """The server log's warnings, errors and tracebacks."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    marks = (" WARNING ", " ERROR ", " CRITICAL ", "Traceback")
    return [line for line in lines if any(m in line for m in marks)][:limit]


def print_table(
    summary: dict[str, dict[str, float]],
    baseline: dict[str, str],
    targets: dict[str, float] | None = None,
    *,
    unsupported: dict[str, str] | None = None,
    width: int = 28,
) -> None:
    """One row per metric measured; ``unsupported`` metrics (of the step named) get a
    "not supported" row instead."""
    target_head = f"{'target':>8}{'met':>5}" if targets is not None else ""
    header = (
        f"{'metric':<{width}}{'n':>4}{'p50 ms':>10}{'p90 ms':>10}{'min':>9}{'max':>9}"
        f"{target_head}  ratio"
    )
    print(header)
    print("-" * len(header))
    for name, s in summary.items():
        ratio = ""
        if name in baseline and baseline[name] in summary:
            ratio = f"{s['p50_ms'] / summary[baseline[name]]['p50_ms']:.2f}x {baseline[name]}"
        target = ""
        if targets is not None:
            if name in targets:
                met = "yes" if s["p50_ms"] <= targets[name] else "NO"
                target = f"{'<=' + format(targets[name], 'g'):>8}{met:>5}"
            else:
                target = " " * 13
        print(
            f"{name:<{width}}{s['n']:>4}{s['p50_ms']:>10.1f}{s['p90_ms']:>10.1f}"
            f"{s['min_ms']:>9.1f}{s['max_ms']:>9.1f}{target}  {ratio}"
        )
    for name, step in (unsupported or {}).items():
        if name not in summary:
            print(f"{name:<{width}}   -  not supported by the node's VMM ({step} step)")


def reflink_capable(directory: Path) -> bool:
    probe = directory / f".reflink-probe-{os.getpid()}"
    clone = probe.with_name(probe.name + ".clone")
    try:
        probe.write_bytes(b"\0" * 4096)
        return (
            subprocess.run(
                ["cp", "--reflink=always", str(probe), str(clone)], capture_output=True
            ).returncode
            == 0
        )
    finally:
        probe.unlink(missing_ok=True)
        clone.unlink(missing_ok=True)


def prepare_data_dir(directory: Path) -> bool:
    """``directory`` on a reflink-capable filesystem where possible (scripts/data-fs, as
    scripts/test does for the test suite); whether it is."""
    directory.mkdir(parents=True, exist_ok=True)
    if not reflink_capable(directory) and (ROOT / "scripts" / "data-fs").exists():
        subprocess.run([str(ROOT / "scripts" / "data-fs"), str(directory), "64G"], check=False)
    reflinks = reflink_capable(directory)
    if not reflinks:
        print(
            f"warning: {directory} cannot reflink: sandbox RAM is a private mapping and "
            "pause/snapshot stream it",
            file=sys.stderr,
        )
    return reflinks


def node_mode(url: str, key: str) -> dict[str, str]:
    """The node's VMM and accelerator, from ``GET /health`` (with the key: without one it
    says only that the node is up), and the baseline for them."""
    with api_client(url, key) as c:
        health = c.get("/health").json()
    vmm, accel = str(health.get("vmm")), str(health.get("accel"))
    baseline = "bare Firecracker" if vmm == "firecracker" else f"bare QEMU ({accel})"
    return {"vmm": vmm, "accel": accel, "baseline": baseline}


def checked_snapshot(snapshot_dir: Path, mode: dict[str, str]) -> Path:
    """``snapshot_dir`` once its manifest says it was saved in the node's ``mode`` (the
    bare VMM restores it with the VMM and accelerator it records)."""
    files = json.loads((snapshot_dir / "snapshot.json").read_text())["files"]
    saved = (files.get("driver"), files.get("accel"))
    if saved != (mode["vmm"], mode["accel"]):
        raise RuntimeError(
            f"template {snapshot_dir} was saved under {saved[0]}/{saved[1]}; "
            f"the node runs {mode['vmm']}/{mode['accel']}"
        )
    return snapshot_dir


def run_all(
    args: argparse.Namespace, url: str, key: str, home: Path | None, scratch: Path | None
) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Every measurement; the raw seconds per metric and everything else for the JSON.
    ``home`` is the server's data directory (the baselines need its template), the bare
    QEMUs' files go to ``scratch``."""
    raw: dict[str, list[float]] = {}
    memory: dict[str, list[float]] = {}
    info: dict[str, Any] = {
        "mode": node_mode(url, key),
        "failures": {},
        "not_supported": {},
        "fork_errors": [],
        "idle": {},
    }

    def step(name: str, work: Callable[[], Any]) -> Any:
        """``work()``; a failure is reported and recorded, and the other parts go on; a
        step the VMM cannot do is recorded as not supported."""
        print(f"... {name}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            out = work()
        except NotSupported as exc:
            print(f"    {name} not supported: {exc}", file=sys.stderr, flush=True)
            info["not_supported"][name] = str(exc)
            return None
        except Exception as exc:
            print(f"    {name} FAILED: {exc!r}", file=sys.stderr, flush=True)
            info["failures"][name] = repr(exc)
            return None
        print(f"    {name} done in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
        return out

    raw |= step("create/kill", lambda: bench_api(url, key, args.runs)) or {}
    raw |= step("pause/resume", lambda: bench_pause_resume(url, key, args.runs)) or {}
    raw |= step("snapshots", lambda: bench_snapshots(url, key, args.runs, args.big_runs)) or {}
    forked = step("fork", lambda: bench_fork(url, key, home, args.fork_runs, args.fork_count))
    if forked is not None:
        raw |= forked[0]
        memory |= forked[1]
        info["fork_errors"] = forked[2]
    info["idle"] = step("idle sandbox", lambda: idle_cost(url, key, home)) or {}
    if home is not None:
        template = home / "templates" / "base"
        snapshot_dirs = sorted(p for p in template.iterdir() if (p / "snapshot.json").exists())
        snapshot_dir = snapshot_dirs[-1]
        bare_bench = bench_bare_firecracker if info["mode"]["vmm"] == "firecracker" else bench_bare
        bare = step(
            info["mode"]["baseline"],
            lambda: bare_bench(
                checked_snapshot(snapshot_dir, info["mode"]),
                args.runs,
                args.fork_runs,
                args.fork_count,
                workdir=scratch,
            ),
        )
        if bare is not None:
            raw |= bare[0]
            memory |= bare[1]
    info["memory"] = memory
    info["leftovers"] = leftovers(url, key, home)
    return raw, info


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--big-runs", type=int, default=3, help="snapshots after 1 GiB written")
    parser.add_argument("--fork-runs", type=int, default=3)
    parser.add_argument("--fork-count", type=int, default=TARGET_FORK_COUNT)
    parser.add_argument("--json", type=Path, default=Path("bench/results/lifecycle.json"))
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=Path(os.environ.get("AENV_TEST_DIR", "/var/tmp/agentenv-tests")),
        help="where the bench's own server keeps its data (made reflink-capable)",
    )
    parser.add_argument("--url", help="an already running server instead of our own")
    parser.add_argument("--key", help="its API key (with --url)")
    parser.add_argument(
        "--server-home", type=Path, help="its data directory (with --url; for the baselines)"
    )
    parser.add_argument(
        "--server-wait",
        type=float,
        default=600.0,
        help="seconds our server may take to build its base template (nested: far longer)",
    )
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/lifecycle.py must run as root")
    if not 1 <= args.fork_count <= 20:
        sys.exit("--fork-count must be between 1 and 20")
    if bool(args.url) != bool(args.key):
        sys.exit("--url and --key go together")

    problems: list[str] = []
    reflinks: bool | None = None
    if args.url:
        raw, info = run_all(args, args.url, args.key, args.server_home, None)
    else:
        reflinks = prepare_data_dir(args.data_dir)
        home = Path(tempfile.mkdtemp(prefix="aenv-bench-", dir=args.data_dir))
        server = ServerProcess(home=home / "node")
        try:
            server.spawn()
            # Polled every few seconds: nested, each poll takes CPU from the template boot.
            server.wait_ready(args.server_wait, poll_every=3.0, request_timeout=30.0)
            raw, info = run_all(args, server.url, server.api_key, server.home, home)
        finally:
            server.stop()
            cleanup_host(server.home)
            problems = log_problems(server.log_path)
            log_copy = args.json.with_suffix(".server.log")
            log_copy.parent.mkdir(parents=True, exist_ok=True)
            if server.log_path.exists():
                shutil.copyfile(server.log_path, log_copy)
            shutil.rmtree(home, ignore_errors=True)

    summary = {name: summarize(values) for name, values in raw.items() if values}
    baseline = {
        "create_to_running": "bare_restore_to_running",
        "kill": "bare_kill",
        "pause": "bare_pause",
        "resume_to_running": "bare_resume_to_running",
        "fork_api": "bare_fork_to_running",
        "fork_to_all_answering": "bare_fork_to_running",
    }
    targets = dict(TARGETS_MS)
    if args.fork_count != TARGET_FORK_COUNT:
        del targets["fork_to_all_answering"]  # the target is for 16 children
    mode = info["mode"]
    print(
        f"\nnode {mode['vmm']}/{mode['accel']}, baseline {mode['baseline']}; "
        f"fork count {args.fork_count}; data directory reflinks: {reflinks}"
    )
    unsupported = {
        metric: step
        for step, metrics in STEP_METRICS.items()
        if step in info["not_supported"]
        for metric in metrics
    }
    print_table(summary, baseline, targets, unsupported=unsupported)
    met = {
        name: {
            "target_ms": target,
            "p50_ms": summary[name]["p50_ms"] if name in summary else None,
            "met": name in summary and summary[name]["p50_ms"] <= target,
        }
        for name, target in targets.items()
    }

    memory = info["memory"]
    idle = info["idle"]
    if idle:
        print(
            f"\nidle sandbox: VMM PSS {idle['idle_vmm_pss_mib']:.0f} MiB, "
            f"CPU {idle['idle_vmm_cpu_percent']:.1f}% of one core"
        )
    if memory.get("fork_child_pss_mib"):
        line = (
            f"idle fork child (of {args.fork_count}): VMM PSS "
            f"{_median(memory['fork_child_pss_mib']):.0f} MiB each "
            f"({_median(memory['fork_children_pss_mib']):.0f} MiB for all)"
        )
        if memory.get("bare_fork_child_pss_mib"):
            line += f"; bare QEMU restore {_median(memory['bare_fork_child_pss_mib']):.0f} MiB"
        print(line)
    if memory.get("fork_child_answered_s"):
        answered = memory["fork_child_answered_s"]
        print(
            f"fork children answered {min(answered) * 1000:.0f} to "
            f"{max(answered) * 1000:.0f} ms after the fork request"
        )
    if memory.get("bare_pause_state_bytes"):
        print(f"bare pause state file: {_median(memory['bare_pause_state_bytes']) / 1024:.0f} KiB")
    if memory.get("bare_pause_memory_bytes"):
        size = _median(memory["bare_pause_memory_bytes"]) / 2**20
        print(f"bare pause RAM image: {size:.0f} MiB")
    if info["fork_errors"]:
        print(f"\nfork: {len(info['fork_errors'])} children failed: {info['fork_errors'][:3]}")
    left = {k: v for k, v in info["leftovers"].items() if v}
    if left:
        print(f"\nleft over after the bench: {left}")
    if info["not_supported"]:
        print(f"\nnot supported by {mode['vmm']}: {info['not_supported']}")
    if info["failures"]:
        print(f"\nFAILED parts (their rows are missing): {info['failures']}")
    if problems:
        print(f"\nserver log: {len(problems)} warnings/errors, first: {problems[:5]}")

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "runs": args.runs,
                "big_runs": args.big_runs,
                "fork_runs": args.fork_runs,
                "fork_count": args.fork_count,
                "mode": mode,
                "reflinks": reflinks,
                "summary": summary,
                "targets": met,
                "idle": idle,
                "memory": memory,
                "failures": info["failures"],
                "not_supported": info["not_supported"],
                "fork_errors": info["fork_errors"],
                "leftovers": info["leftovers"],
                "server_log_problems": problems,
                "raw_seconds": raw,
            },
            indent=2,
        )
    )
    print(f"\nwritten {args.json}")


if __name__ == "__main__":
    main()
