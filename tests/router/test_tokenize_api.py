"""`/tokenize` and `/detokenize` on a running router (real HTTP on 127.0.0.1), in vLLM's shapes:
the ids equal what generation feeds the model, detokenize inverts them, bad input is a 400."""

from __future__ import annotations

import httpx2

from tests.router.conftest import TINY, cluster


async def post(c, path: str, body: dict, **headers: str) -> httpx2.Response:
    async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{c.router.http_port}") as http:
        return await http.post(path, json=body, headers=headers)


async def test_tokenize_prompt_and_messages_as_generation_sees_them():
    async with cluster(http_port=0) as c:
        r = await post(c, "/tokenize", {"model": "tiny", "prompt": "héllo"})
        assert r.status_code == 200
        want = TINY.tokenizer.encode("héllo", add_special_tokens=True)
        assert r.json() == {"count": len(want), "max_model_len": 256, "tokens": want, "token_strs": None}
        r = await post(c, "/tokenize", {"prompt": "ab", "add_special_tokens": False, "return_token_strs": True})
        assert r.json()["tokens"] == [97, 98] and r.json()["token_strs"] == ["a", "b"]
        r = await post(c, "/tokenize", {"messages": [{"role": "user", "content": "ab"}]})
        assert r.json()["tokens"] == [TINY.tokenizer.bos_token_id, 97, 98]  # no template: as chat generation
        r = await post(c, "/detokenize", {"model": "tiny", "tokens": [104, 105]})
        assert r.status_code == 200 and r.json() == {"prompt": "hi"}


async def test_tokenize_errors_name_the_problem():
    async with cluster(http_port=0, api_key="k") as c:
        auth = {"Authorization": "Bearer k"}
        assert (await post(c, "/tokenize", {"prompt": "a"})).status_code == 401
        cases = [("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, 400, "exactly one"),
                 ("/tokenize", {"prompt": 3}, 400, "prompt"),
                 ("/tokenize", {"prompt": "a", "model": "gpt"}, 404, "does not exist"),
                 ("/detokenize", {"tokens": [1, 999]}, 400, "999"),
                 ("/detokenize", {}, 400, "tokens")]
        for path, body, status, words in cases:
            r = await post(c, path, body, **auth)
            assert r.status_code == status and words in r.json()["error"]["message"], (body, r.text)
