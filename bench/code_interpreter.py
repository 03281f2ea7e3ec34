"""The code interpreter (``e2b-code-interpreter`` 2.11.5, template ``code-interpreter-v1``)
against running the same Python as a command, in the same run.

  ci_create        Sandbox.create() of code-interpreter-v1     vs  base_create (e2b Sandbox)
  ci_first_run     the first run_code("1+1") of a new sandbox  vs  cmd_first_run:
                   commands.run("python3 -c 'print(1+1)'") as the first command of one
  ci_steady        run_code("x += 1") in a warm context        vs  cmd_steady: python3 -c
  ci_groupby       a pandas groupby over 1e5 rows              vs  cmd_groupby: python3 -c
                   (the frame is built in each call in both)       (imports pandas each time)

Usage (as root):  .venv/bin/python bench/code_interpreter.py [--runs 5] [--json out.json]
It starts its own server in a temporary data directory (the guest image comes from the
image cache, AENV_IMAGE_CACHE); the template is built once before timing, and the time
that took is reported too.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from e2b import E2B
from e2b_code_interpreter import E2B as InterpreterE2B

from bench.lifecycle import print_table, summarize
from tests.helpers import ServerProcess, live_server

GROUPBY = (
    "import numpy as np, pandas as pd\n"
    "df = pd.DataFrame({'k': np.arange(100_000) % 97, 'v': np.arange(100_000)})\n"
    "print(int(df.groupby('k').v.sum().max()))\n"
)
PAIRS = {
    "ci_create": "base_create",
    "ci_first_run": "cmd_first_run",
    "ci_steady": "cmd_steady",
    "ci_groupby": "cmd_groupby",
}


def python_command(code: str) -> str:
    return f"python3 -c {shlex.quote(code)}"


def bench(opts: dict[str, str | bool], runs: int) -> tuple[dict[str, list[float]], float]:
    ci = InterpreterE2B(**opts)  # type: ignore[arg-type]
    plain = E2B(**opts)  # type: ignore[arg-type]
    results: dict[str, list[float]] = {name: [] for pair in PAIRS.items() for name in pair}
    t0 = time.perf_counter()
    ci.Sandbox.create(timeout=300, request_timeout=3600).kill()  # builds the template
    build_seconds = time.perf_counter() - t0
    plain.Sandbox.create(timeout=120).kill()
    for _ in range(runs):
        t0 = time.perf_counter()
        sandbox = ci.Sandbox.create(timeout=300)
        results["ci_create"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        assert sandbox.run_code("1+1").text == "2"
        results["ci_first_run"].append(time.perf_counter() - t0)
        sandbox.kill()

        t0 = time.perf_counter()
        other = plain.Sandbox.create(timeout=300)
        results["base_create"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        assert other.commands.run(python_command("print(1+1)")).stdout == "2\n"
        results["cmd_first_run"].append(time.perf_counter() - t0)
        other.kill()

    sandbox = ci.Sandbox.create(timeout=900)
    try:
        sandbox.run_code("x = 0")
        for _ in range(runs):
            t0 = time.perf_counter()
            sandbox.run_code("x += 1")
            results["ci_steady"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            sandbox.commands.run(python_command("x = 0\nx += 1"))
            results["cmd_steady"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            done = sandbox.run_code(GROUPBY)
            results["ci_groupby"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            command = sandbox.commands.run(python_command(GROUPBY), timeout=600)
            results["cmd_groupby"].append(time.perf_counter() - t0)
            if done.logs.stdout != [command.stdout]:
                raise RuntimeError(f"the two groupbys differ: {done.logs} vs {command.stdout!r}")
    finally:
        sandbox.kill()
    return results, build_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", type=Path, default=Path("bench/results/code_interpreter.json"))
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/code_interpreter.py must run as root")
    home = Path(tempfile.mkdtemp(prefix="aenv-bench-ci-", dir="/var/tmp"))
    try:
        with live_server(ServerProcess(home=home / "node")) as server:
            opts: dict[str, str | bool] = {
                "api_url": server.url,
                "sandbox_url": server.url,
                "api_key": server.api_key,
                "debug": False,
            }
            raw, build_seconds = bench(opts, args.runs)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    summary = {name: summarize(values) for name, values in raw.items()}
    print(f"template build (first create, root filesystem cached or not): {build_seconds:.1f}s")
    print_table(summary, PAIRS)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "runs": args.runs,
                "sdk": "e2b-code-interpreter 2.11.5",
                "template_build_seconds": build_seconds,
                "summary": summary,
                "raw_seconds": raw,
            },
            indent=2,
        )
    )
    print(f"\nwritten {args.json}")


if __name__ == "__main__":
    main()
