"""What the size of QEMU's TCG translation cache (``AENV_TCG_TB_SIZE_MIB``) costs and saves:
an idle sandbox's memory against the time of commands in it.

One data directory, one server at a time on it: for every round, every size of ``--sizes``
in turn (interleaved, so the host's load falls on all sizes alike) starts the server with
that cache size, creates a sandbox, and measures:

  idle PSS          the VMM's proportional set size after ``--settle`` seconds idle
  first command     ``python3 -c 'import json'`` run once (``bash -l -c``, as the SDK's
                    ``commands.run``): code the guest has not run since its restore, so
                    it is translated
  warm command      the same, ``--runs`` more times (what a small cache must retranslate)
  busy PSS          the VMM's PSS after those commands

The table shows median and p90 over every run of each size, and each median against
the baseline (``--baseline``, the size agentenv used before) measured in the same run.

Usage (as root, with no other server on the data directory):
  .venv/bin/python bench/tcg_cache.py [--sizes 8,16,32,64] [--rounds 3]
      [--json bench/results/tcg_cache.json]
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

MIB = 1024 * 1024
COMMAND = "python3 -c 'import json'"


def pss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no Pss in /proc/{pid}/smaps_rollup")


def command_ms(url: str, sandbox_id: str) -> float:
    started = time.perf_counter()
    result = run_command(url, sandbox_id, COMMAND, timeout=300)
    if result.exit_code != 0:
        raise RuntimeError(f"{COMMAND} exited {result.exit_code}: {result.stderr}")
    return 1000 * (time.perf_counter() - started)


def one_round(home: Path, size: int, runs: int, settle: float) -> dict[str, Any]:
    server = ServerProcess(
        home=home,
        extra_env={
            "AENV_TCG_TB_SIZE_MIB": str(size),
            "AENV_NETWORK_LINGER": "1",
            # The first server builds the base template, slowly on a busy host.
            "AENV_TEMPLATE_BOOT_TIMEOUT": "600",
        },
    )
    with live_server(server), server.client() as api:
        sandbox_id = create_sandbox_id(api, timeout=3600)
        (pid,) = vmm_pids(f"/{sandbox_id}/")
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if f"tcg,tb-size={size}".encode() not in argv:
            raise RuntimeError(f"the VMM does not run with tb-size={size}: {argv}")
        time.sleep(settle)
        idle = pss_mib(pid)
        first = command_ms(server.url, sandbox_id)
        warm = [command_ms(server.url, sandbox_id) for _ in range(runs)]
        busy = pss_mib(pid)
        api.delete(f"/sandboxes/{sandbox_id}")
    return {"idle_pss_mib": idle, "first_ms": first, "warm_ms": warm, "busy_pss_mib": busy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", type=lambda s: [int(v) for v in s.split(",")], default=[8, 16, 32, 64]
    )
    parser.add_argument("--baseline", type=int, default=64, help="size the ratios are against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=10, help="warm commands per round")
    parser.add_argument("--settle", type=float, default=10.0, help="idle seconds before PSS")
    parser.add_argument("--data-dir", type=Path, default=Path("/var/tmp/agentenv-bench"))
    parser.add_argument("--json", type=Path, default=Path("bench/results/tcg_cache.json"))
    args = parser.parse_args()
    if args.baseline not in args.sizes:
        parser.error("--baseline must be one of --sizes")
    prepare_data_dir(args.data_dir)
    home = Path(tempfile.mkdtemp(prefix="aenv-tcg-", dir=args.data_dir)) / "node"
    raw: dict[int, list[dict[str, Any]]] = {size: [] for size in args.sizes}
    try:
        # The base template is built once, at the baseline size, before any round.
        one_round(home, args.baseline, 0, 0)
        for round_no in range(args.rounds):
            for size in args.sizes:
                result = one_round(home, size, args.runs, args.settle)
                raw[size].append(result)
                print(
                    f"round {round_no + 1} tb-size {size:4d} MiB: idle PSS "
                    f"{result['idle_pss_mib']:.0f} MiB, first {result['first_ms']:.0f} ms, "
                    f"warm p50 {statistics.median(result['warm_ms']):.0f} ms",
                    flush=True,
                )
    finally:
        shutil.rmtree(home.parent, ignore_errors=True)

    def stats(values: list[float]) -> dict[str, float]:
        return {"median": statistics.median(values), "p90": percentile(values, 0.9)}

    summary: dict[int, dict[str, dict[str, float]]] = {}
    for size, rounds in raw.items():
        summary[size] = {
            "idle_pss_mib": stats([r["idle_pss_mib"] for r in rounds]),
            "busy_pss_mib": stats([r["busy_pss_mib"] for r in rounds]),
            "first_ms": stats([r["first_ms"] for r in rounds]),
            "warm_ms": stats([ms for r in rounds for ms in r["warm_ms"]]),
        }
    base = summary[args.baseline]
    print(f"\n{COMMAND!r}; ratios against tb-size={args.baseline} in this run")
    header = f"{'tb-size':>8} {'metric':14} {'median':>9} {'p90':>9} {'ratio':>7}"
    print(header)
    for size, metrics in summary.items():
        for name, unit in (
            ("idle_pss_mib", "MiB"),
            ("busy_pss_mib", "MiB"),
            ("first_ms", "ms"),
            ("warm_ms", "ms"),
        ):
            value = metrics[name]
            ratio = value["median"] / base[name]["median"]
            metrics[name]["ratio"] = ratio
            print(
                f"{size:>8} {name:14} {value['median']:7.1f}{unit:>2} "
                f"{value['p90']:7.1f}{unit:>2} {ratio:6.2f}x"
            )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "command": COMMAND,
                "baseline": args.baseline,
                "rounds": args.rounds,
                "summary": {str(k): v for k, v in summary.items()},
                "raw": {str(k): v for k, v in raw.items()},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
