"""PinnedStaging: host-to-device copies through reused pinned buffers, never waiting.

A non-blocking copy reads its pinned source when the stream reaches it, so the source may be
reused only after that. Each buffer handed out is recorded with an event after its copy; a
buffer goes back to the free list once its event has fired (`Event.query`, which does not
wait). When none is free the pool allocates another: a busy loop grows the pool to what it
needs in flight, and never syncs. Off CUDA there is nothing to stage: `to_device` copies.
"""

from __future__ import annotations

import torch

MIN_BYTES = 1 << 16


class PinnedStaging:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._free: list[torch.Tensor] = []
        self._busy: list[tuple[torch.cuda.Event, torch.Tensor]] = []

    @property
    def num_buffers(self) -> int:
        return len(self._free) + len(self._busy)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A contiguous host tensor's bytes on the device, stream-ordered, without a sync.
        The result is a new device tensor of the same dtype and shape."""
        if not self.cuda:
            return host.clone()
        nbytes = host.numel() * host.element_size()
        buf = self._take(nbytes)
        staged = buf[:nbytes].view(host.dtype).view(host.shape)
        staged.copy_(host)
        out = staged.to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._busy.append((event, buf))
        return out

    def _take(self, nbytes: int) -> torch.Tensor:
        self._reap()
        for i, buf in enumerate(self._free):
            if buf.numel() >= nbytes:
                return self._free.pop(i)
        return torch.empty(max(nbytes, MIN_BYTES), dtype=torch.uint8, pin_memory=True)

    def _reap(self) -> None:
        still = []
        for event, buf in self._busy:
            if event.query():
                self._free.append(buf)
            else:
                still.append((event, buf))
        self._busy = still
