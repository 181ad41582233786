"""A serving router process's garbage collector (router.router.freeze_heap): what was alive at
start is frozen out of full passes, and the young generation waits for YOUNG_GC_THRESHOLD net new
objects (a stream's objects die young). Run in a process of its own: it changes the process's GC."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import gc
from router.router import YOUNG_GC_THRESHOLD, freeze_heap
before = gc.get_threshold()
freeze_heap()
print(gc.get_freeze_count() > 1000, gc.get_threshold() == (YOUNG_GC_THRESHOLD, *before[1:]), YOUNG_GC_THRESHOLD > before[0])
"""


def test_freeze_heap_freezes_the_start_and_collects_the_young_less_often() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}).stdout
    assert out.split() == ["True", "True", "True"]
