"""``pdserve bench kv`` end to end on a tiny shape: both processes, the byte check, --inflight."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench import kv


@pytest.mark.parametrize("backend", ["tcp", "ucx"])
def test_bench_moves_every_byte_with_transfers_in_flight(backend: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = kv.main(["--backend", backend, "--layers", "3", "--blocks", "8", "--block-bytes", "4096",
                       "--iters", "2", "--rounds", "1", "--inflight", "3", "--no-thp", "--json"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and result["intact"] is True
    assert result["inflight"] == 3 and result["bytes"] == 3 * 8 * 4096
    assert result["messages"] == 3  # one per layer and transfer: each slot's blocks are contiguous


def test_resident_shim_faults_in_large_anonymous_mappings() -> None:
    """perftest's floor with resident buffers relies on the shim writing every page it maps."""
    shim = kv._resident_shim()
    if shim is None:
        pytest.skip("no C compiler")
    probe = ("import mmap; rss = lambda: int(open('/proc/self/statm').read().split()[1]); before = rss(); "
             "m = mmap.mmap(-1, 32 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS); "
             "print((rss() - before) * mmap.PAGESIZE >> 10)")
    grown = {}
    for mode in ("mmap", "off"):
        env = {**os.environ, "LD_PRELOAD": shim, "PDSERVE_PERFTEST_TOUCH": mode}
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
        grown[mode] = int(out.stdout)  # KiB
    assert grown["mmap"] >= 32 << 10 and grown["off"] < 8 << 10
