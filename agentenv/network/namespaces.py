"""Creating named network namespaces, and running a blocking call inside one.

``setns`` and ``unshare`` move only the calling thread, and a thread that has entered a
sandbox's namespace must never go back to a pool where other work would run in the wrong
namespace. So each call gets a fresh thread that enters the namespace, runs the call and
ends there. Sockets made by the call stay in that namespace after the thread is gone.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from typing import TypeVar

from pyroute2 import netns

__all__ = ["call_in_namespace", "enter_new_namespace"]

_T = TypeVar("_T")

_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
# The first namespace named bind-mounts /run/netns onto itself; two threads doing that at
# once would stack two mounts, so namings within this process take turns (a few syscalls).
_naming_lock = threading.Lock()


def enter_new_namespace(name: str) -> None:
    """Move the calling thread into a new network namespace and name it ``name`` (bound
    at /run/netns/``name``, as ``ip netns add`` does). The thread must be one that ends
    without going back to a pool. Unlike pyroute2's ``netns.create`` this forks no
    helper process, which in a server of a few hundred MiB costs more than the rest of a
    sandbox's network setup; the thread-specific ``/proc/<tid>/ns/net`` is what is bound,
    as ``/proc/self`` would name the process's main thread. Raises ``OSError``
    (``FileExistsError`` if the name is taken)."""
    if _libc.unshare(_CLONE_NEWNET) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"unshare of a network namespace failed: {os.strerror(code)}")
    with _naming_lock:
        netns.attach(name, threading.get_native_id())


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
