"""A neighbour sandbox's command latency while another sandbox runs a fork bomb, with
VMM confinement (a cgroup per VMM) and without it, in the same run.

For each variant a server is started (``AENV_CONFINE_VMM`` true, then false), two
sandboxes are created, and the neighbour's ``true`` (through the proxy, as
``Sandbox.commands.run`` does) is timed ``--runs`` times while the other sandbox idles,
then again while it runs ``b() { b | b & }; b``. The table shows each phase's median and
p90, the slowdown (loaded median / idle median) and the confined slowdown against the
unconfined one. The security suite checks the fork bomb is contained; how much a
neighbour notices is a measurement, so it lives here.

Usage (as root):
  .venv/bin/python bench/neighbour.py [--runs 15] [--json bench/results/neighbour.json]
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
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.lifecycle import percentile, prepare_data_dir
from tests.helpers import ServerProcess, create_sandbox_id, live_server, run_command

FORK_BOMB = "nohup sh -c 'b() { b | b & }; b' >/dev/null 2>&1 & echo started"


def _timings(server: ServerProcess, sandbox_id: str, runs: int) -> list[float]:
    timings = []
    for _ in range(runs):
        started = time.perf_counter()
        result = run_command(server.url, sandbox_id, "true", timeout=120)
        timings.append(time.perf_counter() - started)
        if result.exit_code != 0:
            raise RuntimeError(f"`true` in the neighbour failed: {result}")
    return timings


def measure(data_dir: Path, confined: bool, runs: int) -> dict[str, list[float]]:
    home = Path(tempfile.mkdtemp(prefix="aenv-neighbour-", dir=data_dir))
    server = ServerProcess(
        home=home / "node", extra_env={"AENV_CONFINE_VMM": "true" if confined else "false"}
    )
    try:
        with live_server(server):
            neighbour = create_sandbox_id(server, timeout=900)
            bomber = create_sandbox_id(server, timeout=900)
            _timings(server, neighbour, 2)  # warm-up
            idle = _timings(server, neighbour, runs)
            run_command(server.url, bomber, FORK_BOMB, timeout=60)
            time.sleep(3)  # let the bomb fill the guest
            loaded = _timings(server, neighbour, runs)
            return {"idle": idle, "loaded": loaded}
    finally:
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--json", type=Path, default=Path("bench/results/neighbour.json"))
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=Path(os.environ.get("AENV_TEST_DIR", "/var/tmp/agentenv-tests")),
    )
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/neighbour.py must run as root")
    prepare_data_dir(args.data_dir)

    results: dict[str, dict[str, list[float]]] = {}
    for name, confined in (("confined", True), ("unconfined", False)):
        print(f"... {name}", file=sys.stderr, flush=True)
        results[name] = measure(args.data_dir, confined, args.runs)

    summary: dict[str, Any] = {}
    print(f"\nneighbour `true` through the proxy, {args.runs} runs per phase (ms)")
    print(
        f"{'variant':<12}{'idle p50':>10}{'idle p90':>10}{'bomb p50':>10}{'bomb p90':>10}"
        f"{'slowdown':>10}"
    )
    for name, phases in results.items():
        idle, loaded = phases["idle"], phases["loaded"]
        slowdown = statistics.median(loaded) / statistics.median(idle)
        summary[name] = {
            "idle_p50_ms": statistics.median(idle) * 1000,
            "idle_p90_ms": percentile(idle, 0.9) * 1000,
            "loaded_p50_ms": statistics.median(loaded) * 1000,
            "loaded_p90_ms": percentile(loaded, 0.9) * 1000,
            "slowdown": slowdown,
        }
        s = summary[name]
        print(
            f"{name:<12}{s['idle_p50_ms']:>10.1f}{s['idle_p90_ms']:>10.1f}"
            f"{s['loaded_p50_ms']:>10.1f}{s['loaded_p90_ms']:>10.1f}{slowdown:>9.2f}x"
        )
    ratio = summary["confined"]["slowdown"] / summary["unconfined"]["slowdown"]
    print(f"confined slowdown / unconfined slowdown: {ratio:.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "runs": args.runs,
                "summary": summary,
                "raw_s": results,
                "confined_vs_unconfined": ratio,
            },
            indent=2,
        )
    )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
