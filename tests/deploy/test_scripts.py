"""The scripts users run check what they need before doing anything (deploy/require.sh): run
here with a PATH that lacks a tool, each stops with one line naming the package to install and a
non-zero status, and has started nothing (no sshd, no Ray, no pip, no venv)."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASH = shutil.which("bash") or "/bin/bash"


def path_without(tmp_path: Path, *missing: str) -> str:
    """A PATH of one directory holding links to every command on this PATH but `missing`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for d in os.environ.get("PATH", "").split(os.pathsep):
        if not os.path.isdir(d):
            continue
        for name in os.listdir(d):
            src = os.path.join(d, name)
            if name in missing or (bin_dir / name).exists() or not os.access(src, os.X_OK) or os.path.isdir(src):
                continue
            (bin_dir / name).symlink_to(src)
    return str(bin_dir)


def run(cmd: list[str], tmp_path: Path, *missing: str, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": path_without(tmp_path, *missing), **env}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_try_local_without_rsync_says_so_and_starts_nothing(tmp_path):
    before = set(glob.glob("/tmp/pdserve-ray-up.*"))
    out = run([BASH, "deploy/ray/try_local.sh"], tmp_path, "rsync")
    assert out.returncode == 1, out
    assert "rsync not found: install it (apt-get install rsync)" in out.stderr.splitlines(), out.stderr
    assert out.stdout == "" and set(glob.glob("/tmp/pdserve-ray-up.*")) == before  # no work dir, no sshd, no ray up


def test_gpu_script_without_nvidia_smi_says_so_and_installs_nothing(tmp_path):
    out = run([BASH, "bench/gpu/run.sh", "engine"], tmp_path, "nvidia-smi", OUT=str(tmp_path / "out"))
    assert out.returncode == 1, out
    assert any(line.startswith("nvidia-smi not found: install it (the NVIDIA driver's utilities")
               for line in out.stderr.splitlines()), out.stderr
    assert out.stdout == "" and not (tmp_path / "out").exists()


def test_make_without_its_python_says_so(tmp_path):
    venv = tmp_path / "venv"
    out = run(["make", "venv", f"VENV={venv}", "PY=python3.11"], tmp_path, "python3.11")
    assert out.returncode != 0
    assert ("python3.11 not found: install it (apt-get install python3.11 python3.11-venv), or name another: "
            "make PY=...") in out.stdout.splitlines(), out
    assert not venv.exists()


def test_ci_without_make_says_so(tmp_path):
    out = run([BASH, ".ci/run"], tmp_path, "make")
    assert out.returncode == 1 and out.stderr.splitlines() == ["make not found: install it (apt-get install make)"]
