"""The unmodified ``e2b`` SDK against a real sandbox: envd's filesystem RPCs act as the
request's user.

The finding: as ``user`` (the SDK's default), Stat, ListDir, MakeDir, Move and Remove
worked on root's files, because envd ran them as root: ``/root/secret`` (0600, in 0700
``/root``) could be moved away and ``/etc/hostname`` removed. Reading and writing through
/files already used the user's permissions. envd answers ``permission_denied``, which
the SDK raises as a plain SandboxException; the same calls as root succeed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from e2b import Sandbox, SandboxException

from tests.e2b.support import sdk_client
from tests.helpers import ServerProcess

pytestmark = pytest.mark.vm

SECRET = "/root/secret"


@pytest.fixture(scope="module")
def sbx(server: ServerProcess) -> Iterator[Sandbox]:
    sandbox = sdk_client(server).Sandbox.create(timeout=600)
    try:
        sandbox.files.write(SECRET, "root only", user="root")
        done = sandbox.commands.run(f"chmod 600 {SECRET}; stat -c %a:%U /root", user="root")
        assert done.stdout == "700:root\n", done
        yield sandbox
    finally:
        sandbox.kill()


def _refused(attempt: Callable[[], object]) -> None:
    with pytest.raises(SandboxException, match=r"(?i)permission") as raised:
        attempt()
    # The SDK has no class of its own for permission_denied; nothing more specific (a
    # NotFoundException would mean envd hid the reason).
    assert type(raised.value) is SandboxException, raised.value


def _as_root(sbx: Sandbox, script: str) -> str:
    return sbx.commands.run(script, user="root").stdout


def test_user_cannot_touch_roots_files(sbx: Sandbox) -> None:
    attempts: list[Callable[[], object]] = [
        lambda: sbx.files.remove("/etc/hostname"),
        lambda: sbx.files.rename(SECRET, "/tmp/secret"),
        lambda: sbx.files.list("/root"),
        lambda: sbx.files.get_info(SECRET),
        lambda: sbx.files.make_dir("/root/made"),
        lambda: sbx.files.make_dir("/etc/made"),
        lambda: sbx.files.remove(SECRET),
        lambda: sbx.files.watch_dir("/root"),
    ]
    for attempt in attempts:
        _refused(attempt)
    # exists() is a Stat: it cannot tell whether root's file is there.
    _refused(lambda: sbx.files.exists(SECRET))
    state = _as_root(
        sbx,
        "test -f /etc/hostname && echo hostname; cat /root/secret; echo;"
        " ls -a /tmp /root /etc | grep -cx -e secret -e made",
    )
    assert state == "hostname\nroot only\n1\n", state
    # Reading and writing were already the user's, and still are.
    _refused(lambda: sbx.files.read(SECRET))
    _refused(lambda: sbx.files.write("/etc/made", "x"))


def test_root_can(sbx: Sandbox) -> None:
    hostname = sbx.files.read("/etc/hostname", user="root")
    assert sbx.files.get_info(SECRET, user="root").permissions == "-rw-------"
    assert "secret" in {entry.name for entry in sbx.files.list("/root", user="root")}
    moved = sbx.files.rename(SECRET, "/root/moved", user="root")
    assert moved.path == "/root/moved"
    sbx.files.rename("/root/moved", SECRET, user="root")
    assert sbx.files.make_dir("/root/made", user="root")
    sbx.files.remove("/root/made", user="root")
    sbx.files.remove("/etc/hostname", user="root")
    assert not sbx.files.exists("/etc/hostname", user="root")
    sbx.files.write("/etc/hostname", hostname, user="root")


def test_user_keeps_its_own_files(sbx: Sandbox) -> None:
    made = sbx.files.make_dir("/home/user/envd-user/a")
    assert made
    info = sbx.files.get_info("/home/user/envd-user/a")
    assert (info.owner, info.group) == ("user", "user")
    sbx.files.write("/home/user/envd-user/a/f", "mine")
    sbx.files.rename("/home/user/envd-user/a/f", "/home/user/envd-user/g")
    assert [e.name for e in sbx.files.list("/home/user/envd-user")] == ["a", "g"]
    sbx.files.remove("/home/user/envd-user")
    assert not sbx.files.exists("/home/user/envd-user")
