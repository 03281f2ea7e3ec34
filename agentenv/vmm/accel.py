"""Which accelerator a VMM can use on this host.

Hardware KVM runs guests at native speed; TCG (QEMU's software emulation) runs anywhere.
A ``/dev/kvm`` alone does not mean hardware KVM: on PVM hosts (``kvm_pvm``) the device
exists, VMMs start, and ordinary guest kernels die on the first instruction PVM cannot
emulate. So the probe looks at the host's KVM flavour and CPU flags, not just the device.

Every probe function takes ``root`` so tests can point it at a fake ``/dev``, ``/sys`` and
``/proc`` tree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from agentenv.vmm.base import VMMError

Accel = Literal["kvm", "tcg"]


class AcceleratorUnavailable(VMMError):
    """An explicitly requested accelerator cannot be used on this host."""


@dataclass(frozen=True)
class AccelProbe:
    """The chosen accelerator and a one-line reason a human can act on."""

    accel: Accel
    reason: str


def _kvm_device_usable(root: Path) -> tuple[bool, str]:
    device = root / "dev" / "kvm"
    if not device.exists():
        return False, f"{device} does not exist"
    try:
        fd = os.open(device, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return False, f"{device} cannot be opened: {exc.strerror}"
    os.close(fd)
    return True, f"{device} is usable"


def _cpu_flags(root: Path) -> set[str]:
    try:
        text = (root / "proc" / "cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def probe_accelerator(root: Path = Path("/")) -> AccelProbe:
    """Pick the fastest accelerator that runs an ordinary guest kernel on this host."""
    usable, why = _kvm_device_usable(root)
    if not usable:
        return AccelProbe("tcg", why)
    modules = root / "sys" / "module"
    if (modules / "kvm_pvm").exists():
        return AccelProbe(
            "tcg", "/dev/kvm is PVM (kvm_pvm): ordinary guest kernels cannot run under it"
        )
    flags = _cpu_flags(root)
    if (modules / "kvm_intel").exists() and "vmx" in flags:
        return AccelProbe("kvm", "hardware KVM (kvm_intel, vmx)")
    if (modules / "kvm_amd").exists() and "svm" in flags:
        return AccelProbe("kvm", "hardware KVM (kvm_amd, svm)")
    return AccelProbe("tcg", "/dev/kvm exists but neither kvm_intel+vmx nor kvm_amd+svm is present")


def resolve_accelerator(setting: str, root: Path = Path("/")) -> AccelProbe:
    """Turn a configuration value (``auto``, ``kvm`` or ``tcg``) into an accelerator.

    An explicit choice wins over the probe (``kvm`` on a PVM host is legitimate with a
    PVM guest kernel), but ``kvm`` without a usable ``/dev/kvm`` is refused up front
    rather than left to fail inside the VMM.
    """
    if setting == "auto":
        return probe_accelerator(root)
    if setting == "tcg":
        return AccelProbe("tcg", "set explicitly")
    if setting == "kvm":
        usable, why = _kvm_device_usable(root)
        if not usable:
            raise AcceleratorUnavailable(f"accelerator 'kvm' was requested but {why}")
        return AccelProbe("kvm", "set explicitly")
    raise ValueError(f"unknown accelerator setting {setting!r}; expected auto, kvm or tcg")
