"""E2B's template tag routes (``tags`` in the SDK 2.63's API client): assign
(``POST /templates/tags``), remove (``DELETE /templates/tags``), list
(``GET /templates/{id}/tags``), and the counting and history routes ``tags/count``,
``tags/exists``, ``tags/groups`` and ``tags/{tag}/assignments``. Tags themselves are
:mod:`agentenv.orchestrator.tags`.

A tag's history here is its current assignment only: the repository keeps where each
tag points, not where it pointed before, so ``groups`` and ``assignments`` list one
assignment per tag (``hasMore`` false). A tag is "ready" when its build is still there,
which is every tag :meth:`TemplateTags.listing` answers. A template that does not exist
is a 404 on every route; so is an unknown tag on ``assignments`` (``exists`` answers
``false`` for one, which is what it is for). Built-in templates have no tags.
"""

from __future__ import annotations

import base64
import binascii
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime
from enum import StrEnum
from typing import Annotated

from fastapi import APIRouter, Query, Response
from fastapi.params import Depends
from pydantic import BaseModel, ConfigDict, Field

from agentenv.api.errors import ApiError
from agentenv.api.listing import position
from agentenv.api.models import (
    AssignedTemplateTags,
    AssignTemplateTagsRequest,
    DeleteTemplateTagsRequest,
    TemplateTag,
)
from agentenv.api.params import TemplateRef
from agentenv.limits import MAX_PAGE_SIZE, MAX_TOKEN_LENGTH
from agentenv.orchestrator.errors import Conflict, InvalidRequest, SnapshotNotFound, TagNotFound
from agentenv.orchestrator.orchestrator import Orchestrator
from agentenv.orchestrator.tags import MAX_TAG_LENGTH, TagView, normalize_tag, normalize_tags
from agentenv.orchestrator.templates import BUILTIN_TEMPLATES


class TemplateTagsCount(BaseModel):
    total: int = Field(description="distinct tags whose build is there")


class TemplateTagExists(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    exists: bool
    normalized_tag: str = Field(alias="normalizedTag")


class TemplateTagAssignment(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    assignment_id: str = Field(alias="assignmentId")
    build_id: str = Field(alias="buildId")
    assigned_at: datetime = Field(alias="assignedAt")
    build_created_at: datetime = Field(alias="buildCreatedAt")
    build_finished_at: datetime | None = Field(alias="buildFinishedAt")


class TemplateTagGroup(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    tag: str
    assignments: list[TemplateTagAssignment]
    has_more: bool = Field(alias="hasMore")


class TemplateTagGroups(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    tags: list[TemplateTagGroup]
    next_cursor: str | None = Field(alias="nextCursor")


class TemplateTagAssignments(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    data: list[TemplateTagAssignment]
    next_cursor: str | None = Field(alias="nextCursor")


class TagSort(StrEnum):
    """How ``tags/groups`` orders tags: by their latest assignment or by name."""

    LATEST_ASC = "latest_asc"
    LATEST_DESC = "latest_desc"
    NAME_ASC = "name_asc"
    NAME_DESC = "name_desc"


Cursor = Annotated[str | None, Query(min_length=1, max_length=MAX_TOKEN_LENGTH)]
_BAD_CURSOR = "not a cursor of this server (use nextCursor)"


def _assignment(name: str, view: TagView) -> TemplateTagAssignment:
    # Stable for as long as the tag points where it does, new when it moves.
    event = f"{name}:{view.tag}:{view.build_id}:{view.assigned_at.isoformat()}"
    return TemplateTagAssignment(
        assignmentId=str(uuid.uuid5(uuid.NAMESPACE_URL, event)),
        buildId=view.build_id,
        assignedAt=view.assigned_at,
        buildCreatedAt=view.build_created_at,
        buildFinishedAt=view.build_created_at,
    )


def _sort_key(sort: TagSort) -> Callable[[TagView], tuple[int, str]]:
    if sort in (TagSort.NAME_ASC, TagSort.NAME_DESC):
        return lambda v: (0, v.tag)
    return lambda v: (position(v.assigned_at, v.tag)[0], v.tag)


def _encode_cursor(sort: TagSort, key: tuple[int, str]) -> str:
    raw = f"{sort.value}|{key[0]}|{key[1]}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str, sort: TagSort) -> tuple[int, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        given_sort, when, tag = raw.split("|", 2)
        key = (int(when), tag)
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise ApiError(400, f"tagsCursor: {_BAD_CURSOR}") from None
    if given_sort != sort.value:
        raise ApiError(400, f"tagsCursor: given for sort={given_sort}, not sort={sort.value}")
    return key


async def not_snapshots(orchestrator: Orchestrator, names: list[str]) -> None:
    """:class:`Conflict` if any of ``names`` (a template's name, ``name:tag``) is a
    snapshot's: a name that starts sandboxes must mean one thing."""
    for taken in names:
        try:
            await orchestrator.get_snapshot(taken)
        except SnapshotNotFound:
            continue
        raise Conflict(f"the name {taken!r} is a snapshot's; a template needs another")


def template_tag_routes(orchestrator: Orchestrator, authed: Sequence[Depends]) -> APIRouter:
    router = APIRouter(tags=["tags"])

    async def tags_of(template_id: str) -> tuple[str, list[TagView]]:
        """The template's name and its tags; :class:`TemplateAliasNotFound` (404) if
        ``template_id`` names none."""
        if template_id in BUILTIN_TEMPLATES:
            return template_id, []
        name = await orchestrator.tags.family(template_id)
        return name, await orchestrator.tags.listing(name)

    @router.post(
        "/templates/tags",
        status_code=201,
        response_model=AssignedTemplateTags,
        response_model_by_alias=True,
        dependencies=list(authed),
    )
    async def assign_tags(body: AssignTemplateTagsRequest) -> AssignedTemplateTags:
        """Point ``tags`` at the build ``target`` (``name:tag``, or ``name`` for its
        default tag) names; 404 when it names none."""
        name = body.target.partition(":")[0]
        if name in BUILTIN_TEMPLATES:
            raise Conflict(f"{name!r} is built in and takes no tags")
        # "name:tag" must mean one thing: a snapshot's name, or this tag.
        await not_snapshots(orchestrator, [f"{name}:{tag}" for tag in normalize_tags(body.tags)])
        build_id, tags = await orchestrator.tags.assign(body.target, body.tags)
        return AssignedTemplateTags(tags=tags, buildID=build_id)

    @router.delete("/templates/tags", status_code=204, dependencies=list(authed))
    async def remove_tags(body: DeleteTemplateTagsRequest) -> Response:
        """Remove ``tags`` from template ``name``: all of them or, when it lacks one, none
        (404 naming it). ``default`` cannot be removed (400)."""
        await orchestrator.tags.remove(body.name, body.tags)
        return Response(status_code=204)

    @router.get(
        "/templates/{template_id:ref}/tags/count",
        response_model=TemplateTagsCount,
        dependencies=list(authed),
    )
    async def count_tags(template_id: TemplateRef) -> TemplateTagsCount:
        _, views = await tags_of(template_id)
        return TemplateTagsCount(total=len({v.tag for v in views}))

    @router.get(
        "/templates/{template_id:ref}/tags/exists",
        response_model=TemplateTagExists,
        response_model_by_alias=True,
        dependencies=list(authed),
    )
    async def tag_exists(
        template_id: TemplateRef,
        tag: Annotated[str, Query(min_length=1, max_length=MAX_TAG_LENGTH + 8)],
    ) -> TemplateTagExists:
        cleaned = normalize_tag(tag)
        _, views = await tags_of(template_id)
        return TemplateTagExists(exists=any(v.tag == cleaned for v in views), normalizedTag=cleaned)

    @router.get(
        "/templates/{template_id:ref}/tags/groups",
        response_model=TemplateTagGroups,
        response_model_by_alias=True,
        dependencies=list(authed),
    )
    async def tag_groups(
        template_id: TemplateRef,
        assignment_limit: Annotated[int, Query(alias="assignmentLimit", ge=1, le=100)] = 6,
        tags_limit: Annotated[int, Query(alias="tagsLimit", ge=1, le=MAX_PAGE_SIZE)] = 25,
        tags_cursor: Annotated[str | None, Query(alias="tagsCursor", max_length=256)] = None,
        search: Annotated[str | None, Query(max_length=MAX_TAG_LENGTH)] = None,
        sort: TagSort = TagSort.LATEST_DESC,
    ) -> TemplateTagGroups:
        """The template's tags, each with its assignment, ``tagsLimit`` a page, those
        holding ``search`` (case-insensitive) only."""
        del assignment_limit  # one assignment a tag (see the module's docstring)
        name, views = await tags_of(template_id)
        if search:
            views = [v for v in views if search.strip().lower() in v.tag]
        key = _sort_key(sort)
        descending = sort in (TagSort.LATEST_DESC, TagSort.NAME_DESC)
        views.sort(key=key, reverse=descending)
        if tags_cursor:
            after = _decode_cursor(tags_cursor, sort)
            views = [v for v in views if (key(v) < after if descending else key(v) > after)]
        next_cursor = None
        if len(views) > tags_limit:
            views = views[:tags_limit]
            next_cursor = _encode_cursor(sort, key(views[-1]))
        groups = [
            TemplateTagGroup(tag=v.tag, assignments=[_assignment(name, v)], hasMore=False)
            for v in views
        ]
        return TemplateTagGroups(tags=groups, nextCursor=next_cursor)

    @router.get(
        "/templates/{template_id:ref}/tags/{tag}/assignments",
        response_model=TemplateTagAssignments,
        response_model_by_alias=True,
        dependencies=list(authed),
    )
    async def tag_assignments(
        template_id: TemplateRef,
        tag: str,
        cursor: Cursor = None,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE)] = 50,
    ) -> TemplateTagAssignments:
        """The tag's assignments, newest first; 404 for a tag the template lacks."""
        del limit  # one assignment a tag: never more than a page
        if cursor is not None:
            # This route never hands out a cursor (one page holds everything).
            raise InvalidRequest(f"cursor: {_BAD_CURSOR}")
        cleaned = normalize_tag(tag)
        name, views = await tags_of(template_id)
        found = [v for v in views if v.tag == cleaned]
        if not found:
            raise TagNotFound(f"template {name!r} has no tag {cleaned!r}")
        return TemplateTagAssignments(data=[_assignment(name, found[0])], nextCursor=None)

    @router.get(
        "/templates/{template_id:ref}/tags",
        response_model=list[TemplateTag],
        response_model_by_alias=True,
        dependencies=list(authed),
    )
    async def list_tags(template_id: TemplateRef) -> list[TemplateTag]:
        """The tags of the template a name, ``name:tag`` or build id refers to."""
        _, views = await tags_of(template_id)
        return [TemplateTag(tag=v.tag, buildID=v.build_id, createdAt=v.assigned_at) for v in views]

    return router
