"""router.client.generate_via_router: the JSON shape of the local `pdserve generate --json`."""

from __future__ import annotations

import asyncio

import pytest

from deploy.cli import encode_prompt
from router.client import RouterError, generate_via_router
from tests.router.conftest import TINY, cluster

FIELDS = {"text", "prompt_token_ids", "token_ids", "logprobs", "finish_reason", "stats"}


async def test_generate_via_router_matches_the_local_json_shape():
    async with cluster() as c:
        address = c.client.address
        rows = await asyncio.to_thread(generate_via_router, address, ["hi", "a longer prompt"], chat=True,
                                       max_tokens=6, logprobs=3, seed=7)
        assert len(rows) == 2
        for prompt, row in zip(["hi", "a longer prompt"], rows, strict=True):
            assert set(row) == FIELDS
            assert row["prompt_token_ids"] == encode_prompt(TINY.tokenizer, prompt, raw=False)
            assert len(row["logprobs"]) == len(row["token_ids"]) == 6
            lp = row["logprobs"][0]
            assert set(lp) == {"token_id", "logprob", "rank", "top"} and len(lp["top"]) == 3
            assert lp["token_id"] == row["token_ids"][0]
            assert row["text"] == TINY.tokenizer.decode(row["token_ids"])
            assert set(row["stats"]) == {"steps", "accepted_tokens", "mean_accepted_per_step"}
            s = row["stats"]
            assert s["mean_accepted_per_step"] == round((len(row["token_ids"]) - 1) / s["steps"], 4)
            assert row["finish_reason"] == "length"
        plain = await asyncio.to_thread(generate_via_router, address, ["hi"], chat=False, max_tokens=2)
        assert plain[0]["logprobs"] is None
        with pytest.raises(RouterError, match="INVALID_ARGUMENT: logprobs must be"):
            await asyncio.to_thread(generate_via_router, address, ["hi"], chat=False, logprobs=99)
        await c.settled()
