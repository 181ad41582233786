"""`usage.prompt_tokens_details.cached_tokens` (issue 53): the prompt tokens a node served from
its prefix cache, through the official `openai` client, streamed (`include_usage`) and not, in
1P1D (the prefill node's hit, carried by the first-token message) and colocated (the node's own,
on its last output item). A repeated prompt hits every full block before its last token; with
the cache off, or a first sight, the count is 0."""

from __future__ import annotations

import pytest

from tests.router.real_service import RealService

BLOCK = 16  # EngineConfig's block_size


@pytest.fixture(scope="module", params=["pd", "colocated"])
def service(request):
    s = RealService(request.param, k=2, max_model_len=256, prefix_cache=True)
    yield s
    s.close()


def cached(service: RealService, prompt: str, stream: bool) -> tuple[int, int]:
    """(prompt_tokens, cached_tokens) of one completion."""
    if stream:
        chunks = list(service.client.completions.create(model="tiny", prompt=prompt, max_tokens=3, stream=True,
                                                        stream_options={"include_usage": True}))
        usage = chunks[-1].usage
    else:
        usage = service.client.completions.create(model="tiny", prompt=prompt, max_tokens=3).usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_repeated_prompt_counts_its_cached_blocks(service, stream):
    prompt = f"{'stream' if stream else 'whole'} {service.mode}: " + "the quick brown fox jumps. " * 3
    n, first = cached(service, prompt, stream)
    assert first == 0
    _, again = cached(service, prompt, stream)
    assert again == (n - 1) // BLOCK * BLOCK > 0  # full blocks strictly before the prompt's last token
    _, shorter = cached(service, prompt[: BLOCK * 2 - 2], stream)  # BOS + 2 blocks - 2 bytes: one full block
    assert shorter == BLOCK
    assert service.blocks_back()


def test_chat_usage_has_the_field_and_zero_without_the_cache():
    s = RealService("colocated", k=0, max_model_len=128)
    try:
        for _ in range(2):
            got = s.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * 40}],
                                                   max_tokens=2)
            assert got.usage is not None and got.usage.prompt_tokens_details is not None
            assert got.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        s.close()
