"""Two servers side by side, their lifecycle operations interleaved: a baseline (another
checkout, or this one with other settings) and the candidate (this checkout), so load
that comes and goes on a shared machine falls on both alike.

Both servers run at once. Each cycle times, on each server in turn (the order swapped
every cycle): create → running, the first command, pause, resume → running (connect)
and the first command after it, with ``--fork N`` a fork of N children → API (the
children are killed untimed) and the CPU the server process used meanwhile, its own and
its reaped child processes' (``fork_server_cpu``: on a loaded host a steadier figure than
the wall time), then kill. The table shows each metric's median and p90
for both and the candidate's median over the baseline's.

Usage (as root):
  .venv/bin/python bench/ab.py --baseline /path/to/other/checkout [--cycles 30] [--fork 16]
  .venv/bin/python bench/ab.py --baseline-env AENV_CONFINE_VMM=false   # same code
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.lifecycle import expect, percentile, prepare_data_dir
from tests.helpers import ROOT, ServerProcess, live_server, run_command

METRICS = (
    "create_to_running",
    "create_to_first_command",
    "pause",
    "resume_to_running",
    "resume_to_first_command",
    "kill",
)


@contextmanager
def started(home: Path, checkout: Path, env: dict[str, str]) -> Iterator[ServerProcess]:
    server = ServerProcess(home=home, extra_env={"AENV_NETWORK_LINGER": "30", **env})
    server.root = checkout
    with live_server(server) as srv:
        yield srv


def cpu_seconds(pid: int) -> float:
    """CPU time of process ``pid`` (all its threads) and of the children it has reaped."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def cycle(server: ServerProcess, c: httpx.Client, fork: int = 0) -> dict[str, float]:
    t: dict[str, float] = {}
    t0 = time.perf_counter()
    body = expect(c.post("/sandboxes", json={"templateID": "base", "timeout": 600}), 201).json()
    t["create_to_running"] = time.perf_counter() - t0
    sandbox_id, token = body["sandboxID"], body.get("envdAccessToken") or ""
    assert run_command(server.url, sandbox_id, "echo hi", token=token).stdout == "hi\n"
    t["create_to_first_command"] = time.perf_counter() - t0
    p0 = time.perf_counter()
    expect(c.post(f"/sandboxes/{sandbox_id}/pause"), 204)
    t["pause"] = time.perf_counter() - p0
    r0 = time.perf_counter()
    expect(c.post(f"/sandboxes/{sandbox_id}/connect", json={"timeout": 600}), 201)
    t["resume_to_running"] = time.perf_counter() - r0
    assert run_command(server.url, sandbox_id, "echo hi", token=token).stdout == "hi\n"
    t["resume_to_first_command"] = time.perf_counter() - r0
    if fork:
        assert server.proc is not None
        cpu0, f0 = cpu_seconds(server.proc.pid), time.perf_counter()
        forked = expect(c.post(f"/sandboxes/{sandbox_id}/fork", json={"count": fork}), 201)
        t["fork_to_api"] = time.perf_counter() - f0
        t["fork_server_cpu"] = cpu_seconds(server.proc.pid) - cpu0
        errors = [item["error"] for item in forked.json() if "error" in item]
        assert not errors, errors
        for item in forked.json():
            expect(c.delete(f"/sandboxes/{item['sandbox']['sandboxID']}"), 204)
    k0 = time.perf_counter()
    expect(c.delete(f"/sandboxes/{sandbox_id}"), 204)
    t["kill"] = time.perf_counter() - k0
    return t


def parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"expected KEY=VALUE, got {pair!r}")
        env[key] = value
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, default=ROOT, help="checkout of the baseline")
    parser.add_argument("--baseline-env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--candidate-env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--cycles", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--fork", type=int, default=0, help="children per fork (0: no fork)")
    parser.add_argument("--data-dir", type=Path, default=Path("/var/tmp/agentenv-bench"))
    parser.add_argument("--json", type=Path, default=Path("bench/results/ab.json"))
    args = parser.parse_args()
    prepare_data_dir(args.data_dir)
    home = Path(tempfile.mkdtemp(prefix="aenv-ab-", dir=args.data_dir))
    names = ("baseline", "candidate")
    metrics = METRICS + (("fork_to_api", "fork_server_cpu") if args.fork else ())
    results: dict[str, dict[str, list[float]]] = {n: {m: [] for m in metrics} for n in names}
    try:
        with ExitStack() as stack:
            servers = {
                "baseline": stack.enter_context(
                    started(
                        home / "baseline", args.baseline.resolve(), parse_env(args.baseline_env)
                    )
                ),
                "candidate": stack.enter_context(
                    started(home / "candidate", ROOT, parse_env(args.candidate_env))
                ),
            }
            clients = {n: stack.enter_context(servers[n].client()) for n in names}
            for i in range(args.warmup + args.cycles):
                order = names if i % 2 == 0 else names[::-1]
                for name in order:
                    timings = cycle(servers[name], clients[name], args.fork)
                    if i >= args.warmup:
                        for metric, value in timings.items():
                            results[name][metric].append(value)
    finally:
        shutil.rmtree(home, ignore_errors=True)

    summary: dict[str, Any] = {}
    print(
        f"{'metric':26} {'baseline p50':>12} {'p90':>8} {'candidate p50':>14} {'p90':>8} "
        f"{'ratio':>6}"
    )
    for metric in metrics:
        b, c = results["baseline"][metric], results["candidate"][metric]
        bm, cm = statistics.median(b), statistics.median(c)
        row = {
            "baseline": {"median": bm, "p90": percentile(b, 0.9)},
            "candidate": {"median": cm, "p90": percentile(c, 0.9)},
            "ratio": cm / bm,
        }
        summary[metric] = row
        print(
            f"{metric:26} {bm * 1000:10.1f}ms {row['baseline']['p90'] * 1000:6.0f}ms "
            f"{cm * 1000:12.1f}ms {row['candidate']['p90'] * 1000:6.0f}ms {cm / bm:6.2f}"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "baseline": str(args.baseline.resolve()),
                "baseline_env": args.baseline_env,
                "candidate_env": args.candidate_env,
                "cycles": args.cycles,
                "summary": summary,
                "raw_seconds": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
