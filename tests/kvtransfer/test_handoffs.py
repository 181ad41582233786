"""A transfer's fixed cost is its hand-overs (issue 48): the receiver's ack is written by the
handler that decided it, and the ipc sender's ``finish`` waits for the copy's event on the loop
unless the copy takes long. No timing is asserted: what ran, and in what order."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import torch

from kvtransfer import KVLayout, TransferState, create_receiver, wire
from kvtransfer.ipc import completed


class _Event:
    """A CUDA event's interface: complete after ``queries`` queries, or once synchronized."""

    def __init__(self, queries: int) -> None:
        self.left = queries
        self.queried = 0
        self.synced_on: list[threading.Thread] = []

    def query(self) -> bool:
        self.queried += 1
        self.left -= 1
        return self.left < 0 or bool(self.synced_on)

    def synchronize(self) -> None:
        self.synced_on.append(threading.current_thread())


def test_a_copy_done_at_once_costs_no_thread() -> None:
    event = _Event(0)
    asyncio.run(completed(event, spin_s=60.0))
    assert event.queried == 1 and not event.synced_on


def test_a_copy_done_within_the_spin_is_polled_on_the_loop() -> None:
    event = _Event(3)
    asyncio.run(completed(event, spin_s=60.0))
    assert event.queried == 4 and not event.synced_on


def test_a_copy_not_done_in_the_spin_is_waited_for_in_a_thread() -> None:
    """Finished only after ``synchronize`` returned, and that ran off the loop's thread."""
    event = _Event(1 << 30)

    async def run() -> threading.Thread:
        await completed(event, spin_s=0.0)
        assert event.synced_on  # nothing after ``completed`` runs before the copy completed
        return threading.current_thread()

    loop_thread = asyncio.run(run())
    assert len(event.synced_on) == 1 and event.synced_on[0] is not loop_thread


class _Writer:
    def __init__(self, buffered: int) -> None:
        self.frames: list[bytes] = []
        self.drained = 0
        self.transport = self
        self.buffered = buffered

    def write(self, data: bytes) -> None:
        self.frames.append(data)

    def get_write_buffer_size(self) -> int:
        return self.buffered

    async def drain(self) -> None:
        self.drained += 1


class _Link:
    def __init__(self, buffered: int = 0) -> None:
        self.writer = _Writer(buffered)


def _send_on_loop(receiver: Any, link: _Link) -> int:
    """``_send`` an ack on the receiver's loop; the frames written before it gave the loop back."""

    async def send() -> int:
        receiver._send(link, wire.make("ack", rid="r", tok=b"t" * 16, ok=True, reason=""))
        written = len(link.writer.frames)
        await asyncio.sleep(0.05)  # let a drain task, if any, run
        return written

    return int(receiver._thread.submit(send()).result(timeout=10))


def test_the_tcp_receiver_writes_its_ack_before_giving_the_loop_back() -> None:
    """The ack is on the socket before ``_end`` wakes the receiver's waiter; a write the socket
    took whole needs no drain task, one it buffered is drained."""
    for backend in ("tcp", "ipc"):
        receiver = create_receiver(backend, timeout_s=10)
        try:
            quick, buffered = _Link(0), _Link(1 << 20)
            assert _send_on_loop(receiver, quick) == 1 and quick.writer.drained == 0
            assert _send_on_loop(receiver, buffered) == 1 and buffered.writer.drained == 1
            assert wire.decode(quick.writer.frames[0][wire.HEADER.size:])["t"] == "ack"
        finally:
            receiver.close()


def test_on_end_calls_back_once_the_transfer_ended_and_at_once_after() -> None:
    receiver = create_receiver("tcp", timeout_s=10)
    try:
        receiver.register(KVLayout([torch.zeros(2, 4, 64, dtype=torch.uint8)], 1))
        receiver.expect("r", [1], [0])
        ended, calls = threading.Event(), list[str]()

        def first() -> None:
            calls.append(receiver.poll("r").state.value)
            ended.set()

        receiver.on_end("r", first)
        assert not calls
        receiver.abort("r", "gone")
        assert ended.wait(10) and calls == [TransferState.FAILED.value]
        receiver.on_end("r", lambda: calls.append("late"))
        assert calls == [TransferState.FAILED.value, "late"]
    finally:
        receiver.close()
