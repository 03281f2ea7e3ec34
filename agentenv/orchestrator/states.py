"""The sandbox state machine: the states a sandbox record can be in and the transitions
between them. The table here is the only definition; :meth:`Store.transition
<agentenv.orchestrator.store.Store.transition>` refuses any change it does not list, so
a new operation must add its edges here first.

::

    (new) -> creating -> running <-> pausing -> paused <-> resuming -> running
                         running -> snapshotting -> running
                         running -> forking -> running
             running | paused -> killing -> (gone)

Besides the happy paths: a failed pause, snapshot or fork goes back to ``running``, a
failed resume back to ``paused``, and recovery after a crash may settle any in-between
state (``pausing -> paused`` when the save had finished, a VM state to ``paused`` when
its VMM is lost but its disk is not, a VM state to ``running`` when its VMM survived).
A VMM that exits on its own while the server runs takes ``running -> paused`` the same
way (:mod:`.liveness`, under the operation lock, so from ``running`` only).
A record in ``creating`` or ``killing`` is never settled: it is removed with its files.
"""

from __future__ import annotations

from enum import StrEnum

from agentenv.orchestrator.errors import Conflict


class SandboxState(StrEnum):
    CREATING = "creating"
    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"
    RESUMING = "resuming"
    SNAPSHOTTING = "snapshotting"
    FORKING = "forking"
    KILLING = "killing"


S = SandboxState

TRANSITIONS: dict[SandboxState, frozenset[SandboxState]] = {
    S.CREATING: frozenset({S.RUNNING}),
    # paused directly: a sandbox whose VMM died is kept as a filesystem-only pause, by
    # recovery after a restart or by liveness as soon as the exit is noticed.
    S.RUNNING: frozenset({S.PAUSING, S.SNAPSHOTTING, S.FORKING, S.KILLING, S.PAUSED}),
    # paused: saved; running: the save failed and the VM runs on.
    S.PAUSING: frozenset({S.PAUSED, S.RUNNING}),
    S.PAUSED: frozenset({S.RESUMING, S.KILLING}),
    # paused: the restore failed (or was interrupted) and the saved state is intact.
    S.RESUMING: frozenset({S.RUNNING, S.PAUSED}),
    # paused: the VMM was lost in a crash mid-capture and only the disk is kept.
    S.SNAPSHOTTING: frozenset({S.RUNNING, S.PAUSED}),
    S.FORKING: frozenset({S.RUNNING, S.PAUSED}),
    S.KILLING: frozenset(),
}
# States in which a VMM process exists (re-adopted after a restart).
VM_STATES = frozenset({S.RUNNING, S.PAUSING, S.SNAPSHOTTING, S.FORKING})

# What callers see: SDKs know only "running" and "paused", and a sandbox in transition is
# still what it was. States not listed (creating, killing) are invisible.
PUBLIC_STATE: dict[SandboxState, str] = {
    S.RUNNING: "running",
    S.PAUSING: "running",
    S.SNAPSHOTTING: "running",
    S.FORKING: "running",
    S.PAUSED: "paused",
    S.RESUMING: "paused",
}
VISIBLE_STATES = frozenset(PUBLIC_STATE)
# States a new operation may start from (others wait for the one in progress).
SETTLED_STATES = frozenset({S.RUNNING, S.PAUSED})


# Why a sandbox entering a state (None: its record removed) stops taking proxied
# traffic: its guest is about to be killed or saved, or is already gone. Connections open
# into it would otherwise wait on a guest that never answers again.
_TRAFFIC_ENDS: dict[SandboxState | None, str] = {
    S.KILLING: "killed",
    None: "killed",
    S.PAUSING: "paused",
    S.PAUSED: "paused",
}


def traffic_end(new: SandboxState | None) -> str | None:
    """Why entering ``new`` ends the sandbox's proxied traffic ("killed", "paused"),
    or None when the sandbox goes on taking it (a snapshot or fork keeps it running)."""
    return _TRAFFIC_ENDS.get(new)


def allowed(old: SandboxState, new: SandboxState) -> bool:
    return new in TRANSITIONS[old]


class IllegalTransition(RuntimeError):
    """A change the state machine does not have: a bug in the caller, never a user's
    mistake."""

    def __init__(self, sandbox_id: str, old: SandboxState, new: SandboxState) -> None:
        super().__init__(f"sandbox {sandbox_id}: {old} -> {new} is not a transition")
        self.sandbox_id, self.old, self.new = sandbox_id, old, new


class StateChanged(Conflict):
    """A compare-and-set lost: the record was not in the expected state (another
    operation moved it, or it is gone: ``actual`` None)."""

    def __init__(
        self, sandbox_id: str, expected: SandboxState, actual: SandboxState | None
    ) -> None:
        super().__init__(f"sandbox {sandbox_id} is {actual or 'gone'}, not {expected}")
        self.sandbox_id, self.expected, self.actual = sandbox_id, expected, actual
