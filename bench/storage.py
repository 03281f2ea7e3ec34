"""Layered storage and the snapshot repository, through the HTTP API of two live nodes
sharing one repository (a posix directory, then S3), against baselines in the same run.

  seal                      the snapshot's disk seal (server log phase ``seal``)
                            baseline: ``cp --reflink=always`` of the sandbox's disk top
  capture after X           POST /sandboxes/{id}/snapshots until 201 (local capture)
  commit after X (server)   the server's own commit time (log: ``committed ... in N ms``)
  commit after X (visible)  POST until the second node answers 200 for the snapshot
                            baseline of both: the capture (X = 0, 100 MiB, 1 GiB of new
                            data written in the guest since the previous snapshot)
  restore cold / warm       create from a snapshot on the node that never saw it (fetch
                            into its cache), then again (warm); baseline: warm
  repository growth         bytes the repository grew by per snapshot
  disk beyond shared        bytes of a sandbox's directory in extents it shares with
                            nothing (FIEMAP), idle / after writing 100 MiB / after a
                            snapshot; baseline: the template's allocated bytes (a copy)

Usage (as root):
  .venv/bin/python bench/storage.py [--runs 3] [--big-runs 1] [--skip-s3]
      [--data-dir /var/tmp/agentenv-tests] [--json bench/results/storage.json]
Figures on a shared 2-core host are noisy: read medians and ratios, not single runs.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.lifecycle import api_client, expect, prepare_data_dir, print_table, summarize
from tests.helpers import ServerProcess, live_server, run_command
from tests.s3server import S3Server, start_s3_server

ROOT = Path(__file__).resolve().parent.parent
MIB = 1024 * 1024
SIZES = {"0": None, "100MiB": 100, "1GiB": 1024}

_FS_IOC_FIEMAP = 0xC020660B
_FIEMAP_FLAG_SYNC = 0x1
_FIEMAP_EXTENT_LAST = 0x1
_FIEMAP_EXTENT_SHARED = 0x2000
_EXTENTS_PER_CALL = 512


def unshared_bytes(path: Path) -> int:
    """Bytes of ``path`` in extents no other file shares (reflinks share theirs)."""
    total, start = 0, 0
    with open(path, "rb") as f:
        while True:
            # struct fiemap: start, length, flags, mapped extents, extent count, reserved;
            # then the struct fiemap_extent array (56 bytes each).
            header = struct.pack(
                "=QQLLLL", start, 2**64 - 1, _FIEMAP_FLAG_SYNC, 0, _EXTENTS_PER_CALL, 0
            )
            buf = bytearray(header + bytes(56 * _EXTENTS_PER_CALL))
            fcntl.ioctl(f.fileno(), _FS_IOC_FIEMAP, buf)
            mapped = struct.unpack_from("=L", buf, 20)[0]
            last = False
            for i in range(mapped):
                logical, _, length, _, _, flags = struct.unpack_from("=QQQQQL", buf, 32 + 56 * i)
                if not flags & _FIEMAP_EXTENT_SHARED:
                    total += length
                last = bool(flags & _FIEMAP_EXTENT_LAST)
                start = logical + length
            if mapped == 0 or last:
                return total


def tree_bytes(directory: Path, *, unshared: bool) -> int:
    total = 0
    seen: set[int] = set()
    for path in directory.rglob("*"):
        if not path.is_file() or path.is_symlink():
            continue
        st = path.stat()
        if st.st_ino in seen:
            continue
        seen.add(st.st_ino)
        total += unshared_bytes(path) if unshared else st.st_blocks * 512
    return total


class Node:
    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.client = api_client(server.url, server.api_key)

    def create(self, template: str = "base") -> str:
        body = expect(self.client.post("/sandboxes", json={"templateID": template}), 201).json()
        return str(body["sandboxID"])

    def kill(self, sandbox_id: str) -> None:
        expect(self.client.delete(f"/sandboxes/{sandbox_id}"), 204)

    def sh(self, sandbox_id: str, command: str) -> str:
        result = run_command(self.server.url, sandbox_id, command, timeout=600)
        if result.exit_code != 0:
            raise RuntimeError(f"{command!r} failed: {result.stderr}")
        return result.stdout

    def log_value(self, pattern: str, timeout: float = 600) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, self.server.log_path.read_text(errors="replace"))
            if found:
                return found
            time.sleep(0.05)
        raise RuntimeError(f"no log line matching {pattern!r}")


def repository_bytes(url: str, s3: S3Server | None) -> int:
    if url.startswith("file://"):
        return tree_bytes(Path(url.removeprefix("file://")), unshared=False)
    assert s3 is not None
    import boto3

    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    client = boto3.client(
        "s3",
        endpoint_url=s3.env["AWS_ENDPOINT_URL"],
        aws_access_key_id=s3.env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=s3.env["AWS_SECRET_ACCESS_KEY"],
        region_name=s3.env.get("AWS_REGION", "us-east-1"),
    )
    total = 0
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            total += sum(int(o["Size"]) for o in page.get("Contents", []))
    except client.exceptions.NoSuchBucket:
        return 0  # made by the first commit
    return total


def disk_top(home: Path, sandbox_id: str) -> Path:
    tops = sorted(
        (home / "sandboxes" / sandbox_id).glob("disk*.qcow2"), key=lambda p: p.stat().st_mtime
    )
    return tops[-1]


def bench_backend(
    backend: str, a: Node, b: Node, url: str, s3: S3Server | None, args: argparse.Namespace
) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """Snapshots on A after writing 0 / 100 MiB / 1 GiB, their commits, their first and
    second restores on B."""
    times: dict[str, list[float]] = {}
    sizes: dict[str, list[int]] = {}

    def add(name: str, seconds: float) -> None:
        times.setdefault(f"{backend} {name}", []).append(seconds)

    sandbox_id = a.create()
    snapshots: list[str] = []
    try:
        for label, mib in SIZES.items():
            runs = args.big_runs if label == "1GiB" else args.runs
            for _ in range(runs):
                if mib:
                    a.sh(sandbox_id, f"head -c {mib}M /dev/urandom > /home/user/data-{label}; sync")
                before = repository_bytes(url, s3)
                top = disk_top(a.server.home, sandbox_id)
                with tempfile.TemporaryDirectory(dir=top.parent) as scratch:
                    t0 = time.perf_counter()
                    subprocess.run(["cp", "--reflink=always", str(top), scratch], check=True)
                    add("reflink of disk top", time.perf_counter() - t0)
                t0 = time.perf_counter()
                r = expect(a.client.post(f"/sandboxes/{sandbox_id}/snapshots", json={}), 201)
                captured = time.perf_counter() - t0
                snapshot_id = r.json()["snapshotID"]
                while b.client.get(f"/snapshots/{snapshot_id}").status_code != 200:
                    time.sleep(0.05)
                visible = time.perf_counter() - t0
                taken = a.log_value(rf"snapshot {snapshot_id} taken in \d+ ms \(([^)]*)\)")
                seal = re.search(r"seal (\d+)", taken.group(1))
                committed = a.log_value(rf"snapshot {snapshot_id} committed to \S+ in (\d+) ms")
                add("seal", int(seal.group(1)) / 1000 if seal else float("nan"))
                add(f"capture after {label}", captured)
                add(f"commit after {label} (server)", int(committed.group(1)) / 1000)
                add(f"commit after {label} (visible)", visible)
                sizes.setdefault(f"{backend} repository growth after {label}", []).append(
                    repository_bytes(url, s3) - before
                )
                snapshots.append(snapshot_id)
    finally:
        a.kill(sandbox_id)
    for snapshot_id in snapshots[: args.runs]:
        for kind in ("cold", "warm"):
            t0 = time.perf_counter()
            child = b.create(snapshot_id)
            add(f"restore {kind}", time.perf_counter() - t0)
            b.kill(child)
    return times, sizes


def bench_disk_space(a: Node, args: argparse.Namespace) -> dict[str, list[int]]:
    sizes: dict[str, list[int]] = {}
    template_dirs = list((a.server.home / "templates" / "base").glob("*/snapshot.json"))
    template = tree_bytes(template_dirs[0].parent, unshared=False)
    for _ in range(args.runs):
        sizes.setdefault("template allocated (a full copy)", []).append(template)
        sandbox_id = a.create()
        workdir = a.server.home / "sandboxes" / sandbox_id
        try:
            a.sh(sandbox_id, "sync")
            time.sleep(6)  # the background RAM flush writes back what the guest dirtied
            sizes.setdefault("sandbox idle", []).append(tree_bytes(workdir, unshared=True))
            a.sh(sandbox_id, "head -c 100M /dev/urandom > /home/user/data; sync")
            time.sleep(6)
            sizes.setdefault("after 100 MiB written", []).append(tree_bytes(workdir, unshared=True))
            expect(a.client.post(f"/sandboxes/{sandbox_id}/snapshots", json={}), 201)
            sizes.setdefault("after a snapshot of that", []).append(
                tree_bytes(workdir, unshared=True)
            )
        finally:
            a.kill(sandbox_id)
    return sizes


@contextlib.contextmanager
def nodes(root: Path, name: str, extra: dict[str, str]) -> Iterator[tuple[Node, Node]]:
    a = ServerProcess(home=root / f"{name}-a", extra_env={**extra, "AENV_NODE_ID": f"{name}-a"})
    b = ServerProcess(home=root / f"{name}-b", extra_env={**extra, "AENV_NODE_ID": f"{name}-b"})
    with live_server(a), live_server(b):
        yield Node(a), Node(b)


def print_sizes(sizes: dict[str, list[int]], baseline: str | None) -> None:
    header = f"{'bytes':<44}{'n':>4}{'median MiB':>12}{'max MiB':>10}  ratio"
    print(header)
    print("-" * len(header))
    base = sorted(sizes[baseline])[len(sizes[baseline]) // 2] if baseline in sizes else None
    for name, values in sizes.items():
        median = sorted(values)[len(values) // 2]
        ratio = f"{median / base:.3f}x of the template" if base and name != baseline else ""
        print(f"{name:<44}{len(values):>4}{median / MIB:>12.1f}{max(values) / MIB:>10.1f}  {ratio}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--big-runs", type=int, default=1, help="snapshots after 1 GiB written")
    parser.add_argument("--skip-s3", action="store_true")
    parser.add_argument("--data-dir", type=Path, default=Path("/var/tmp/agentenv-tests"))
    parser.add_argument("--json", type=Path, default=ROOT / "bench/results/storage.json")
    args = parser.parse_args()
    prepare_data_dir(args.data_dir)
    root = Path(tempfile.mkdtemp(prefix="bench-storage-", dir=args.data_dir))
    times: dict[str, list[float]] = {}
    sizes: dict[str, list[int]] = {}
    try:
        posix_url = (root / "repository").as_uri()
        with nodes(root, "posix", {"AENV_REPOSITORY": posix_url}) as (a, b):
            print("... posix", file=sys.stderr, flush=True)
            t, s = bench_backend("posix", a, b, posix_url, None, args)
            times |= t
            sizes |= s
            print("... disk space", file=sys.stderr, flush=True)
            sizes |= bench_disk_space(a, args)
        if not args.skip_s3:
            with start_s3_server(root / "s3") as s3:
                s3_url = s3.url("bench")
                with nodes(root, "s3", {**s3.env, "AENV_REPOSITORY": s3_url}) as (a, b):
                    print("... s3", file=sys.stderr, flush=True)
                    t, s = bench_backend("s3", a, b, s3_url, s3, args)
                    times |= t
                    sizes |= s
    finally:
        shutil.rmtree(root, ignore_errors=True)

    summary = {name: summarize(values) for name, values in times.items()}
    baseline: dict[str, str] = {}
    for backend in ("posix", "s3"):
        baseline[f"{backend} seal"] = f"{backend} reflink of disk top"
        baseline[f"{backend} restore cold"] = f"{backend} restore warm"
        for label in SIZES:
            for kind in ("server", "visible"):
                baseline[f"{backend} commit after {label} ({kind})"] = (
                    f"{backend} capture after {label}"
                )
    print()
    print_table(summary, baseline, width=40)
    print()
    print_sizes(sizes, "template allocated (a full copy)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"times": summary, "raw_seconds": times, "bytes": sizes}, indent=2)
    )
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
