"""This process's memory: its figures for reports (`pdserve status`, `bench chaos`), and the
garbage collector held off while a process starts.

psutil is not a dependency; /proc/self/status gives the resident set now (VmRSS) and its peak
over the process's life (VmHWM). Elsewhere the figures are -1. Never raises.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """The garbage collector off inside, as it was after. For a start-up's imports (torch, ray): they
    make hundreds of thousands of objects that live as long as the process, and each full collection
    on the way walks all of them made so far; the little cyclic garbage they leave is left once."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


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


def process_age_s() -> float:
    """Seconds since this process started (-1 where /proc is not there): a Ray actor's process
    starts before its constructor runs, so this counts the worker's own start too."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rpartition(")")[2].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            return round(float(f.read().split()[0]) - started, 2)
    except (OSError, ValueError, IndexError):
        return -1.0
