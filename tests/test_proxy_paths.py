"""The proxy's request-path parse: what it refuses and what it passes through unchanged
(no VMs; the attack end to end is in tests/security/test_proxy_auth.py)."""

from __future__ import annotations

import pytest

from agentenv.proxy.paths import PathRefused, RequestPath


@pytest.mark.parametrize(
    "raw",
    [
        b"/files/../init",
        b"/files/./init",
        b"/..",
        b"/.",
        b"/a/..",
        b"//init",
        b"/files//init",
        b"/files/%2e%2e/init",
        b"/files/%2E./init",
        b"/files%2Finit",
        b"/files%2finit",
        b"/files%5Cinit",
        b"/files\\init",
        b"/files%00",
        b"http://host/init",
        b"*",
        b"",
        b"/%C3",
    ],
)
def test_ambiguous_paths_are_refused(raw: bytes) -> None:
    with pytest.raises(PathRefused):
        RequestPath.parse(raw)


@pytest.mark.parametrize(
    ("raw", "decoded"),
    [
        (b"/init", "/init"),
        (b"/%69nit", "/init"),
        (b"/files", "/files"),
        (b"/process.Process/Start", "/process.Process/Start"),
        (b"/a..b/c.d/...", "/a..b/c.d/..."),
        (b"/caf%C3%A9/x%20y", "/café/x y"),
        (b"/", "/"),
    ],
)
def test_unambiguous_paths_keep_their_raw_bytes(raw: bytes, decoded: str) -> None:
    path = RequestPath.parse(raw)
    assert (path.raw, path.decoded) == (raw, decoded)
