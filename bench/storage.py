"""Layered storage and the snapshot repository, through the HTTP API of two live nodes
sharing one repository (a posix directory, then S3), against baselines in the same run.

Measured (``--runs`` times unless noted; the 1 GiB rows ``--big-runs`` times):
  seal                        the ``seal`` phase of a snapshot (server log)
                              baseline: ``cp --reflink=always`` of the sandbox's disk top
  capture after X             the server's ``taken in N ms`` for a snapshot taken after X
                              (0, 100 MiB, 1 GiB) of new data was written in the guest
                              since the previous snapshot
  commit after X (server)     the server's own ``committed ... in N ms``
  commit after X (visible)    POST /sandboxes/{id}/snapshots until the second node answers
                              200 for the snapshot; baseline of both: capture after X
  restore cold after X        on the second node, create from a snapshot it never fetched
                              (the fetch into its cache included), snapshots in the order
                              they were taken, so each fetch is of that snapshot's own
                              layer, RAM and state; baseline: restore warm (the same again)
  repository growth after X   bytes the repository grew by per snapshot (posix: ``du -sb``;
                              S3: the objects' sizes)
  disk beyond shared layers   bytes of a sandbox's directory in extents shared with nothing
                              else (FIEMAP), just created / after writing 100 MiB in it /
                              after a snapshot of that; baseline: the template's allocated
                              bytes with its disk's backing chain (a full copy)
Each backend starts with one untimed snapshot (committed, then restored on the second
node) that pushes and fetches what every later one shares (the template's RAM and disk
layers); its figures are reported on their own as ``first commit``/``first restore``.

Usage (as root):
  .venv/bin/python bench/storage.py [--runs 3] [--big-runs 1] [--skip-s3]
      [--data-dir /var/tmp/agentenv-tests] [--json bench/results/storage.json]
Figures on a shared 2-core host are noisy: read medians and ratios, not single runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agentenv.snapshots.layout import MachineSnapshot
from agentenv.storage.extents import unshared_bytes
from agentenv.storage.images import backing_chain
from bench.lifecycle import (
    api_client,
    expect,
    log_problems,
    percentile,
    prepare_data_dir,
    print_table,
    summarize,
)
from tests.helpers import ServerProcess, live_server, netns_names, run_command, vmm_pids
from tests.s3server import S3Server, start_s3_server

MIB = 1024 * 1024
# New data written in the guest before a snapshot: label → MiB.
WRITES = {"0": 0, "100MiB": 100, "1GiB": 1024}
RESTORED = ("0", "100MiB")  # the snapshots restored cold and warm on the second node
POLL_S = 0.02
SERVERS: list[ServerProcess] = []  # every server started, for their logs
DIED: dict[str, int] = {}  # servers that exited during the bench: their exit codes


# -- bytes on disk ------------------------------------------------------------------
def _files(directory: Path) -> Iterator[Path]:
    """Regular files under ``directory``, each inode once."""
    seen: set[tuple[int, int]] = set()
    for path in sorted(directory.rglob("*")):
        with contextlib.suppress(FileNotFoundError):
            st = path.lstat()
            if path.is_symlink() or not path.is_file() or (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            yield path


def unshared_tree_bytes(directory: Path) -> int:
    # Written back everywhere first: a clone's pending writes unshare the other side too.
    os.sync()
    total = 0
    for path in _files(directory):
        with contextlib.suppress(FileNotFoundError):
            total += unshared_bytes(path)
    return total


def allocated_bytes(paths: list[Path]) -> int:
    return sum(p.stat().st_blocks * 512 for p in paths)


def du_bytes(directory: Path) -> int:
    """Apparent size of ``directory`` as ``du -sb`` counts it."""
    if not directory.exists():
        return 0
    out = subprocess.run(["du", "-sb", str(directory)], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0])


def s3_bytes(s3: S3Server, url: str) -> int:
    """Sum of the sizes of the objects under the repository's prefix."""
    import boto3
    import botocore.config

    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    client = boto3.session.Session().client(
        "s3",
        endpoint_url=s3.env["AWS_ENDPOINT_URL"],
        aws_access_key_id=s3.env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=s3.env["AWS_SECRET_ACCESS_KEY"],
        region_name=s3.env["AWS_REGION"],
        config=botocore.config.Config(s3={"addressing_style": "path"}),
    )
    total = 0
    try:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        for page in pages:
            total += sum(int(item["Size"]) for item in page.get("Contents", []))
    except client.exceptions.NoSuchBucket:
        return 0  # the first commit makes it
    return total


# -- one node -----------------------------------------------------------------------
class Node:
    """A live server and an API client for it."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.home = server.home
        self.client = api_client(server.url, server.api_key)

    def create(self, template: str = "base") -> str:
        response = self.client.post("/sandboxes", json={"templateID": template, "timeout": 3600})
        return str(expect(response, 201).json()["sandboxID"])

    def kill(self, sandbox_id: str) -> None:
        expect(self.client.delete(f"/sandboxes/{sandbox_id}"), 204)

    def sh(self, sandbox_id: str, command: str) -> str:
        result = run_command(self.server.url, sandbox_id, command, timeout=900)
        if result.exit_code != 0:
            raise RuntimeError(f"{command!r} exited with {result.exit_code}: {result.stderr}")
        return result.stdout

    def write(self, sandbox_id: str, name: str, mib: int) -> float:
        """Seconds to write ``mib`` MiB of new (random) data to a file in the guest."""
        t0 = time.perf_counter()
        self.sh(sandbox_id, f"head -c {mib}M /dev/urandom > /home/user/{name}; sync")
        return time.perf_counter() - t0

    def snapshot(self, sandbox_id: str) -> tuple[str, float]:
        t0 = time.perf_counter()
        response = self.client.post(f"/sandboxes/{sandbox_id}/snapshots", json={})
        return str(expect(response, 201).json()["snapshotID"]), time.perf_counter() - t0

    def sees(self, snapshot_id: str) -> bool:
        response = self.client.get(f"/snapshots/{snapshot_id}")
        if response.status_code not in (200, 404):
            expect(response, 200)
        return response.status_code == 200

    def cache_used(self) -> int:
        health = self.client.get("/health").json()
        return int((health.get("cache") or {}).get("usedBytes", 0))

    def log_match(self, pattern: str, timeout: float = 900) -> re.Match[str]:
        """The first server log line matching ``pattern``, waiting for it."""
        compiled = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            found = compiled.search(self.server.log_path.read_text(errors="replace"))
            if found:
                return found
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.server.log_path}: no line matching {pattern!r}")
            time.sleep(POLL_S)

    def taken(self, snapshot_id: str) -> dict[str, float]:
        """The snapshot's ``taken in N ms (phase a, ...)``, in seconds: total and phases."""
        found = self.log_match(rf"snapshot {snapshot_id} taken in (\d+) ms \(([^)]*)\)")
        phases = {"total": int(found.group(1)) / 1000}
        for name, ms in re.findall(r"(\w+) (\d+)", found.group(2)):
            phases[name] = int(ms) / 1000
        return phases

    def committed(self, snapshot_id: str) -> float:
        found = self.log_match(rf"snapshot {snapshot_id} committed to \S+ in (\d+) ms")
        return int(found.group(1)) / 1000

    def pause_reshared(self, sandbox_id: str, timeout: float = 900) -> None:
        """Pause, then wait until the RAM file is reshared and the upload is done (its
        frozen copy, which keeps the old blocks, removed)."""
        expect(self.client.post(f"/sandboxes/{sandbox_id}/pause"), 204)
        self.log_match(rf"sandbox {sandbox_id} \(paused\): RAM file shares", timeout)
        deadline = time.monotonic() + timeout
        while (
            not expect(self.client.get(f"/sandboxes/{sandbox_id}"), 200)
            .json()
            .get("pauseCommitted")
        ):
            if time.monotonic() > deadline:
                raise RuntimeError(f"sandbox {sandbox_id}: pause not committed in {timeout}s")
            time.sleep(POLL_S)

    def disk_top(self, sandbox_id: str) -> Path:
        """The sandbox's writable disk image (the one its VMM has open)."""
        workdir = self.home / "sandboxes" / sandbox_id
        tops = [p for p in workdir.glob("disk*.qcow2") if p.is_file()]
        return max(tops, key=lambda p: p.stat().st_mtime_ns)

    def close(self) -> None:
        self.client.close()


@contextlib.contextmanager
def node_pair(root: Path, backend: str, env: dict[str, str]) -> Iterator[tuple[Node, Node]]:
    """Two servers (homes of their own) sharing the repository in ``env``."""
    servers = [
        ServerProcess(
            home=root / f"{backend}-{n}", extra_env={**env, "AENV_NODE_ID": f"{backend}-{n}"}
        )
        for n in ("a", "b")
    ]
    SERVERS.extend(servers)
    with live_server(servers[0]), live_server(servers[1]):
        nodes = (Node(servers[0]), Node(servers[1]))
        try:
            yield nodes
        finally:
            for node in nodes:
                node.close()
            for server in servers:
                code = server.proc.poll() if server.proc is not None else None
                if code is not None:  # it should still be serving
                    DIED[server.home.name] = code
                    print(f"    server {server.home.name} exited with {code}", file=sys.stderr)


# -- the measurements ---------------------------------------------------------------
class Results:
    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}
        self.sizes: dict[str, list[int]] = {}
        self.info: dict[str, Any] = {"failures": {}}

    def time(self, name: str, seconds: float) -> None:
        self.times.setdefault(name, []).append(seconds)

    def size(self, name: str, value: int) -> None:
        self.sizes.setdefault(name, []).append(value)


def reflink_copy_seconds(source: Path, scratch: Path) -> float:
    """Seconds ``cp --reflink=always`` takes to clone ``source`` (the clone is removed)."""
    target = scratch / f"clone-{source.name}"
    try:
        t0 = time.perf_counter()
        subprocess.run(["cp", "--reflink=always", str(source), str(target)], check=True)
        return time.perf_counter() - t0
    finally:
        target.unlink(missing_ok=True)


def bench_backend(
    backend: str,
    a: Node,
    b: Node,
    repository_bytes: Callable[[], int],
    scratch: Path,
    args: argparse.Namespace,
    out: Results,
) -> None:
    """Snapshots on node A after writing 0 / 100 MiB / 1 GiB, their commits as node B
    sees them, then cold and warm restores of them on B."""

    def take(sandbox_id: str) -> dict[str, Any]:
        """A snapshot, timed until B sees it; the log's figures; the repository growth."""
        before = repository_bytes()
        snapshot_id, api = a.snapshot(sandbox_id)
        t0 = time.perf_counter() - api
        while not b.sees(snapshot_id):
            time.sleep(POLL_S)
        visible = time.perf_counter() - t0
        return {
            "id": snapshot_id,
            "api": api,
            "visible": visible,
            "taken": a.taken(snapshot_id),
            "committed": a.committed(snapshot_id),
            "growth": repository_bytes() - before,
        }

    sandbox_id = a.create()
    restore: list[tuple[str, str]] = []  # (label, snapshot id), in the order taken
    try:
        a.sh(sandbox_id, "echo ready")
        first = take(sandbox_id)
        out.time(f"{backend} first commit (template layers too)", first["committed"])
        out.size(f"{backend} repository growth, first snapshot", first["growth"])
        restore.append(("first", first["id"]))
        for label, mib in WRITES.items():
            for _ in range(args.big_runs if mib >= 1024 else args.runs):
                if mib:
                    # Rewritten: every block is new to the top made by the last snapshot.
                    name = f"data-{label}"
                    out.time(f"{backend} write {label} in guest", a.write(sandbox_id, name, mib))
                out.time(
                    f"{backend} reflink copy of disk top",
                    reflink_copy_seconds(a.disk_top(sandbox_id), scratch),
                )
                snap = take(sandbox_id)
                out.time(f"{backend} seal", snap["taken"].get("seal", float("nan")))
                out.time(f"{backend} capture after {label}", snap["taken"]["total"])
                out.time(f"{backend} capture after {label} (API)", snap["api"])
                out.time(f"{backend} commit after {label} (server)", snap["committed"])
                out.time(f"{backend} commit after {label} (visible)", snap["visible"])
                out.size(f"{backend} repository growth after {label}", snap["growth"])
                if label in RESTORED:
                    restore.append((label, snap["id"]))
    finally:
        a.kill(sandbox_id)

    for label, snapshot_id in restore:
        cache0 = b.cache_used()
        for kind in ("cold", "warm"):
            t0 = time.perf_counter()
            child = b.create(snapshot_id)
            elapsed = time.perf_counter() - t0
            b.kill(child)
            if kind == "warm":
                out.time(f"{backend} restore warm", elapsed)
            elif label == "first":
                out.time(f"{backend} first restore (template layers too)", elapsed)
            else:
                out.time(f"{backend} restore cold after {label}", elapsed)
        fetched = b.cache_used() - cache0
        if label == "first":
            out.size(f"{backend} node cache growth, first restore", fetched)
        else:
            out.size(f"{backend} node cache growth per cold restore after {label}", fetched)


def bench_disk_space(a: Node, args: argparse.Namespace, out: Results) -> None:
    """Unshared bytes of a sandbox's directory: just created, after 100 MiB written,
    after a snapshot of that, paused (its RAM file reshared with the template's); of the
    snapshot's directory once the sandbox is gone; and of an idle sandbox before and after
    a pause."""
    manifests = sorted((a.home / "templates" / "base").glob("*/snapshot.json"))
    template_dir = manifests[-1].parent
    template_files = list(_files(template_dir))
    chain = backing_chain(MachineSnapshot.load(template_dir).disk)
    below = [p for p in chain if p.parent != template_dir]
    out.size("template dir allocated", allocated_bytes(template_files))
    full_copy = allocated_bytes(template_files + below)
    for _ in range(args.runs):
        out.size("template + its disk chain allocated (a full copy)", full_copy)
        sandbox_id = a.create()
        workdir = a.home / "sandboxes" / sandbox_id
        try:
            a.sh(sandbox_id, "echo ready")
            out.size("sandbox just created: unshared", unshared_tree_bytes(workdir))
            out.size(
                "sandbox just created: allocated incl. shared",
                allocated_bytes(list(_files(workdir))),
            )
            a.write(sandbox_id, "data-100MiB", 100)
            out.size("after writing 100 MiB: unshared", unshared_tree_bytes(workdir))
            snapshot_id, _ = a.snapshot(sandbox_id)
            out.size("after a snapshot of that: unshared", unshared_tree_bytes(workdir))
            local = a.home / "snapshots" / snapshot_id
            if local.is_dir():
                out.size("  that snapshot's own dir: unshared", unshared_tree_bytes(local))
            a.committed(snapshot_id)  # its commit reads the files: not under the next run
            a.log_match(rf"snapshot {snapshot_id}: RAM file shares")
            a.pause_reshared(sandbox_id)
            out.size("paused, RAM file reshared: unshared", unshared_tree_bytes(workdir))
        finally:
            a.kill(sandbox_id)
        if local.is_dir():
            # What the snapshot costs for as long as it is kept.
            out.size("  that snapshot's dir, sandbox gone: unshared", unshared_tree_bytes(local))
        # A sandbox that only started: what a pause leaves once its RAM file is reshared.
        idle = a.create()
        try:
            a.sh(idle, "echo ready")
            workdir = a.home / "sandboxes" / idle
            out.size("idle sandbox before pause: unshared", unshared_tree_bytes(workdir))
            a.pause_reshared(idle)
            out.size("idle sandbox paused, reshared: unshared", unshared_tree_bytes(workdir))
        finally:
            a.kill(idle)


# -- output -------------------------------------------------------------------------
def print_sizes(sizes: dict[str, list[int]], baseline: str) -> None:
    width = max([44, *(len(name) + 2 for name in sizes)])
    header = f"{'bytes':<{width}}{'n':>4}{'median MiB':>12}{'p90 MiB':>10}{'max MiB':>10}  ratio"
    print(header)
    print("-" * len(header))
    base = statistics.median(sizes[baseline]) if sizes.get(baseline) else None
    for name, values in sizes.items():
        median = statistics.median(values)
        ratio = ""
        if base and name != baseline and not name.startswith(("posix", "s3", "template")):
            ratio = f"{median / base:.3f}x full copy"
        print(
            f"{name:<{width}}{len(values):>4}{median / MIB:>12.1f}"
            f"{percentile([float(v) for v in values], 0.9) / MIB:>10.1f}"
            f"{max(values) / MIB:>10.1f}  {ratio}"
        )


def baselines(times: dict[str, list[float]]) -> dict[str, str]:
    baseline: dict[str, str] = {}
    for backend in ("posix", "s3"):
        baseline[f"{backend} seal"] = f"{backend} reflink copy of disk top"
        baseline[f"{backend} first restore (template layers too)"] = f"{backend} restore warm"
        for label in WRITES:
            for kind in ("server", "visible"):
                baseline[f"{backend} commit after {label} ({kind})"] = (
                    f"{backend} capture after {label}"
                )
            baseline[f"{backend} restore cold after {label}"] = f"{backend} restore warm"
    return {k: v for k, v in baseline.items() if k in times}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--big-runs", type=int, default=1, help="snapshots after 1 GiB written")
    parser.add_argument("--skip-s3", action="store_true", help="the posix repository only")
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=Path(os.environ.get("AENV_TEST_DIR", "/var/tmp/agentenv-tests")),
        help="where the bench's servers keep their data (made reflink-capable)",
    )
    parser.add_argument("--json", type=Path, default=Path("bench/results/storage.json"))
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/storage.py must run as root")
    if args.runs < 1 or args.big_runs < 0:
        sys.exit("--runs must be at least 1 and --big-runs at least 0")

    reflinks = prepare_data_dir(args.data_dir)
    root = Path(tempfile.mkdtemp(prefix="aenv-bench-storage-", dir=args.data_dir))
    scratch = root / "scratch"
    scratch.mkdir()
    out = Results()
    started = time.perf_counter()

    def step(name: str, work: Callable[[], Any]) -> None:
        """``work()``; a failure is reported and recorded, and the other parts go on."""
        print(f"... {name}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            work()
        except Exception as exc:
            print(f"    {name} FAILED: {exc!r}", file=sys.stderr, flush=True)
            out.info["failures"][name] = repr(exc)
            return
        print(f"    {name} done in {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)

    def posix() -> None:
        repository = root / "repository"
        with node_pair(root, "posix", {"AENV_REPOSITORY": repository.as_uri()}) as (a, b):
            step(
                "posix repository",
                lambda: bench_backend(
                    "posix", a, b, lambda: du_bytes(repository), scratch, args, out
                ),
            )
            step("disk space per sandbox", lambda: bench_disk_space(a, args, out))

    def s3() -> None:
        with start_s3_server(root / "s3") as server:
            url = server.url("bench")
            env = {**server.env, "AENV_REPOSITORY": url}
            with node_pair(root, "s3", env) as (a, b):
                step(
                    "S3 repository",
                    lambda: bench_backend(
                        "s3", a, b, lambda: s3_bytes(server, url), scratch, args, out
                    ),
                )

    problems: dict[str, list[str]] = {}
    try:
        step("posix nodes", posix)
        if not args.skip_s3:
            step("S3 nodes", s3)
    finally:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        for server in SERVERS:
            problems[server.home.name] = log_problems(server.log_path)
            if server.log_path.exists():
                shutil.copyfile(
                    server.log_path, args.json.with_suffix(f".{server.home.name}.server.log")
                )
        left = {
            "vmm_pids": vmm_pids(str(root)),
            "netns": sorted(
                n
                for n in netns_names()
                for s in SERVERS
                if n.startswith(f"ae{_instance_tag(s.home)}-")
            ),
        }
        shutil.rmtree(root, ignore_errors=True)

    summary = {name: summarize(values) for name, values in out.times.items() if values}
    print(
        f"\nrepositories: posix{'' if args.skip_s3 else ', S3 (SeaweedFS)'}; "
        f"data directory reflinks: {reflinks}; {time.perf_counter() - started:.0f}s in all"
    )
    print()
    print_table(summary, baselines(out.times), width=max(len(n) for n in summary) + 2)
    print()
    if out.sizes:
        print_sizes(out.sizes, "template + its disk chain allocated (a full copy)")
    problems = {k: v for k, v in problems.items() if v}
    if problems:
        print(f"\nserver log warnings/errors: { {k: v[:3] for k, v in problems.items()} }")
    if DIED:
        print(f"\nservers that died during the bench (exit codes): {DIED}")
    left = {k: v for k, v in left.items() if v}
    if left:
        print(f"\nleft over after the bench: {left}")
    if out.info["failures"]:
        print(f"\nFAILED parts (their rows are missing): {out.info['failures']}")
    args.json.write_text(
        json.dumps(
            {
                "runs": args.runs,
                "big_runs": args.big_runs,
                "skip_s3": args.skip_s3,
                "reflinks": reflinks,
                "summary": summary,
                "baselines": baselines(out.times),
                "bytes": out.sizes,
                "raw_seconds": out.times,
                "failures": out.info["failures"],
                "server_log_problems": problems,
                "leftovers": left,
                "servers_died": DIED,
            },
            indent=2,
        )
    )
    print(f"\nwritten {args.json}")


def _instance_tag(home: Path) -> str:
    from agentenv.config import Config

    return Config.load(env={}, home=home).instance_tag


if __name__ == "__main__":
    main()
