"""What idle sandboxes cost in CPU: the server process and the VMMs, with no sandbox and
then with ``--sandboxes`` idle ones, in the same run, optionally against another checkout.

A server is started, its own CPU time (user + system, from ``/proc/PID/stat``, its
threads included, its children not) is sampled over ``--window`` seconds cut into ten
slices, then ``--sandboxes`` sandboxes are created and left alone for ``--settle``
seconds, and the server's and the VMMs' CPU are sampled the same way, with the VMMs'
wakeups (voluntary context switches of all their threads: each one a sleep that ended).
The table shows each as a percentage of one core (wakeups a second), median and p90 over
the slices, per sandbox where that is what matters, and the server's cost with sandboxes
against its cost without them (the baseline of the same run).

With ``--baseline-root`` (another checkout, e.g. the main one; ``--baseline-image-cache``
its guest image cache) the baseline's server is measured the same way, alternating with
this checkout's ``--rounds`` times, or with ``--together`` both at once, every slice
sampling both (the same host load for each; twice the sandboxes on the node). The last
column is this checkout's median against the baseline's.

Usage (as root):
  .venv/bin/python bench/idle.py [--sandboxes 20] [--window 60] [--json bench/results/idle.json]
      [--baseline-root /var/tmp/main --baseline-image-cache DIR [--together | --rounds 2]]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agentenv.vmm.base import thread_wakeups
from bench.lifecycle import percentile, prepare_data_dir
from tests.helpers import ServerProcess, create_sandbox_id, live_server, vmm_pids

ROOT = Path(__file__).resolve().parent.parent
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


def wakeups(pid: int) -> int:
    """Voluntary context switches of all of ``pid``'s threads so far."""
    return sum(thread_wakeups(pid).values())


@dataclass(frozen=True)
class Watched:
    """Processes whose CPU (and optionally wakeups) one series sums, per ``per``."""

    pids: Callable[[], list[int]]
    per: int = 1
    count_wakeups: bool = False


def only(pid: int) -> list[int]:
    return [pid]


def sample(series: dict[str, Watched], window: float) -> dict[str, list[float]]:
    """Percent of one core each series used in each of :data:`SLICES` slices of
    ``window`` seconds, all series in the same slices; a series that counts wakeups also
    gives ``<name> wakeups`` (a second)."""
    shares: dict[str, list[float]] = {}
    for _ in range(SLICES):
        watched = {name: w.pids() for name, w in series.items()}
        cpu = {name: {pid: cpu_seconds(pid) for pid in pids} for name, pids in watched.items()}
        woke = {name: {pid: wakeups(pid) for pid in pids} for name, pids in watched.items()}
        started = time.monotonic()
        time.sleep(window / SLICES)
        elapsed = time.monotonic() - started
        for name, pids in watched.items():
            per = series[name].per
            used = sum(max(0.0, cpu_seconds(pid) - cpu[name][pid]) for pid in pids)
            shares.setdefault(name, []).append(100 * used / elapsed / per)
            if series[name].count_wakeups:
                ended = sum(max(0, wakeups(pid) - woke[name][pid]) for pid in pids)
                shares.setdefault(f"{name} wakeups", []).append(ended / elapsed / per)
    return shares


def server_for(root: Path, data_dir: Path, image_cache: Path | None) -> ServerProcess:
    home = Path(tempfile.mkdtemp(prefix="aenv-idle-", dir=data_dir))
    env = {"AENV_NETWORK_LINGER": "1", "AENV_TEMPLATE_BOOT_TIMEOUT": "600"}
    if image_cache is not None:
        env["AENV_IMAGE_CACHE"] = str(image_cache)
    return ServerProcess(home=home / "node", root=root, extra_env=env)


def measure(
    servers: dict[str, ServerProcess], sandboxes: int, window: float, settle: float
) -> dict[str, dict[str, list[float]]]:
    """The servers alone, then with ``sandboxes`` idle sandboxes each, all sampled in the
    same slices; per server: ``server_alone``, ``server_with_sandboxes``,
    ``vmm_per_sandbox`` (% of one core) and ``vmm_wakeups_per_sandbox`` (a second)."""
    try:
        with contextlib.ExitStack() as stack:
            for server in servers.values():
                stack.enter_context(live_server(server))
            server_pids = {}
            for name, server in servers.items():
                assert server.proc is not None
                server_pids[name] = server.proc.pid
            time.sleep(settle)
            alone = sample(
                {name: Watched(functools.partial(only, pid)) for name, pid in server_pids.items()},
                window,
            )
            for _ in range(sandboxes):  # round robin, so both have settled as long
                for server in servers.values():
                    with server.client() as c:
                        create_sandbox_id(c, timeout=3600)
            time.sleep(settle)
            for server in servers.values():
                vmms = vmm_pids(str(server.home))
                if len(vmms) != sandboxes:
                    raise RuntimeError(f"{len(vmms)} VMMs for {sandboxes} sandboxes")
            with_sandboxes = sample(
                {name: Watched(functools.partial(only, pid)) for name, pid in server_pids.items()},
                window,
            )
            vmms_of: dict[str, Watched] = {
                name: Watched(
                    functools.partial(vmm_pids, str(server.home)), sandboxes, count_wakeups=True
                )
                for name, server in servers.items()
            }
            vmm_shares = sample(vmms_of, window)
    finally:
        for server in servers.values():
            shutil.rmtree(server.home.parent, ignore_errors=True)
    return {
        name: {
            "server_alone": alone[name],
            "server_with_sandboxes": with_sandboxes[name],
            "vmm_per_sandbox": vmm_shares[name],
            "vmm_wakeups_per_sandbox": vmm_shares[f"{name} wakeups"],
        }
        for name in servers
    }


def summarize(
    raw: dict[str, list[float]], sandboxes: int, baseline: dict[str, list[float]] | None
) -> dict[str, Any]:
    """Median and p90 of each row (printed), the server's cost per sandbox, and each
    row's median against the baseline checkout's."""

    def row(name: str, key: str, unit: str) -> dict[str, float]:
        values = raw[key]
        median, p90 = statistics.median(values), percentile(values, 0.9)
        entry = {"median": median, "p90": p90}
        shown = ""
        if baseline is not None:
            base = statistics.median(baseline[key])
            if base > 0:  # no ratio against a baseline that used no measurable CPU
                entry["ratio"] = median / base
                shown = f" {entry['ratio']:7.2f} x"
        print(f"{name:40} {median:8.3f} {unit} {p90:8.3f} {unit}{shown}")
        return entry

    summary = {
        "server alone": row("server, no sandbox", "server_alone", "%"),
        "server with sandboxes": row("server, with the sandboxes", "server_with_sandboxes", "%"),
        "vmm per sandbox": row("VMM, per idle sandbox", "vmm_per_sandbox", "%"),
        "vmm wakeups per sandbox": row(
            "VMM wakeups a second, per idle sandbox", "vmm_wakeups_per_sandbox", "/"
        ),
    }
    base = summary["server alone"]["median"]
    extra = (summary["server with sandboxes"]["median"] - base) / sandboxes
    ratio = summary["server with sandboxes"]["median"] / base if base > 0 else None
    print(f"{'server, added per idle sandbox':40} {extra:8.3f} %")
    shown = f"{ratio:8.2f} x" if ratio is not None else "     n/a (baseline 0)"
    print(f"{'server with / without sandboxes':40} {shown}")
    return {"rows": summary, "server_added_per_sandbox": extra, "server_ratio": ratio}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sandboxes", type=int, default=20)
    parser.add_argument("--window", type=float, default=60.0, help="seconds per measurement")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds before measuring")
    parser.add_argument("--baseline-root", type=Path, help="another checkout to compare with")
    parser.add_argument("--baseline-image-cache", type=Path, help="the baseline's image cache")
    parser.add_argument("--together", action="store_true", help="both servers at once")
    parser.add_argument("--rounds", type=int, default=1, help="alternations (not --together)")
    parser.add_argument("--data-dir", type=Path, default=Path("/var/tmp/agentenv-bench"))
    parser.add_argument("--json", type=Path, default=Path("bench/results/idle.json"))
    args = parser.parse_args()
    prepare_data_dir(args.data_dir)
    checkouts: dict[str, tuple[Path, Path | None]] = {"this": (ROOT, None)}
    if args.baseline_root is not None:
        checkouts = {
            "baseline": (args.baseline_root.resolve(), args.baseline_image_cache),
            **checkouts,
        }

    def servers(names: list[str]) -> dict[str, ServerProcess]:
        made = {}
        for name in names:
            root, image_cache = checkouts[name]
            made[name] = server_for(root, args.data_dir, image_cache)
        return made

    raw: dict[str, dict[str, list[float]]] = {name: {} for name in checkouts}
    batches = [list(checkouts)] if args.together else [[name] for name in checkouts]
    for round_no in range(1 if args.together else args.rounds):
        for batch in batches:
            measured = measure(servers(batch), args.sandboxes, args.window, args.settle)
            for name, result in measured.items():
                for key, values in result.items():
                    raw[name].setdefault(key, []).extend(values)
                print(f"round {round_no + 1} {name}: measured", flush=True)
    summaries = {}
    for name in checkouts:
        title = f"{name}: {args.sandboxes} idle sandboxes"
        print(f"\n{title:40} {'median':>10} {'p90':>10}")
        baseline = raw["baseline"] if name != "baseline" and "baseline" in raw else None
        summaries[name] = summarize(raw[name], args.sandboxes, baseline)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "sandboxes": args.sandboxes,
                "window_s": args.window,
                "together": args.together,
                "checkouts": {name: str(root) for name, (root, _) in checkouts.items()},
                "summary": summaries,
                "raw": raw,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
