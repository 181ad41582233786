"""TLS on the router's gRPC and HTTP ports, with a certificate made at test time: a client that
trusts it and sends the API key is served; a plain-text client, a client trusting another CA,
and a TLS client with no or a wrong key are refused (UNAUTHENTICATED for the key)."""

from __future__ import annotations

import asyncio
import ssl
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from deploy.config import ConfigError, RouterConfig, ServiceConfig
from router.client import RouterClient, RouterError, build_request
from router.tls import TlsError
from tests.router.conftest import cluster
from tests.tlscert import self_signed

KEY = "s3cret"


async def test_grpc_over_tls_needs_the_ca_and_the_key(tmp_path):
    cert, key = self_signed(tmp_path)
    other_ca, _ = self_signed(tmp_path, "other")
    async with cluster(api_key=KEY, tls_cert=cert, tls_key=key) as c:
        address = f"127.0.0.1:{c.router.grpc_port}"
        async with RouterClient(address, KEY, tls_ca=cert) as good:
            out = await good.generate(build_request("ab", max_tokens=3))
            assert out["finish_reason"] == "length" and len(out["token_ids"]) == 3
            assert (await good.health()).serving
        for api_key in (None, "wrong"):
            async with RouterClient(address, api_key, tls_ca=cert) as keyless:
                with pytest.raises(RouterError) as e:
                    await keyless.generate(build_request("ab", max_tokens=3))
                assert e.value.code == "UNAUTHENTICATED"
        for ca in (None, other_ca):  # plain text; TLS trusting another CA
            async with RouterClient(address, KEY, tls_ca=ca) as bad:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await bad.stub.Health(build_health(), timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        from deploy.cli import main

        argv = ["generate", "--router", address, "--tls-ca", cert, "--api-key", KEY, "--json", "--max-tokens", "3", "hi"]
        assert await asyncio.to_thread(main, argv) == 0  # pdserve generate --router over TLS
        assert await asyncio.to_thread(main, argv[:3] + argv[5:]) == 2  # plain text: one error line
        await c.settled()
        assert c.router.counts["finished:length"] == 2


def build_health():
    from protos import pdserve_pb2

    return pdserve_pb2.HealthRequest()


async def test_openai_client_over_https_with_the_ca(tmp_path):
    cert, key = self_signed(tmp_path)
    async with cluster(http_port=0, api_key=KEY, tls_cert=cert, tls_key=key) as c:
        base = f"https://127.0.0.1:{c.router.http_port}"
        http = openai.DefaultAsyncHttpxClient(verify=ssl.create_default_context(cafile=cert))
        oa = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, http_client=http)
        got = await oa.completions.create(model="tiny", prompt="ab", max_tokens=4, temperature=0)
        assert got.choices[0].finish_reason == "length" and got.usage.completion_tokens == 4
        wrong = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0,
                                   http_client=openai.DefaultAsyncHttpxClient(
                                       verify=ssl.create_default_context(cafile=cert)))
        with pytest.raises(openai.AuthenticationError):
            await wrong.models.list()
        untrusting = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)  # system roots
        with pytest.raises(openai.APIConnectionError):
            await untrusting.models.list()
        plain = f"http://127.0.0.1:{c.router.http_port}/health"
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # plain HTTP to the TLS port
            await asyncio.to_thread(lambda: urllib.request.urlopen(plain, timeout=5).read())
        await c.settled()


def test_cert_and_key_go_together_and_bad_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="tls_cert and tls_key go together"):
        ServiceConfig.load(None, {"router.tls_cert": "/x.crt"})
    from router.tls import server_credentials

    with pytest.raises(TlsError, match="cannot read the TLS certificate file .*missing.crt"):
        server_credentials(str(tmp_path / "missing.crt"), str(tmp_path / "missing.key"))
    (tmp_path / "junk.key").write_text("not a key")
    cert, _ = self_signed(tmp_path)
    with pytest.raises(TlsError, match="junk.key is not PEM"):
        server_credentials(cert, str(tmp_path / "junk.key"))
    assert RouterConfig(tls_cert=cert, tls_key=cert).tls_cert == cert


def test_cli_takes_both_spellings():
    from deploy.cli import build_parser
    from deploy.cli_service import service_config

    for flags in (["--tls-cert", "c.pem", "--tls-key", "k.pem"], ["--ssl-certfile", "c.pem", "--ssl-keyfile", "k.pem"]):
        cfg = service_config(build_parser().parse_args(["up", *flags]))
        assert (cfg.router.tls_cert, cfg.router.tls_key) == ("c.pem", "k.pem")
    args = build_parser().parse_args(["generate", "--router", "h:1", "--tls-ca", "ca.pem", "hi"])
    assert args.tls_ca == "ca.pem"


async def test_bench_serve_speaks_tls_with_the_key_through_both_doors(tmp_path):
    from bench import serve as bench_serve
    from tests.bench.test_serve import bench_args

    cert, key = self_signed(tmp_path)
    async with cluster(http_port=0, api_key=KEY, tls_cert=cert, tls_key=key) as c:
        for target in ({"router": f"127.0.0.1:{c.router.grpc_port}"},
                       {"base_url": f"https://127.0.0.1:{c.router.http_port}"}):
            args = bench_args(tmp_path, tls_ca=cert, api_key=KEY, num_prompts=4, **target)
            report = await bench_serve.sweep(args, bench_serve.load_dataset(args), [float("inf")])
            assert report["runs"][0]["completed"] == 4 and report["runs"][0]["failed"] == 0
        await c.settled()
