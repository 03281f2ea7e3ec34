"""The guest kernel command line, computed from the host and the fixed guest addresses."""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from pathlib import Path

from agentenv.network.addresses import GUEST_GATEWAY, GUEST_IP, GUEST_PREFIX

_CPU_MHZ = re.compile(r"^cpu MHz\s*:\s*([0-9.]+)\s*$", re.MULTILINE)


def tsc_khz_from_cpuinfo(cpuinfo: str) -> int | None:
    """The first ``cpu MHz`` of /proc/cpuinfo in kHz, or None if it is absent."""
    match = _CPU_MHZ.search(cpuinfo)
    if match is None:
        return None
    khz = round(float(match.group(1)) * 1000)
    return khz if khz > 0 else None


@functools.cache
def host_tsc_khz() -> int | None:
    try:
        return tsc_khz_from_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        return None


def kernel_cmdline(extra: Mapping[str, str] | None = None, *, tsc_khz: int | None = None) -> str:
    """The guest kernel command line.

    ``extra`` adds or overrides parameters; an empty value gives a bare flag (``{"quiet": ""}``).
    ``tsc_khz`` defaults to the host's TSC frequency: under TCG the guest TSC runs at the host
    rate, and without ``tsc_early_khz`` calibration against microvm's PIT can fail and hang
    the boot.
    """
    params: dict[str, str] = {
        "console": "ttyS0",
        "root": "/dev/vda",
        "rw": "",
        "quiet": "",
        # The CRNG is seeded from RDRAND at once instead of after ~1 s of TCG time.
        "random.trust_cpu": "on",
        # microvm has no HPET or ACPI PM timer to watch the TSC against, so the kernel
        # rejects it and falls back to jiffies: a tick that never stops (idle guests burn
        # host CPU) and coarse, slow time reads. The TSC is steady under TCG and KVM alike.
        "tsc": "reliable",
        # A guest panic reboots at once (triple fault, no ACPI needed); the VMM runs QEMU
        # with -no-reboot, so the VM exits instead of hanging.
        # The soft-lockup watchdog wakes every CPU every 4 s (an idle guest's wakeups are
        # the node's CPU), and under TCG on a busy node it reports lockups that are only
        # the host's scheduling.
        "nowatchdog": "",
        # Pressure stall information: its averaging work runs every 2 s while the CPU was
        # not idle, and its own kworker counts as not idle, so on this kernel (6.1) it
        # never stops. With it off, an idle sandbox's VMM woke 2.8 times a second instead
        # of 6.9 and used a third of the CPU. /proc/pressure is absent in the guest.
        "psi": "0",
        "panic": "-1",
        "reboot": "t",
        "aenv.ip": f"{GUEST_IP}/{GUEST_PREFIX}",
        "aenv.gw": GUEST_GATEWAY,
    }
    khz = tsc_khz if tsc_khz is not None else host_tsc_khz()
    if khz is not None:
        params["tsc_early_khz"] = str(khz)
    for key, value in (extra or {}).items():
        if not key or any(c.isspace() for c in key + value) or "=" in key:
            raise ValueError(f"bad kernel parameter {key!r}={value!r}")
        params[key] = value
    return " ".join(key if value == "" else f"{key}={value}" for key, value in params.items())
