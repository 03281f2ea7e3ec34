"""Checking an uploaded COPY archive against the files hash it was uploaded under.

e2b's template builder names each COPY step's files by a hash it computes on the client:
SHA-256 over ``COPY <src> <dest>`` and then, for every file, directory and link the step
copies (in the order it puts them in the archive), the path relative to the context
directory, ``st_mode`` (type and permission bits, in decimal), the size (not for
directories) and the content of regular files, or the target of a symbolic link. The
archive it uploads holds exactly those entries, in that order. So the hash can be
computed again from the archive alone, and an archive that does not reproduce it is not
the one the hash names.

That matters because uploads are stored by hash and shared: a build whose hash is
already present skips its upload. Without this check anyone holding an upload link could
store any archive under a hash another user's build will name. The archive is only read
here, never unpacked on the host (it is unpacked inside the build guest).
"""

from __future__ import annotations

import hashlib
import stat
import tarfile
from pathlib import Path

__all__ = ["UploadMismatch", "archive_files_hash", "check_upload"]

_CHUNK = 1 << 20

# tar keeps only the permission bits of a mode; the type comes from the entry's type.
_TYPE_BITS = {
    tarfile.REGTYPE: stat.S_IFREG,
    tarfile.AREGTYPE: stat.S_IFREG,
    tarfile.CONTTYPE: stat.S_IFREG,
    tarfile.LNKTYPE: stat.S_IFREG,  # a hard link: the client hashed the file it names
    tarfile.DIRTYPE: stat.S_IFDIR,
    tarfile.SYMTYPE: stat.S_IFLNK,
    tarfile.CHRTYPE: stat.S_IFCHR,
    tarfile.BLKTYPE: stat.S_IFBLK,
    tarfile.FIFOTYPE: stat.S_IFIFO,
}


class UploadMismatch(ValueError):
    """An uploaded archive does not reproduce the files hash it was uploaded under."""

    def __init__(self, files_hash: str, reason: str) -> None:
        super().__init__(f"the upload for files {files_hash} {reason}")
        self.files_hash = files_hash
        self.reason = reason


def _encoded(text: str) -> bytes:
    # tarfile decodes names with surrogateescape; this gives back the bytes the client had.
    return text.encode("utf-8", "surrogateescape")


def archive_files_hash(archive: Path, src: str, dest: str) -> str:
    """The files hash e2b's builder would have computed for the COPY ``src`` ``dest``
    whose archive is ``archive`` (plain or gzip tar). :class:`tarfile.TarError` if it is
    not a readable tar archive."""
    digest = hashlib.sha256(_encoded(f"COPY {src} {dest}"))
    with tarfile.open(archive, mode="r:*") as tar:
        for member in tar:
            type_bits = _TYPE_BITS.get(member.type)
            if type_bits is None:
                raise tarfile.TarError(f"entry {member.name!r} has an unknown type")
            content = member
            if member.islnk():
                # The client hashed the linked file: its size and content.
                content = tar.getmember(member.linkname)
            digest.update(_encoded(member.name))
            digest.update(str(type_bits | (member.mode & 0o7777)).encode())
            if member.issym():
                link = _encoded(member.linkname)
                digest.update(str(len(link)).encode())
                digest.update(link)
            elif not member.isdir():
                digest.update(str(content.size).encode())
            if content.isreg():
                data = tar.extractfile(content)
                if data is None:
                    raise tarfile.TarError(f"entry {member.name!r} has no content")
                while chunk := data.read(_CHUNK):
                    digest.update(chunk)
    return digest.hexdigest()


def check_upload(archive: Path, files_hash: str, src: str, dest: str) -> None:
    """:class:`UploadMismatch` unless ``archive`` is what ``files_hash`` names."""
    try:
        actual = archive_files_hash(archive, src, dest)
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise UploadMismatch(files_hash, f"is not a readable tar archive ({exc})") from None
    if actual != files_hash.lower():
        raise UploadMismatch(
            files_hash, f"does not match it: its files for COPY {src} {dest} hash to {actual}"
        )
