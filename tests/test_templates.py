"""Templates built through E2B's build API by the unmodified SDK and by the ``aenv`` CLI,
from an OCI image served by a local registry (built from Debian packages by the test
setup): steps run, files copied, environment, working directory and a live start
process end up in sandboxes made from the template; tags (sync and async SDK) and start
commands that exit."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import AsyncSandbox, AsyncTemplate, Sandbox, Template, wait_for_file, wait_for_timeout
from e2b.api import client_async, client_sync
from e2b.api.client.api.tags import (
    get_templates_template_id_tags_count,
    get_templates_template_id_tags_exists,
    get_templates_template_id_tags_groups,
    get_templates_template_id_tags_tag_assignments,
)
from e2b.api.client.api.templates import get_templates, get_v2_templates
from e2b.api.client.models import Template as ListedTemplate
from e2b.connection_config import ConnectionConfig
from e2b.exceptions import BuildException, SandboxException, TemplateException
from e2b.template.main import TemplateClass

from tests.e2b.support import sdk_opts
from tests.helpers import ROOT, ServerProcess, live_server
from tests.registry import LocalRegistry, push_test_image, start_registry

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def registry(test_root: Path) -> Iterator[LocalRegistry]:
    with start_registry(test_root / "registry") as reg:
        yield reg


@pytest.fixture(scope="module")
def image(registry: LocalRegistry) -> str:
    return push_test_image(registry)


@pytest.fixture(scope="module")
def node(test_root: Path, guest_image: None) -> Iterator[ServerProcess]:
    with live_server(ServerProcess(home=test_root / "templates-node")) as srv:
        yield srv


def build_opts(node: ServerProcess) -> dict[str, Any]:
    return {k: v for k, v in sdk_opts(node).items() if k != "sandbox_url"}


def test_sdk_builds_a_template_from_an_image(
    node: ServerProcess, image: str, tmp_path: Path
) -> None:
    context = tmp_path / "context"
    (context / "conf").mkdir(parents=True)
    (context / "hello.txt").write_text("hello from the build context\n")
    (context / "conf" / "app.toml").write_text("answer = 42\n")
    name = "sdk-image-template"
    template = (
        Template(file_context_path=str(context))
        .from_image(image)
        # Steps run as "user" (E2B's default) unless told otherwise; WORKDIR creates
        # the directory for them.
        .set_workdir("/srv/app")
        .run_cmd("echo built > built.txt && whoami > /tmp/build-user.txt")
        .run_cmd("mkdir -p /opt/root-only && whoami > /opt/root-only/who", user="root")
        .set_envs({"AENV_BUILD_MARKER": "from-build"})
        .copy("hello.txt", "/srv/app/hello.txt")
        .copy("conf", "/srv/app/conf")
        .run_cmd("pwd > /srv/app/workdir.txt && echo $AENV_BUILD_MARKER > /srv/app/env.txt")
        .set_start_cmd(
            "sh -c 'echo $$ > /tmp/start.pid; "
            "while true; do date +%s > /tmp/.alive; mv /tmp/.alive /tmp/alive; sleep 1; done'",
            wait_for_file("/tmp/alive"),
        )
    )
    logs: list[str] = []
    info = Template.build(
        template,
        name,
        cpu_count=2,
        memory_mb=512,
        on_build_logs=lambda entry: logs.append(entry.message),
        **build_opts(node),
    )
    assert info.template_id and info.build_id
    assert any("step" in line for line in logs), logs

    sandbox = Sandbox.create(template=name, timeout=300, **sdk_opts(node))
    try:
        run = sandbox.commands.run
        assert run("cat built.txt").stdout == "built\n"  # default workdir
        assert run("cat /tmp/build-user.txt").stdout == "user\n"
        assert run("whoami").stdout == "user\n"
        assert run("cat /opt/root-only/who").stdout == "root\n"
        assert run("pwd").stdout.strip() == "/srv/app"
        assert run("cat /srv/app/workdir.txt").stdout.strip() == "/srv/app"
        assert run("echo $AENV_BUILD_MARKER").stdout.strip() == "from-build"
        assert run("cat /srv/app/env.txt").stdout.strip() == "from-build"
        # The image's own environment and layers.
        assert run("echo $AENV_IMAGE_MARKER").stdout.strip() != ""
        assert run("cat /opt/agentenv-test/layer2.txt").stdout == "hello from layer 2\n"
        assert run("test ! -e /etc/agentenv-test/layer1-only.txt").exit_code == 0
        # COPY: a file and a directory.
        assert run("cat hello.txt").stdout == "hello from the build context\n"
        assert run("cat conf/app.toml").stdout == "answer = 42\n"
        # The start process runs on in the sandbox.
        pid = run("cat /tmp/start.pid").stdout.strip()
        assert run(f"test -d /proc/{pid}").exit_code == 0
        first = int(run("cat /tmp/alive").stdout)
        time.sleep(2.5)
        assert int(run("cat /tmp/alive").stdout) > first
    finally:
        sandbox.kill()

    with httpx.Client(
        base_url=node.url, headers={"X-API-Key": node.api_key}, trust_env=False, timeout=60
    ) as c:
        listed = c.get("/v2/templates").json()
        ours = [t for t in listed if name in t["names"]]
        assert len(ours) == 1 and ours[0]["buildStatus"] == "ready", listed
        assert ours[0]["templateID"] == info.template_id
        alias = c.get(f"/templates/aliases/{name}").json()
        assert alias["templateID"] == info.template_id
        detail = c.get(f"/templates/{info.template_id}").json()
        assert detail["builds"][0]["status"] == "ready"
        assert c.delete(f"/templates/{name}").status_code == 204
        assert name not in [n for t in c.get("/v2/templates").json() for n in t["names"]]
        r = c.post("/sandboxes", json={"templateID": name})
        assert r.status_code == 400, r.text


def test_build_from_a_template(node: ServerProcess) -> None:
    """FROM another template: the built-in one here (what the SDK's default base image
    also maps to), then a template built from that."""
    first = Template().from_template("base").run_cmd("echo one > /home/user/layers.txt")
    Template.build(first, "derived-one", **build_opts(node))
    second = (
        Template()
        .from_template("derived-one")
        .run_cmd("echo two >> /home/user/layers.txt", user="user")
    )
    Template.build(second, "derived-two", **build_opts(node))
    sandbox = Sandbox.create(template="derived-two", timeout=120, **sdk_opts(node))
    try:
        assert sandbox.commands.run("cat /home/user/layers.txt").stdout == "one\ntwo\n"
    finally:
        sandbox.kill()
    for name in ("derived-two", "derived-one"):
        # The SDK deletes templates through the route snapshots share.
        assert Sandbox.delete_snapshot(name, **sdk_opts(node)) is True
        with httpx.Client(
            base_url=node.url, headers={"X-API-Key": node.api_key}, trust_env=False
        ) as c:
            assert c.get(f"/templates/aliases/{name}").status_code == 404


def test_failing_step_reports_the_step_and_the_error(node: ServerProcess, image: str) -> None:
    template = (
        Template()
        .from_image(image)
        .run_cmd("echo fine")
        .run_cmd("echo about to fail >&2; exit 3")
        .run_cmd("echo never")
    )
    with pytest.raises(BuildException) as failure:
        Template.build(template, "failing-template", **build_opts(node))
    message = str(failure.value)
    assert "step 2" in message and "exited with code 3" in message, message
    with httpx.Client(base_url=node.url, headers={"X-API-Key": node.api_key}, trust_env=False) as c:
        names = [n for t in c.get("/v2/templates").json() for n in t["names"]]
        ready = [
            t for t in c.get("/v2/templates").json()
            if "failing-template" in t["names"] and t["buildStatus"] == "ready"
        ]  # fmt: skip
        assert not ready, names


def test_start_command_that_fails_before_it_is_ready_fails_the_build(
    node: ServerProcess, image: str
) -> None:
    template = Template().from_image(image).set_start_cmd("echo dying; exit 1", "false")
    with pytest.raises(BuildException) as failure:
        Template.build(template, "dying-start", **build_opts(node))
    assert "exited with code 1 before the template was ready" in str(failure.value)
    assert "dying" in str(failure.value)


def test_tags_with_the_sync_sdk(node: ServerProcess) -> None:
    """Build with tags, name:tag wherever a template is named, assign, remove and list
    tags, the default tag; and a start command that exits at once (``echo ready``) with
    a ready check that waits: readiness decides, as in E2B."""
    opts = build_opts(node)

    def layer(text: str) -> TemplateClass:
        return (
            Template()
            .from_template("base")
            .run_cmd(f"echo {text} > /home/user/which")
            .set_start_cmd("echo ready > /tmp/started", wait_for_timeout(1000))
        )

    first = Template.build(layer("one"), "tagged", **opts)
    assert first.tags == ["default"]
    second = Template.build(layer("two"), "tagged:V2", tags=["canary"], **opts)
    assert sorted(second.tags) == ["canary", "v2"]

    # Listed once (v1 and v2 listings), as the build the name starts; the SDK's own
    # API client parses every entry, and the tag count and history routes.
    api = client_sync.get_api_client(ConnectionConfig(**opts))
    for listed in (get_v2_templates.sync(client=api), get_templates.sync(client=api)):
        assert isinstance(listed, list)
        ours = [t for t in listed if isinstance(t, ListedTemplate) and "tagged" in t.names]
        assert len(ours) == 1, listed
        assert ours[0].template_id == first.template_id and ours[0].build_count == 2
    count = get_templates_template_id_tags_count.sync("tagged", client=api)
    assert count is not None and getattr(count, "total", None) == 3
    exists = get_templates_template_id_tags_exists.sync("tagged", client=api, tag="Canary")
    assert getattr(exists, "exists", None) is True
    assert getattr(exists, "normalized_tag", None) == "canary"
    groups = get_templates_template_id_tags_groups.sync("tagged", client=api)
    assert {g.tag: str(g.assignments[0].build_id) for g in getattr(groups, "tags", [])} == {
        "default": first.build_id,
        "v2": second.build_id,
        "canary": second.build_id,
    }
    history = get_templates_template_id_tags_tag_assignments.sync("tagged", "v2", client=api)
    assert [str(a.build_id) for a in getattr(history, "data", [])] == [second.build_id]
    unknown = get_templates_template_id_tags_tag_assignments.sync_detailed(
        "tagged", "nope", client=api
    )
    assert unknown.status_code == 404

    def which(template: str) -> str:
        sandbox = Sandbox.create(template=template, timeout=120, **sdk_opts(node))
        try:
            assert sandbox.commands.run("cat /tmp/started").stdout == "ready\n"
            return sandbox.commands.run("cat /home/user/which").stdout.strip()
        finally:
            sandbox.kill()

    # "tagged" is "tagged:default": the build without tags; v2 and canary the second.
    assert which("tagged") == "one"
    assert which("tagged:v2") == "two"
    tags = {t.tag: t.build_id for t in Template.get_tags(second.template_id, **opts)}
    assert tags == {"default": first.build_id, "v2": second.build_id, "canary": second.build_id}

    assigned = Template.assign_tags("tagged:v2", ["stable", "default"], **opts)
    assert assigned.build_id == second.build_id and sorted(assigned.tags) == ["default", "stable"]
    assert which("tagged") == "two"
    Template.remove_tags("tagged", "canary", **opts)
    assert "canary" not in {t.tag for t in Template.get_tags("tagged", **opts)}
    with pytest.raises(TemplateException, match="404"):
        Template.remove_tags("tagged", ["canary"], **opts)
    with pytest.raises(TemplateException, match="400"):
        Template.remove_tags("tagged", ["default"], **opts)
    with pytest.raises(TemplateException, match="404"):
        Template.assign_tags("tagged:nope", "x", **opts)
    with pytest.raises(SandboxException, match="404"):
        Sandbox.create(template="tagged:canary", **sdk_opts(node))
    assert Template.exists("tagged:stable", **opts)

    assert Sandbox.delete_snapshot("tagged:stable", **sdk_opts(node)) is True
    assert not Template.exists("tagged", **opts)
    with pytest.raises(TemplateException, match="404"):
        Template.get_tags("tagged", **opts)


async def test_tags_with_the_async_sdk(node: ServerProcess) -> None:
    opts = build_opts(node)
    template = Template().from_template("base").run_cmd("echo async > /home/user/which")
    # Only a tag: the template has no default build yet.
    built = await AsyncTemplate.build(template, "atagged:v1", **opts)
    assert built.tags == ["v1"]
    with pytest.raises(SandboxException):
        await AsyncSandbox.create(template="atagged", **sdk_opts(node))
    sandbox = await AsyncSandbox.create(template="atagged:v1", timeout=120, **sdk_opts(node))
    try:
        assert (await sandbox.commands.run("cat /home/user/which")).stdout == "async\n"
    finally:
        await sandbox.kill()
    api = client_async.get_api_client(ConnectionConfig(**opts))
    listed = await get_v2_templates.asyncio(client=api)
    assert isinstance(listed, list)
    (ours,) = [t for t in listed if isinstance(t, ListedTemplate) and "atagged" in t.names]
    assert ours.template_id == built.template_id  # no default build: its only one
    assigned = await AsyncTemplate.assign_tags("atagged:v1", "default", **opts)
    assert assigned.build_id == built.build_id
    count = await get_templates_template_id_tags_count.asyncio("atagged", client=api)
    assert getattr(count, "total", None) == 2
    missing = await get_templates_template_id_tags_exists.asyncio("atagged", client=api, tag="v9")
    assert getattr(missing, "exists", None) is False
    gone = await get_templates_template_id_tags_count.asyncio_detailed("nowhere", client=api)
    assert gone.status_code == 404
    tags = {t.tag: t.build_id for t in await AsyncTemplate.get_tags("atagged", **opts)}
    assert tags == {"default": built.build_id, "v1": built.build_id}
    await AsyncTemplate.remove_tags("atagged", "v1", **opts)
    with pytest.raises(TemplateException, match="404"):
        await AsyncTemplate.remove_tags("atagged", "v1", **opts)
    sandbox = await AsyncSandbox.create(template="atagged", timeout=120, **sdk_opts(node))
    await sandbox.kill()
    assert await AsyncSandbox.delete_snapshot("atagged", **sdk_opts(node)) is True


def aenv(
    node: ServerProcess, *args: str, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(cwd or ROOT),
        "AENV_SERVER": node.url,
        "AENV_API_KEY": node.api_key,
    }
    return subprocess.run(
        [sys.executable, "-m", "agentenv.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=cwd or ROOT,
    )


def test_cli_pull_and_dockerfile_build(node: ServerProcess, image: str, tmp_path: Path) -> None:
    pulled = aenv(node, "pull", image, "--name", "cli-pulled", "--output", "json")
    assert pulled.returncode == 0, pulled.stderr
    assert json.loads(pulled.stdout)["name"] == "cli-pulled"
    started = aenv(node, "start", "cli-pulled", "--detach")
    assert started.returncode == 0, started.stderr
    sandbox_id = started.stdout.strip()
    out = aenv(node, "exec", sandbox_id, "--", "cat /opt/agentenv-test/layer2.txt")
    assert out.stdout == "hello from layer 2\n", out.stderr
    aenv(node, "rm", sandbox_id)

    (tmp_path / "greeting.txt").write_text("copied by a Dockerfile\n")
    (tmp_path / "Dockerfile").write_text(
        f"FROM {image}\n"
        "ENV GREETING=dockerfile\n"
        "RUN mkdir -p /work && echo $GREETING > /work/env.txt\n"
        "WORKDIR /work\n"
        "COPY greeting.txt /work/greeting.txt\n"
    )
    built = aenv(node, "template", "build", str(tmp_path / "Dockerfile"), "--name", "cli-built")
    assert built.returncode == 0, built.stderr
    listed = aenv(node, "template", "ls", "--output", "json")
    assert "cli-built" in listed.stdout, listed.stdout
    started = aenv(node, "start", "cli-built", "--detach")
    assert started.returncode == 0, started.stderr
    sandbox_id = started.stdout.strip()
    out = aenv(node, "exec", sandbox_id, "--", "cat env.txt greeting.txt; echo $GREETING")
    assert out.stdout == "dockerfile\ncopied by a Dockerfile\ndockerfile\n", out.stderr
    aenv(node, "rm", sandbox_id)
    removed = aenv(node, "template", "rm", "cli-built")
    assert removed.returncode == 0, removed.stderr
