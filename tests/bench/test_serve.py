"""`pdserve bench serve` against the router on fake nodes, through both doors: every request
counted once, percentiles ordered, the sweep's report and plots written."""

from __future__ import annotations

import argparse

import pytest

from bench import serve
from tests.router.conftest import cluster


def bench_args(tmp_path, **over) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    args = p.parse_args(["--num-prompts", "12", "--output-len", "6", "--range-ratio", "0.5",
                         "--slo-ttft-ms", "60000", "--slo-itl-ms", "60000", "--plot-dir", str(tmp_path)])
    args.status_interval_s = 0.02  # the fake nodes' figures change only when the test says so
    for k, v in over.items():
        setattr(args, k, v)
    return args


async def test_bench_serve_grpc_and_http_sweep(tmp_path):
    async with cluster(http_port=0) as c:
        for target in ({"router": f"127.0.0.1:{c.router.grpc_port}"},
                       {"base_url": f"http://127.0.0.1:{c.router.http_port}", "dataset": "random",
                        "input_len": 20, "max_concurrency": 4},
                       {"base_url": f"http://127.0.0.1:{c.router.http_port}", "dataset": "random",
                        "input_len": 20, "max_concurrency": 4, "http_client": "raw"}):
            args = bench_args(tmp_path, **target)
            items = serve.load_dataset(args)
            report = await serve.sweep(args, items, [50.0, float("inf")])
            for run in report["runs"]:
                assert run["completed"] == 12 and run["failed"] == 0, run["errors"]
                assert run["output_throughput"] > 0
                for key in ("ttft", "itl", "e2e"):
                    assert run[key]["p50_ms"] <= run[key]["p90_ms"] <= run[key]["p99_ms"]
                assert len(run["samples"]["itl_ms"]) == sum(i.output_len for i in items) - 12
                assert run["slo_attainment"] == 1.0  # SLOs (--slo-itl-ms: the TPOT SLO) no run misses
                assert run["tpot"]["p50_ms"] <= run["tpot"]["p99_ms"]
                if "base_url" in target:  # the router's own TTFT lies inside the client's, request by request
                    server = run["server"]
                    assert 0 < server["router_ttft_mean_ms"] <= run["ttft"]["mean_ms"]
                    parts = [server[f"ttft_{p}_mean_ms"] for p in ("parse", "tokenize", "queue", "reserve",
                                                                    "prefill_queue", "prefill", "return", "write")]
                    assert server["ttft_reserve_mean_ms"] > 0 and min(parts) >= 0
                    assert abs(sum(parts) - server["router_ttft_mean_ms"]) < 0.05  # they add up (rounded means)
                    assert run["server"]["kv_blocks_used_after"] == run["server"]["kv_blocks_used_before"]
                else:
                    assert run["server"] == {}
            assert report["slo_tpot_ms"] == 60000 and report["goodput"]["goodput_method"] == "all_pass"
            assert report["goodput"]["goodput_rate"] == 50.0  # the highest finite rate: all pass
            serve.plot(report, tmp_path)
        assert (tmp_path / "latency_cdf.png").stat().st_size > 0 and (tmp_path / "rate_sweep.png").is_file()
        await c.settled()


def test_duration_fills_each_finite_rate_with_the_first_requests_of_one_dataset():
    args = argparse.Namespace(num_prompts=12, duration_s=0.5)
    assert [serve.prompts_at(args, r) for r in (4.0, 100.0, float("inf"))] == [12, 50, 12]
    assert serve.prompts_at(argparse.Namespace(num_prompts=12), 100.0) == 12  # no window: --num-prompts


async def test_bench_serve_sends_rate_times_duration_at_a_high_rate(tmp_path):
    async with cluster() as c:
        args = bench_args(tmp_path, router=f"127.0.0.1:{c.router.grpc_port}", duration_s=0.1)
        items = serve.load_dataset(argparse.Namespace(**{**vars(args), "num_prompts": 30}))
        report = await serve.sweep(args, items, [300.0, float("inf")])
        assert [run["completed"] for run in report["runs"]] == [30, 12]
        assert all(run["failed"] == 0 for run in report["runs"])
        await c.settled()


async def test_each_client_is_warmed_by_a_request_that_is_not_timed(tmp_path):
    """The sender's warm-up (`Sender.warm`) reaches the router through each client kind, and fails
    loudly where nothing answers."""
    from bench import serve_load

    async with cluster(http_port=0) as c:
        http = f"http://127.0.0.1:{c.router.http_port}"
        targets = [{"router": f"127.0.0.1:{c.router.grpc_port}"}, {"base_url": http},
                   {"base_url": http, "http_client": "raw"}]
        for target in targets:
            client = serve_load.sender(bench_args(tmp_path, **target))
            try:
                await client.warm()
            finally:
                await client.close()
        client = serve_load.sender(bench_args(tmp_path, base_url="http://127.0.0.1:9", http_client="raw"))
        try:
            with pytest.raises(Exception):  # noqa: B017 (httpx's connect error)
                await client.warm()
        finally:
            await client.close()
        await c.settled()
