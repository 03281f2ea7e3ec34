"""``aenv template`` (ls, rm, build), ``aenv pull`` and ``aenv snapshot``: the things
sandboxes start from. Templates are built through the ``e2b`` SDK's ``Template`` (imported
by the commands that build, never at import time); listings and deletions go through
``ControlPlane``. It owns these commands only; ``main`` adds them to the ``aenv`` app by
``register``. It must not touch server internals or the sandbox commands."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from agentenv.cli.command_helpers import (
    JsonObject,
    Output,
    SandboxId,
    busy,
    control_plane,
    print_ids,
    remove_each,
)
from agentenv.cli.errors import CliError, ExitCode, translate
from agentenv.cli.output import OutputFormat, ago, as_sent, note, print_json, table, use_output

if TYPE_CHECKING:
    from agentenv.cli.api import ControlPlane

template_app = typer.Typer(help="Templates (and snapshots, which start sandboxes too).")
snapshot_app = typer.Typer(help="Persistent snapshots of running sandboxes.", no_args_is_help=True)


@template_app.command("ls")
def template_ls(output: Output = None) -> None:
    """List templates (built in, built from images and Dockerfiles) with their state,
    and the snapshots that serve as templates."""
    fmt = use_output(output)
    with control_plane() as cp:
        health_templates = cp.health().templates
        built = cp.list_templates()
        snapshots = cp.list_snapshots()
    items: list[JsonObject] = [
        {
            "templateID": t.template_id,
            "kind": "template",
            "state": t.build_status,
            "names": [n for n in t.names if n != t.template_id],
            "createdAt": as_sent(t.created_at),
        }
        for t in built
    ]
    listed = {t.template_id for t in built}
    items += [
        {"templateID": name, "kind": "template", "state": state, "names": []}
        for name, state in health_templates.items()
        if name not in listed
    ]
    items += [
        {
            "templateID": snap.snapshot_id,
            "kind": "snapshot",
            "state": "ready",
            "names": snap.names,
            "sandboxID": snap.sandbox_id,
            "createdAt": as_sent(snap.created_at),
        }
        for snap in snapshots
    ]
    if fmt is OutputFormat.JSON:
        print_json(items)
        return
    table(
        ("TEMPLATE", "KIND", "STATE", "NAMES", "FROM SANDBOX", "CREATED"),
        [
            (
                item["templateID"],
                item["kind"],
                item["state"],
                ", ".join(item["names"]) or "-",
                item.get("sandboxID") or "-",
                ago(item.get("createdAt")),
            )
            for item in items
        ],
    )


@template_app.command("rm")
def template_rm(
    names: Annotated[list[str], typer.Argument(metavar="NAME", help="template or snapshot")],
    output: Output = None,
) -> None:
    """Delete templates (snapshots; built-in templates cannot be deleted)."""
    use_output(output)
    with control_plane() as cp:
        remove_each(names, cp.delete_template)


def build_template(
    cp: ControlPlane, template: Any, name: str, cpus: int | None, memory: int | None
) -> JsonObject:
    """Build ``template`` (an SDK ``Template``) on the server under ``name``, printing
    its build log on stderr when that is a terminal; the template's ids."""
    from e2b import Template
    from e2b.exceptions import BuildException

    show_logs = sys.stderr.isatty()

    def on_log(entry: Any) -> None:
        if show_logs:
            print(f"{entry.level:>5} {entry.message}", file=sys.stderr)

    try:
        info = Template.build(
            template,
            name,
            cpu_count=cpus or 2,
            memory_mb=memory or 512,
            on_build_logs=on_log,
            **{k: v for k, v in cp.sdk_options().items() if k != "sandbox_url"},
        )
    except BuildException as exc:
        raise CliError(f"build of {name!r} failed: {exc}") from exc
    except Exception as exc:
        raise translate(exc, cp.server) from exc
    return {"templateID": info.template_id, "buildID": info.build_id, "name": name}


Cpus = Annotated[int | None, typer.Option("--cpu", help="vCPUs of the template's sandboxes")]
MemoryMB = Annotated[int | None, typer.Option("--memory", help="RAM in MiB of its sandboxes")]


@template_app.command("build")
def template_build(
    dockerfile: Annotated[Path, typer.Argument(help="Dockerfile (its directory is the context)")],
    name: Annotated[str, typer.Option("--name", "-n", help="template name")],
    cpu: Cpus = None,
    memory: MemoryMB = None,
    output: Output = None,
) -> None:
    """Build a template from a Dockerfile: FROM, RUN, ENV, WORKDIR, USER, COPY, CMD."""
    use_output(output)
    from e2b import Template

    if not dockerfile.is_file():
        raise CliError(f"{dockerfile}: no such file", ExitCode.NOT_FOUND)
    try:
        template = Template(file_context_path=str(dockerfile.parent)).from_dockerfile(
            str(dockerfile)
        )
    except Exception as exc:
        raise CliError(f"{dockerfile}: {exc}", ExitCode.USAGE) from exc
    with control_plane() as cp, busy(f"building {name}"):
        result = build_template(cp, template, name, cpu, memory)
    print_ids([result["templateID"]], result)


def pull(
    image: Annotated[str, typer.Argument(help="OCI image, e.g. registry:5000/team/app:1")],
    name: Annotated[str, typer.Option("--name", "-n", help="template name")],
    cpu: Cpus = None,
    memory: MemoryMB = None,
    output: Output = None,
) -> None:
    """Make a template from an OCI image (pulled by the server, cached by digest)."""
    use_output(output)
    from e2b import Template

    with control_plane() as cp, busy(f"pulling {image}"):
        result = build_template(cp, Template().from_image(image), name, cpu, memory)
    print_ids([result["templateID"]], result)


@snapshot_app.command("create")
def snapshot_create(
    sandbox_id: SandboxId,
    name: Annotated[str | None, typer.Option("--name", help="name to start sandboxes by")] = None,
    output: Output = None,
) -> None:
    """Snapshot a running sandbox (it keeps running); prints the snapshot id."""
    use_output(output)
    with control_plane() as cp, busy(f"snapshotting {sandbox_id}"):
        snapshot = cp.create_snapshot(sandbox_id, name)
    print_ids([snapshot.snapshot_id], as_sent(snapshot))


@snapshot_app.command("ls")
def snapshot_ls(
    sandbox_id: Annotated[
        str | None, typer.Option("--sandbox", help="only this sandbox's snapshots")
    ] = None,
    output: Output = None,
) -> None:
    """List snapshots."""
    fmt = use_output(output)
    with control_plane() as cp:
        items = cp.list_snapshots(sandbox_id)
    if fmt is OutputFormat.JSON:
        print_json([as_sent(item) for item in items])
        return
    if not items:
        note("no snapshots")
        return
    table(
        ("SNAPSHOT", "NAMES", "SANDBOX", "TEMPLATE", "CREATED"),
        [
            (
                item.snapshot_id,
                ", ".join(item.names) or "-",
                item.sandbox_id or "-",
                item.template_id or "-",
                ago(item.created_at),
            )
            for item in items
        ],
    )


@snapshot_app.command("rm")
def snapshot_rm(
    snapshot_ids: Annotated[list[str], typer.Argument(metavar="SNAPSHOT", help="id or name")],
    output: Output = None,
) -> None:
    """Delete snapshots (their files go once no sandbox uses them)."""
    use_output(output)
    with control_plane() as cp:
        remove_each(snapshot_ids, cp.delete_snapshot)


def register(app: typer.Typer) -> None:
    """Add ``pull`` and the ``template`` and ``snapshot`` groups to ``app``."""
    app.command()(pull)
    app.add_typer(template_app, name="template", no_args_is_help=True)
    app.add_typer(snapshot_app, name="snapshot")
