"""The build plan of a template: what ``POST /v2/templates/{id}/builds/{build}`` asked for.

The E2B SDK's ``Template()`` builder serializes to a body of the form::

    {"fromImage": "python:3", "force": false, "startCmd": "...", "readyCmd": "...",
     "steps": [{"type": "RUN", "args": ["pip install x", "root"], "force": false},
               {"type": "COPY", "args": ["app/", "/app/", "user", "0755"],
                "filesHash": "<sha256 hex>", "force": false}]}

``parse_build`` checks such a body and turns it into typed steps; the builder executes
them in order. ``copy_script`` makes the shell script that places one uploaded COPY
archive inside the guest. Nothing here does I/O.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class PlanError(ValueError):
    """The build body cannot be honoured; the API answers 400 with this message."""


@dataclass(frozen=True)
class RunStep:
    command: str
    # Runs as the current USER when None.
    user: str | None


@dataclass(frozen=True)
class EnvStep:
    values: dict[str, str]


@dataclass(frozen=True)
class WorkdirStep:
    path: str


@dataclass(frozen=True)
class UserStep:
    user: str


@dataclass(frozen=True)
class CopyStep:
    # Names the archive the SDK uploaded through ``GET /templates/{id}/files/{hash}``.
    files_hash: str
    # Relative to the SDK's context directory, possibly a glob; the archive holds exactly
    # what it matched, under paths relative to that directory.
    src: str
    dest: str
    # "name", "uid" or "user:group"; None leaves the files owned by root.
    user: str | None
    mode: int | None


Step = RunStep | EnvStep | WorkdirStep | UserStep | CopyStep


@dataclass(frozen=True)
class BuildPlan:
    from_image: str | None
    from_template: str | None
    steps: tuple[Step, ...]
    start_cmd: str | None
    ready_cmd: str | None


# ARG is not emitted by the SDK (its Dockerfile parser turns ARG into ENV) but other
# clients of the same API send it; a build-time variable is an environment variable here.
SUPPORTED_STEPS = ("RUN", "ENV", "ARG", "WORKDIR", "USER", "COPY")

# The API documents filesHash as lowercase hex SHA-256; it also names a file on disk.
_FILES_HASH = re.compile(r"[0-9a-f]{64}")
_MODE = re.compile(r"[0-7]{1,4}")


def parse_build(body: Mapping[str, Any]) -> BuildPlan:
    """Check a build-start body and return its plan; raise ``PlanError`` naming the problem."""
    if not isinstance(body, Mapping):
        raise PlanError("the build body must be a JSON object")
    if body.get("fromImageRegistry") is not None:
        raise PlanError(
            "fromImageRegistry (private registry credentials) is not supported; "
            "use a public image or push the image to a registry that needs no login"
        )
    from_image = _optional_str(body, "fromImage")
    from_template = _optional_str(body, "fromTemplate")
    if from_image and from_template:
        raise PlanError("give either fromImage or fromTemplate, not both")
    if not from_image and not from_template:
        # The SDK always sends one (Template() defaults to fromImage "e2bdev/base"); a
        # server-side default image would silently build something nobody asked for.
        raise PlanError(
            "the build names no base: set fromImage or fromTemplate "
            "(there is no default base image on this server)"
        )
    raw_steps = body.get("steps")
    if raw_steps is None:
        raw_steps = []
    if not isinstance(raw_steps, list):
        raise PlanError("steps must be a list")
    steps = tuple(_parse_step(i, raw) for i, raw in enumerate(raw_steps))
    return BuildPlan(
        from_image=from_image or None,
        from_template=from_template or None,
        steps=steps,
        start_cmd=_optional_str(body, "startCmd") or None,
        ready_cmd=_optional_str(body, "readyCmd") or None,
    )


def describe(step: Step) -> str:
    """One line for the build log, in Dockerfile syntax: ``RUN apt-get install -y x``."""
    if isinstance(step, RunStep):
        lines = step.command.strip().splitlines() or [""]
        text = lines[0] if len(lines) == 1 else f"{lines[0]} ... (+{len(lines) - 1} lines)"
        return f"RUN {text}" if step.user is None else f"RUN (as {step.user}) {text}"
    if isinstance(step, EnvStep):
        pairs = " ".join(f"{key}={shlex.quote(value)}" for key, value in step.values.items())
        return f"ENV {pairs}"
    if isinstance(step, WorkdirStep):
        return f"WORKDIR {step.path}"
    if isinstance(step, UserStep):
        return f"USER {step.user}"
    flags = ""
    if step.user is not None:
        flags += f"--chown={step.user} "
    if step.mode is not None:
        flags += f"--chmod={step.mode:04o} "
    return f"COPY {flags}{step.src} {step.dest}"


def copy_script(step: CopyStep, archive: str, workdir: str) -> str:
    """A POSIX sh script, run as root in the guest, that places a COPY step's files.

    ``archive`` is where the uploaded tar (gzipped or not) was written in the guest and
    ``workdir`` the build's working directory, against which a relative ``dest`` is
    resolved. Docker COPY semantics: every top-level entry of the archive is one match
    of ``src``; a matched directory has its contents copied, a matched file goes to
    ``dest/<name>`` when ``dest`` ends in "/", already is a directory or several entries
    matched, and to ``dest`` itself otherwise. Missing parent directories are created.
    The archive and the scratch directory are removed whether or not the copy worked.
    """
    if _escapes(step.src):
        raise PlanError(f"COPY source {step.src!r} must be relative to the build context")
    base = workdir if workdir.startswith("/") else "/" + workdir
    target = posixpath.normpath(posixpath.join(base, step.dest))
    if target.startswith("//"):
        target = "/" + target.lstrip("/")
    dest_is_dir = step.dest.endswith("/") or posixpath.basename(step.dest) in (".", "..")
    owner = ""
    if step.user is not None:
        # A bare user also names the group, as E2B's builder does ("1000" -> "1000:1000").
        owner = step.user if ":" in step.user else f"{step.user}:{step.user}"
    mode = "" if step.mode is None else f"{step.mode:04o}"
    head = "\n".join(
        [
            "set -eu",
            f"archive={shlex.quote(archive)}",
            f"scratch={shlex.quote(archive + '.unpack')}",
            f"dest={shlex.quote(target)}",
            f"dest_is_dir={'1' if dest_is_dir else ''}",
            f"owner={shlex.quote(owner)}",
            f"mode={shlex.quote(mode)}",
        ]
    )
    return head + "\n" + _COPY_BODY


# The body of every copy script; the variables above are its only inputs. Ownership and
# mode are applied in the scratch tree before copying, so `cp -a` carries them over and
# nothing already at the destination (like a user's home directory) is re-owned.
_COPY_BODY = r"""
cleanup() { rm -rf "$scratch"; rm -f "$archive"; }
trap cleanup EXIT
rm -rf "$scratch"
mkdir -p "$scratch/files"

# The SDK gzips by default; copy(..., gzip=False) uploads a plain tar.
tarball=$archive
if [ "$(od -An -tx1 -N2 "$archive" | tr -d ' \n')" = 1f8b ]; then
  tarball="$scratch/layer.tar"
  gzip -dc "$archive" >"$tarball"
fi
# -o: files belong to root (or --chown), not to the uid that made the archive.
tar -x -o -f "$tarball" -C "$scratch/files"

# The archive holds what src matched plus, for a matched directory, all of its contents,
# each under its path in the build context; the matches are the members none of whose
# parents is a member. GNU tar escapes unusual names in listings unless told not to.
if tar --version 2>/dev/null | grep -q 'GNU tar'; then
  tar -t --quoting-style=literal -f "$tarball" >"$scratch/members"
else
  tar -t -f "$tarball" >"$scratch/members"
fi
awk '
{
  n = $0
  while (substr(n, 1, 1) == "/") n = substr(n, 2)
  while (substr(n, 1, 2) == "./") n = substr(n, 3)
  while (length(n) > 1 && substr(n, length(n)) == "/") n = substr(n, 1, length(n) - 1)
  if (n == "" || n == "./") n = "."
  if (!(n in seen)) { seen[n] = 1; order[++count] = n }
}
END {
  for (i = 1; i <= count; i++) {
    n = order[i]
    top = !(n != "." && ("." in seen))
    p = n
    while (top && match(p, /\/[^\/]*$/) > 0) {
      p = substr(p, 1, RSTART - 1)
      if (p in seen) top = 0
    }
    if (top) print n
  }
}' "$scratch/members" >"$scratch/matches"

count=0
while IFS= read -r match <&3; do count=$((count + 1)); done 3<"$scratch/matches"
if [ "$count" -eq 0 ]; then
  echo "COPY: the uploaded archive is empty" >&2
  exit 1
fi
into_dir=$dest_is_dir
if [ "$count" -gt 1 ] || [ -d "$dest" ]; then into_dir=1; fi

# mkdir -p, giving the directories it creates to the COPY owner as Docker does.
make_dirs() {
  top=
  d=$1
  while [ ! -e "$d" ] && [ ! -L "$d" ]; do
    top=$d
    d=$(dirname "$d")
  done
  mkdir -p "$1"
  if [ -n "$top" ] && [ -n "$owner" ]; then chown -Rh "$owner" "$top"; fi
}

while IFS= read -r match <&3; do
  if [ "$match" = . ]; then src="$scratch/files"; else src="$scratch/files/$match"; fi
  if [ -n "$owner" ]; then chown -Rh "$owner" "$src"; fi
  # Never through a symlink: its target may be anywhere in the guest.
  if [ -n "$mode" ]; then find "$src" ! -type l -exec chmod "$mode" {} +; fi
  if [ -d "$src" ] && [ ! -L "$src" ]; then
    make_dirs "$dest"
    for entry in "$src"/* "$src"/.[!.]* "$src"/..?*; do
      if [ -e "$entry" ] || [ -L "$entry" ]; then cp -a "$entry" "$dest/"; fi
    done
  elif [ -n "$into_dir" ]; then
    make_dirs "$dest"
    cp -a "$src" "$dest/"
  else
    make_dirs "$(dirname "$dest")"
    if [ -e "$dest" ] || [ -L "$dest" ]; then rm -f "$dest"; fi
    cp -a "$src" "$dest"
  fi
done 3<"$scratch/matches"
"""


def _optional_str(body: Mapping[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is None or isinstance(value, str):
        return value
    raise PlanError(f"{key} must be a string")


def _escapes(src: str) -> bool:
    normalized = posixpath.normpath(src)
    return src.startswith("/") or normalized == ".." or normalized.startswith("../")


def _parse_step(index: int, raw: Any) -> Step:
    where = f"steps[{index}]"
    if not isinstance(raw, Mapping):
        raise PlanError(f"{where}: a step must be an object with type and args")
    kind = raw.get("type")
    if not isinstance(kind, str) or kind.upper() not in SUPPORTED_STEPS:
        raise PlanError(
            f"{where}: unsupported step type {kind!r}; supported: {', '.join(SUPPORTED_STEPS)}"
        )
    kind = kind.upper()
    where = f"{where} ({kind})"
    args = raw.get("args")
    if args is None:
        args = []
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise PlanError(f"{where}: args must be a list of strings")

    if kind == "RUN":
        if len(args) not in (1, 2) or not args[0].strip():
            raise PlanError(f"{where}: args must be [command] or [command, user]")
        return RunStep(command=args[0], user=(args[1] or None) if len(args) == 2 else None)
    if kind in ("ENV", "ARG"):
        if not args or len(args) % 2:
            raise PlanError(f"{where}: args must be name/value pairs [name, value, ...]")
        values: dict[str, str] = {}
        for key, value in zip(args[::2], args[1::2], strict=True):
            if not key or "=" in key or "\0" in key:
                raise PlanError(f"{where}: invalid variable name {key!r}")
            values[key] = value
        return EnvStep(values=values)
    if kind == "WORKDIR":
        if len(args) != 1 or not args[0]:
            raise PlanError(f"{where}: args must be [path]")
        return WorkdirStep(path=args[0])
    if kind == "USER":
        if len(args) != 1 or not args[0].strip():
            raise PlanError(f"{where}: args must be [user]")
        return UserStep(user=args[0])
    return _parse_copy(where, raw, args)


def _parse_copy(where: str, raw: Mapping[str, Any], args: list[str]) -> CopyStep:
    if not 2 <= len(args) <= 4:
        raise PlanError(f"{where}: args must be [src, dest, user?, mode?]")
    src, dest = args[0], args[1]
    user = args[2] if len(args) > 2 and args[2] else None
    mode_text = args[3] if len(args) > 3 else ""
    if not src or not dest:
        raise PlanError(f"{where}: src and dest must not be empty")
    if _escapes(src):
        raise PlanError(f"{where}: src {src!r} must be a relative path inside the build context")
    mode: int | None = None
    if mode_text:
        if not _MODE.fullmatch(mode_text):
            raise PlanError(f"{where}: mode {mode_text!r} is not an octal file mode like 0755")
        mode = int(mode_text, 8)
    files_hash = raw.get("filesHash")
    if not isinstance(files_hash, str) or not _FILES_HASH.fullmatch(files_hash):
        raise PlanError(f"{where}: filesHash must be the lowercase hex SHA-256 of the upload")
    return CopyStep(files_hash=files_hash, src=src, dest=dest, user=user, mode=mode)
