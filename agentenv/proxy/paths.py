"""The request path, parsed once.

Access decisions in the proxy depend on the path (envd's public routes, the routes it
never forwards), so the path the proxy checks must be exactly the one the guest sees.
Clients can send paths that mean different things to different parsers: ``/files/../init``
is ``/files/../init`` to a prefix check and ``/init`` to an HTTP client that normalises it;
``/a%2Fb`` is one segment or two depending on who decodes it. Rather than normalise (and
then hope every later parser agrees), the proxy refuses every path in which parsers could
disagree and forwards the raw bytes it checked, unchanged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes

# Percent-encodings of characters that change a path's structure once decoded: the
# separators '/' and '\', the dot of dot segments, and NUL.
_STRUCTURAL_ESCAPES = re.compile(rb"%(2[fF]|5[cC]|2[eE]|00)")


class PathRefused(ValueError):
    """The raw request path is ambiguous; ``str(exc)`` says why."""


@dataclass(frozen=True)
class RequestPath:
    """A raw request path (no query) that every parser reads the same way."""

    raw: bytes
    #: The decoded path: same segments as ``raw``, since no separator was encoded.
    decoded: str

    @classmethod
    def parse(cls, raw: bytes) -> RequestPath:
        """Check ``raw`` (the path as the client sent it) or raise :class:`PathRefused`."""
        if not raw.startswith(b"/"):
            # Absolute-form ("http://host/x") and asterisk-form ("*") targets included.
            raise PathRefused("the request path must start with '/'")
        if b"\\" in raw:
            raise PathRefused("the request path must not contain '\\'")
        if b"//" in raw:
            raise PathRefused("the request path must not contain empty segments ('//')")
        escape = _STRUCTURAL_ESCAPES.search(raw)
        if escape:
            raise PathRefused(
                f"the request path must not encode separators, dots or NUL "
                f"({escape.group().decode()})"
            )
        segments = raw.split(b"/")
        if any(segment in (b".", b"..") for segment in segments):
            raise PathRefused("the request path must not contain dot segments ('.' or '..')")
        try:
            decoded = unquote_to_bytes(raw).decode()
        except UnicodeDecodeError:
            raise PathRefused("the request path is not UTF-8 once decoded") from None
        return cls(raw, decoded)
