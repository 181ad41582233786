"""This process's memory, for reports (`pdserve status`, `bench chaos`): Linux /proc only.

psutil is not a dependency; /proc/self/status gives the resident set now (VmRSS) and its peak
over the process's life (VmHWM). Elsewhere the figures are -1. Never raises.
"""

from __future__ import annotations

import os


def process_memory() -> dict[str, float]:
    """{"pid", "rss_mb" (now), "max_rss_mb" (peak)} of this process, MiB."""
    fields = {"VmRSS": -1.0, "VmHWM": -1.0}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in fields:
                    fields[name] = round(int(value.split()[0]) / 1024, 1)  # kB
    except (OSError, ValueError, IndexError):
        pass
    return {"pid": os.getpid(), "rss_mb": fields["VmRSS"], "max_rss_mb": fields["VmHWM"]}
