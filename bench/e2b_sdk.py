"""Latency seen by the official E2B SDK (``e2b`` 2.63) against agentenv.

Measures, through the unmodified SDK talking to a local server (``api_url`` and
``sandbox_url`` both the server, option A of the protocol reference):
  sdk_create            Sandbox.create() until it returns (the sandbox is killed, untimed)
  sdk_run_true          sbx.commands.run("true") on one running sandbox
  sdk_write_1mib        sbx.files.write() of 1 MiB of random bytes
  sdk_read_1mib         sbx.files.read(format="bytes") of that file
and, as the baseline in the same run, the same four operations as plain HTTP requests
with httpx (``POST /v2/sandboxes``, one Connect ``Process/Start`` stream, ``POST`` and
``GET /files``) through the same server: the ratio is what the SDK's own machinery adds.

Usage (as root):  .venv/bin/python bench/e2b_sdk.py [--runs 20] [--json out.json]
It starts its own server in a temporary data directory, like bench/lifecycle.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
from e2b import E2B

from bench.lifecycle import print_table, summarize
from tests.helpers import ServerProcess, live_server, run_command

PAYLOAD_BYTES = 1024 * 1024
OPERATIONS = ("create", "run_true", "write_1mib", "read_1mib")


def bench_sdk(client: E2B, runs: int) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {
        "sdk_create": [],
        "sdk_run_true": [],
        "sdk_write_1mib": [],
        "sdk_read_1mib": [],
    }
    # Warm-up: the first restore after a template build reads the RAM image from disk,
    # and the SDK's first calls open its connection pools.
    client.Sandbox.create(timeout=120).kill()
    for _ in range(runs):
        t0 = time.perf_counter()
        sandbox = client.Sandbox.create(timeout=120)
        results["sdk_create"].append(time.perf_counter() - t0)
        sandbox.kill()

    sandbox = client.Sandbox.create(timeout=600)
    try:
        sandbox.commands.run("true")
        for _ in range(runs):
            t0 = time.perf_counter()
            sandbox.commands.run("true")
            results["sdk_run_true"].append(time.perf_counter() - t0)
        for i in range(runs):
            payload = os.urandom(PAYLOAD_BYTES)
            path = f"/tmp/bench-{i}.bin"
            t0 = time.perf_counter()
            sandbox.files.write(path, payload)
            t1 = time.perf_counter()
            back = sandbox.files.read(path, format="bytes")
            t2 = time.perf_counter()
            if bytes(back) != payload:
                raise RuntimeError(f"read back {len(back)} bytes that differ from what was written")
            sandbox.files.remove(path)
            results["sdk_write_1mib"].append(t1 - t0)
            results["sdk_read_1mib"].append(t2 - t1)
    finally:
        sandbox.kill()
    return results


def bench_raw_http(server: ServerProcess, runs: int) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {
        "http_create": [],
        "http_run_true": [],
        "http_write_1mib": [],
        "http_read_1mib": [],
    }
    with server.client() as api:

        def create() -> tuple[str, str]:
            response = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 600})
            response.raise_for_status()
            body = response.json()
            return str(body["sandboxID"]), str(body["envdAccessToken"])

        api.delete(f"/sandboxes/{create()[0]}")  # warm-up, like the SDK run
        for _ in range(runs):
            t0 = time.perf_counter()
            sandbox_id, _ = create()
            results["http_create"].append(time.perf_counter() - t0)
            api.delete(f"/sandboxes/{sandbox_id}")

        sandbox_id, token = create()
        envd = httpx.Client(
            base_url=server.url,
            headers={"E2b-Sandbox-Id": sandbox_id, "X-Access-Token": token},
            timeout=120,
            trust_env=False,
        )
        try:
            run_command(server.url, sandbox_id, "true", token=token)
            for _ in range(runs):
                t0 = time.perf_counter()
                run_command(server.url, sandbox_id, "true", token=token)
                results["http_run_true"].append(time.perf_counter() - t0)
            for i in range(runs):
                payload = os.urandom(PAYLOAD_BYTES)
                path = f"/tmp/raw-{i}.bin"
                t0 = time.perf_counter()
                envd.post(
                    "/files", params={"path": path}, files={"file": (path, payload)}
                ).raise_for_status()
                t1 = time.perf_counter()
                back = envd.get("/files", params={"path": path})
                t2 = time.perf_counter()
                back.raise_for_status()
                if back.content != payload:
                    raise RuntimeError("raw read returned different bytes")
                results["http_write_1mib"].append(t1 - t0)
                results["http_read_1mib"].append(t2 - t1)
        finally:
            envd.close()
            api.delete(f"/sandboxes/{sandbox_id}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--json", type=Path, default=Path("bench/results/e2b_sdk.json"))
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/e2b_sdk.py must run as root")
    home = Path(tempfile.mkdtemp(prefix="aenv-bench-sdk-", dir="/var/tmp"))
    try:
        with live_server(ServerProcess(home=home / "node")) as server:
            client = E2B(
                api_url=server.url, sandbox_url=server.url, api_key=server.api_key, debug=False
            )
            raw = bench_sdk(client, args.runs)
            raw.update(bench_raw_http(server, args.runs))
    finally:
        shutil.rmtree(home, ignore_errors=True)
    summary = {name: summarize(values) for name, values in raw.items()}
    print_table(summary, {f"sdk_{op}": f"http_{op}" for op in OPERATIONS})
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {"runs": args.runs, "sdk": "e2b 2.63.0", "summary": summary, "raw_seconds": raw},
            indent=2,
        )
    )
    print(f"\nwritten {args.json}")


if __name__ == "__main__":
    main()
