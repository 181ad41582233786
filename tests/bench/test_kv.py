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
        env = {**os.environ, "LD_PRELOAD": shim, "RESIDENT_SHIM_TOUCH": mode}
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
        grown[mode] = int(out.stdout)  # KiB
    assert grown["mmap"] >= 32 << 10 and grown["off"] < 8 << 10


def test_the_perftest_client_is_retried_while_its_server_is_not_listening(tmp_path):
    """`bench.kv._perftest_client`: a client refused (the server not listening yet) runs again;
    the first answer that is not a refusal is the result. A stand-in client refuses twice."""
    tries = tmp_path / "tries"
    script = (f"import pathlib; p = pathlib.Path({str(tries)!r}); n = int(p.read_text()) if p.exists() else 0; "
              "p.write_text(str(n + 1)); "
              "print('UCX ERROR client failed. connect() failed: Connection refused' if n < 2 else 'Final: 1 2 3')")
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        out = kv._perftest_client([sys.executable, "-c", script], {}, server)
    finally:
        server.kill()
    assert out.strip() == "Final: 1 2 3" and tries.read_text() == "3"
