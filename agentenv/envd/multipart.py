"""A streaming ``multipart/form-data`` parser (RFC 7578) for uploads.

Bytes go in with :meth:`MultipartParser.feed` as they arrive; parts come out as a
:class:`PartStart` (the part's headers), :class:`PartData` chunks and a :class:`PartEnd`.
Memory use is bounded by the header limit plus one input chunk: body bytes are released
as soon as they cannot be the start of the next boundary.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from enum import Enum, auto

#: Limit for one part's header block; real headers are a few hundred bytes.
MAX_PART_HEADER_BYTES = 16 * 1024
#: Limit for what may precede the first boundary.
MAX_PREAMBLE_BYTES = 64 * 1024


class MultipartError(ValueError):
    """The body is not valid multipart/form-data."""


@dataclass(frozen=True, slots=True)
class PartStart:
    headers: dict[str, str]
    #: The ``name`` parameter of Content-Disposition.
    name: str | None
    #: The ``filename`` parameter of Content-Disposition, verbatim (directories kept).
    filename: str | None


@dataclass(frozen=True, slots=True)
class PartData:
    data: bytes


@dataclass(frozen=True, slots=True)
class PartEnd:
    pass


MultipartEvent = PartStart | PartData | PartEnd


class _Phase(Enum):
    PREAMBLE = auto()
    AFTER_BOUNDARY = auto()
    HEADERS = auto()
    BODY = auto()
    DONE = auto()


def boundary_from_content_type(content_type: str) -> str:
    """The ``boundary`` parameter of a multipart Content-Type header."""
    _, params = parse_header_params(content_type)
    boundary = params.get("boundary")
    if not boundary or len(boundary) > 200:
        raise MultipartError("multipart Content-Type has no valid boundary")
    return boundary


def parse_header_params(value: str) -> tuple[str, dict[str, str]]:
    """Split ``type; a=b; c="d"`` into the value and lower-cased parameters.

    Quoted strings may contain ``;`` and backslash escapes; ``name*=`` (RFC 5987) values
    are decoded and take precedence over plain ones.
    """
    items = _split_params(value)
    main = items[0].strip().lower() if items else ""
    params: dict[str, str] = {}
    extended: dict[str, str] = {}
    for item in items[1:]:
        key, sep, raw = item.partition("=")
        if not sep:
            continue
        key = key.strip().lower()
        raw = raw.strip()
        if key.endswith("*"):
            charset, _, rest = raw.partition("'")
            _language, _, encoded = rest.partition("'")
            try:
                extended[key[:-1]] = urllib.parse.unquote(
                    encoded, encoding=charset or "utf-8", errors="strict"
                )
            except (LookupError, UnicodeDecodeError):
                continue
        else:
            params[key] = _unquote(raw)
    params.update(extended)
    return main, params


def _split_params(value: str) -> list[str]:
    items: list[str] = []
    current: list[str] = []
    quoted = escaped = False
    for char in value:
        if escaped:
            escaped = False
        elif quoted and char == "\\":
            escaped = True
        elif char == '"':
            quoted = not quoted
        elif char == ";" and not quoted:
            items.append("".join(current))
            current = []
            continue
        current.append(char)
    items.append("".join(current))
    return items


def _unquote(raw: str) -> str:
    if len(raw) >= 2 and raw[0] == raw[-1] == '"':
        out: list[str] = []
        escaped = False
        for char in raw[1:-1]:
            if escaped:
                out.append(char)
                escaped = False
            elif char == "\\":
                escaped = True
            else:
                out.append(char)
        # Browsers and httpx percent-encode a double quote inside a quoted filename.
        return "".join(out).replace("%22", '"')
    return raw


class MultipartParser:
    """Incremental parser for one multipart body."""

    def __init__(self, boundary: str) -> None:
        self._dash_boundary = b"--" + boundary.encode("latin-1")
        self._delimiter = b"\r\n" + self._dash_boundary
        self._buffer = bytearray()
        self._phase = _Phase.PREAMBLE

    @property
    def done(self) -> bool:
        return self._phase is _Phase.DONE

    def feed(self, chunk: bytes) -> list[MultipartEvent]:
        """Consume ``chunk``; return the events it completes."""
        if self._phase is _Phase.DONE:
            return []  # the epilogue is ignored
        self._buffer += chunk
        events: list[MultipartEvent] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> None:
        """The body has ended: raise unless the closing boundary was seen."""
        if self._phase is not _Phase.DONE:
            raise MultipartError("multipart body ended before its closing boundary")

    def _step(self, events: list[MultipartEvent]) -> bool:
        """Advance as far as the buffer allows; False when more input is needed."""
        buffer = self._buffer
        if self._phase is _Phase.PREAMBLE:
            # The first boundary may open the body or follow a preamble line.
            if buffer.startswith(self._dash_boundary):
                del buffer[: len(self._dash_boundary)]
                self._phase = _Phase.AFTER_BOUNDARY
                return True
            index = buffer.find(self._delimiter)
            if index < 0:
                if len(buffer) > MAX_PREAMBLE_BYTES:
                    raise MultipartError("no multipart boundary found")
                return False
            del buffer[: index + len(self._delimiter)]
            self._phase = _Phase.AFTER_BOUNDARY
            return True

        if self._phase is _Phase.AFTER_BOUNDARY:
            line_end = buffer.find(b"\r\n")
            if line_end < 0:
                if len(buffer) >= 2 and buffer[:2] == b"--":
                    self._phase = _Phase.DONE
                    buffer.clear()
                    return False
                if len(buffer) > 1024:
                    raise MultipartError("malformed multipart boundary line")
                return False
            line = bytes(buffer[:line_end])
            del buffer[: line_end + 2]
            if line.startswith(b"--"):
                self._phase = _Phase.DONE
                buffer.clear()
                return False
            if line.strip(b" \t"):
                raise MultipartError("malformed multipart boundary line")
            self._phase = _Phase.HEADERS
            return True

        if self._phase is _Phase.HEADERS:
            if buffer.startswith(b"\r\n"):
                header_block = b""
                del buffer[:2]
            else:
                end = buffer.find(b"\r\n\r\n")
                if end < 0:
                    if len(buffer) > MAX_PART_HEADER_BYTES:
                        raise MultipartError("multipart part headers are too large")
                    return False
                header_block = bytes(buffer[:end])
                del buffer[: end + 4]
            events.append(_part_start(header_block))
            self._phase = _Phase.BODY
            return True

        if self._phase is _Phase.BODY:
            index = buffer.find(self._delimiter)
            if index >= 0:
                if index:
                    events.append(PartData(bytes(buffer[:index])))
                del buffer[: index + len(self._delimiter)]
                events.append(PartEnd())
                self._phase = _Phase.AFTER_BOUNDARY
                return True
            # Keep a tail that could be the start of a split delimiter.
            safe = len(buffer) - (len(self._delimiter) - 1)
            if safe > 0:
                events.append(PartData(bytes(buffer[:safe])))
                del buffer[:safe]
            return False

        return False


def _part_start(header_block: bytes) -> PartStart:
    headers: dict[str, str] = {}
    try:
        text = header_block.decode("utf-8")
    except UnicodeDecodeError:
        text = header_block.decode("latin-1")
    for line in text.split("\r\n"):
        if not line:
            continue
        key, sep, value = line.partition(":")
        if not sep:
            raise MultipartError(f"malformed multipart header line {line!r}")
        headers[key.strip().lower()] = value.strip()
    disposition = headers.get("content-disposition")
    if disposition is None:
        raise MultipartError("multipart part has no Content-Disposition")
    kind, params = parse_header_params(disposition)
    if kind != "form-data":
        raise MultipartError(f"multipart part disposition is {kind!r}, not form-data")
    return PartStart(headers=headers, name=params.get("name"), filename=params.get("filename"))
