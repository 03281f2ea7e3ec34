"""Build plans: bodies made by the real E2B SDK, and COPY scripts run against its archives."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
from e2b import Template, wait_for_port
from e2b.api.client.models import TemplateBuildStartV2
from e2b.template.main import TemplateBuilder
from e2b.template.utils import tar_file_stream

from agentenv.orchestrator.build_plan import (
    BuildPlan,
    CopyStep,
    EnvStep,
    PlanError,
    RunStep,
    UserStep,
    WorkdirStep,
    copy_script,
    describe,
    parse_build,
)

HASH = "a" * 64


def wire_body(template: Any) -> dict[str, Any]:
    """The JSON ``Template.build`` posts to ``/v2/templates/{id}/builds/{build}``: the same
    serialization and model round trip as ``e2b.template_sync.main.Template._build``."""
    base = template._template
    body = base._serialize(base._instructions_with_hashes())
    result: dict[str, Any] = json.loads(json.dumps(TemplateBuildStartV2.from_dict(body).to_dict()))
    return result


@pytest.fixture
def context(tmp_path: Path) -> Path:
    ctx = tmp_path / "context"
    (ctx / "app").mkdir(parents=True)
    (ctx / "app" / "main.py").write_text("print('hi')\n")
    (ctx / "app" / "run.sh").write_text("#!/bin/sh\n")
    (ctx / "app" / "run.sh").chmod(0o755)
    (ctx / "app" / ".env").write_text("A=1\n")
    (ctx / "app" / "pkg" / "deep").mkdir(parents=True)
    (ctx / "app" / "pkg" / "deep" / "mod.py").write_text("x = 1\n")
    (ctx / "app" / "link").symlink_to("main.py")
    (ctx / "a.txt").write_text("a\n")
    (ctx / "b.txt").write_text("b\n")
    (ctx / ".hidden.txt").write_text("hidden\n")
    (ctx / "config.json").write_text("{}\n")
    (ctx / "my dir").mkdir()
    (ctx / "my dir" / "file one.txt").write_text("spaced\n")
    return ctx


# -- parse_build against the SDK's own bodies ---------------------------------------------


def test_sdk_builder_chain(context: Path) -> None:
    template = (
        Template(file_context_path=str(context))
        .from_image("python:3.12")
        .set_envs({"NODE_ENV": "production", "GREETING": "hello world"})
        .set_workdir("/app")
        .set_user("root")
        .run_cmd("echo hi")
        .run_cmd(["pip install a", "pip install b"], user="user")
        .copy("config.json", "/etc/app/config.json")
        .copy("app", "/app/", user="user", mode=0o755)
        .apt_install(["curl"])
        .set_start_cmd("python -m http.server 8000", wait_for_port(8000))
    )
    body = wire_body(template)
    plan = parse_build(body)

    assert plan.from_image == "python:3.12"
    assert plan.from_template is None
    assert plan.start_cmd == "python -m http.server 8000"
    assert plan.ready_cmd == '[ -n "$(ss -Htuln sport = :8000)" ]'
    steps = plan.steps
    assert steps[0] == EnvStep({"NODE_ENV": "production", "GREETING": "hello world"})
    assert steps[1] == WorkdirStep("/app")
    assert steps[2] == UserStep("root")
    assert steps[3] == RunStep("echo hi", None)
    assert steps[4] == RunStep("pip install a && pip install b", "user")
    hashes = [s["filesHash"] for s in body["steps"] if s["type"] == "COPY"]
    assert steps[5] == CopyStep(hashes[0], "config.json", "/etc/app/config.json", None, None)
    assert steps[6] == CopyStep(hashes[1], "app", "/app/", "user", 0o755)
    assert isinstance(steps[7], RunStep) and steps[7].user == "root"
    assert "apt-get install -y curl" in steps[7].command
    assert len(steps) == 8


def test_sdk_from_template_and_ready_cmd_only() -> None:
    template = Template().from_template("my-base").set_ready_cmd("[ -f /tmp/ready ]")
    plan = parse_build(wire_body(template))
    assert plan == BuildPlan(None, "my-base", (), None, "[ -f /tmp/ready ]")


def test_sdk_default_base_image_is_sent_explicitly() -> None:
    # Template() without from_* still names e2bdev/base (a builder is only reachable
    # through from_*, so wrap one by hand), so parse_build never sees a body without a base.
    plan = parse_build(wire_body(TemplateBuilder(Template()).run_cmd("true")))
    assert plan.from_image == "e2bdev/base"


def test_sdk_dockerfile(context: Path) -> None:
    dockerfile = "\n".join(
        [
            "FROM node:20",
            "ARG VERSION=1.2",
            "ENV PORT=3000 MODE=prod",
            "WORKDIR /srv",
            "COPY --chown=node:node --chmod=0644 config.json ./",
            "COPY *.txt /data/",
            "RUN npm install -g pnpm",
            "USER node",
            'CMD ["node", "server.js"]',
        ]
    )
    template = Template(file_context_path=str(context)).from_dockerfile(dockerfile)
    plan = parse_build(wire_body(template))
    assert plan.from_image == "node:20"
    assert plan.start_cmd == "node server.js"
    assert plan.ready_cmd == "sleep 20"
    # The parser starts as root in / like Docker; E2B's user/home defaults are appended
    # only when the Dockerfile set neither USER nor WORKDIR.
    assert plan.steps[:2] == (UserStep("root"), WorkdirStep("/"))
    assert [type(s).__name__ for s in plan.steps[2:]] == [
        "EnvStep",  # ARG becomes ENV in the SDK
        "EnvStep",
        "WorkdirStep",
        "CopyStep",
        "CopyStep",
        "RunStep",
        "UserStep",
    ]
    assert plan.steps[2] == EnvStep({"VERSION": "1.2"})
    assert plan.steps[3] == EnvStep({"PORT": "3000", "MODE": "prod"})
    copy = plan.steps[5]
    assert isinstance(copy, CopyStep)
    assert (copy.src, copy.dest, copy.user, copy.mode) == ("config.json", "./", "node:node", 0o644)


def test_private_registry_rejected() -> None:
    template = Template().from_image("registry.example/img:1", username="u", password="p")
    with pytest.raises(PlanError, match=r"fromImageRegistry.*not supported"):
        parse_build(wire_body(template))


# -- parse_build errors --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"steps": []}, "no base"),
        ({"fromImage": "a", "fromTemplate": "b"}, "not both"),
        ({"fromImage": 3}, "fromImage must be a string"),
        ({"fromImage": "a", "steps": {}}, "steps must be a list"),
        ({"fromImage": "a", "steps": ["RUN x"]}, r"steps\[0\]: a step must be an object"),
        (
            {"fromImage": "a", "steps": [{"type": "RUN", "args": ["x"]}, {"type": "ADD"}]},
            r"steps\[1\]: unsupported step type 'ADD'; supported: RUN, ENV, ARG, WORKDIR",
        ),
        ({"fromImage": "a", "steps": [{"type": "RUN", "args": []}]}, r"steps\[0\] \(RUN\)"),
        ({"fromImage": "a", "steps": [{"type": "RUN", "args": [1]}]}, "list of strings"),
        ({"fromImage": "a", "steps": [{"type": "ENV", "args": ["A"]}]}, "name/value pairs"),
        ({"fromImage": "a", "steps": [{"type": "ENV", "args": ["", "v"]}]}, "variable name"),
        ({"fromImage": "a", "steps": [{"type": "WORKDIR", "args": []}]}, r"\[path\]"),
        ({"fromImage": "a", "steps": [{"type": "USER", "args": ["a", "b"]}]}, r"\[user\]"),
        (
            {"fromImage": "a", "steps": [{"type": "COPY", "args": ["a", "/b"]}]},
            r"steps\[0\] \(COPY\): filesHash",
        ),
        (
            {"fromImage": "a", "steps": [{"type": "COPY", "args": ["a"], "filesHash": HASH}]},
            "src, dest",
        ),
        (
            {
                "fromImage": "a",
                "steps": [{"type": "COPY", "args": ["a", "/b", "", "0999"], "filesHash": HASH}],
            },
            "octal",
        ),
        (
            {
                "fromImage": "a",
                "steps": [{"type": "COPY", "args": ["../a", "/b"], "filesHash": HASH}],
            },
            "inside the build context",
        ),
        (
            {
                "fromImage": "a",
                "steps": [{"type": "COPY", "args": ["/etc", "/b"], "filesHash": HASH}],
            },
            "inside the build context",
        ),
        (
            {
                "fromImage": "a",
                "steps": [{"type": "COPY", "args": ["a", "/b"], "filesHash": "../x"}],
            },
            "filesHash",
        ),
    ],
)
def test_parse_errors(body: dict[str, Any], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        parse_build(body)


def test_lenient_forms() -> None:
    plan = parse_build(
        {
            "fromTemplate": "base",
            "fromImage": None,
            "steps": [
                {"type": "arg", "args": ["V", ""]},
                {"type": "RUN", "args": ["make", ""]},
                {"type": "COPY", "args": ["a", "/b"], "filesHash": HASH, "forceUpload": True},
            ],
            "force": True,
            "startCmd": "",
        }
    )
    assert plan.steps == (
        EnvStep({"V": ""}),
        RunStep("make", None),
        CopyStep(HASH, "a", "/b", None, None),
    )
    assert plan.start_cmd is None


def test_describe() -> None:
    assert describe(RunStep("apt-get install -y x", None)) == "RUN apt-get install -y x"
    assert describe(RunStep("a\nb\nc", "root")) == "RUN (as root) a ... (+2 lines)"
    assert describe(EnvStep({"A": "1", "B": "x y"})) == "ENV A=1 B='x y'"
    assert describe(WorkdirStep("/app")) == "WORKDIR /app"
    assert describe(UserStep("user")) == "USER user"
    assert describe(CopyStep(HASH, "app", "/app/", "user", 0o755)) == (
        "COPY --chown=user --chmod=0755 app /app/"
    )
    assert describe(CopyStep(HASH, "a.txt", "b", None, None)) == "COPY a.txt b"


# -- copy_script run for real --------------------------------------------------------------

BUSYBOX_APPLETS = ("sh awk cat chmod chown cp dirname find grep gzip mkdir od rm tar tr").split()


def _shells() -> list[str]:
    shells = ["/bin/sh"]
    if shutil.which("bash"):
        shells.append("bash")
    if shutil.which("busybox"):
        shells.append("busybox")
    return shells


@pytest.fixture(params=_shells())
def run_copy(request: pytest.FixtureRequest, tmp_path: Path, context: Path) -> Any:
    """Archive ``src`` the way the SDK uploads it, then run the COPY script for it."""
    shell: str = request.param
    env = dict(os.environ)
    argv0 = [shell]
    if shell == "busybox":
        # Only busybox applets on PATH: the script must not need GNU tools.
        bin_dir = tmp_path / "bb"
        bin_dir.mkdir()
        busybox = shutil.which("busybox")
        assert busybox
        for applet in BUSYBOX_APPLETS:
            (bin_dir / applet).symlink_to(busybox)
        env["PATH"] = str(bin_dir)
        argv0 = [str(bin_dir / "sh")]

    def run(
        step: CopyStep, workdir: str = "/", gzip: bool = True
    ) -> subprocess.CompletedProcess[str]:
        archive = tmp_path / "upload dir" / f"{step.files_hash}.tar"
        archive.parent.mkdir(exist_ok=True)
        with tar_file_stream(step.src, str(context), [], False, gzip) as stream:
            archive.write_bytes(stream.read())
        script = copy_script(step, str(archive), workdir)
        result = subprocess.run(
            [*argv0, "-c", script], env=env, capture_output=True, text=True, check=False
        )
        assert result.returncode == 0, result.stderr
        # The archive and the scratch directory are gone.
        assert list(archive.parent.iterdir()) == []
        return result

    return run


@pytest.fixture
def guest(tmp_path: Path) -> Path:
    # A space in every destination path.
    root = tmp_path / "guest root"
    root.mkdir()
    return root


def test_copy_file_into_dir(run_copy: Any, guest: Path) -> None:
    run_copy(CopyStep(HASH, "config.json", f"{guest}/etc/app/", None, None))
    assert (guest / "etc" / "app" / "config.json").read_text() == "{}\n"


def test_copy_ignores_archived_owner(run_copy: Any, guest: Path, context: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("only root can make a file owned by someone else")
    os.chown(context / "config.json", 1234, 1234)
    run_copy(CopyStep(HASH, "config.json", f"{guest}/etc/", None, None))
    st = (guest / "etc" / "config.json").stat()
    assert (st.st_uid, st.st_gid) == (0, 0)


def test_copy_file_to_file_path(run_copy: Any, guest: Path) -> None:
    (guest / "etc").mkdir()
    (guest / "etc" / "settings.json").write_text("old")
    run_copy(CopyStep(HASH, "config.json", f"{guest}/etc/settings.json", None, None))
    assert (guest / "etc" / "settings.json").read_text() == "{}\n"
    run_copy(CopyStep(HASH, "config.json", f"{guest}/new/parent/renamed.json", None, None))
    assert (guest / "new" / "parent" / "renamed.json").read_text() == "{}\n"


def test_copy_file_into_existing_dir_without_slash(run_copy: Any, guest: Path) -> None:
    (guest / "srv").mkdir()
    run_copy(CopyStep(HASH, "a.txt", f"{guest}/srv", None, None))
    assert (guest / "srv" / "a.txt").read_text() == "a\n"


def test_copy_dir_contents(run_copy: Any, guest: Path) -> None:
    (guest / "app").mkdir()
    (guest / "app" / "existing").write_text("kept")
    run_copy(CopyStep(HASH, "app", f"{guest}/app", None, None))
    app = guest / "app"
    assert sorted(p.name for p in app.iterdir()) == [
        ".env",
        "existing",
        "link",
        "main.py",
        "pkg",
        "run.sh",
    ]
    assert (app / "pkg" / "deep" / "mod.py").read_text() == "x = 1\n"
    assert (app / "run.sh").stat().st_mode & 0o777 == 0o755
    assert (app / "link").is_symlink() and os.readlink(app / "link") == "main.py"
    assert not (app / "app").exists()


def test_copy_glob_with_dotmatch(run_copy: Any, guest: Path) -> None:
    run_copy(CopyStep(HASH, "*.txt", f"{guest}/data/", None, None))
    names = sorted(p.name for p in (guest / "data").iterdir())
    assert names == [".hidden.txt", "a.txt", "b.txt"]


def test_copy_glob_in_subdir(run_copy: Any, guest: Path) -> None:
    run_copy(CopyStep(HASH, "app/*.py", f"{guest}/py", None, None))
    # Only main.py matched: one file and no trailing slash, so dest is that file.
    assert (guest / "py").read_text() == "print('hi')\n"
    run_copy(CopyStep(HASH, "app/**/*.py", f"{guest}/flat/", None, None))
    assert sorted(p.name for p in (guest / "flat").iterdir()) == ["main.py", "mod.py"]


def test_copy_relative_dest(run_copy: Any, guest: Path) -> None:
    workdir = guest / "home" / "user"
    workdir.mkdir(parents=True)
    run_copy(CopyStep(HASH, "config.json", "./conf/", None, None), workdir=str(workdir))
    run_copy(CopyStep(HASH, "a.txt", ".", None, None), workdir=str(workdir))
    run_copy(CopyStep(HASH, "b.txt", "sub/b2.txt", None, None), workdir=str(workdir))
    assert (workdir / "conf" / "config.json").exists()
    assert (workdir / "a.txt").exists()
    assert (workdir / "sub" / "b2.txt").read_text() == "b\n"


def test_copy_whole_context(run_copy: Any, guest: Path) -> None:
    run_copy(CopyStep(HASH, ".", f"{guest}/ctx", None, None))
    assert (guest / "ctx" / "app" / "main.py").exists()
    assert (guest / "ctx" / "my dir" / "file one.txt").exists()


def test_copy_path_with_spaces(run_copy: Any, guest: Path) -> None:
    run_copy(CopyStep(HASH, "my dir/file one.txt", f"{guest}/dest dir/", None, None))
    assert (guest / "dest dir" / "file one.txt").read_text() == "spaced\n"
    run_copy(CopyStep(HASH, "my dir", f"{guest}/whole dir", None, None))
    assert (guest / "whole dir" / "file one.txt").exists()


def test_copy_mode_and_owner(run_copy: Any, guest: Path) -> None:
    # Root can give files away; anyone else can only "give" them to themselves.
    uid = 4321 if os.geteuid() == 0 else os.geteuid()
    gid = 4321 if os.geteuid() == 0 else os.getegid()
    (guest / "opt").mkdir()
    before = (guest / "opt").stat()
    run_copy(CopyStep(HASH, "app", f"{guest}/opt/app/", f"{uid}:{gid}", 0o750))
    app = guest / "opt" / "app"
    for path in [app, app / "main.py", app / "pkg", app / "pkg" / "deep" / "mod.py"]:
        st = path.lstat()
        assert (st.st_uid, st.st_gid) == (uid, gid), path
        assert stat.S_IMODE(st.st_mode) == 0o750 or path == app, path
    # The symlink itself is re-owned, its target is untouched by chmod through it.
    assert (app / "link").lstat().st_uid == uid
    # What was already there keeps its owner and mode.
    after = (guest / "opt").stat()
    assert (after.st_uid, after.st_mode) == (before.st_uid, before.st_mode)
    # A bare user names the group too.
    owner = str(uid) if os.geteuid() == 0 else f"{uid}:{gid}"
    run_copy(CopyStep(HASH, "a.txt", f"{guest}/single.txt", owner, 0o600))
    st = (guest / "single.txt").stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (uid, gid, 0o600)


def test_copy_plain_tar(run_copy: Any, guest: Path) -> None:
    run_copy(CopyStep(HASH, "app", f"{guest}/plain/", None, None), gzip=False)
    assert (guest / "plain" / "main.py").exists()


def test_copy_failure_still_cleans_up(tmp_path: Path) -> None:
    archive = tmp_path / "x.tar"
    archive.write_bytes(b"not a tar archive at all" * 100)
    script = copy_script(CopyStep(HASH, "a", "/nowhere", None, None), str(archive), "/")
    result = subprocess.run(["/bin/sh", "-c", script], capture_output=True, check=False)
    assert result.returncode != 0
    assert list(tmp_path.iterdir()) == []


def test_copy_script_rejects_escaping_src() -> None:
    with pytest.raises(PlanError):
        copy_script(CopyStep(HASH, "../x", "/y", None, None), "/tmp/a.tar", "/")
