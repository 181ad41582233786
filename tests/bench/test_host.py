"""`pdserve bench host`: two router processes on one port in front of a synthetic node, loaded by
two client processes; every request completes, and the report carries the routers' CPU figures."""

from __future__ import annotations

import json

import pytest

from deploy.cli import main


def test_bench_host_reports_throughput_and_router_cpu(tmp_path, capsys):
    out = tmp_path / "host.json"
    assert main(["bench", "host", "--model", "tiny", "--num-prompts", "8", "--output-len", "12",
                 "--client-processes", "2", "--routers", "2", "--repeat", "1", "--step-ms", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    (run,) = report["runs"]
    assert run["completed"] == 8 and run["failed"] == 0 and report["client_processes"] == 2
    assert run["output_throughput"] > 0 and report["node_messages"] > 0
    routers = run["cpu"]["routers"]
    assert routers["cpu_s"] >= 0 and "us_per_token" in routers and "us_per_node_message" in routers
    assert {"client0", "client1", "node0", "router", "router1"} <= set(run["cpu"])
    assert "routers' us/token" in capsys.readouterr().out


def test_bench_host_real_node_splits_its_cpu(tmp_path, capsys):
    """`--node-model tiny`: one real colocated node behind the router; every request completes and
    each run reports the node's CPU per token as model compute + host path (loop thread + other threads)."""
    out = tmp_path / "host.json"
    assert main(["bench", "host", "--node-model", "tiny", "--num-prompts", "8", "--output-len", "12",
                 "--client-processes", "1", "--repeat", "2", "--max-num-seqs", "4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert len(report["runs"]) == 2
    for run in report["runs"]:
        assert run["completed"] == 8 and run["failed"] == 0
        node = run["node"]
        assert node["tokens"] == 8 * 12 and node["loop_rounds"] > 0
        assert node["host_us_per_token"] == pytest.approx(node["us_per_token"] - node["compute_us_per_token"], abs=0.2)
        assert node["host_us_per_token"] == pytest.approx(
            node["loop_host_us_per_token"] + node["other_threads_us_per_token"], abs=0.2)
        assert "colocated-loop" in node["threads_us_per_token"]
    assert "host: loop thread" in capsys.readouterr().out
