"""A prefill node and a decode node of TP size 2: four processes (two real gloo groups on
127.0.0.1), rank 0 of each behind its real gRPC server, KV over tcp rank to rank, driven with
raw stubs the way the router drives them. Greedy output equals the single-process engine's
(so each decode rank received its KV-head shard intact: either half wrong changes the tokens),
and so does a seeded sampled request's, whose prompt prefix both decode ranks had cached (k > 0:
both nodes cache prefixes, so only the uncached blocks cross); a descriptor one prefill rank refuses is refused by
both; an abort ends its request once, only rank 0 of each node emitted messages, and every rank's
blocks come back. At TP size 4 (eight processes; tiny's KV heads replicated) greedy output is
the single-process engine's too."""

from __future__ import annotations

import queue
import threading
import time
from contextlib import contextmanager

import grpc
import msgpack
import pytest
import torch.multiprocessing as mp

from engine.engine import EngineConfig, LLMEngine
from engine.model.loader import load_model
from engine.sampling.sampling_params import SamplingParams
from engine.tp.launch import free_port, init_group
from protos import node_pb2, node_pb2_grpc
from protos.convert import pack_token_ids, sampling_to_proto
from protos.messages import FirstToken, unpack_outputs
from tests.prefill_stream import send_prefill

VOCAB = 320  # tiny
PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], list(range(40, 77))]


def _build(role: str, tp, k: int):
    """The rank's node, started, and (rank 0) its gRPC server and port."""
    from decode_node.server import serve_decode
    from decode_node.tp import TPDecodeNode
    from prefill_node.server import DecodeClients, serve_prefill
    from prefill_node.tp import TPPrefillNode

    cfg = EngineConfig(num_speculative_tokens=k, block_shuffle_seed=3 if role == "decode" else 4,
                       enable_prefix_caching=k > 0)  # with k > 0 both nodes cache prompt prefixes
    kv = {"kv_backend": "tcp", "kv_timeout_s": 10}
    if role == "decode":
        node = TPDecodeNode(load_model("tiny"), cfg, tp, kv_quarantine_s=0.3, **kv)
    else:
        node = TPPrefillNode(load_model("tiny"), cfg, DecodeClients().send_first_token, tp, **kv)
    node.start()
    if tp.rank:
        return node, None, 0
    serve = serve_decode if role == "decode" else serve_prefill
    return node, *serve(node, f"{role}-0")


def _rank_main(role: str, rank: int, size: int, port: int, k: int, reports, stop) -> None:
    import torch.distributed as dist

    tp = init_group(rank, size, port, "cpu")
    try:
        node, server, grpc_port = _build(role, tp, k)
        if server is not None:
            reports.put(("address", role, f"127.0.0.1:{grpc_port}"))
        stop.wait()
        if server is not None:
            server.stop(0)
        node.stop()  # rank 0's loop tells the other ranks to stop; theirs returns then
        reports.put(("end", role, rank, node.blocks.num_free, node.blocks.capacity, node.emitted))
    except BaseException as e:
        reports.put(("failed", role, rank, repr(e)))
    finally:
        dist.destroy_process_group()


class Outputs:
    """Reads the decode node's output stream into a queue."""

    def __init__(self, stub) -> None:
        self.items: queue.SimpleQueue = queue.SimpleQueue()
        self.stream = stub.Outputs(node_pb2.OutputsRequest(subscriber="test"))
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for payload in self.stream:
                for item in unpack_outputs(payload.msgpack, VOCAB):
                    self.items.put(item)
        except grpc.RpcError:
            pass


def generate(d, p, daddr, outputs: Outputs, rid: str, prompt: list[int], params=PARAMS,
             abort: bool = False, k: int = 2) -> tuple[list[int], str]:
    """(tokens, finish reason) of one request; `abort`: the router aborts it after its first token."""
    sampling = sampling_to_proto(params, 1 if params.seed is None else params.seed, ())
    res = d.Reserve(node_pb2.ReserveRequest(request_id=rid, prompt_len=len(prompt), sampling=sampling,
                                            prompt_token_ids_packed=pack_token_ids(prompt)))
    assert res.admitted, res.reason
    reply = send_prefill(p, node_pb2.PrefillRequest(
        request_id=rid, prompt_token_ids_packed=pack_token_ids(prompt), sampling=sampling,
        descriptor_msgpack=res.descriptor_msgpack, decode_address=daddr))
    tokens = [FirstToken.unpack(reply.msgpack, VOCAB, k).token]
    if abort:
        d.Abort(node_pb2.AbortRequest(request_id=rid, reason="client went away"))
    while True:
        item = outputs.items.get(timeout=60)
        assert item.request_id == rid and not item.error, item.error
        tokens += item.tokens
        if item.finish_reason:
            return tokens, item.finish_reason


def refused_by_rank1(d, p, daddr, outputs: Outputs) -> None:
    """A descriptor whose rank-1 part is broken: every prefill rank refuses the job (rank 0
    alone would start it), the router's abort ends the reservation, the nodes serve on."""
    sampling = sampling_to_proto(PARAMS, 1, ())
    res = d.Reserve(node_pb2.ReserveRequest(request_id="bad", prompt_len=5, sampling=sampling))
    desc = msgpack.unpackb(res.descriptor_msgpack, raw=False)
    desc["tp_ranks"] = [{}]
    with pytest.raises(grpc.RpcError) as err:
        send_prefill(p, node_pb2.PrefillRequest(
            request_id="bad", prompt_token_ids_packed=pack_token_ids([1, 2, 3, 4, 5]), sampling=sampling,
            descriptor_msgpack=msgpack.packb(desc), decode_address=daddr))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "another tensor-parallel rank refused" in err.value.details()
    d.Abort(node_pb2.AbortRequest(request_id="bad", reason="prefill refused"))
    item = outputs.items.get(timeout=60)  # its one terminal: the abort, or rank 0's aborted transfer's error
    assert item.request_id == "bad" and (item.finish_reason == "abort" or "KV transfer failed" in item.error)


def _wait_all_free(stubs, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while any((s := stub.Status(node_pb2.StatusRequest())).free_blocks != s.total_blocks for stub in stubs):
        assert time.monotonic() < deadline, "blocks did not come back"
        time.sleep(0.05)


def _start_groups(ctx, reports, stop, k: int, size: int = 2) -> list:
    procs = []
    for role in ("prefill", "decode"):
        port = free_port()
        procs += [ctx.Process(target=_rank_main, args=(role, r, size, port, k, reports, stop), daemon=True)
                  for r in range(size)]
    for proc in procs:
        proc.start()
    return procs


def _next(reports, kind: str) -> tuple:
    msg = reports.get(timeout=300)
    assert msg[0] == kind, msg
    return msg


@contextmanager
def tp_groups(k: int, size: int = 2):
    """A prefill and a decode group of `size` ranks (spawned processes), driven as the router
    would: yields (decode stub, prefill stub, decode address, outputs, finish), where finish()
    waits for every block back, ends the groups and returns each rank's end report, sorted."""
    ctx = mp.get_context("spawn")
    reports, stop = ctx.Queue(), ctx.Event()
    procs = _start_groups(ctx, reports, stop, k, size)
    try:
        addr = dict(_next(reports, "address")[1:] for _ in range(2))
        d = node_pb2_grpc.DecodeControlStub(grpc.insecure_channel(addr["decode"]))
        p = node_pb2_grpc.PrefillControlStub(grpc.insecure_channel(addr["prefill"]))
        outputs = Outputs(d)

        def finish() -> list:
            _wait_all_free([d, p])
            outputs.stream.cancel()
            stop.set()
            return sorted(_next(reports, "end")[1:] for _ in range(2 * size))

        yield d, p, addr["decode"], outputs, finish
    finally:
        stop.set()
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()


@pytest.mark.parametrize("k", [0, 2])
def test_p_tp2_to_d_tp2_greedy_equals_single_process_and_only_rank0_emits(k):
    ref = LLMEngine(load_model("tiny"), EngineConfig()).generate(PROMPTS, PARAMS)
    with tp_groups(k) as (d, p, daddr, outputs, finish):
        got = [generate(d, p, daddr, outputs, f"r{i}", prompt, k=k) for i, prompt in enumerate(PROMPTS)]
        assert got == [(r.output_ids, "length") for r in ref]
        sampled = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, seed=7)
        want = LLMEngine(load_model("tiny"), EngineConfig(num_speculative_tokens=k)).generate(PROMPTS[1:], sampled)
        assert generate(d, p, daddr, outputs, "s", PROMPTS[1], sampled, k=k) == (want[0].output_ids, "length")
        skipped = d.Status(node_pb2.StatusRequest()).kv_skipped_bytes
        assert (skipped > 0) == (k > 0)  # "s" repeats r1's prompt: its 2 full blocks stayed on both decode ranks
        refused_by_rank1(d, p, daddr, outputs)
        long = SamplingParams(max_tokens=500, ignore_eos=True)
        tokens, reason = generate(d, p, daddr, outputs, "a", PROMPTS[0], long, abort=True, k=k)
        assert reason == "abort" and len(tokens) < 500  # one terminal event, on every rank's scheduler
        ends = finish()
    assert [(role, rank, free == total) for role, rank, free, total, _ in ends] == [
        ("decode", 0, True), ("decode", 1, True), ("prefill", 0, True), ("prefill", 1, True)]
    emitted = {(role, rank): n for role, rank, _, _, n in ends}
    assert emitted[("decode", 1)] == emitted[("prefill", 1)] == 0
    assert emitted[("prefill", 0)] == len(PROMPTS) + 2 and emitted[("decode", 0)] > 0


def test_p_tp4_to_d_tp4_with_replicated_kv_heads_greedy_equals_single_process():
    """tiny's 2 KV heads over 4 ranks: each cached on two ranks of each node, each decode rank
    receiving its own copy from the prefill rank of its index."""
    ref = LLMEngine(load_model("tiny"), EngineConfig()).generate(PROMPTS, PARAMS)
    with tp_groups(k=2, size=4) as (d, p, daddr, outputs, finish):
        got = [generate(d, p, daddr, outputs, f"r{i}", prompt) for i, prompt in enumerate(PROMPTS)]
        assert got == [(r.output_ids, "length") for r in ref]
        ends = finish()
    assert all(free == total for _, _, free, total, _ in ends)
    assert [n > 0 for role, rank, _, _, n in ends] == [rank == 0 for role, rank, _, _, _ in ends]
