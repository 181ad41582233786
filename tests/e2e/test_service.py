"""I1, I2, I4 and bad input through router -> prefill -> decode on a local Ray cluster."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from engine.sampling_params import SamplingParams
from router.client import RouterClient, build_request
from tests.e2e.conftest import run_async, start_service, wait_blocks_returned

pytestmark = pytest.mark.usefixtures("ray_cluster")

VOCAB = 320  # tiny


def mixed_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.choice([1, 5, 17, 40, 90, 150]))] for _ in range(n)]


async def generate_all(address, prompts, **options):
    async with RouterClient(address) as client:
        return await asyncio.gather(*(client.generate(build_request(p, **options)) for p in prompts))


@pytest.fixture(scope="module", params=[(1, 1), (2, 2)], ids=["1P1D", "2P2D"])
def layout(request):
    return request.param


@pytest.fixture(scope="module", params=[0, 3], ids=["k0", "k3"])
def service(request, layout):
    svc, address = start_service(*layout, request.param)
    yield svc, address, request.param
    svc.stop()


def test_i1_greedy_through_service_equals_single_process(service, tiny_reference):
    svc, address, k = service
    prompts = mixed_prompts(32, seed=1)
    results = run_async(generate_all(address, prompts, max_tokens=16, ignore_eos=True))
    ref = tiny_reference(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert [r["token_ids"] for r in results] == [r.output_ids for r in ref]
    assert all(r["finish_reason"] == "length" for r in results)
    wait_blocks_returned(svc)


def test_i2_logprobs_and_seeded_sampling_equal_single_process(service, tiny_reference):
    svc, address, k = service
    prompts = mixed_prompts(6, seed=2)
    for top in (0, 5):
        results = run_async(generate_all(address, prompts, max_tokens=8, ignore_eos=True, logprobs=top))
        ref = tiny_reference(prompts, SamplingParams(max_tokens=8, ignore_eos=True, logprobs=top))
        for got, want in zip(results, ref, strict=True):
            assert got["token_ids"] == want.output_ids
            assert len(got["logprobs"]) == len(want.logprobs)  # the first token's included
            for g, w in zip(got["logprobs"], want.logprobs, strict=True):
                assert g["logprob"] == pytest.approx(w.logprob, abs=1e-4)
                assert g["rank"] == w.rank
                assert [i for i, _ in g["top"]] == [i for i, _ in w.top]
                assert [v for _, v in g["top"]] == pytest.approx([v for _, v in w.top], abs=1e-4)
    sampled = dict(temperature=0.8, seed=11, max_tokens=12, ignore_eos=True)
    results = run_async(generate_all(address, prompts, **sampled))
    ref = tiny_reference(prompts, SamplingParams(**sampled), k=k)
    assert [r["token_ids"] for r in results] == [r.output_ids for r in ref]
    wait_blocks_returned(svc)


def test_i4_cancelled_streams_end_and_free_everything(service):
    svc, address, k = service

    async def cancel_mid_stream(client, prompt):
        call = client.stream(build_request(prompt, max_tokens=500, ignore_eos=True))
        got = 0
        async for msg in call:
            got += len(msg.token_ids)
            if got >= 3:
                call.cancel()
                break
        return got

    async def main():
        async with RouterClient(address) as client:
            counts = await asyncio.gather(*(cancel_mid_stream(client, p) for p in mixed_prompts(50, seed=3)))
            for _ in range(100):
                if (await client.health()).running_requests == 0:
                    break
                await asyncio.sleep(0.1)
            return counts, (await client.health()).running_requests

    counts, running = run_async(main())
    assert all(c >= 3 for c in counts)
    assert running == 0
    wait_blocks_returned(svc)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(prompt=""), "empty"),
        (dict(prompt=[1] * 5000), "context"),
        (dict(prompt=[1, 2], max_tokens=0), "max_tokens"),
        (dict(prompt=[1, 2], logprobs=21), "logprobs"),
        (dict(prompt=[1, 2], model="no-such-model"), "model"),
        (dict(prompt="x" * (2 << 20)), "limit"),
    ],
)
def test_bad_input_is_invalid_argument_and_service_keeps_serving(service, options, message):
    svc, address, k = service

    async def main():
        async with RouterClient(address) as client:
            opts = dict(options)
            prompt = opts.pop("prompt")
            with pytest.raises(Exception) as err:
                await client.generate(build_request(prompt, **opts))
            ok = await client.generate(build_request([1, 2, 3], max_tokens=3))
            return err.value, ok

    err, ok = run_async(main())
    assert getattr(err, "code", None) == grpc.StatusCode.INVALID_ARGUMENT.name
    assert message in str(err).lower()
    assert len(ok["token_ids"]) >= 1
