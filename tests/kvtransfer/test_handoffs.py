"""A transfer's fixed cost is its hand-overs (issue 48): the receiver's ack is written by the
handler that decided it, the ipc sender's ``finish`` waits for the copy's event on the loop
unless the copy takes long, and a caller's burst of calls wakes the sender's loop once. No timing
is asserted: what ran, and in what order."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import torch

from kvtransfer import KVLayout, TransferState, create_receiver, create_sender, wire
from kvtransfer.ipc import completed
from kvtransfer.loop import LoopThread


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


def test_calls_queued_while_a_drain_runs_wake_no_one() -> None:
    """The first call wakes the loop; the ones queued while its drain runs go with that drain."""
    thread = LoopThread("test-drain")
    wakes, ran, gate, inside = [0], list[int](), threading.Event(), threading.Event()
    schedule = thread.loop.call_soon_threadsafe

    def counted(fn: Any, *args: Any) -> Any:
        wakes[0] += fn == thread._drain
        return schedule(fn, *args)

    thread.loop.call_soon_threadsafe = counted  # type: ignore[method-assign,assignment]
    try:
        def first() -> None:
            inside.set()
            gate.wait(10)
            ran.append(0)

        thread.call(first)
        assert inside.wait(10)
        for i in range(1, 6):
            thread.call(ran.append, i)
        gate.set()
        thread.submit(asyncio.sleep(0)).result(timeout=10)  # behind every queued call
        assert ran == [0, 1, 2, 3, 4, 5] and wakes[0] == 1
    finally:
        thread.stop()


def test_a_start_with_no_call_after_it_still_begins() -> None:
    """tcp defers ``begin`` to the transfer's next call; with none, the watchdog's tick sends it."""
    receiver = create_receiver("tcp", timeout_s=30)
    sender = create_sender("tcp", timeout_s=30)
    layout = KVLayout([torch.zeros(2, 4, 64, dtype=torch.uint8)], 1)
    try:
        receiver.register(layout)
        sender.register(layout)
        sender.start("r", receiver.expect("r", [1], [0]))
        begun = threading.Event()
        for _ in range(200):  # up to 10 s; the tick is 0.1 s
            # both sides: the receiver may read ``begin`` before the sender's loop marks it sent
            if all(end.poll("r").state is TransferState.TRANSFERRING for end in (receiver, sender)):
                begun.set()
                break
            threading.Event().wait(0.05)
        assert begun.is_set()
        sender.abort("r")
        assert sender.wait("r", 10).state is TransferState.FAILED
        assert receiver.wait("r", 10).state is TransferState.FAILED
    finally:
        sender.close()
        receiver.close()


def test_a_groups_ready_events_are_waited_on_in_one_thread_hop() -> None:
    """Four layers queued together, each with its own event (and one shared): one executor call
    waits on each event once, off the loop, before the data leaves."""
    receiver = create_receiver("tcp", timeout_s=30)
    sender: Any = create_sender("tcp", timeout_s=30)  # its loop is read below
    layout = KVLayout([torch.zeros(2, 4, 64, dtype=torch.uint8) for _ in range(4)], 1)
    hops, gate = [0], threading.Event()
    loop = sender._thread.loop
    run_in_executor = loop.run_in_executor

    def counted(executor: Any, fn: Any, *args: Any) -> Any:
        hops[0] += 1
        return run_in_executor(executor, fn, *args)

    loop.run_in_executor = counted  # type: ignore[method-assign]
    try:
        receiver.register(layout)
        sender.register(layout)
        sender.start("r", receiver.expect("r", [1, 2], [0, 1, 2, 3]))
        sender._thread.call(gate.wait, 10)  # holds the loop: the layers below form one group
        events = [_Event(0), _Event(0), _Event(0)]
        for layer, event in enumerate([events[0], events[1], events[2], events[2]]):
            sender.send_layer("r", layer, [0, 3], ready=event)
        sender.finish("r")
        gate.set()
        assert sender.wait("r", 10).state is TransferState.DONE
        assert hops[0] == 1
        assert all(len(e.synced_on) == 1 and e.synced_on[0] is not sender._thread._thread for e in events)
    finally:
        sender.close()
        receiver.close()
