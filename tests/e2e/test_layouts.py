"""xPyD layouts on a real local Ray cluster with `tiny`: 1P3D finishes every request and the
router's load reaches every decode node (2P2D, over ipc: test_service.py's
`test_load_reaches_every_node`); a layout wanting more GPUs than the host has fails before any
actor starts; `bench serve --launch` compares a PD layout and a colocated one with the same GPU
count on the same requests."""

from __future__ import annotations

import argparse
import asyncio
import json
import random

import pytest

from bench import serve
from deploy.config import ServiceConfig
from deploy.service import check_gpus_fit
from engine.sampling.sampling_params import SamplingParams
from router.client import RouterClient, build_request
from tests.e2e.conftest import BASE, run_async, start_service, wait_blocks_returned

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.mark.parametrize(("prefill", "decode", "k", "kv"), [(1, 3, 0, "ucx")], ids=["1P3D-ucx"])
def test_load_reaches_every_decode_node(prefill, decode, k, kv, tiny_reference):
    """Every node of the layout takes work, and the tokens equal the engine alone's."""
    svc, address = start_service(prefill, decode, k=k, **{"kv_transfer.backend": kv})
    try:
        rng = random.Random(0)
        prompts = [[rng.randrange(256) for _ in range(rng.choice([5, 17, 40]))] for _ in range(12)]

        async def main():
            async with RouterClient(address) as client:
                return await asyncio.gather(*(client.generate(build_request(p, max_tokens=6, ignore_eos=True))
                                              for p in prompts))

        results = run_async(main())
        ref = tiny_reference(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
        assert [r["token_ids"] for r in results] == [r.output_ids for r in ref]
        assert {r["finish_reason"] for r in results} == {"length"}
        wait_blocks_returned(svc)
        info = svc.node_info()
        assert sorted(k for k in info) == sorted([("prefill", i) for i in range(prefill)]
                                                 + [("decode", i) for i in range(decode)])
        received = {key: i["kv_bytes"] for key, i in info.items() if key[0] == "decode"}
        assert all(b > 0 for b in received.values()), received  # every decode node took requests
        prefilled = {key: i["prefill_tokens"] for key, i in info.items() if key[0] == "prefill"}
        assert all(t > 0 for t in prefilled.values()), prefilled
        assert sum(prefilled.values()) == sum(len(p) for p in prompts)
    finally:
        svc.stop()


def test_a_layout_wanting_more_gpus_than_the_host_has_is_refused():
    cfg = ServiceConfig.load(None, BASE | {"model.device": "cuda", "prefill.num_nodes": 1, "decode.num_nodes": 3})
    with pytest.raises(ValueError, match="take 4 GPUs"):
        check_gpus_fit(cfg)  # this Ray cluster has none
    check_gpus_fit(ServiceConfig.load(None, BASE))  # a CPU service asks for none


def test_bench_serve_compares_a_pd_and_a_colocated_layout(tmp_path, capsys):
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    out = tmp_path / "goodput.json"
    args = p.parse_args([
        "--launch", "--model", "tiny", "--layout", "prefill=1,decode=1", "--layout", "colocated=2",
        "--dataset", "random", "--input-len", "24", "--output-len", "6", "--length-dist", "lognormal",
        "--num-prompts", "4", "--request-rate", "2,8", "--protocol", "http", "--http-client", "raw",
        "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--spec-tokens", "0", "--json", str(out),
        "--plot-dir", str(tmp_path), "--set", "prefill.num_cpus=0.5", "--set", "decode.num_cpus=0.5",
        "--set", "colocated.num_cpus=0.5", "--set", "router.status_interval_s=0.25"])
    assert serve.run(args) == 0
    report = json.loads(out.read_text())
    assert report["model"] == "tiny" and report["seed"] == 0 and report["length_dist"] == "lognormal"
    assert [lay["name"] for lay in report["layouts"]] == ["1P1D", "colocated2"]
    assert [lay["gpus"] for lay in report["layouts"]] == [2.0, 2.0]
    for lay in report["layouts"]:
        assert [r["request_rate"] for r in lay["runs"]] == [2.0, 8.0]
        for r in lay["runs"]:
            assert r["completed"] == 4 and r["failed"] == 0, r["errors"]
            assert r["slo_attainment"] == 1.0  # SLOs no CPU run misses
            assert r["tpot"]["p50_ms"] <= r["tpot"]["p99_ms"]
        assert (lay["goodput_rate"], lay["goodput_method"]) == (8.0, "all_pass")
    pd_runs = report["layouts"][0]["runs"]
    assert [r["server"].get("kv_transfers") for r in pd_runs] == [4, 4], pd_runs[0]["server"]  # one per request
    assert all(0 < r["server"]["kv_transfer_p50_ms"] <= r["server"]["kv_transfer_p99_ms"] for r in pd_runs)
    assert "kv_transfers" not in report["layouts"][1]["runs"][0]["server"]  # colocated: no transfer
    assert report["goodput_ratio_pd_over_colocated"] == 1.0
    assert "PD / colocated goodput: 1" in capsys.readouterr().out
    assert (tmp_path / "attainment.png").stat().st_size > 0
