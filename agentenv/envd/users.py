"""OS accounts as envd sees them: looking users up, reading the user a request names, and
resolving request paths against a user's home the way E2B's envd does."""

from __future__ import annotations

import base64
import binascii
import grp
import os
import pwd
from dataclasses import dataclass

#: The account E2B templates run commands as; envd's default when it exists.
PREFERRED_DEFAULT_USER = "user"


class UnknownUserError(LookupError):
    """The named OS account does not exist."""

    def __init__(self, name: str) -> None:
        super().__init__(f"user {name!r} does not exist")
        self.name = name


class BadAuthorizationError(ValueError):
    """The Authorization header is present but is not ``Basic base64(name:password)``."""


@dataclass(frozen=True, slots=True)
class OSUser:
    """An OS account resolved from the password database."""

    name: str
    uid: int
    gid: int
    home: str
    #: Supplementary group ids, as initgroups(3) would set them.
    groups: tuple[int, ...]


def lookup_user(name: str) -> OSUser:
    """Return the account called ``name``; raise UnknownUserError if there is none."""
    if not name:
        raise UnknownUserError(name)
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise UnknownUserError(name) from None
    try:
        groups = tuple(os.getgrouplist(entry.pw_name, entry.pw_gid))
    except OSError:
        groups = (entry.pw_gid,)
    return OSUser(
        name=entry.pw_name,
        uid=entry.pw_uid,
        gid=entry.pw_gid,
        home=entry.pw_dir or "/",
        groups=groups,
    )


def user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def initial_default_user() -> str:
    """The default user before /init says otherwise: ``user`` if it exists, else root."""
    return PREFERRED_DEFAULT_USER if user_exists(PREFERRED_DEFAULT_USER) else "root"


def user_from_authorization(header: str | None) -> str | None:
    """The user name in ``Authorization: Basic base64(name:)``, or None without the header.

    The password part is ignored: choosing a user is identification, not authentication.
    """
    if header is None or not header.strip():
        return None
    scheme, _, credentials = header.strip().partition(" ")
    if scheme.lower() != "basic":
        raise BadAuthorizationError(f"unsupported authorization scheme {scheme!r}")
    try:
        decoded = base64.b64decode(credentials.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise BadAuthorizationError("authorization credentials are not valid base64") from None
    name, _, _password = decoded.partition(":")
    return name


def expand_path(path: str, user: OSUser) -> str:
    """Resolve ``path`` for ``user``: ``~`` is their home and relative paths start there.

    The result is absolute and normalised; symlinks are left alone.
    """
    if path == "~" or path.startswith("~/"):
        path = user.home + path[1:]
    if not os.path.isabs(path):
        path = os.path.join(user.home, path)
    return os.path.normpath(path)


def owner_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)
