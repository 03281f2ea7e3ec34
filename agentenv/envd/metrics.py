"""``GET /metrics``: the guest's CPU, memory and disk use, in E2B envd's JSON shape.

CPU use is measured between consecutive calls from ``/proc/stat`` deltas (the first call
measures since boot); memory comes from ``/proc/meminfo`` and disk from ``statvfs("/")``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class CpuTimes:
    busy: int
    total: int


def read_cpu_times(stat_text: str) -> CpuTimes:
    """Aggregate jiffies from the ``cpu`` line of /proc/stat."""
    for line in stat_text.splitlines():
        if line.startswith("cpu "):
            fields = [int(v) for v in line.split()[1:]]
            # user nice system idle iowait irq softirq steal (guest time is in user)
            values = (fields + [0] * 8)[:8]
            idle = values[3] + values[4]
            total = sum(values)
            return CpuTimes(busy=total - idle, total=total)
    raise ValueError("/proc/stat has no aggregate cpu line")


def read_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo in bytes."""
    info: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            scale = 1024 if len(parts) > 1 and parts[1] == "kB" else 1
            info[key.strip()] = int(parts[0]) * scale
    return info


class MetricsSampler:
    """Keeps the previous CPU sample so each call reports use since the last one."""

    def __init__(self) -> None:
        self._previous: CpuTimes | None = None

    def sample(self) -> dict[str, Any]:
        with open("/proc/stat") as f:
            cpu = read_cpu_times(f.read())
        previous, self._previous = self._previous, cpu
        base = previous or CpuTimes(0, 0)
        total_delta = cpu.total - base.total
        busy_delta = cpu.busy - base.busy
        cpu_pct = 100.0 * busy_delta / total_delta if total_delta > 0 else 0.0

        with open("/proc/meminfo") as f:
            mem = read_meminfo(f.read())
        mem_total = mem.get("MemTotal", 0)
        available = mem.get("MemAvailable", mem.get("MemFree", 0))
        mem_used = max(mem_total - available, 0)
        mem_cache = mem.get("Cached", 0) + mem.get("Buffers", 0)

        disk = os.statvfs("/")
        disk_total = disk.f_blocks * disk.f_frsize
        disk_used = (disk.f_blocks - disk.f_bfree) * disk.f_frsize
        return {
            "ts": int(time.time()),
            "cpu_count": os.cpu_count() or 1,
            "cpu_used_pct": round(min(max(cpu_pct, 0.0), 100.0), 2),
            "mem_total": mem_total,
            "mem_used": mem_used,
            "mem_cache": mem_cache,
            "mem_total_mib": mem_total // MIB,
            "mem_used_mib": mem_used // MIB,
            "disk_used": disk_used,
            "disk_total": disk_total,
        }
