"""py-spy over a benchmark's processes: where a router's or a node's CPU goes during a run.

`record(pid, out)` starts sampling process `pid` (every thread, idle ones too: a node's loop blocked
on the GPU shows as such) into `out` as collapsed stacks, flamegraph.pl's input; `stop` ends the
samplers, which write their files then. py-spy comes from PATH or beside this Python (the venv's
`py-spy`, and the GPU machines' bundle); without it nothing is sampled and `record` says so once.
"""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)
RATE_HZ = 200


def executable() -> str | None:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return found if Path(found).exists() else None


def record(pid: int, out: str | Path, idle: bool = True) -> subprocess.Popen | None:
    exe = executable()
    if exe is None:
        log.warning("py-spy not found (PATH, or beside %s): %s is not sampled", sys.executable, out)
        return None
    cmd = [exe, "record", "--pid", str(pid), "--rate", str(RATE_HZ), "--format", "raw", "--output", str(out),
           "--nonblocking", "--threads", *(["--idle"] if idle else [])]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop(procs: list[subprocess.Popen | None]) -> None:
    for proc in procs:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
    for proc in procs:
        if proc is not None:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
