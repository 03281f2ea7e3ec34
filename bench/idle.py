"""What idle sandboxes cost in CPU: the server process and the VMMs, with no sandbox and
then with ``--sandboxes`` idle ones, in the same run.

A server is started, its own CPU time (user + system, from ``/proc/PID/stat``, its
threads included, its children not) is sampled over ``--window`` seconds cut into ten
slices, then ``--sandboxes`` sandboxes are created and left alone for ``--settle``
seconds, and the server's and the VMMs' CPU are sampled the same way. The table shows
each as a percentage of one core, median and p90 over the slices, per sandbox where that
is what matters, and the server's cost with sandboxes against its cost without them
(the baseline of the same run).

Run it from two checkouts, alternating, to compare them (the server runs from the
checkout the bench is in).

Usage (as root):
  .venv/bin/python bench/idle.py [--sandboxes 20] [--window 60] [--json bench/results/idle.json]
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.lifecycle import percentile, prepare_data_dir
from tests.helpers import ServerProcess, create_sandbox_id, live_server, vmm_pids

TICKS = os.sysconf("SC_CLK_TCK")
SLICES = 10


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` (all its threads), 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # After the command name: state is field 3, utime 14 and stime 15 (1-based).
    return (int(fields[11]) + int(fields[12])) / TICKS


def sample(pids: Callable[[], list[int]], window: float) -> list[float]:
    """Percent of one core the processes ``pids()`` used in each of :data:`SLICES`
    slices of ``window`` seconds."""
    shares = []
    for _ in range(SLICES):
        watched = pids()
        before = {pid: cpu_seconds(pid) for pid in watched}
        started = time.monotonic()
        time.sleep(window / SLICES)
        elapsed = time.monotonic() - started
        used = sum(max(0.0, cpu_seconds(pid) - before[pid]) for pid in watched)
        shares.append(100 * used / elapsed)
    return shares


def measure(data_dir: Path, sandboxes: int, window: float, settle: float) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix="aenv-idle-", dir=data_dir))
    server = ServerProcess(home=home / "node", extra_env={"AENV_NETWORK_LINGER": "1"})
    try:
        with live_server(server):
            assert server.proc is not None
            server_pid = server.proc.pid
            time.sleep(settle)
            alone = sample(lambda: [server_pid], window)
            with server.client() as c:
                for _ in range(sandboxes):
                    create_sandbox_id(c, timeout=3600)
            time.sleep(settle)
            vmms = vmm_pids(str(server.home))
            if len(vmms) != sandboxes:
                raise RuntimeError(f"{len(vmms)} VMMs for {sandboxes} sandboxes")
            with_sandboxes = sample(lambda: [server_pid], window)
            vmm_total = sample(lambda: vmm_pids(str(server.home)), window)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    return {
        "server_alone": alone,
        "server_with_sandboxes": with_sandboxes,
        "vmm_per_sandbox": [share / sandboxes for share in vmm_total],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sandboxes", type=int, default=20)
    parser.add_argument("--window", type=float, default=60.0, help="seconds per measurement")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds before measuring")
    parser.add_argument("--data-dir", type=Path, default=Path("/var/tmp/agentenv-bench"))
    parser.add_argument("--json", type=Path, default=Path("bench/results/idle.json"))
    args = parser.parse_args()
    prepare_data_dir(args.data_dir)
    raw = measure(args.data_dir, args.sandboxes, args.window, args.settle)

    def row(name: str, values: list[float]) -> dict[str, float]:
        median, p90 = statistics.median(values), percentile(values, 0.9)
        print(f"{name:44} {median:8.3f} % {p90:8.3f} %")
        return {"median": median, "p90": p90}

    title = f"CPU, % of one core ({args.sandboxes} idle sandboxes)"
    print(f"{title:44} {'median':>10} {'p90':>10}")
    summary = {
        "server alone": row("server, no sandbox (baseline)", raw["server_alone"]),
        "server with sandboxes": row("server, with the sandboxes", raw["server_with_sandboxes"]),
        "vmm per sandbox": row("VMM, per idle sandbox", raw["vmm_per_sandbox"]),
    }
    base = summary["server alone"]["median"]
    extra = (summary["server with sandboxes"]["median"] - base) / args.sandboxes
    # No ratio against a baseline that used no measurable CPU (10 ms clock ticks).
    ratio = summary["server with sandboxes"]["median"] / base if base > 0 else None
    print(f"{'server, added per idle sandbox':44} {extra:8.3f} %")
    shown = f"{ratio:8.2f} x" if ratio is not None else "     n/a (baseline 0)"
    print(f"{'server with / without sandboxes':44} {shown}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "sandboxes": args.sandboxes,
                "window_s": args.window,
                "summary": summary,
                "server_added_per_sandbox": extra,
                "server_ratio": ratio,
                "raw_percent": raw,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
