"""Path and query parameters as the API accepts them: their limits are checked before a
route runs (a 400 naming the parameter) and listed in the OpenAPI document."""

from __future__ import annotations

from typing import Annotated

from fastapi import Path, Query
from starlette.convertors import Convertor, register_url_convertor

from agentenv.limits import (
    ID_PATTERN,
    MAX_FILES_HASH_LENGTH,
    MAX_ID_LENGTH,
    MAX_TEMPLATE_REF_LENGTH,
    MAX_TOKEN_LENGTH,
    TEMPLATE_REF_PATTERN,
)


class ReferenceConvertor(Convertor[str]):
    """``{name:ref}``: a template or snapshot reference in a path, which may hold "/"
    (names like ``team/app``), matched whatever else it holds so that the model, not the
    router, refuses it. Starlette's ``path`` stops at a newline: a DELETE of a name with
    one fell through to a GET-only route of the same path and answered 405."""

    regex = "(?s:.+)"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("ref", ReferenceConvertor())

SandboxId = Annotated[
    str,
    Path(
        min_length=1,
        max_length=MAX_ID_LENGTH,
        pattern=ID_PATTERN,
        description="a sandbox id (letters, digits and . _ : -)",
    ),
]
# A template's or snapshot's id or name (names may hold "/": team/name).
TemplateRef = Annotated[
    str,
    Path(
        min_length=1,
        max_length=MAX_TEMPLATE_REF_LENGTH,
        pattern=TEMPLATE_REF_PATTERN,
        description="an id or name: no leading / and no control characters",
    ),
]
# The id of a template being built, or of its build (UUIDs here).
BuildRecordId = Annotated[
    str,
    Path(
        min_length=1,
        max_length=MAX_ID_LENGTH,
        pattern=ID_PATTERN,
        description="a template or build id (letters, digits and . _ : -)",
    ),
]
FilesHash = Annotated[
    str,
    Path(
        min_length=1,
        max_length=MAX_FILES_HASH_LENGTH,
        pattern=r"^[0-9a-fA-F]+$",
        description="a COPY step's files hash (hex)",
    ),
]
NextToken = Annotated[
    str | None,
    Query(
        alias="nextToken",
        min_length=1,
        max_length=MAX_TOKEN_LENGTH,
        description="the X-Next-Token of the previous page",
    ),
]
