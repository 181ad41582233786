"""``pdserve bench kv`` end to end on a tiny shape: both processes, the byte check, --inflight."""

from __future__ import annotations

import json

import pytest

from kvtransfer import bench


@pytest.mark.parametrize("backend", ["tcp", "ucx"])
def test_bench_moves_every_byte_with_transfers_in_flight(backend: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = bench.main(["--backend", backend, "--layers", "3", "--blocks", "8", "--block-bytes", "4096",
                       "--iters", "2", "--rounds", "1", "--inflight", "3", "--no-thp", "--json"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and result["intact"] is True
    assert result["inflight"] == 3 and result["bytes"] == 3 * 8 * 4096
    assert result["messages"] == 3  # one per layer and transfer: each slot's blocks are contiguous
