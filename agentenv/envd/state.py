"""What the orchestrator configures through ``POST /init``: sandbox env vars, the access
token, default user and workdir, plus the one-shot system effects (clock, entropy).

/init is called again after every snapshot restore, so applying it must be idempotent:
env vars are merged, the token and defaults are replaced, and the clock is only stepped
when it is actually off.

In a guest the configuration is also kept in a root-only file on ``/run`` (a tmpfs, so
it lives exactly as long as the guest's memory, snapshots included): the guest's init
restarts an envd that died, and the new one must come back with the same token, user
and env vars rather than open and unconfigured.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import fcntl
import hmac
import json
import logging
import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .users import OSUser, UnknownUserError, expand_path, initial_default_user, lookup_user

logger = logging.getLogger("agentenv.envd")

#: Only step the clock when it is off by more than this; small steps would just add jitter.
CLOCK_STEP_THRESHOLD_S = 0.05
#: RNDADDENTROPY = _IOW('R', 0x03, int[2]) from <linux/random.h>.
RNDADDENTROPY = 0x40085203
RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07)


class InitError(ValueError):
    """The /init body is malformed or names something that does not exist."""


@dataclass(frozen=True, slots=True)
class InitRequest:
    """A parsed ``POST /init`` body. Every field is optional; None means "leave as is"."""

    env_vars: dict[str, str] | None = None
    access_token: str | None = None
    timestamp: dt.datetime | None = None
    default_user: str | None = None
    default_workdir: str | None = None
    seed: bytes | None = None

    @classmethod
    def from_json(cls, body: Any) -> InitRequest:
        """Validate the decoded JSON body (camelCase keys, as E2B's orchestrator sends)."""
        if body is None:
            return cls()
        if not isinstance(body, dict):
            raise InitError("body must be a JSON object")
        env_vars = body.get("envVars")
        if env_vars is not None:
            if not isinstance(env_vars, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in env_vars.items()
            ):
                raise InitError("envVars must be an object of string values")
            for key in env_vars:
                if not key or "=" in key or "\0" in key:
                    raise InitError(f"envVars has an invalid name {key!r}")
        access_token = _optional_str(body, "accessToken")
        if access_token is not None and not access_token.strip():
            # An empty token must never mean "stop checking": a client that managed to
            # send one would switch authentication off.
            raise InitError("accessToken must not be empty (omit it to keep the current one)")
        return cls(
            env_vars=env_vars,
            access_token=access_token,
            timestamp=_parse_timestamp(_optional_str(body, "timestamp")),
            default_user=_optional_str(body, "defaultUser") or None,
            default_workdir=_optional_str(body, "defaultWorkdir") or None,
            seed=_parse_seed(_optional_str(body, "seed")),
        )


def _optional_str(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise InitError(f"{key} must be a string")
    return value


def _parse_timestamp(value: str | None) -> dt.datetime | None:
    if not value:
        return None
    # RFC 3339: fromisoformat handles offsets; accept the "Z" suffix and nanoseconds too.
    text = value.strip()
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    date_part, sep, rest = text.partition(".")
    if sep:
        digits = len(rest) - len(rest.lstrip("0123456789"))
        text = f"{date_part}.{rest[: min(digits, 6)]}{rest[digits:]}"
    try:
        parsed = dt.datetime.fromisoformat(text)
    except ValueError:
        raise InitError(f"timestamp {value!r} is not RFC 3339") from None
    if parsed.tzinfo is None:
        raise InitError(f"timestamp {value!r} has no UTC offset")
    return parsed


def _parse_seed(value: str | None) -> bytes | None:
    if not value:
        return None
    try:
        return base64.b64decode(value, validate=True)
    except binascii.Error:
        raise InitError("seed is not valid base64") from None


@dataclass(slots=True)
class EnvdState:
    """envd's mutable configuration, shared by the HTTP endpoints and the RPC services."""

    #: Whether /init may touch the system (clock, kernel RNG). Off when envd runs on a
    #: developer host or in tests.
    manage_system: bool = True
    env_vars: dict[str, str] = field(default_factory=dict)
    access_token: str | None = None
    default_user: str = field(default_factory=initial_default_user)
    #: The workdir /init configured; None means "the user's home".
    default_workdir: str | None = None
    #: Where the configuration is kept for an envd restarted after a crash; None: nowhere.
    state_file: Path | None = None

    @classmethod
    def restore(cls, state_file: Path, *, manage_system: bool = True) -> EnvdState:
        """A state keeping its configuration in ``state_file``, with what an earlier envd
        of this guest kept there (nothing if there is none or it is unreadable)."""
        state = cls(manage_system=manage_system, state_file=state_file)
        try:
            kept = json.loads(state_file.read_text())
            env_vars = {str(k): str(v) for k, v in dict(kept["env_vars"]).items()}
            token, user, workdir = (kept[k] for k in ("access_token", "default_user", "workdir"))
            if not all(v is None or isinstance(v, str) for v in (token, user, workdir)):
                raise TypeError("not strings")
        except FileNotFoundError:
            return state
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("ignoring the kept configuration in %s: %s", state_file, e)
            return state
        state.env_vars, state.access_token, state.default_workdir = env_vars, token, workdir
        if user is not None:
            state.default_user = user
        logger.warning("restarted: configuration restored from %s", state_file)
        return state

    def _keep(self) -> None:
        if self.state_file is None:
            return
        kept = {
            "env_vars": self.env_vars,
            "access_token": self.access_token,
            "default_user": self.default_user,
            "workdir": self.default_workdir,
        }
        self.state_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = self.state_file.with_name(f".{self.state_file.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(kept, f)
        os.replace(tmp, self.state_file)

    def apply_init(self, request: InitRequest) -> None:
        """Apply an /init request. Validates first so a bad request changes nothing."""
        if request.default_user is not None:
            try:
                lookup_user(request.default_user)
            except UnknownUserError as e:
                raise InitError(str(e)) from None
        if request.default_workdir is not None and not os.path.isabs(request.default_workdir):
            raise InitError("defaultWorkdir must be an absolute path")

        if request.env_vars:
            self.env_vars.update(request.env_vars)
        if request.access_token is not None:
            self.access_token = request.access_token
        if request.default_user is not None:
            self.default_user = request.default_user
        if request.default_workdir is not None:
            self.default_workdir = os.path.normpath(request.default_workdir)
        try:
            self._keep()
        except OSError as e:
            # Served as configured; only a restart after a crash would lose it.
            logger.warning("could not keep the configuration in %s: %s", self.state_file, e)
        if self.manage_system:
            if request.timestamp is not None:
                sync_clock(request.timestamp)
            if request.seed:
                add_entropy(request.seed)

    def token_matches(self, presented: str | None) -> bool:
        """Whether a request carrying ``presented`` as X-Access-Token may proceed."""
        if self.access_token is None:
            return True
        if presented is None:
            return False
        return hmac.compare_digest(presented.encode(), self.access_token.encode())

    def default_cwd(self, user_home: str) -> str:
        return self.default_workdir or user_home

    def resolve_path(self, path: str, user: OSUser) -> str:
        """Expand a request path for ``user``; empty means the default workdir."""
        if not path:
            return self.default_cwd(user.home)
        return expand_path(path, user)


def sync_clock(timestamp: dt.datetime) -> None:
    """Step CLOCK_REALTIME to ``timestamp`` when it is off (after a snapshot restore the
    guest clock is as old as the snapshot)."""
    target = timestamp.timestamp()
    if abs(time.time() - target) <= CLOCK_STEP_THRESHOLD_S:
        return
    try:
        time.clock_settime(time.CLOCK_REALTIME, target)
    except OSError as e:
        logger.warning("could not set the system clock: %s", e)


def add_entropy(seed: bytes) -> None:
    """Mix ``seed`` into the kernel RNG, crediting it when we are allowed to.

    Restored snapshots share RNG state; fresh host entropy keeps sandboxes from producing
    the same "random" numbers.
    """
    try:
        with open("/dev/urandom", "wb", buffering=0) as urandom:
            try:
                # struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
                padded = seed + b"\0" * (-len(seed) % 4)
                info = struct.pack("ii", len(seed) * 8, len(seed)) + padded
                fcntl.ioctl(urandom.fileno(), RNDADDENTROPY, info)
                # Mixing in is not enough: an initialised CRNG reseeds from its input
                # pool only once a minute, and every restore of one snapshot would hand
                # out the same bytes until then.
                fcntl.ioctl(urandom.fileno(), RNDRESEEDCRNG)
            except OSError:
                # Without CAP_SYS_ADMIN: a plain write still mixes the bytes in.
                urandom.write(seed)
    except OSError as e:
        logger.warning("could not seed the kernel RNG: %s", e)
