"""A decode step's outputs: packed in one device buffer by the step, read back by one copy.

The step (a CUDA graph's, or an eager one) writes everything the host reads of it into one flat
int64 buffer, in the segments `StepLayout` names: the tokens [R, k+1], the emitted counts [R]
and the finished flags [R] (the tail kernel writes these three in place: kernels/decode_tail.py),
then, when the step computes logprobs, their four tensors (fp32 ones as raw bits, two a word),
then, in a constrained step (grammar masks), the new drafts [R, k]: the host builds the next
step's masks from them.
After the launch, `HostOutputs.copy_no_sync` queues one copy of that buffer into a pinned host
buffer and records the buffer's own event; the read point (`ModelRunner.collect`) waits on that
event and reads the host buffer through the same layout. A step is thus one graph replay, one
copy and one event record, whatever it outputs. On CUDA the copy is a kernel writing the pinned
buffer (kernels/publish.py), so no copy engine runs at the step boundary.

Pinned buffers are reused: one is taken at each launch and given back when its step has been
read, so the overlapped loop (launch step N+1, then read step N) holds two of them (double
buffering) and never hands out a buffer a queued copy may still write. A handle dropped without
being read keeps its buffer. Off CUDA there is no copy: the host reads the step's buffer itself.

Must never sync: nothing here waits but `HostCopy.wait`, which is the read point.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.sampling.sampler import LogprobsTensors
from kernels.publish import publish


@dataclass(frozen=True)
class StepLayout:
    """Where a step's outputs lie in its packed int64 buffer."""

    rows: int  # R: the step's rows (a graph's bucket: padding rows included)
    k1: int  # tokens per row: k + 1
    lp_rows: int = 0  # rows whose logprobs the step computes, k + 1 entries each (0: none)
    num_top: int = 0  # top logprobs per entry
    drafts: bool = False  # the step's new drafts [R, k] (a constrained step: engine/runner/constrained.py)

    def _sizes(self) -> list[int]:
        n = self.lp_rows * self.k1
        top = n * self.num_top
        r = self.rows
        return [r * self.k1, r, r, -(-n // 2), n, top, -(-top // 2), r * (self.k1 - 1) if self.drafts else 0]

    @property
    def words(self) -> int:
        return sum(self._sizes())

    def empty(self, device: torch.device | str) -> Tensor:
        return torch.empty(self.words, dtype=torch.long, device=device)

    def drafts_view(self, buf: Tensor) -> Tensor | None:
        """The new drafts [R, k] inside `buf` (None: the layout has none)."""
        if not self.drafts:
            return None
        return buf[: self.words].split(self._sizes())[7].view(self.rows, self.k1 - 1)

    def views(self, buf: Tensor) -> tuple[Tensor, Tensor, Tensor, LogprobsTensors | None]:
        """(tokens [R, k+1], emitted [R], finished [R] (0/1), logprobs or None) inside `buf`."""
        tokens, emitted, finished, lp, rank, top_ids, top_lp, _ = buf[: self.words].split(self._sizes())
        if not self.lp_rows:
            return tokens.view(self.rows, self.k1), emitted, finished, None
        n, t = self.lp_rows * self.k1, self.num_top
        lps = LogprobsTensors(lp.view(torch.float32)[:n], rank, top_ids.view(n, t),
                              top_lp.view(torch.float32)[: n * t].view(n, t))
        return tokens.view(self.rows, self.k1), emitted, finished, lps

    def write_logprobs(self, buf: Tensor, lps: LogprobsTensors) -> None:
        """Copy a step's logprobs (`lp_rows` * (k+1) entries) into their segments of `buf`."""
        into = self.views(buf)[3]
        assert into is not None, "a layout without logprobs"
        for dst, src in zip(astuple_lp(into), astuple_lp(lps), strict=True):
            dst.copy_(src.view(dst.shape))


def astuple_lp(lp: LogprobsTensors) -> tuple[Tensor, ...]:
    return (lp.token_logprob, lp.token_rank, lp.top_ids, lp.top_logprobs)


@dataclass
class HostCopy:
    """A step's packed outputs on their way to the host."""

    host: Tensor  # int64: the step's buffer, pinned host memory on CUDA (the device buffer elsewhere)
    event: torch.cuda.Event | None  # recorded after the copy; None off CUDA
    index: int = -1  # the pinned buffer's index in its pool

    def wait(self) -> None:
        """The read point: returns once `host` holds the step's outputs."""
        if self.event is not None:
            self.event.synchronize()


class HostOutputs:
    """Reused pinned buffers (each with its own event) that steps' packed outputs are copied into."""

    def __init__(self, device: torch.device, min_words: int = 0) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.min_words = min_words  # buffers are made at least this large: one size serves every step
        self._bufs: list[tuple[Tensor, torch.cuda.Event]] = []
        self._free: list[int] = []
        if self.cuda:  # compile (or load) the copy kernel now, not at the first step
            publish(torch.zeros(1, dtype=torch.long, device=device), torch.zeros(1, dtype=torch.long, pin_memory=True))

    @property
    def num_buffers(self) -> int:
        return len(self._bufs)

    def copy_no_sync(self, packed: Tensor) -> HostCopy:
        """Queue the copy of a step's buffer to the host (stream-ordered after the step); never waits."""
        if not self.cuda:
            return HostCopy(packed, None)
        i = self._take(packed.numel())
        buf, event = self._bufs[i]
        host = buf[: packed.numel()]
        publish(packed, host)  # the SMs write the pinned buffer: no copy engine at the step boundary
        event.record()
        return HostCopy(host, event, i)

    def release(self, copy: HostCopy) -> None:
        """Give a read step's buffer back (after `wait` and the reads)."""
        if copy.index >= 0:
            self._free.append(copy.index)

    def _take(self, words: int) -> int:
        for j, i in enumerate(self._free):
            if self._bufs[i][0].numel() >= words:
                return self._free.pop(j)
        buf = torch.empty(max(words, self.min_words), dtype=torch.long, pin_memory=True)
        self._bufs.append((buf, torch.cuda.Event()))
        return len(self._bufs) - 1
