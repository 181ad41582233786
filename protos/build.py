"""Regenerate the committed gRPC stubs: `make protos` (python -m protos.build).

`generate(out_dir)` writes them elsewhere; tests compare that with the committed files.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ["protos/pdserve.proto", "protos/node.proto"]


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc

    args = ["protoc", f"-I{ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}"]
    if protoc.main(args + [str(ROOT / p) for p in PROTOS]) != 0:
        raise RuntimeError("protoc failed")
    return sorted((out_dir / "protos").glob("*_pb2*.py*"))


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        for f in generate(Path(tmp)):
            (ROOT / "protos" / f.name).write_bytes(f.read_bytes())
            print(f"wrote protos/{f.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
