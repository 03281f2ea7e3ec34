"""The nested KVM core's step runner (:func:`tests.kvm.core.run_core`), without a host:
a step of ``RETRIED_STEPS`` that fails once runs again, reported as retried, with what it
started killed first; a second failure, or any other step's first, is a failure."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pytest

from tests.kvm import core as core_module
from tests.kvm.core import Core


class FakeSandbox:
    def __init__(self) -> None:
        self.killed = False

    def kill(self) -> None:
        self.killed = True


def _core() -> Core:
    return Core(srv=cast(Any, None), mode="fake", opts={}, restart=lambda: None, vmm_processes=list)


def _run(names: list[str], core: Core) -> dict[str, str]:
    def step(name: str, action: Callable[[], Any]) -> Any:
        return action()

    return core_module.run_core(core, names, step)


def test_a_retried_step_that_fails_once_passes_and_is_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    attempts: list[FakeSandbox] = []

    def flaky_fork(core: Core) -> None:
        child = FakeSandbox()
        attempts.append(child)
        core.started.append(cast(Any, child))
        if len(attempts) == 1:
            raise AssertionError("child 2 did not answer")

    monkeypatch.setattr(core_module, "start_parent", lambda core: None)
    monkeypatch.setitem(core_module.STEPS, "fork", flaky_fork)
    core = _core()
    assert _run(["fork"], core) == {}
    assert core.retried == {"fork": "AssertionError: child 2 did not answer"}
    # The failed attempt's sandbox was killed and dropped; the second one's is left to
    # the final cleanup (which kills every started sandbox).
    assert attempts[0].killed and attempts[1].killed
    assert len(attempts) == 2


def test_a_second_failure_and_other_steps_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: dict[str, int] = {"fork": 0, "pty": 0}

    def always_fails(name: str) -> Callable[[Core], None]:
        def action(core: Core) -> None:
            calls[name] += 1
            raise AssertionError(f"{name} broke")

        return action

    monkeypatch.setattr(core_module, "start_parent", lambda core: None)
    monkeypatch.setitem(core_module.STEPS, "fork", always_fails("fork"))
    monkeypatch.setitem(core_module.STEPS, "pty", always_fails("pty"))
    core = _core()
    failed = _run(["fork", "pty"], core)
    assert failed == {"fork": "AssertionError: fork broke", "pty": "AssertionError: pty broke"}
    assert calls == {"fork": 2, "pty": 1}
