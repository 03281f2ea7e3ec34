"""Debian package access through the host's apt: resolving, downloading and unpacking .debs."""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from agentenv.guest.cache import content_key, sha256_file
from agentenv.guest.errors import GuestImageError
from agentenv.guest.host import run

_URI_LINE = re.compile(
    r"^'(?P<uri>[^']+)' (?P<file>\S+) (?P<size>\d+) SHA256:(?P<sha>[0-9a-f]{64})$"
)


@dataclass(frozen=True)
class DebPackage:
    """One concrete .deb as apt would download it."""

    name: str
    version: str
    filename: str
    sha256: str
    uri: str

    def pin(self) -> str:
        return f"{self.name}={self.version}"


def _version_from_filename(filename: str) -> str:
    # <name>_<version with %3a for ':'>_<arch>.deb
    return filename.split("_")[1].replace("%3a", ":")


async def locate(packages: Iterable[str]) -> list[DebPackage]:
    """Resolve package names to the exact candidate .debs (one ``apt-get`` call, no download)."""
    names = sorted(set(packages))
    out = await run(["apt-get", "download", "--print-uris", *names])
    found: list[DebPackage] = []
    for line in out.splitlines():
        match = _URI_LINE.match(line.strip())
        if match is None:
            continue
        filename = match["file"]
        found.append(
            DebPackage(
                name=filename.split("_")[0],
                version=_version_from_filename(filename),
                filename=filename,
                sha256=match["sha"],
                uri=match["uri"],
            )
        )
    missing = set(names) - {p.name for p in found}
    if missing:
        raise GuestImageError(
            f"apt cannot locate {', '.join(sorted(missing))}; run 'apt-get update'"
        )
    return sorted(found, key=lambda p: p.name)


async def download(packages: Iterable[DebPackage], deb_dir: Path) -> list[Path]:
    """Download the .debs into ``deb_dir`` (kept as a cache) and verify their SHA-256."""
    deb_dir.mkdir(parents=True, exist_ok=True)
    wanted = list(packages)
    absent = [p for p in wanted if not (deb_dir / p.filename).is_file()]
    if absent:
        await run(["apt-get", "download", *[p.pin() for p in absent]], cwd=deb_dir)
    paths: list[Path] = []
    for package in wanted:
        path = deb_dir / package.filename
        if not path.is_file():
            raise GuestImageError(f"apt-get download did not produce {path}")
        if sha256_file(path) != package.sha256:
            path.unlink()
            raise GuestImageError(f"{package.filename}: SHA-256 mismatch; deleted, retry")
        paths.append(path)
    return paths


async def extract(deb: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    await run(["dpkg-deb", "-x", deb, dest])


def parse_depends(out: str) -> dict[str, list[str]]:
    """Parse ``apt-cache depends`` output for one or more packages.

    Keeps Depends/PreDepends; of alternatives (``|Depends: a`` then ``Depends: b``) only the
    first; virtual packages (``<name>``) are dropped.
    """
    result: dict[str, list[str]] = {}
    current: list[str] | None = None
    skip_alternative = False
    for line in out.splitlines():
        if not line.strip():
            continue
        if not line.startswith(" "):
            current = result.setdefault(line.strip(), [])
            skip_alternative = False
            continue
        stripped = line.strip()
        is_alternative_tail = skip_alternative
        skip_alternative = stripped.startswith("|")
        if is_alternative_tail or current is None:
            continue
        kind, _, name = stripped.lstrip("|").partition(":")
        name = name.strip()
        if kind in ("Depends", "PreDepends") and name and not name.startswith("<"):
            current.append(name)
    return result


async def depends_many(packages: Iterable[str]) -> dict[str, list[str]]:
    """Direct dependencies of each package's candidate version (one ``apt-cache`` call)."""
    names = sorted(set(packages))
    out = await run(
        [
            "apt-cache",
            "depends",
            "--no-recommends",
            "--no-suggests",
            "--no-conflicts",
            "--no-breaks",
            "--no-replaces",
            "--no-enhances",
            *names,
        ]
    )
    return parse_depends(out)


async def depends(package: str) -> list[str]:
    return (await depends_many([package])).get(package, [])


async def dependency_closure(roots: Iterable[str], follow: Callable[[str], bool]) -> list[str]:
    """The roots plus every package reachable through dependencies accepted by ``follow``."""
    seen: set[str] = set()
    level = set(roots)
    while level:
        seen |= level
        found = await depends_many(level)
        level = {d for deps in found.values() for d in deps if follow(d)} - seen
    return sorted(seen)


def _sources_uris(text: str, deb822: bool) -> list[tuple[str, str]]:
    """(uri, suite) pairs from an apt sources file."""
    pairs: list[tuple[str, str]] = []
    if deb822:
        for stanza in text.split("\n\n"):
            fields: dict[str, str] = {}
            for line in stanza.splitlines():
                if line.startswith("#") or ":" not in line or line.startswith(" "):
                    continue
                key, _, value = line.partition(":")
                fields[key.strip().lower()] = value.strip()
            if "deb" not in fields.get("types", "").split() or fields.get("enabled") == "no":
                continue
            for uri in fields.get("uris", "").split():
                for suite in fields.get("suites", "").split():
                    pairs.append((uri, suite))
    else:
        for line in text.splitlines():
            words = shlex.split(line, comments=True)
            if len(words) >= 3 and words[0] == "deb":
                rest = [w for w in words[1:] if not w.startswith("[")]
                if len(rest) >= 2:
                    pairs.append((rest[0], rest[1]))
    return pairs


def host_apt_sources(etc_apt: Path = Path("/etc/apt")) -> list[tuple[str, str]]:
    pairs: list[tuple[str, str]] = []
    legacy = etc_apt / "sources.list"
    if legacy.is_file():
        pairs += _sources_uris(legacy.read_text(), deb822=False)
    parts = etc_apt / "sources.list.d"
    if parts.is_dir():
        for path in sorted(parts.glob("*.list")):
            pairs += _sources_uris(path.read_text(), deb822=False)
        for path in sorted(parts.glob("*.sources")):
            pairs += _sources_uris(path.read_text(), deb822=True)
    return pairs


def debian_mirror(suite: str, etc_apt: Path = Path("/etc/apt")) -> str:
    """The host's mirror URL serving ``suite`` (e.g. ``bookworm``)."""
    for uri, source_suite in host_apt_sources(etc_apt):
        if source_suite == suite:
            return uri
    raise GuestImageError(f"no apt source for suite {suite!r} in {etc_apt}; cannot debootstrap")


def apt_state_key(
    lists_dir: Path = Path("/var/lib/apt/lists"), etc_apt: Path = Path("/etc/apt")
) -> str:
    """Changes whenever apt could pick different candidate versions: after ``apt-get update``
    or an edit of the sources, preferences or apt configuration. Lets a cached build skip
    apt's slow list parsing (this host's apt has no binary package cache)."""
    entries: list[list[object]] = []
    for directory in (lists_dir, etc_apt):
        if not directory.is_dir():
            continue
        for path in sorted(directory.rglob("*")):
            try:
                if path.is_file() and path.name != "lock" and "partial" not in path.parts:
                    stat = path.stat()
                    entries.append([str(path), stat.st_size, stat.st_mtime_ns])
            except OSError:
                continue
    return content_key(entries)
