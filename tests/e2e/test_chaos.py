"""Faults together under load (the fast case of `pdserve bench chaos`): 2 prefill + 2 decode
nodes with k=3 at twice their capacity, node actors of both kinds killed in turn, the router
actor killed (Ray restarts it), Abort storms, client cancels and KV messages dropped, delayed and
duplicated (1% each). Nothing is lost or duplicated (a stream broken by the router's death ends
with one clean UNAVAILABLE), every finished request's tokens equal the single-process engine's
greedy output (aborted and cancelled ones a prefix of it), every KV block comes back, and the
restarted router serves a request after the run."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

from bench.chaos import Stuck, chaos, make_jobs
from engine.sampling.sampling_params import SamplingParams
from tests.e2e.conftest import run_async, start_service, wait_blocks_returned
from tests.e2e.test_router_restart import generate_after_restart

pytestmark = pytest.mark.usefixtures("ray_cluster")
AFTER = [9, 8, 7, 6, 5]  # a prompt sent after the run, to the restarted router


# Each node actor killed once and the router once per round: on a slow machine more router kills
# could end every stream in flight each time, so that no request would finish at all. The third
# node fault (decode node 1's) is a CUDA error in its next step instead of a kill.
ARGS = dict(requests=240, min_prompt=4, max_prompt=64, min_output=8, max_output=64, cancel_fraction=0.1, seed=1,
            concurrency=None, kill_every=2.5, max_kills=4, step_error_every=3, abort_every=1.0, abort_fraction=0.05,
            router_restart_every=3.0, max_router_kills=1, deadline_s=300.0, progress_s=1.0, timeout_s=0)
# Long answers, no faults, a deadline for the whole run that they cannot meet.
STUCK = {**ARGS, "requests": 6, "min_output": 500, "max_output": 500, "kill_every": 0, "abort_every": 0,
         "router_restart_every": 0, "cancel_fraction": 0, "timeout_s": 0.3, "seed": 99}


def faulted(report: dict) -> bool:
    """Whether a round saw every kind of fault: node kills, Abort storms and a router kill."""
    faults = report["faults"]
    return all(faults.get(kind, 0) >= 1 for kind in ("killed_decode", "abort_rpcs", "killed_router"))


def test_kills_router_restarts_aborts_cancels_and_overload_together_lose_nothing(tiny_reference, capsys):
    """The faults come on a clock (every 2.5 s, 1 s, 3 s): a machine that serves the 240 requests
    before they all came runs another round, twice as long, until one round saw them all. The
    first 128 requests may all end with the router's kill; the next ones finish."""
    after = tiny_reference([AFTER], [SamplingParams(max_tokens=12, ignore_eos=True)])[0]
    faults = {f"kv_transfer.faults.{k}": 0.01 for k in ("drop", "delay", "duplicate")}
    service, address = start_service(2, 2, 3, **{"router.node_wait_s": 60, "decode.max_num_seqs": 32, **faults})
    try:
        sent, rounds = 0, []
        while not rounds or not faulted(rounds[-1]):
            assert len(rounds) < 5, f"no round saw every kind of fault: {rounds[-1]['faults']}"
            args = argparse.Namespace(**{**ARGS, "requests": ARGS["requests"] << len(rounds), "seed": 1 + len(rounds)})
            jobs = [replace(j, index=sent + j.index) for j in make_jobs(args, vocab=320)]  # new request ids
            ref = tiny_reference([j.prompt for j in jobs], [SamplingParams(max_tokens=j.max_tokens, ignore_eos=True)
                                                            for j in jobs])
            rounds.append(check_round(chaos(service, address, jobs, [r.output_ids for r in ref], args,
                                            default_concurrency=128), args.requests))
            sent += args.requests
        assert " ended (" in capsys.readouterr().err  # progress lines came while the rounds ran
        stuck_run_reports_what_is_in_flight(service, address, sent)
        # the run may end before a restarted router's first request: ask one once it is back
        tokens, last = run_async(generate_after_restart(address, AFTER, 12))
    finally:
        service.stop()
    report = rounds[-1]
    for r in rounds:  # the third node fault of a round, when it came, was decode node 1's step error
        node_faults = sum(n for k, n in r["faults"].items() if k.startswith(("killed_d", "killed_p", "step_error_")))
        assert r["faults"].get("step_error_decode", 0) == (node_faults >= 3), r["faults"]
    assert tokens == after.output_ids and last.finished.reason == "length"  # the restarted router serves
    assert report["memory"]["router"]["replaced"] == 1 and report["memory"]["decode"]["replaced"] >= 1, report


def stuck_run_reports_what_is_in_flight(service, address, sent: int) -> None:
    """Past `--timeout-s` the run stops and says which requests were in flight, with their tokens
    so far, and where the load sat; the requests it walked away from give their blocks back."""
    args = argparse.Namespace(**STUCK)
    jobs = [replace(j, index=sent + j.index) for j in make_jobs(args, vocab=320)]
    with pytest.raises(Stuck) as stuck:
        chaos(service, address, jobs, [[] for _ in jobs], args, default_concurrency=8)
    report = stuck.value.report
    assert report["timed_out"] and report["sent"] == 6 and report["ended"] < 6, report
    assert {r["request_id"] for r in report["in_flight"]} <= {j.request_id for j in jobs} and report["in_flight"]
    assert all(r["tokens"] < r["max_tokens"] == 500 for r in report["in_flight"]), report
    assert {"decode-0", "decode-1", "prefill-0", "prefill-1"} <= set(report["nodes"]), report
    wait_blocks_returned(service, timeout=60)


def check_round(report: dict, requests: int) -> dict:
    assert report["clean"], report
    assert report["sent"] == requests and report["lost"] == report["duplicated"] == report["wrong_tokens"] == 0
    assert report["leaked_blocks"] == 0 and report["finished_correct"] > 0
    ends = sum(report[k] for k in ("finished_correct", "aborted_correct", "cancelled_by_client", "clean_error"))
    assert ends == requests, report  # every request in exactly one row
    assert report["router_restarts"] == report["faults"].get("killed_router", 0), report  # each came back
    return report
