"""bench serve's --py-spy-dir: every service process sampled over a run, the clients not."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from bench import py_spy
from bench.serve_clients import CpuWatch


@pytest.mark.skipif(py_spy.executable() is None, reason="py-spy is not installed")
def test_a_watched_run_samples_each_service_process_into_its_file(tmp_path) -> None:
    busy = subprocess.Popen([sys.executable, "-c", "while True: sum(range(10000))"])
    try:
        watch = CpuWatch({"router": busy.pid, "client0": os.getpid()}, (str(tmp_path), "rate8"))
        watch.start()
        time.sleep(1.0)
        figures = watch.stop(tokens=100, chunks=10)
    finally:
        busy.kill()
    assert figures["router"]["cpu_s"] > 0
    written = sorted(p.name for p in tmp_path.iterdir())
    if not written:
        pytest.skip("py-spy could not attach to a process here (ptrace not permitted)")
    assert written == ["rate8_router.txt"]  # the client's own process is not sampled
    stacks = (tmp_path / "rate8_router.txt").read_text().splitlines()
    assert stacks and all(line.rsplit(" ", 1)[1].isdigit() for line in stacks)
    assert any("<module>" in line for line in stacks)
