"""Running a blocking call inside a named network namespace.

``setns`` moves only the calling thread, and a thread that has entered a sandbox's
namespace must never go back to a pool where other work would run in the wrong
namespace. So each call gets a fresh thread that enters the namespace, runs the call and
ends there. Sockets made by the call stay in that namespace after the thread is gone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from pyroute2 import netns

__all__ = ["call_in_namespace"]

_T = TypeVar("_T")


def call_in_namespace(name: str, func: Callable[[], _T]) -> _T:
    """``func()`` called in a fresh thread that has entered network namespace ``name``;
    its exception is raised here. Blocking: a thread start and a setns call."""
    outcome: list[_T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            netns.setns(name, flags=0)
            outcome.append(func())
        except BaseException as exc:
            failure.append(exc)

    worker = threading.Thread(target=run, name=f"netns-{name}")
    worker.start()
    worker.join()
    if failure:
        raise failure[0]
    return outcome[0]
