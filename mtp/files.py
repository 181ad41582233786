"""Stage 3 of `pdserve train-mtp`: the head file (DeepSeek key form, the feature layers in its
metadata), the loss curve (PNG, with or without matplotlib), and the progress bars."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.model.llama import CausalLM, mtp_state_dict
from engine.model.loader import FEATURE_LAYERS_KEY


def save_head(model: CausalLM, path: Path, dtype: torch.dtype, meta: dict[str, str]) -> dict[str, torch.Tensor]:
    """The MTP module as a standalone DeepSeek-form safetensors file (the feature layers it reads,
    if any, in its metadata); returns what was saved."""
    tensors = {k: v.to("cpu", dtype).contiguous() for k, v in mtp_state_dict(model).items()}
    if model.config.mtp_feature_layers:
        meta = {**meta, FEATURE_LAYERS_KEY: ",".join(map(str, model.config.mtp_feature_layers))}
    save_file(tensors, str(path), metadata=meta)
    return tensors


def save_loss_curve(history: list[dict], path: Path) -> None:
    """Per-level KL against step as a PNG (matplotlib when installed, else a bare line plot)."""
    if not history:
        return
    steps = [h["step"] for h in history]
    curves = list(zip(*(h["kl"] for h in history), strict=True))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        write_line_png(path, steps, [list(c) for c in curves])
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for j, c in enumerate(curves, start=1):
        ax.plot(steps, c, label=f"level {j} (draft {j})")
    ax.set(xlabel="step", ylabel="KL(target || MTP), nats", yscale="log", title=path.stem)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_line_png(path: Path, xs: list[float], curves: list[list[float]], size: tuple[int, int] = (640, 360)) -> None:
    """A minimal PNG (zlib only): white canvas, grey axes, one colored polyline per curve."""
    import struct
    import zlib

    w, h = size
    img = bytearray(b"\xff" * (w * h * 3))
    colors = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40)]
    ys = [math.log(max(v, 1e-6)) for c in curves for v in c]
    lo, hi, x0, x1 = min(ys), max(ys) + 1e-9, min(xs), max(xs) + 1e-9
    px = lambda x: int(40 + (x - x0) / (x1 - x0) * (w - 60))  # noqa: E731
    py = lambda y: int(h - 30 - (math.log(max(y, 1e-6)) - lo) / (hi - lo) * (h - 50))  # noqa: E731
    for x in range(40, w - 19):
        _put(img, w, h, x, h - 30, (128, 128, 128))
    for y in range(20, h - 29):
        _put(img, w, h, 40, y, (128, 128, 128))
    for c, color in zip(curves, colors * 4, strict=False):
        pts = [(px(x), py(y)) for x, y in zip(xs, c, strict=True)]
        for (ax_, ay), (bx, by) in zip(pts, pts[1:], strict=False):
            n = max(abs(bx - ax_), abs(by - ay), 1)
            for t in range(n + 1):
                _put(img, w, h, ax_ + (bx - ax_) * t // n, ay + (by - ay) * t // n, color)
    raw = b"".join(b"\x00" + bytes(img[r * w * 3 : (r + 1) * w * 3]) for r in range(h))
    chunk = lambda tag, data: struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))  # noqa: E731
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
    path.write_bytes(png + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def _put(img: bytearray, w: int, h: int, x: int, y: int, color: tuple[int, int, int]) -> None:
    if 0 <= x < w and 0 <= y < h:
        img[(y * w + x) * 3 : (y * w + x) * 3 + 3] = bytes(color)


class _Progress:
    """A progress line on stderr when tqdm is absent (same `update`/`set_postfix` calls)."""

    def __init__(self, total: int, desc: str, initial: int = 0) -> None:
        self.total, self.desc, self.n, self.post, self.last = total, desc, initial, "", 0.0

    def update(self, n: int) -> None:
        self.n += n
        if time.monotonic() - self.last > 5 or self.n >= self.total:
            self.last = time.monotonic()
            print(f"{self.desc}: {self.n}/{self.total} {self.post}", file=sys.stderr, flush=True)

    def set_postfix(self, **kw: str) -> None:
        self.post = " ".join(f"{k}={v}" for k, v in kw.items())

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def progress(total: int, desc: str, initial: int = 0) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return _Progress(total, desc, initial)
    return tqdm(total=total, desc=desc, initial=initial, mininterval=2.0, file=sys.stderr, disable=None)  # quiet off a TTY
