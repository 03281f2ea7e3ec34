"""Uploaded COPY archives against their files hash, with the e2b SDK's own hash and archive
functions making the reference (the SDK's builder is what uploads them)."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import httpx
import pytest
from e2b.template.utils import calculate_files_hash, tar_file_stream

from agentenv.orchestrator.upload_check import UploadMismatch, archive_files_hash, check_upload


def _context(root: Path) -> Path:
    """A context directory with what a COPY may carry: nested files, an empty
    directory, an executable, a symbolic link, a hard link and a setgid directory."""
    (root / "app" / "lib").mkdir(parents=True)
    (root / "app" / "empty").mkdir()
    (root / "app" / "lib" / "module.py").write_text("print('hi')\n")
    (root / "app" / "run.sh").write_text("#!/bin/sh\necho run\n")
    (root / "app" / "run.sh").chmod(0o755)
    (root / "app" / "data.bin").write_bytes(os.urandom(3 * 1024 * 1024 + 17))
    os.symlink("lib/module.py", root / "app" / "link.py")
    os.link(root / "app" / "data.bin", root / "app" / "data-again.bin")
    (root / "app" / "shared").mkdir()
    (root / "app" / "shared").chmod(0o2775)
    return root


def _sdk_upload(context: Path, src: str, dest: str, out: Path, *, gzip: bool) -> str:
    """The archive the SDK uploads for COPY src dest, written to ``out``, and its hash."""
    files_hash = calculate_files_hash(src, dest, str(context), [], False, None)
    stream = tar_file_stream(src, str(context), [], False, gzip)
    out.write_bytes(stream.read())
    return files_hash


@pytest.mark.parametrize("gzip", [False, True])
@pytest.mark.parametrize("src", ["app", "app/**", "app/*.sh"])
def test_sdk_archives_reproduce_their_hash(tmp_path: Path, src: str, gzip: bool) -> None:
    context = _context(tmp_path / "context")
    archive = tmp_path / "upload.tar"
    files_hash = _sdk_upload(context, src, "/srv/", archive, gzip=gzip)
    assert archive_files_hash(archive, src, "/srv/") == files_hash
    check_upload(archive, files_hash, src, "/srv/")
    # The same files named for another step do not match: src and dest are hashed too.
    with pytest.raises(UploadMismatch):
        check_upload(archive, files_hash, src, "/elsewhere/")


def test_a_changed_archive_does_not_match(tmp_path: Path) -> None:
    context = _context(tmp_path / "context")
    archive = tmp_path / "upload.tar"
    files_hash = _sdk_upload(context, "app", "/srv/", archive, gzip=False)
    # Same names, sizes and modes; one byte of content differs.
    data = bytearray(archive.read_bytes())
    offset = data.index(b"echo run")
    data[offset] = ord("E")
    archive.write_bytes(bytes(data))
    with pytest.raises(UploadMismatch, match="does not match"):
        check_upload(archive, files_hash, "app", "/srv/")
    # An extra entry appended to an otherwise identical archive.
    clean = tmp_path / "clean.tar"
    _sdk_upload(context, "app", "/srv/", clean, gzip=False)
    with tarfile.open(clean, "a") as tar:
        extra = tarfile.TarInfo("app/extra")
        tar.addfile(extra, io.BytesIO(b""))
    with pytest.raises(UploadMismatch):
        check_upload(clean, files_hash, "app", "/srv/")


def test_what_is_not_a_tar_archive_is_refused_by_name(tmp_path: Path) -> None:
    archive = tmp_path / "upload.tar"
    archive.write_bytes(b"\x1f\x8b" + os.urandom(600))
    with pytest.raises(UploadMismatch, match="not a readable tar archive") as info:
        check_upload(archive, "ab" * 32, "app", "/srv/")
    assert info.value.files_hash == "ab" * 32


async def test_builds_refuse_and_remove_an_upload_that_does_not_match(tmp_path: Path) -> None:
    """Through the template API on fakes: an archive stored under another build's hash is
    refused when the build starts (400 naming the hash), removed, and the link then asks
    for an upload again; the first upload under a hash is not replaced by a later one."""
    from agentenv.api.app import create_app
    from tests.fakes import start_node

    node = await start_node(tmp_path / "node", tmp_path / "repository")
    try:
        api_key = "upload-check-key"
        app = create_app(node.orchestrator, api_key, manage_lifecycle=False)
        headers = {"X-API-Key": api_key}
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://test", headers=headers
        ) as api:
            context = _context(tmp_path / "context")
            real = tmp_path / "real.tar"
            files_hash = _sdk_upload(context, "app", "/srv/", real, gzip=True)
            answer = await api.post("/v3/templates", json={"name": "poisoned"})
            assert answer.status_code in (200, 202), answer.text
            template_id = answer.json()["templateID"]
            build_id = answer.json()["buildID"]
            link = (await api.get(f"/templates/{template_id}/files/{files_hash}")).json()
            assert link["present"] is False
            # Someone holding an upload link stores other bytes under that hash.
            forged = tmp_path / "forged.tar"
            _sdk_upload(context, "app/run.sh", "/srv/", forged, gzip=True)
            put = await api.put(link["url"], content=forged.read_bytes())
            assert put.status_code == 200
            # A later upload (the real one) does not replace the first.
            put = await api.put(link["url"], content=real.read_bytes())
            assert put.status_code == 200
            again = (await api.get(f"/templates/{template_id}/files/{files_hash}")).json()
            assert again["present"] is True
            body = {
                "fromImage": "debian:12",
                "steps": [
                    {"type": "COPY", "args": ["app", "/srv/"], "filesHash": files_hash},
                ],
            }
            started = await api.post(f"/v2/templates/{template_id}/builds/{build_id}", json=body)
            assert started.status_code == 400, started.text
            assert files_hash in started.text and "does not match" in started.text
            # Removed: the SDK's next attempt is asked for the upload again.
            link = (await api.get(f"/templates/{template_id}/files/{files_hash}")).json()
            assert link["present"] is False
    finally:
        await node.stop()
