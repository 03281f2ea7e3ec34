"""Template tags as E2B defines them: a template name's builds carry tags (``v1``,
``stable``), ``name:tag`` names the build a tag points at wherever a template is named,
and ``name`` alone is ``name:default``. A build asked for with no tag gets ``default``;
one asked for as ``name:v2`` (or with ``tags``) gets those tags only, so ``name`` keeps
starting the build it started before. ``default`` can be moved but not removed. A tag
may also be a build's id (``name:<build id>``).

Parsing and checking of names and tags (no I/O), and :class:`TemplateTags`, which
assigns, removes and lists tags in the repository through the catalog (where the
default tag is the name itself and the others are tag records, so every node sees
them). A build's record says which template name it belongs to in its metadata
(``templateName``); records from before tags fall back to their first name.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from agentenv.orchestrator.errors import (
    InvalidRequest,
    TagNotFound,
    TemplateAliasNotFound,
)
from agentenv.orchestrator.records import SnapshotEntry

if TYPE_CHECKING:
    from agentenv.orchestrator.catalog import Catalog

DEFAULT_TAG = "default"
TAG_SEPARATOR = ":"
MAX_TAG_LENGTH = 128
# The metadata key of a template build's record naming its template.
TEMPLATE_NAME_KEY = "templateName"
_TAG = re.compile(r"[a-z0-9._-]+")


def normalize_tag(tag: str) -> str:
    """``tag`` as stored: trimmed and lower-cased (as E2B does); :class:`InvalidRequest`
    unless it is 1-128 of ``a-z 0-9 . _ -`` and not a UUID (which names a build)."""
    cleaned = tag.strip().lower()
    if not _TAG.fullmatch(cleaned) or len(cleaned) > MAX_TAG_LENGTH or cleaned in (".", ".."):
        raise InvalidRequest(
            f"invalid tag {tag!r}: 1-{MAX_TAG_LENGTH} of letters, digits and . _ -"
        )
    if _is_uuid(cleaned):
        raise InvalidRequest(f"invalid tag {tag!r}: a tag cannot be a UUID (a build's id)")
    return cleaned


def normalize_tags(tags: Iterable[str]) -> list[str]:
    """Each tag normalized, duplicates dropped, in the order given."""
    out: list[str] = []
    for tag in tags:
        cleaned = normalize_tag(tag)
        if cleaned not in out:
            out.append(cleaned)
    return out


def split_name(ref: str, *, build_id: bool = False) -> tuple[str, str | None]:
    """``name[:tag]`` as a caller of the tag and build routes gives it: the name and
    its tag (``None`` when it has none; with ``build_id``, a build's id may stand for
    the tag). :class:`InvalidRequest` for an empty name or a bad tag."""
    name, sep, tag = ref.strip().partition(TAG_SEPARATOR)
    if not name:
        raise InvalidRequest(f"invalid template name {ref!r}: the name is empty")
    if not sep:
        return name, None
    if build_id and _is_uuid(tag.strip()):
        return name, str(uuid.UUID(tag.strip()))
    return name, normalize_tag(tag)


def parse_tagged(key: str) -> tuple[str, str, str | None] | None:
    """A reference of the form ``name:tag`` or ``name:<build id>`` as
    ``(name, tag, build id)`` (tag ``""`` with a build id), or ``None`` if ``key`` is not
    one: then it can only be an id or a plain name."""
    name, sep, tag = key.partition(TAG_SEPARATOR)
    if not sep or not name or not tag:
        return None
    if _is_uuid(tag.strip()):
        return name, "", str(uuid.UUID(tag.strip()))
    try:
        return name, normalize_tag(tag), None
    except InvalidRequest:
        return None


def family_of(entry: SnapshotEntry) -> str | None:
    """The template name a committed build belongs to (None for a snapshot)."""
    if entry.type != "template":
        return None
    return entry.metadata.get(TEMPLATE_NAME_KEY) or (entry.names[0] if entry.names else None)


def _is_uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class TagView:
    """One tag of a template, as ``GET /templates/{id}/tags`` lists it."""

    tag: str
    build_id: str
    assigned_at: datetime
    # When the build was committed (a build is created and finished by its commit here).
    build_created_at: datetime


class TemplateTags:
    """Assigning, removing and listing the tags of template names in the repository."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

    async def family(self, key: str) -> str:
        """The template name ``key`` (a name, ``name:tag`` or a build's id) refers to;
        :class:`TemplateAliasNotFound` if none."""
        parsed = parse_tagged(key)
        name = key if parsed is None else parsed[0]
        if await self._exists(name):
            return name
        entry = await self.catalog.lookup(key)
        family = None if entry is None else family_of(entry)
        if family is None:
            raise TemplateAliasNotFound(key)
        return family

    async def _exists(self, name: str) -> bool:
        default = await self.catalog.resolve_tag(name, DEFAULT_TAG)
        return default is not None or bool(await self.catalog.tags(name))

    async def default_build(self, name: str) -> str | None:
        """The record id of the build template ``name`` starts (its ``default`` tag),
        or ``None`` when no build has it."""
        entry = await self.catalog.resolve_tag(name, DEFAULT_TAG)
        return None if entry is None else entry.id

    async def listing(self, key: str) -> list[TagView]:
        """Every tag of the template ``key`` refers to whose build is still there,
        ``default`` included when it points at one."""
        name = await self.family(key)
        views: list[TagView] = []
        default = await self.catalog.resolve_tag(name, DEFAULT_TAG)
        if default is not None:
            views.append(
                TagView(DEFAULT_TAG, _build_id(default), default.created_at, default.created_at)
            )
        for tag in await self.catalog.tags(name):
            entry = await self.catalog.resolve_tag(name, tag.tag)
            if entry is not None:
                views.append(TagView(tag.tag, _build_id(entry), tag.assigned_at, entry.created_at))
        return views

    async def assign(self, target: str, tags: list[str]) -> tuple[str, list[str]]:
        """Point ``tags`` at the build ``target`` (``name`` or ``name:tag``) names:
        its build id and the tags as stored. :class:`TagNotFound` if ``target`` names
        no build of a template."""
        cleaned = normalize_tags(tags)
        if not cleaned:
            raise InvalidRequest("at least one tag is required")
        name, tag = split_name(target, build_id=True)
        await self.family(name)
        entry = await self.catalog.resolve_tag(name, tag or DEFAULT_TAG)
        if entry is None:
            raise TagNotFound(f"template {name!r} has no build tagged {tag or DEFAULT_TAG!r}")
        await self.catalog.set_tags(name, cleaned, entry.id)
        return _build_id(entry), cleaned

    async def remove(self, name: str, tags: list[str]) -> None:
        """Remove ``tags`` from template ``name``: all or none, :class:`TagNotFound`
        naming those it does not have."""
        cleaned = normalize_tags(tags)
        if not cleaned:
            raise InvalidRequest("at least one tag is required")
        if DEFAULT_TAG in cleaned:
            raise InvalidRequest(f"the {DEFAULT_TAG!r} tag cannot be removed")
        family, tag = split_name(name)
        if tag is not None:
            raise InvalidRequest("give the template's name without a tag; tags go in 'tags'")
        await self.family(family)
        present = {t.tag for t in await self.catalog.tags(family)}
        missing = [t for t in cleaned if t not in present]
        if missing:
            raise TagNotFound(f"template {family!r} has no tag {', '.join(missing)}")
        await self.catalog.drop_tags(family, cleaned)


def _build_id(entry: SnapshotEntry) -> str:
    return entry.metadata.get("buildID", entry.id)
