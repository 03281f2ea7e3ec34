"""Template listings and look-ups (``GET /v2/templates``, ``GET /templates``,
``GET /templates/{id}``): one entry per template, as E2B lists them, not one per build.

Here every build of a template is its own record (its id is the build's template id),
and the builds of one template share its name (:func:`agentenv.orchestrator.tags.family_of`).
An entry stands for the name:

- ``templateID`` and ``buildID`` are those of the build the name starts (its ``default``
  tag), or of its newest build when no build has the default tag (a template built only
  as ``name:v1``), so ``Sandbox.create(template=entry.templateID)`` starts what the name
  starts;
- ``names`` and ``aliases`` are ``[name]``; ``buildCount`` counts the name's builds,
  committed or in progress; ``createdAt`` is the first build's time, ``updatedAt`` the
  last one's;
- ``buildStatus`` is ``ready`` once a build of the name is committed, unless a newer one
  is in progress (``waiting``/``building``); a failed rebuild leaves it ``ready`` (the
  template still starts). A name with no committed build shows its latest build's status.

``GET /templates/{id}`` answers the entry with every build of the template in
``builds``, newest first. ``GET /v2/templates`` pages with ``limit`` and ``nextToken``
(oldest first, the order it has always listed in).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query, Response
from fastapi.params import Depends

from agentenv.api.listing import page, position
from agentenv.api.models import TemplateBuildSummary, TemplateInfo, TemplateWithBuilds
from agentenv.api.params import NextToken, TemplateRef
from agentenv.limits import MAX_PAGE_SIZE
from agentenv.orchestrator.builds import Build, BuildManager
from agentenv.orchestrator.errors import SnapshotNotFound, TemplateAliasNotFound
from agentenv.orchestrator.orchestrator import Orchestrator
from agentenv.orchestrator.tags import TEMPLATE_NAME_KEY
from agentenv.orchestrator.templates import BUILTIN_TEMPLATES
from agentenv.orchestrator.views import SnapshotView

# E2B's default page size of GET /v2/templates (the SDK sends limit=100 too).
DEFAULT_TEMPLATE_PAGE_SIZE = 100
_IN_PROGRESS = ("waiting", "building")


@dataclass
class _Family:
    """What is known of one template name: its committed builds and those this node
    is running or ran."""

    name: str
    committed: list[SnapshotView] = field(default_factory=list)
    builds: list[Build] = field(default_factory=list)
    # The record id of the build the name starts, if one has the default tag.
    default: str | None = None


def template_listing_routes(
    orchestrator: Orchestrator, builds: BuildManager, authed: Sequence[Depends]
) -> APIRouter:
    router = APIRouter(tags=["templates"])

    async def families() -> dict[str, _Family]:
        found: dict[str, _Family] = {}
        for view in await orchestrator.list_snapshots(type_="template"):
            name = _family_name(view)
            found.setdefault(name, _Family(name)).committed.append(view)
        for build in builds.builds():
            if build.status == "ready" and build.name not in found:
                continue  # committed, then deleted
            found.setdefault(build.name, _Family(build.name)).builds.append(build)
        for family in found.values():
            if family.committed:
                family.default = await orchestrator.tags.default_build(family.name)
        return found

    def builtin_infos() -> list[TemplateInfo]:
        infos = []
        for builtin in BUILTIN_TEMPLATES:
            base = orchestrator.store.get_template(builtin)
            if base is None:
                continue
            infos.append(
                TemplateInfo(
                    templateID=builtin,
                    buildID=base.build_id,
                    cpuCount=base.vcpus,
                    memoryMB=base.memory_mib,
                    diskSizeMB=base.disk_size_mib,
                    aliases=[builtin],
                    names=[builtin],
                    createdAt=base.created_at,
                    updatedAt=base.created_at,
                    envdVersion=base.envd_version,
                    buildStatus="ready",
                )
            )
        return infos

    async def template_infos() -> list[TemplateInfo]:
        infos = builtin_infos()
        infos += [_family_info(f) for f in (await families()).values()]
        return sorted(infos, key=lambda i: (i.created_at, i.template_id))

    @router.get(
        "/templates",
        response_model=list[TemplateInfo],
        response_model_by_alias=True,
        dependencies=list(authed),
    )
    async def list_templates_v1() -> list[TemplateInfo]:
        return await template_infos()

    @router.get(
        "/v2/templates",
        response_model=list[TemplateInfo],
        response_model_by_alias=True,
        dependencies=list(authed),
    )
    async def list_templates(
        response: Response,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE)] = DEFAULT_TEMPLATE_PAGE_SIZE,
        next_token: NextToken = None,
        team_id: Annotated[str | None, Query(alias="teamID", max_length=200)] = None,
    ) -> list[TemplateInfo]:
        """Every template once; ``teamID`` is accepted and ignored (one team)."""
        del team_id
        infos = await template_infos()
        return page(infos, _info_key, "asc", next_token, limit, response)

    async def family_of_ref(ref: str) -> tuple[_Family | None, SnapshotView | None]:
        """The template ``ref`` (an id, a name, ``name:tag``) belongs to, and the
        committed build it names, if it names one."""
        known = await families()
        with contextlib.suppress(SnapshotNotFound):
            view = await orchestrator.get_snapshot(ref, "template")
            return known.get(_family_name(view)), view
        for family in known.values():
            if ref == family.name or any(b.template_id == ref for b in family.builds):
                return family, None
        return None, None

    @router.get(
        "/templates/{template_id:ref}",
        response_model=TemplateWithBuilds,
        response_model_by_alias=True,
        dependencies=list(authed),
    )
    async def get_template(template_id: TemplateRef) -> TemplateWithBuilds:
        """The template ``template_id`` names, with all its builds (newest first); its
        ``templateID`` and ``buildID`` are those of the build ``template_id`` starts (a
        name: its default build; ``name:tag``: the tagged one; a build's id: that build)."""
        for builtin in builtin_infos():
            if builtin.template_id == template_id:
                return TemplateWithBuilds(**builtin.model_dump(), builds=[_summary_of(builtin)])
        family, named = await family_of_ref(template_id)
        if family is None:
            raise TemplateAliasNotFound(template_id)
        info = _family_info(family, named)
        summaries = [_committed_summary(v) for v in family.committed]
        committed_ids = {v.snapshot_id for v in family.committed}
        summaries += [
            _build_summary(b) for b in family.builds if b.template_id not in committed_ids
        ]
        summaries.sort(key=lambda s: s.created_at, reverse=True)
        return TemplateWithBuilds(**info.model_dump(), builds=summaries)

    return router


def _family_name(view: SnapshotView) -> str:
    meta = view.record.metadata
    return meta.get(TEMPLATE_NAME_KEY) or (view.names[0] if view.names else view.snapshot_id)


def _info_key(info: TemplateInfo) -> tuple[int, str]:
    return position(info.created_at, info.template_id)


def _family_info(family: _Family, named: SnapshotView | None = None) -> TemplateInfo:
    """The entry of ``family``, its ids those of the build ``named`` if given."""
    committed_ids = {v.snapshot_id for v in family.committed}
    running = [b for b in family.builds if b.template_id not in committed_ids]
    latest_run = max(running, key=lambda b: b.created_at, default=None)
    if family.committed:
        default = [v for v in family.committed if v.snapshot_id == family.default]
        chosen = named or max(default or family.committed, key=lambda v: v.record.created_at)
        info = _snapshot_info(chosen, family.name)
        status = info.build_status
        newest = max(v.record.created_at for v in family.committed)
        if latest_run is not None and latest_run.status in _IN_PROGRESS:
            status = latest_run.status  # type: ignore[assignment]
        times = [v.record.created_at for v in family.committed] + [b.created_at for b in running]
        return info.model_copy(
            update={
                "build_count": len(family.committed)
                + sum(b.status in _IN_PROGRESS for b in running),
                "created_at": min(times),
                "updated_at": max([newest] + [_aware(b.updated_at) for b in running]),
                "build_status": status,
            }
        )
    assert latest_run is not None  # a family has a committed build or a build
    return _build_info(latest_run).model_copy(update={"build_count": len(running)})


def _aware(when: datetime) -> datetime:
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def _snapshot_info(view: SnapshotView, name: str) -> TemplateInfo:
    rec = view.record
    meta = rec.metadata
    return TemplateInfo(
        templateID=rec.snapshot_id,
        buildID=meta.get("buildID", rec.snapshot_id),
        cpuCount=int(meta.get("cpuCount", "0") or 0),
        memoryMB=int(meta.get("memoryMB", "0") or 0),
        diskSizeMB=int(meta.get("diskSizeMB", "0") or 0),
        aliases=[name],
        names=[name],
        createdAt=rec.created_at,
        updatedAt=rec.created_at,
        envdVersion=meta.get("envdVersion", ""),
        buildStatus="ready",
    )


def _build_info(build: Build) -> TemplateInfo:
    return TemplateInfo(
        templateID=build.template_id,
        buildID=build.build_id,
        cpuCount=build.cpu_count,
        memoryMB=build.memory_mb,
        diskSizeMB=0,
        aliases=[build.name],
        names=[build.name],
        createdAt=build.created_at,
        updatedAt=build.updated_at or datetime.now(UTC),
        envdVersion="",
        buildStatus=build.status,  # type: ignore[arg-type]
    )


def _summary_of(info: TemplateInfo) -> TemplateBuildSummary:
    return TemplateBuildSummary(
        buildID=info.build_id,
        status=info.build_status,
        createdAt=info.created_at,
        updatedAt=info.updated_at,
        cpuCount=info.cpu_count,
        memoryMB=info.memory_mb,
        diskSizeMB=info.disk_size_mb,
        envdVersion=info.envd_version,
    )


def _committed_summary(view: SnapshotView) -> TemplateBuildSummary:
    return _summary_of(_snapshot_info(view, ""))


def _build_summary(build: Build) -> TemplateBuildSummary:
    return _summary_of(_build_info(build))
