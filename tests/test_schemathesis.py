"""Schemathesis against a live server's OpenAPI document (issue #12): its examples,
coverage, fuzzing and stateful phases (the last follows the document's links from a
create to the routes of the sandbox it made), bounded to a few minutes, must find no
server error, no status code the document does not list, and no response outside its
schema.

Schemathesis runs from its own virtualenv, built once (PyPI only) and cached under
``/var/cache/agentenv/test-venvs`` like the old SDK's (tests/e2b/test_sdk_v1_paths.py),
so its dependencies never meet the project's. The server is one of its own: the run
creates, forks and kills sandboxes, which the shared server's tests must not see.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import ServerProcess, cached_venv, live_server

pytestmark = pytest.mark.vm

SCHEMATHESIS_VERSION = "4.32.5"
# Examples per operation and phase: 30 operations take about two minutes on a 2-core
# host at 15; the whole run is cut off well before the suite would notice.
MAX_EXAMPLES = 10
RUN_TIMEOUT_S = 420


@pytest.fixture(scope="module")
def schemathesis_cli() -> Path:
    """The ``st`` command of a cached virtualenv."""
    venv = cached_venv(
        f"schemathesis-{SCHEMATHESIS_VERSION}", f"schemathesis=={SCHEMATHESIS_VERSION}"
    )
    return venv / "bin" / "st"


@pytest.fixture(scope="module")
def fuzzed_server(test_root: Path, guest_image: None) -> Iterator[ServerProcess]:
    with live_server(ServerProcess(home=test_root / "schemathesis")) as srv:
        yield srv


def test_schemathesis_finds_no_server_error_or_undocumented_answer(
    fuzzed_server: ServerProcess, schemathesis_cli: Path, tmp_path: Path
) -> None:
    run = subprocess.run(
        [
            str(schemathesis_cli),
            "run",
            f"{fuzzed_server.url}/openapi.json",
            "--header",
            f"X-API-Key: {fuzzed_server.api_key}",
            "--phases",
            "examples,coverage,fuzzing,stateful",
            "--max-examples",
            str(MAX_EXAMPLES),
            "--checks",
            "not_a_server_error,status_code_conformance,content_type_conformance,"
            "response_schema_conformance",
            "--request-timeout",
            "60",
            "--no-color",
        ],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        # Schemathesis keeps a cache (.schemathesis/) in its working directory.
        cwd=tmp_path,
    )
    report = run.stdout + run.stderr
    assert run.returncode == 0, report[-6000:]
    assert "Test cases:" in report and " passed" in report, report[-3000:]
    log = fuzzed_server.log_path.read_text(errors="replace")
    assert "unhandled error" not in log, log[-6000:]
