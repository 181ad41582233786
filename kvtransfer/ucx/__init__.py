"""UCX transport (ucxx): shared memory on one host, CUDA IPC between GPUs, RDMA/TCP across.

Endpoints are made from *worker addresses* (carried in the descriptor and in
``begin``), not from IP:port, so UCX picks shared memory / CUDA IPC on one host;
endpoint error handling is off because with it UCX falls back to TCP (~0.7 GB/s vs
~5 GB/s here). A dead peer is therefore noticed by the ``timeout_s`` watchdogs.

Messages are tagged sends, not RMA: ucxx's Python API exposes no memory
registration or put/get, and large tagged sends already use UCX's zero-copy
rendezvous protocol (the receiver pulls). Tags:
- control to a receiver: ``CTRL | receiver id``; acks to a sender: ``ACK | sender id``;
  both carry ``wire.seal`` frames (magic, length, crc32) into a fixed buffer.
- data: ``serial << 31 | layer << 21 | announced << 20 | run * planes + plane``, where
  ``serial`` is 32 bits derived from the transfer token (``wire.token_serial``), unique among
  the receiving process's recent requests, so a stale message never matches another request's
  receive and a sender without the token (one the router did not introduce) cannot name a
  posted receive; ``announced`` says the layer's runs came in a ``layers`` message rather than
  being the destination's own (pre-posted) runs.
- authentication: UCX messages carry no sender identity, so every control message carries the
  transfer token and is dropped without it (``authenticate``), before ``begin`` makes an
  endpoint or anything is posted for it. Pre-posted receives wait for data under tags only a
  holder of the token can compute; guessing one means guessing 32 bits per pending request.

Receives are posted as soon as ``expect`` is called (queued on the loop; ``expect`` does
not wait), before the sender exists: every layer, over the destination's own runs
(maximal stretches of consecutive destination blocks). A sender
whose source is contiguous wherever the destination is (the usual case) sends into them
without any announcement; nothing on the receiver stands between ``begin`` and the first
byte. A layer with other runs is announced; its pre-posted receives are retired and the
announced runs posted under the ``announced`` tags, so the two can never mix.

Threads: the process-wide loop thread (``runtime()``, shared by every UcxSender and
UcxReceiver of the process) and, in a receiving process, ``settings.UCX_LANES`` lane
threads (default 2). ucxx's asyncio layer (progress thread, ``Request.wait`` polling with
``sleep(0)``) is not used; ``Driver`` drives ucxx's core API from the loop thread, as
ucx_perftest does: post, ``worker.progress()``, reap completions by callback, sleep on
the worker's epoll descriptor when idle. Control messages go through the driver's worker;
data sends through its second, never-armed worker, reaped on a timer (``send_data``). Data
receives go to the lanes (``Lane``): one UCX worker and thread
each, layer ``l`` on lane ``l % lanes``, whose addresses the descriptor carries. The
receiver pulls the bytes, so the lanes copy in parallel; a lane busy-polls only while
receives of a transfer that began are pending. ``UCXPY_*`` variables have no effect;
``settings.UCX_SPIN`` (off) turns the busy-polling off. ``UCX_*`` variables apply.

Careful: ucxx 0.52 cannot cancel a posted receive from Python. A receive that must go
(its transfer failed, or its layer was announced with other runs) is *retired*: the
receiver sends a zero-byte message with its tag to its own worker, which completes it
without writing a byte; a request turns terminal only once all its receives completed,
so a late send from an aborted sender can never land in blocks that were handed back.
(A receive already matched to a sender's data completes with that data first; the
zero-byte message then stays in UCX's unexpected queue, a few bytes.)

Files: tags.py (the tag space), core.py (ucxx's API and what the threads share), worker.py (the
driver), lanes.py (the receive lanes), process.py (the process's loop thread and driver,
loopback, device binding), link.py (control messages and data sends between the two ends),
sender.py and receiver.py (the two ends).
"""

from kvtransfer.ucx.process import driver, restrict_to_loopback, runtime, send_raw
from kvtransfer.ucx.receiver import UcxReceiver
from kvtransfer.ucx.sender import UcxSender
from kvtransfer.ucx.tags import ACK, ANNOUNCED, CTRL, data_tag

__all__ = [
    "ACK", "ANNOUNCED", "CTRL", "UcxReceiver", "UcxSender", "data_tag", "driver", "restrict_to_loopback",
    "runtime", "send_raw",
]
