"""Facts about the machine a run or a benchmark ran on, for the records they write."""

from __future__ import annotations

import platform


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (else the platform's processor name),
    e.g. "Intel(R) Xeon(R) Processor"."""
    name = platform.processor() or platform.machine() or "cpu"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return name
