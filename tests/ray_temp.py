"""Ray temp dirs for tests: under the test's tmp path, named by a short link.

Ray puts its AF_UNIX sockets in `{temp dir}/session_{date}_{pid}/sockets/`, and a socket's
path must stay under 108 bytes. pytest's tmp path (user name, run number, and with
pytest-xdist the worker's `popen-gwN`) plus Ray's 41-byte session name went past that, so Ray
gets `/tmp/pdt-XXXXXXXX/r`, a link to a directory in the test's tmp path: the files stay there."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def ray_temp_dir(tmp_path_factory: pytest.TempPathFactory, name: str = "ray") -> Iterator[str]:
    real = tmp_path_factory.mktemp(name)
    short = Path(tempfile.mkdtemp(prefix="pdt-"))
    link = short / "r"
    link.symlink_to(real, target_is_directory=True)
    try:
        yield str(link)
    finally:
        link.unlink()
        short.rmdir()
