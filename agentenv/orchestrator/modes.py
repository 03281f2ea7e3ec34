"""Modes: the VMM and accelerator a node runs sandboxes under (``qemu/tcg``,
``firecracker/kvm``, ...), and the check that a saved machine was saved under this
node's mode before anything is restored from it.

A machine's saved state restores only under the VMM and accelerator that saved it: QEMU
and Firecracker state files are different formats, and CPU state saved under KVM does
not load under TCG or back. Every saved machine records both
(:attr:`SnapshotFiles.driver` and :attr:`SnapshotFiles.accel`): a template's or
snapshot's ``snapshot.json`` (fork images included), a paused sandbox's paused manifest,
and a repository record's ``manifest["files"]`` (templates, snapshots and paused
sandboxes committed by any node). A restore in another mode is refused with
:class:`~.errors.ModeMismatch` before it fetches, claims or changes anything, so the
snapshot stays and a paused sandbox stays paused (and unclaimed, for a node of its
mode). Owns no state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentenv.orchestrator.errors import ModeMismatch
from agentenv.vmm.base import SnapshotFiles


@dataclass(frozen=True)
class Mode:
    """A VMM (a driver's name) and an accelerator."""

    vmm: str
    accel: str

    def __str__(self) -> str:
        return f"{self.vmm}/{self.accel}"

    @classmethod
    def of_files(cls, files: SnapshotFiles) -> Mode:
        """The mode a machine's saved state was saved under."""
        return cls(files.driver, files.accel)

    @classmethod
    def of_manifest(cls, manifest: Mapping[str, Any]) -> Mode | None:
        """The mode recorded in a repository record's manifest (its ``files``, the
        :class:`SnapshotFiles` of the machine without local paths); None if it names
        none (a malformed record, left to fail where it is read)."""
        files = manifest.get("files")
        if not isinstance(files, Mapping):
            return None
        vmm, accel = files.get("driver"), files.get("accel")
        if not isinstance(vmm, str) or not isinstance(accel, str):
            return None
        return cls(vmm, accel)

    def require(self, what: str, saved: Mode | None) -> None:
        """Raise :class:`ModeMismatch` unless ``saved`` (the mode ``what``, e.g.
        "snapshot X", was saved under) is this node's mode ``self``."""
        if saved is not None and saved != self:
            raise ModeMismatch(what, str(saved), str(self))
