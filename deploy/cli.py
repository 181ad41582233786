"""The `pdserve` command line."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("pdserve: not yet", file=sys.stderr)
    return 2
