"""A count of the ipc pools opened in this process (`PeerPool.open`), for the priming tests."""

from __future__ import annotations

import pytest

from kvtransfer import peer_pool


def count_pool_opens(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The list each `PeerPool.open` appends its receiver's pid to, from now on (undone by monkeypatch)."""
    opened: list[int] = []
    real_open = peer_pool.PeerPool.open.__func__  # type: ignore[attr-defined]

    def counted(cls, pool, local):
        opened.append(pool["pid"])
        return real_open(cls, pool, local)

    monkeypatch.setattr(peer_pool.PeerPool, "open", classmethod(counted))
    return opened
