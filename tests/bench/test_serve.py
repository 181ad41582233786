"""`pdserve bench serve` against the router on fake nodes, through both doors: every request
counted once, percentiles ordered, the sweep's report and plots written."""

from __future__ import annotations

import argparse

from bench import serve
from tests.router.conftest import cluster


def bench_args(tmp_path, **over) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    args = p.parse_args(["--num-prompts", "12", "--output-len", "6", "--range-ratio", "0.5",
                         "--plot-dir", str(tmp_path)])
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
                if "base_url" in target:  # the router's own TTFT lies inside the client's, request by request
                    server = run["server"]
                    assert 0 < server["router_ttft_mean_ms"] <= run["ttft"]["mean_ms"]
                    for call in ("router_reserve_call_mean_ms", "router_prefill_call_mean_ms"):  # one attempt
                        assert 0 < server[call] <= server["router_ttft_mean_ms"]  # each, before the first token
                    assert run["server"]["kv_blocks_used_after"] == run["server"]["kv_blocks_used_before"]
                else:
                    assert run["server"] == {}
            serve.plot(report, tmp_path)
        assert (tmp_path / "latency_cdf.png").stat().st_size > 0 and (tmp_path / "rate_sweep.png").is_file()
        await c.settled()
