"""The nested KVM test host: a QEMU TCG VM with emulated SVM (``-cpu max``) in which
agentenv runs with a live ``/dev/kvm``, so the Firecracker and QEMU/KVM paths, which this
machine's PVM ``/dev/kvm`` cannot run, are exercised end to end.

It owns: the host's root filesystem image (``image.py``, cached content-addressed beside
the guest image), starting, stopping and talking to the VM (``machine.py``, driven by
``scripts/kvm-host``), the agent that runs commands inside it (``agent.py``, stdlib only),
the end-to-end smoke run inside it (``smoke.py``) and the tests that drive all of it
(``test_nested.py``, marker ``kvm``). It is test tooling, not product code: nothing under
``agentenv/`` imports it.
"""
