"""A CUDA context made early, off the main thread: a process's start (`pdserve generate`, every
node process of `pdserve up`) overlaps the context's creation with its imports and the weights'
read instead of meeting it at its first CUDA call."""

from __future__ import annotations

import threading


def start_cuda_init(device: str) -> threading.Thread | None:
    """On a CUDA `device` ('cuda' or 'cuda:N', the device the process will compute on), create its
    context in a background thread (torch releases the GIL for the driver's work) and return the
    thread; the main thread's first CUDA call waits for it (torch's lazy init holds a lock). None
    elsewhere. An error is left for the main thread to meet with its own message."""
    if not device.startswith("cuda"):
        return None
    import torch

    def init() -> None:
        try:
            torch.empty(1, device=device)
        except Exception:
            pass

    thread = threading.Thread(target=init, name="cuda-init", daemon=True)
    thread.start()
    return thread
