"""engine/cuda_init.py: the early CUDA context is made on the device given, in a thread, only on CUDA."""

from __future__ import annotations

import torch

from engine.cuda_init import start_cuda_init


def test_off_cuda_no_thread_starts(monkeypatch):
    started = []
    monkeypatch.setattr("threading.Thread.start", lambda self: started.append(self.name))
    assert start_cuda_init("cpu") is None
    assert start_cuda_init("auto") is None
    assert started == []


def test_the_context_is_made_on_the_device_given(monkeypatch):
    made = []
    monkeypatch.setattr(torch, "empty", lambda *shape, device: made.append(device))
    thread = start_cuda_init("cuda:1")
    assert thread is not None and thread.name == "cuda-init" and thread.daemon
    thread.join(timeout=10)
    assert made == ["cuda:1"]


def test_an_error_is_left_to_the_main_thread(monkeypatch):
    def fail(*shape, device):
        raise RuntimeError("no CUDA driver")

    monkeypatch.setattr(torch, "empty", fail)
    errors = []
    monkeypatch.setattr("threading.excepthook", lambda args: errors.append(args.exc_value))
    thread = start_cuda_init("cuda")
    assert thread is not None
    thread.join(timeout=10)
    assert not thread.is_alive() and errors == []
