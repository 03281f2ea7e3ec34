"""What an idle sandbox and its fork children hold in host memory, for this checkout
against another one (``--baseline-root``, e.g. the main checkout) in the same run.

For each checkout in turn (``--rounds`` times, alternating) a server is started on a data
directory of its own, and:

  idle sandbox      one sandbox's VMM PSS and RSS after ``--settle`` seconds idle
  after a free      the same after a guest process wrote 200 MiB and exited
                    (``--settle`` seconds later): what free page reporting gives back
  fork child        PSS of each of ``--children`` fork children of that sandbox, idle for
                    ``--settle`` seconds (every child answers ``echo`` first)

The table shows median and p90 over every sample, and the ratio of this checkout's
median to the baseline's.

Usage (as root):
  .venv/bin/python bench/memory.py --baseline-root /work/main [--rounds 1] [--children 4]
      [--json bench/results/memory.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.lifecycle import percentile, prepare_data_dir
from tests.helpers import ServerProcess, create_sandbox_id, live_server, run_command, vmm_pids

ROOT = Path(__file__).resolve().parent.parent
ALLOCATE_AND_FREE = "python3 -c \"x = b'x' * (200 << 20)\""


def memory_mib(pid: int) -> tuple[float, float]:
    """(PSS, RSS) of ``pid`` in MiB."""
    values = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("Pss", "Rss"):
            values[key] = int(rest.split()[0]) / 1024
    return values["Pss"], values["Rss"]


def one_run(root: Path, data_dir: Path, children: int, settle: float) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix="aenv-memory-", dir=data_dir)) / "node"
    server = ServerProcess(
        home=home,
        root=root,
        extra_env={"AENV_NETWORK_LINGER": "1", "AENV_TEMPLATE_BOOT_TIMEOUT": "600"},
    )
    try:
        with live_server(server), server.client() as api:
            parent = create_sandbox_id(api, timeout=3600)
            (pid,) = vmm_pids(f"/{parent}/")
            time.sleep(settle)
            idle = memory_mib(pid)
            result = run_command(server.url, parent, ALLOCATE_AND_FREE, timeout=300)
            if result.exit_code != 0:
                raise RuntimeError(f"allocation failed: {result.stderr}")
            time.sleep(settle)
            freed = memory_mib(pid)
            response = api.post(f"/sandboxes/{parent}/fork", json={"count": children})
            response.raise_for_status()
            kids = [item["sandbox"]["sandboxID"] for item in response.json()]
            for kid in kids:
                if run_command(server.url, kid, "echo hi", timeout=300).stdout != "hi\n":
                    raise RuntimeError(f"fork child {kid} does not answer")
            time.sleep(settle)
            child = [memory_mib(vmm_pids(f"/{kid}/")[0]) for kid in kids]
    finally:
        shutil.rmtree(home.parent, ignore_errors=True)
    return {
        "idle_pss_mib": [idle[0]],
        "idle_rss_mib": [idle[1]],
        "after_free_pss_mib": [freed[0]],
        "after_free_rss_mib": [freed[1]],
        "fork_child_pss_mib": [c[0] for c in child],
        "fork_child_rss_mib": [c[1] for c in child],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-root", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--children", type=int, default=4)
    parser.add_argument("--settle", type=float, default=20.0)
    parser.add_argument("--data-dir", type=Path, default=Path("/var/tmp/agentenv-bench"))
    parser.add_argument("--json", type=Path, default=Path("bench/results/memory.json"))
    args = parser.parse_args()
    prepare_data_dir(args.data_dir)
    checkouts = {"baseline": args.baseline_root.resolve(), "this": ROOT}
    raw: dict[str, dict[str, list[float]]] = {name: {} for name in checkouts}
    for round_no in range(args.rounds):
        for name, root in checkouts.items():
            result = one_run(root, args.data_dir, args.children, args.settle)
            for key, values in result.items():
                raw[name].setdefault(key, []).extend(values)
            print(f"round {round_no + 1} {name}: {json.dumps(result)}", flush=True)
    summary: dict[str, dict[str, dict[str, float]]] = {}
    print(f"\n{'metric':22} {'checkout':9} {'median':>8} {'p90':>8} {'ratio':>7}")
    for key in raw["this"]:
        for name in checkouts:
            values = raw[name][key]
            median = statistics.median(values)
            base = statistics.median(raw["baseline"][key])
            entry = {"median": median, "p90": percentile(values, 0.9), "ratio": median / base}
            summary.setdefault(key, {})[name] = entry
            print(f"{key:22} {name:9} {median:8.1f} {entry['p90']:8.1f} {entry['ratio']:6.2f}x")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "checkouts": {k: str(v) for k, v in checkouts.items()},
                "summary": summary,
                "raw": raw,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
