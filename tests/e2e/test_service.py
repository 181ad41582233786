"""I1, I2, I4 and bad input through router -> prefill -> decode on a local Ray cluster."""

from __future__ import annotations

import asyncio
import random
import time
import urllib.request

import grpc
import openai
import pytest

from engine.grammar.structured import StructuredSpec
from engine.sampling.sampling_params import SamplingParams
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


# Each layout and each k, not every pair: what k changes lives in the nodes, what the layout
# changes (placement over several nodes) in the router, and neither looks at the other; several
# nodes at k = 0 serve greedy requests in test_layouts.py (1P3D) and test_faults.py (2P2D). The
# 2P2D service moves its KV over ipc (the prefill nodes write straight into the decode nodes' mapped
# caches), the others over ucx, as test_layouts.py's 1P3D and test_faults.py's services do.
@pytest.fixture(scope="module", params=[(1, 1, 0, "ucx"), (1, 1, 3, "ucx"), (2, 2, 3, "ipc")],
                ids=["k0-1P1D", "k3-1P1D", "k3-2P2D-ipc"])
def service(request):
    prefill, decode, k, kv = request.param
    svc, address = start_service(prefill, decode, k, **{"kv_transfer.backend": kv})
    yield svc, address, k
    svc.stop()


def test_i1_greedy_through_service_equals_single_process(service, tiny_reference):
    svc, address, k = service
    prompts = mixed_prompts(32, seed=1)
    results = run_async(generate_all(address, prompts, max_tokens=16, ignore_eos=True))
    ref = tiny_reference(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    assert [r["token_ids"] for r in results] == [r.output_ids for r in ref]
    assert all(r["finish_reason"] == "length" for r in results)
    wait_blocks_returned(svc)


def test_load_reaches_every_node(service, tiny_reference):
    """Every node of the layout takes work (every prefill node prefills, every decode node receives
    KV; counted from before the requests: the service is the module's), and the tokens equal the
    engine alone's."""
    svc, address, k = service
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.choice([5, 17, 40]))] for _ in range(12)]
    before, scraped = svc.node_info(), scrape(svc)
    results = run_async(generate_all(address, prompts, max_tokens=6, ignore_eos=True))
    ref = tiny_reference(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert [r["token_ids"] for r in results] == [r.output_ids for r in ref]
    assert {r["finish_reason"] for r in results} == {"length"}
    wait_blocks_returned(svc)
    info = svc.node_info()
    assert sorted(info) == sorted(before)
    received = {key: i["kv_bytes"] - before[key]["kv_bytes"] for key, i in info.items() if key[0] == "decode"}
    assert all(b > 0 for b in received.values()), received  # every decode node took requests
    prefilled = {key: i["prefill_tokens"] - before[key]["prefill_tokens"] for key, i in info.items()
                 if key[0] == "prefill"}
    assert all(t > 0 for t in prefilled.values()), prefilled
    # a Prefill request the router gave up on (a loaded host: a Reserve past its deadline) may have run
    # before the retry: the router counts its tokens; a moved request is prefilled again with its tokens
    after = scrape(svc)
    abandoned, moved = (total(after, name) - total(scraped, name) for name in
                        ("pdserve:prefill_abandoned_tokens_total", "pdserve:request_migrations_total"))
    assert sum(len(p) for p in prompts) <= sum(prefilled.values())
    if not moved:
        assert sum(prefilled.values()) <= sum(len(p) for p in prompts) + abandoned, (prefilled, abandoned)


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


# ---- the OpenAI-compatible HTTP door (the official client) and /metrics --------------------
PROMPTS = ["Hello there", "The capital of France is", "1, 2, 3,"]


def openai_client(svc):
    return openai.AsyncOpenAI(base_url=f"http://{svc.http_address}/v1", api_key="none", max_retries=0)


async def http_and_grpc(svc, address):
    oa = openai_client(svc)
    async with RouterClient(address) as client:
        grpc_out = [await client.generate(build_request(p, max_tokens=12, logprobs=3, chat=chat))
                    for chat in (False, True) for p in PROMPTS]
    comp = [await oa.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0, logprobs=3)
            for p in PROMPTS]
    chat = [await oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}],
                                             max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
            for p in PROMPTS]
    streamed = []
    for p in PROMPTS:
        stream = await oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}],
                                                  max_tokens=12, temperature=0, stream=True)
        streamed.append("".join([ch.choices[0].delta.content or "" async for ch in stream]))
    return grpc_out, comp, chat, streamed


def test_openai_client_greedy_text_and_logprobs_equal_grpc(service):
    svc, address, k = service
    grpc_out, comp, chat, streamed = run_async(http_and_grpc(svc, address))
    plain, chatted = grpc_out[: len(PROMPTS)], grpc_out[len(PROMPTS):]
    assert [c.choices[0].text for c in comp] == [g["text"] for g in plain]
    assert [c.choices[0].message.content for c in chat] == [g["text"] for g in chatted] == streamed
    for c, g in zip(comp, plain, strict=True):
        assert c.usage.completion_tokens == len(g["token_ids"])
        assert c.choices[0].logprobs.token_logprobs == pytest.approx([lp["logprob"] for lp in g["logprobs"]])
    for c, g in zip(chat, chatted, strict=True):
        assert [e.logprob for e in c.choices[0].logprobs.content] == pytest.approx([lp["logprob"] for lp in g["logprobs"]])
        assert all(len(e.top_logprobs) == 3 for e in c.choices[0].logprobs.content)
    wait_blocks_returned(svc)


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
          "additionalProperties": False}


async def structured_requests(svc, address):
    oa = openai_client(svc)
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    messages = [{"role": "user", "content": "Name a city as JSON."}]
    whole = await oa.chat.completions.create(model="tiny", messages=messages, max_tokens=8, response_format=fmt)
    stream = await oa.chat.completions.create(model="tiny", messages=messages, max_tokens=8, response_format=fmt,
                                              stream=True)
    chunks = [ch async for ch in stream]
    with pytest.raises(openai.BadRequestError) as bad:
        await oa.completions.create(model="tiny", prompt="a", max_tokens=2, extra_body={"guided_regex": "(("})
    async with RouterClient(address) as client:
        grpc_out = await client.generate(build_request([1, 2, 3], max_tokens=4,
                                                       structured=StructuredSpec("regex", "[a-z]+")))
    return whole, chunks, bad.value, grpc_out


def test_structured_requests_are_served_by_the_nodes(service):
    """The spec rides the node messages into P and D actors (protos/convert.py) without a refusal;
    a spec that does not compile is the router's 400. (Masking is the engine's, tested there.)"""
    svc, address, k = service
    whole, chunks, bad, grpc_out = run_async(structured_requests(svc, address))
    assert whole.choices[0].finish_reason in ("stop", "length") and chunks[-1].choices[0].finish_reason
    assert "regex does not compile" in bad.body["message"]  # type: ignore[index]
    assert grpc_out["finish_reason"] in ("stop", "length")
    wait_blocks_returned(svc)


def test_http_clients_that_disconnect_free_their_blocks(service):
    svc, address, k = service

    async def leave_stream(oa, i):
        stream = await oa.completions.create(model="tiny", prompt=f"go {i}", max_tokens=500, stream=True,
                                             extra_body={"ignore_eos": True})
        got = 0
        async for _ch in stream:
            got += 1
            if got >= 3:
                break
        await stream.close()
        return got

    async def leave_whole(oa):
        task = asyncio.create_task(oa.completions.create(model="tiny", prompt="stay", max_tokens=800,
                                                         extra_body={"ignore_eos": True}))
        await asyncio.sleep(0.5)  # (no timing assertion: only lets the request start)
        task.cancel()

    async def main():
        oa = openai_client(svc)
        counts = await asyncio.gather(*(leave_stream(oa, i) for i in range(8)), leave_whole(oa))
        async with RouterClient(address) as client:
            for _ in range(100):
                if (await client.health()).running_requests == 0:
                    break
                await asyncio.sleep(0.1)
            return counts[:-1], (await client.health()).running_requests

    counts, running = run_async(main())
    assert all(c >= 3 for c in counts) and running == 0
    wait_blocks_returned(svc)


def scrape(svc) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{svc.http_address}/metrics").read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def total(samples, name, **labels) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and all((k, v2) in ls for k, v2 in labels.items()))


def settled_scrape(svc):
    """A scrape once the router's view of every node has caught up with earlier tests' traffic
    (node figures come with its Status polls, every 0.5 s here): two scrapes a few polls apart agree."""
    wait_blocks_returned(svc)
    node_keys = ("pdserve:prefill_tokens_total", "pdserve:kv_transfer_bytes_total", "pdserve:kv_blocks_used")
    last = None
    for _ in range(60):
        now = scrape(svc)
        view = [total(now, key) for key in node_keys]
        if view == last and view[2] == 0:
            return now
        last = view
        time.sleep(1.5)
    raise AssertionError(f"the router's view of the nodes did not settle: {last}")


def test_metrics_scrape_counts_add_up(service):
    svc, address, k = service
    before = settled_scrape(svc)

    async def traffic():
        oa = openai_client(svc)
        ok = await asyncio.gather(*(oa.completions.create(model="tiny", prompt=[1, 2, i], max_tokens=6 + i,
                                                          temperature=0, extra_body={"ignore_eos": True})
                                    for i in range(5)))
        with pytest.raises(openai.BadRequestError):
            await oa.completions.create(model="tiny", prompt="x", max_tokens=0)
        with pytest.raises(openai.NotFoundError):
            await oa.completions.create(model="nope", prompt="x", max_tokens=3)
        return ok

    ok = run_async(traffic())
    wait_blocks_returned(svc)
    prompt_tokens = sum(r.usage.prompt_tokens for r in ok)

    def delta(name, **labels):
        return total(after, name, **labels) - total(before, name, **labels)

    for _ in range(150):  # node figures arrive with the router's next Status poll of each node
        after = scrape(svc)
        kv = [delta("pdserve:kv_transfer_bytes_total", kind=kind) for kind in ("prefill", "decode")]
        if delta("pdserve:prefill_tokens_total") == prompt_tokens and kv[0] == kv[1] and \
                total(after, "pdserve:kv_blocks_used") == 0:
            break
        time.sleep(0.2)

    tokens = sum(r.usage.completion_tokens for r in ok)
    assert tokens == sum(6 + i for i in range(5))
    assert delta("pdserve:request_success_total", finished_reason="length") == 5
    assert delta("pdserve:request_failure_total", code="INVALID_ARGUMENT") == 1
    assert delta("pdserve:request_failure_total", code="NOT_FOUND") == 1
    assert delta("pdserve:generation_tokens_total") == tokens
    assert delta("pdserve:prompt_tokens_total") == prompt_tokens
    assert delta("pdserve:time_to_first_token_seconds_count") == 5
    assert delta("pdserve:inter_token_latency_seconds_count") == tokens - 5
    assert delta("pdserve:e2e_request_latency_seconds_count") == 5
    for phase in ("reserve", "prefill"):  # one placement each (no migration); inside their TTFTs
        assert delta(f"pdserve:request_{phase}_time_seconds_count") == 5
        assert 0 < delta(f"pdserve:request_{phase}_time_seconds_sum") < delta("pdserve:time_to_first_token_seconds_sum")
    nodes = {dict(ls)["node"] for (n, ls) in after if n == "pdserve:kv_blocks_free"}
    assert len(nodes) == sum(1 for key in svc.actors)
    assert total(after, "pdserve:kv_blocks_used") == 0
    assert delta("pdserve:prefill_tokens_total") == prompt_tokens
    assert delta("pdserve:prefill_seconds_total") > 0 and delta("pdserve:kv_transfer_seconds_sum", kind="prefill") > 0
    assert delta("pdserve:kv_transfer_seconds_count", kind="prefill") == 5  # one transfer per request
    assert delta("pdserve:kv_transfer_seconds_bucket", kind="prefill", le="+Inf") == 5
    assert kv[0] == kv[1] > 0  # what P pushed, D received
    drafts = [delta("pdserve:spec_decode_num_draft_tokens_total", position=str(i)) for i in range(k)]
    accepted = [delta("pdserve:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(k)]
    assert all(d > 0 for d in drafts) and all(0 <= a <= d for a, d in zip(accepted, drafts, strict=True))
    assert accepted == sorted(accepted, reverse=True)  # a draft counts only after its predecessors
