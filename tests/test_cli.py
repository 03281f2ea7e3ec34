"""``aenv`` end to end: the CLI run as a subprocess against a live server (real VMs),
with its settings in the environment and a private config directory."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT, ServerProcess, free_port

pytestmark = pytest.mark.vm

AENV = [sys.executable, "-m", "agentenv.cli"]
MIB = 1024 * 1024


def cli_env(server: ServerProcess, config_home: Path, **extra: str) -> dict[str, str]:
    """The environment for an aenv run: this server and key, nothing from the host's
    own AENV_* / E2B_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
    env.update(
        AENV_SERVER=server.url,
        AENV_API_KEY=server.api_key,
        XDG_CONFIG_HOME=str(config_home),
        PYTHONPATH=str(ROOT),
    )
    env.update(extra)
    return env


def run(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    # Never the test runner's terminal: aenv would prompt on it.
    return subprocess.run(
        [*AENV, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )


def ok(env: dict[str, str], *args: str, timeout: float = 120) -> str:
    result = run(env, *args, timeout=timeout)
    assert result.returncode == 0, (args, result.returncode, result.stderr)
    return result.stdout


def assert_one_line_error(result: subprocess.CompletedProcess[str], code: int) -> str:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("aenv: "), lines
    assert "Traceback" not in result.stderr
    return lines[0]


def sandboxes(env: dict[str, str], *filters: str) -> list[dict[str, Any]]:
    listed = json.loads(ok(env, "ls", "--output", "json", *filters))
    assert isinstance(listed, list)
    return listed


@pytest.fixture
def env(server: ServerProcess, tmp_path: Path) -> dict[str, str]:
    return cli_env(server, tmp_path / "config")


@pytest.fixture(scope="module")
def sandbox(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One sandbox, started detached by the CLI, shared by the module's tests."""
    env = cli_env(server, tmp_path_factory.mktemp("config"))
    started = ok(env, "start", "base", "--detach", "--timeout", "900", "-m", "suite=cli")
    sandbox_id = started.strip()
    assert re.fullmatch(r"[\w-]+", sandbox_id), started
    yield sandbox_id
    run(env, "rm", sandbox_id)


@pytest.fixture
def aenv_on_path(tmp_path: Path) -> Path:
    """A directory with an ``aenv`` that runs this checkout's CLI, for shell scripts."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "aenv"
    shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m agentenv.cli "$@"\n')
    shim.chmod(0o755)
    return bin_dir


# -- auth and errors ---------------------------------------------------------------------
def test_auth_stores_private_file_and_errors_are_one_line(
    server: ServerProcess, tmp_path: Path
) -> None:
    config_home = tmp_path / "config"
    bare = {
        k: v
        for k, v in cli_env(server, config_home).items()
        if k not in ("AENV_SERVER", "AENV_API_KEY")
    }

    result = run(bare, "ls")
    assert_one_line_error(result, 3)  # no key anywhere yet

    ok(bare, "auth", "--server", server.url, "--key", server.api_key)
    stored = config_home / "aenv" / "config.toml"
    assert stat.S_IMODE(stored.stat().st_mode) == 0o600
    assert server.url in stored.read_text()
    shown = json.loads(ok(bare, "auth", "--show", "--output", "json"))
    assert shown["server"] == server.url and shown["serverSource"] == "file"
    assert shown["apiKeySource"] == "file" and shown["status"].startswith("ok")
    assert server.api_key not in json.dumps(shown)  # masked
    ok(bare, "ls")  # the stored settings work

    # A rejected key is not stored.
    result = run(bare, "auth", "--server", server.url, "--key", "e2b_wrong")
    assert "rejected" in assert_one_line_error(result, 3)
    assert server.api_key in stored.read_text()
    # The environment overrides the file.
    assert_one_line_error(run({**bare, "AENV_API_KEY": "e2b_wrong"}, "ls"), 3)

    dead = f"http://127.0.0.1:{free_port()}"
    result = run({**bare, "AENV_SERVER": dead}, "ls")
    assert dead in assert_one_line_error(result, 5)
    result = run({**bare, "AENV_SERVER": dead}, "health", "--output", "json")
    assert_one_line_error(result, 5)
    assert json.loads(result.stdout)["code"] == 5

    assert_one_line_error(run(bare, "pause", "no-such-sandbox"), 4)
    assert_one_line_error(run(bare, "exec", "no-such-sandbox", "--", "true"), 4)
    assert_one_line_error(run(bare, "snapshot", "rm", "no-such-snapshot"), 4)
    assert_one_line_error(run(bare, "template", "rm", "base"), 6)
    line = assert_one_line_error(run(bare, "pull", "registry.invalid/x:1", "--name", "bad"), 1)
    assert "failed" in line and "registry.invalid" in line
    assert_one_line_error(run(bare, "template", "build", "/no/Dockerfile", "--name", "x"), 4)
    assert_one_line_error(run(bare, "ls", "--state", "sleeping"), 2)


# -- commands ------------------------------------------------------------------------------
def test_exec_streams_output_and_propagates_exit_code(env: dict[str, str], sandbox: str) -> None:
    result = run(env, "exec", sandbox, "--", "sh", "-c", "echo out; echo err >&2; exit 7")
    assert result.returncode == 7, result.stderr
    assert result.stdout == "out\n"
    assert result.stderr == "err\n"

    assert ok(env, "exec", sandbox, "--", "echo $((6*7)) | tr 4 X") == "X2\n"

    # Output arrives as the command makes it, not when it ends.
    proc = subprocess.Popen(
        [*AENV, "exec", sandbox, "--", "echo first; sleep 3; echo second"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()
    first_at = time.monotonic()
    rest = proc.stdout.read()
    assert proc.wait(60) == 0
    assert (first, rest) == ("first\n", "second\n")
    assert time.monotonic() - first_at > 2.0


def test_ls_json_and_filters(env: dict[str, str], sandbox: str) -> None:
    piped = json.loads(ok(env, "ls"))  # not a terminal: JSON without asking
    assert sandbox in {item["sandboxID"] for item in piped}
    mine = sandboxes(env, "--state", "running", "--metadata", "suite=cli")
    assert [item["sandboxID"] for item in mine] == [sandbox]
    assert mine[0]["metadata"] == {"suite": "cli"}
    assert sandboxes(env, "--state", "paused", "--metadata", "suite=cli") == []
    assert sandboxes(env, "--metadata", "suite=other") == []


def peak_rss_mib(command: list[str], env: dict[str, str]) -> tuple[int, float]:
    """Run ``command``; its exit status and peak resident memory in MiB (measured in a
    fresh process, whose only child is ``command``)."""
    probe = (
        "import resource, subprocess, sys\n"
        "code = subprocess.run(sys.argv[1:]).returncode\n"
        "print(code, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, *command],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout.split()
    return int(out[-2]), int(out[-1]) / 1024


def test_upload_download_round_trip_streams(
    env: dict[str, str], sandbox: str, tmp_path: Path
) -> None:
    original = tmp_path / "random.bin"
    digest = hashlib.sha256()
    with original.open("wb") as f:
        for _ in range(50):
            chunk = os.urandom(MIB)
            digest.update(chunk)
            f.write(chunk)

    # The baseline loads the SDK and talks to envd too, but moves no file.
    _, baseline = peak_rss_mib([*AENV, "exec", sandbox, "--", "true"], env)
    code, upload_peak = peak_rss_mib(
        [*AENV, "upload", sandbox, str(original), "/tmp/random.bin"], env
    )
    assert code == 0
    guest_sum = ok(env, "exec", sandbox, "--", "sha256sum /tmp/random.bin").split()[0]
    assert guest_sum == digest.hexdigest()

    back = tmp_path / "back"
    back.mkdir()
    code, download_peak = peak_rss_mib(
        [*AENV, "download", sandbox, "/tmp/random.bin", str(back)], env
    )
    assert code == 0
    copied = back / "random.bin"
    assert copied.stat().st_size == 50 * MIB
    with copied.open("rb") as f:
        assert hashlib.file_digest(f, "sha256").hexdigest() == digest.hexdigest()
    assert [p.name for p in back.iterdir()] == ["random.bin"]  # no staging file left
    # Streamed: neither transfer holds the 50 MiB file in memory.
    assert upload_peak < baseline + 30, (baseline, upload_peak)
    assert download_peak < baseline + 30, (baseline, download_peak)


def test_fork_children_are_listed(env: dict[str, str], sandbox: str) -> None:
    children = ok(env, "fork", sandbox, "--count", "4", timeout=300).split()
    assert len(children) == 4 and sandbox not in children
    try:
        listed = {item["sandboxID"]: item for item in sandboxes(env)}
        for child in children:
            assert listed[child]["lineage"]["parentID"] == sandbox
            assert listed[child]["metadata"] == {"suite": "cli"}
    finally:
        removed = ok(env, "rm", *children).split()
    assert removed == children
    assert not set(children) & {item["sandboxID"] for item in sandboxes(env)}


def test_pause_resume_snapshot(env: dict[str, str], sandbox: str) -> None:
    ok(env, "exec", sandbox, "--", "echo kept > /tmp/mark")
    assert ok(env, "pause", sandbox).strip() == sandbox
    paused = sandboxes(env, "--state", "paused", "--metadata", "suite=cli")
    assert [s["sandboxID"] for s in paused] == [sandbox]
    assert_one_line_error(run(env, "pause", sandbox), 6)
    assert ok(env, "resume", sandbox).strip() == sandbox
    assert ok(env, "exec", sandbox, "--", "cat /tmp/mark") == "kept\n"
    ok(env, "timeout", sandbox, "900")

    snapshot_id = ok(env, "snapshot", "create", sandbox, "--name", "cli-snap").strip()
    try:
        listed = json.loads(ok(env, "snapshot", "ls", "--sandbox", sandbox))
        assert [(s["snapshotID"], s["names"]) for s in listed] == [(snapshot_id, ["cli-snap"])]
        templates = {t["templateID"]: t for t in json.loads(ok(env, "template", "ls"))}
        assert templates["base"]["state"] == "ready"
        assert templates[snapshot_id]["names"] == ["cli-snap"]
    finally:
        assert ok(env, "snapshot", "rm", snapshot_id).strip() == snapshot_id


# -- the interactive shell -----------------------------------------------------------------
class Tmux:
    """A private tmux server (its own socket) with one detached session."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket

    def __call__(self, *args: str) -> str:
        return subprocess.run(
            ["tmux", "-S", str(self.socket), *args],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout

    def pane(self) -> str:
        return self("capture-pane", "-p", "-t", "aenv")

    def wait_for(self, check: Callable[[str], bool], what: str, limit: float = 60) -> str:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            screen = self.pane()
            if check(screen):
                return screen
            time.sleep(0.2)
        pytest.fail(f"timed out waiting for {what}; the pane shows:\n{self.pane()}")

    def size(self) -> str:
        return self("display-message", "-p", "-t", "aenv", "#{pane_height} #{pane_width}").strip()


def has_line(screen: str, text: str) -> bool:
    """Whether a line of the screen is exactly ``text`` (output, not the typed command)."""
    return text in (line.strip() for line in screen.splitlines())


def test_start_attaches_an_interactive_shell(
    server: ServerProcess, tmp_path: Path, aenv_on_path: Path
) -> None:
    env = cli_env(server, tmp_path / "config")
    exit_file = tmp_path / "exit"
    script = tmp_path / "session.sh"
    exports = "".join(
        f"export {name}={shlex.quote(env[name])}\n"
        for name in ("AENV_SERVER", "AENV_API_KEY", "XDG_CONFIG_HOME", "PYTHONPATH")
    )
    script.write_text(
        f"{exports}export PATH={shlex.quote(str(aenv_on_path))}:$PATH\n"
        f"aenv start base --metadata suite=cli-tmux\n"
        f"echo EXIT=$? > {shlex.quote(str(exit_file))}\n"
    )
    tmux = Tmux(tmp_path / "tmux.sock")
    tmux("new-session", "-d", "-s", "aenv", "-x", "100", "-y", "30", f"sh {script}")
    try:
        tmux.wait_for(lambda s: bool(re.search(r"[$#] *$", s.rstrip())), "a shell prompt")
        tmux("send-keys", "-t", "aenv", "echo hello-$((6*7))", "Enter")
        tmux.wait_for(lambda s: has_line(s, "hello-42"), "the echo's output")

        # The size sent when the PTY started, then a resize.
        tmux("send-keys", "-t", "aenv", "clear; stty size", "Enter")
        tmux.wait_for(lambda s: has_line(s, tmux.size()), f"stty size {tmux.size()}")
        tmux("resize-window", "-t", "aenv", "-x", "120", "-y", "40")
        assert tmux.size() == "40 120"
        tmux("send-keys", "-t", "aenv", "clear; stty size", "Enter")
        tmux.wait_for(lambda s: has_line(s, "40 120"), "stty size 40 120", limit=20)

        # Ctrl-C interrupts the guest's command, not aenv.
        tmux("send-keys", "-t", "aenv", "clear; sleep 60", "Enter")
        time.sleep(1)
        tmux("send-keys", "-t", "aenv", "C-c")
        tmux("send-keys", "-t", "aenv", "echo after-$((1+1))", "Enter")
        tmux.wait_for(lambda s: has_line(s, "after-2"), "output after Ctrl-C", limit=20)

        tmux("send-keys", "-t", "aenv", "exit 3", "Enter")
        deadline = time.monotonic() + 60
        while not exit_file.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert exit_file.read_text().strip() == "EXIT=3"
    finally:
        subprocess.run(["tmux", "-S", str(tmp_path / "tmux.sock"), "kill-server"], check=False)
    # Without --keep the sandbox is gone with the shell.
    assert sandboxes(env, "--metadata", "suite=cli-tmux") == []


# -- the README ----------------------------------------------------------------------------
def readme_quick_start() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Command line\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block is not None, "no sh block in README's Command line section"
    return block.group(1)


def test_readme_quick_start_runs(server: ServerProcess, tmp_path: Path, aenv_on_path: Path) -> None:
    commands = readme_quick_start()
    assert len(commands.strip().splitlines()) == 5
    # The README shows a default server; this one listens elsewhere with its own key.
    key_file = tmp_path / "api_key"
    key_file.write_text(server.api_key)
    for default in ("http://127.0.0.1:8000", "/var/lib/agentenv/api_key"):
        assert default in commands
    commands = commands.replace("http://127.0.0.1:8000", server.url)
    commands = commands.replace("/var/lib/agentenv/api_key", str(key_file))
    env = {
        k: v
        for k, v in cli_env(server, tmp_path / "config").items()
        if k not in ("AENV_SERVER", "AENV_API_KEY")
    }
    env["PATH"] = f"{aenv_on_path}:{env['PATH']}"
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", commands],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "Linux" in result.stdout  # uname -a
    assert (tmp_path / "config" / "aenv" / "config.toml").exists()
