"""Fuzzing the HTTP front door (router/http.py) of a running router in front of a real prefill
node and a real decode node (in this process, their gRPC servers on 127.0.0.1, KV over tcp).

Bodies: random bytes, any JSON, and OpenAI completion / chat bodies whose fields take values of
every JSON type and at every bound. Each answer is a clean one: 200 with its choices, each ending
once (a stream ends with one finish reason per choice and `[DONE]`), or 400/404 with OpenAI's error JSON
naming the problem; never a 5xx, never a hang. Afterwards the service is healthy, answers a
known request as it did before the fuzz, and every KV block is back on both nodes."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx2
import pytest
from hypothesis import given
from hypothesis import strategies as st

from decode_node.node import DecodeNode
from decode_node.server import serve_decode
from deploy.config import RouterConfig
from engine.engine import EngineConfig
from engine.model.loader import load_model, load_model_info
from prefill_node.node import PrefillNode
from prefill_node.server import DecodeClients, serve_prefill
from router import NodeDirectory, Router
from tests.fuzz import fuzz_settings

MAX_MODEL_LEN = 40
JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
                    | st.text(max_size=12), lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)
EDGE = st.sampled_from([None, 0, 1, 2, -1, 20, 21, 2**31, 2**63, 2**64, 1e308, -0.5, 0.5, 1.5, "", "x", "tiny",
                        [], [1], {}, True, False])
VALUE = EDGE | JSON
CONTENT = st.text(max_size=20) | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]),
                                                                  "text": st.text(max_size=8)}), max_size=2)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"])},
                                optional={"content": CONTENT | VALUE})
PROMPT = st.text(max_size=20) | st.lists(st.integers(-1, 330), max_size=6) | st.lists(st.text(max_size=5), max_size=2) \
    | st.lists(st.lists(st.integers(0, 300), max_size=4), max_size=2) | VALUE
COMMON = {k: VALUE for k in ("model", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos",
                             "n", "best_of", "stream", "stream_options", "frequency_penalty", "logit_bias", "user",
                             "presence_penalty", "repetition_penalty", "prompt_logprobs")}
SMALL_MAX = st.integers(1, 4) | VALUE  # mostly short generations: the fuzz stays fast on a small CPU
COMPLETION = st.fixed_dictionaries({"prompt": PROMPT, "max_tokens": SMALL_MAX},
                                   optional={**COMMON, "logprobs": VALUE, "echo": VALUE, "suffix": VALUE})
CHAT = st.fixed_dictionaries({"messages": st.lists(MESSAGE, max_size=3) | VALUE, "max_completion_tokens": SMALL_MAX},
                             optional={**COMMON, "max_tokens": VALUE, "logprobs": VALUE, "top_logprobs": VALUE})


class Service:
    """P and D (real nodes, real gRPC servers) and a Router serving HTTP on its own loop thread."""

    def __init__(self) -> None:
        loaded = load_model("tiny")
        cfg = EngineConfig(num_speculative_tokens=2, max_model_len=MAX_MODEL_LEN)
        self.decode = DecodeNode(loaded, cfg, kv_backend="tcp", kv_timeout_s=5, kv_quarantine_s=0.2)
        self.clients = DecodeClients()
        self.prefill = PrefillNode(loaded, cfg, self.clients.send_first_token, kv_backend="tcp", kv_timeout_s=5)
        self.decode.start()
        self.prefill.start()
        self.servers = [serve_decode(self.decode, "d0"), serve_prefill(self.prefill, "p0")]
        (_, dport), (_, pport) = self.servers
        directory = NodeDirectory([f"127.0.0.1:{pport}"], [f"127.0.0.1:{dport}"])
        config = RouterConfig(host="127.0.0.1", port=0, http_port=0, status_interval_s=0.5, default_timeout_s=60)
        self.router = Router(load_model_info("tiny"), directory, config, max_model_len=MAX_MODEL_LEN)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.call(self.router.start())
        self.http = httpx2.Client(base_url=f"http://127.0.0.1:{self.router.http_port}", timeout=30)

    def call(self, coro):  # noqa: ANN001, ANN201
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def blocks_back(self, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            nodes = (self.decode.blocks, self.prefill.blocks)
            if all(b.num_free == b.capacity for b in nodes) and not self.router.requests:
                return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        self.http.close()
        self.call(self.router.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        for server, _ in self.servers:
            server.stop(0)
        self.prefill.stop()
        self.decode.stop()


@pytest.fixture(scope="module")
def service():
    s = Service()
    yield s
    s.close()


KNOWN = {"prompt": [1, 2, 3], "max_tokens": 6, "temperature": 0}


def check_answer(r: httpx2.Response, body: object) -> None:
    assert r.status_code in (200, 400, 404), (r.status_code, r.text[:300], body)
    if r.status_code != 200:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and err["type"] == "invalid_request_error"
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
        assert events[-1] == "[DONE]", r.text[-300:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks), chunks
        reasons = [(ch["index"], ch["finish_reason"]) for c in chunks for ch in c["choices"] if ch["finish_reason"]]
        indexes = sorted(i for i, _ in reasons)  # each choice ends once
        assert indexes == list(range(len(reasons))) and {f for _, f in reasons} <= {"stop", "length"}, chunks
        return
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == list(range(len(choices))) and choices
    assert all(c["finish_reason"] in ("stop", "length") for c in choices)


def post(service: Service, path: str, content: bytes) -> httpx2.Response:
    return service.http.post(path, content=content, headers={"content-type": "application/json"})


def test_known_request_before_the_fuzz(service: Service) -> None:
    r = post(service, "/v1/completions", json.dumps(KNOWN).encode())
    assert r.status_code == 200
    service.known = r.json()["choices"][0]["text"]  # type: ignore[attr-defined]


@fuzz_settings(80)
@given(st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       st.binary(max_size=64) | JSON.map(lambda v: json.dumps(v).encode()) | st.just(b'{"prompt": "ab", "max_tok'))
def test_random_bodies_are_refused_cleanly(service: Service, path: str, body: bytes) -> None:
    check_answer(post(service, path, body), body)


@fuzz_settings(120)
@given(COMPLETION)
def test_completion_bodies(service: Service, body: dict) -> None:
    check_answer(post(service, "/v1/completions", json.dumps(body).encode()), body)


@fuzz_settings(120)
@given(CHAT)
def test_chat_bodies(service: Service, body: dict) -> None:
    check_answer(post(service, "/v1/chat/completions", json.dumps(body).encode()), body)


def test_after_the_fuzz_the_service_is_healthy_and_nothing_leaked(service: Service) -> None:
    health = service.http.get("/health").json()
    assert health["serving"] is True, health
    r = post(service, "/v1/completions", json.dumps(KNOWN).encode())
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == service.known  # type: ignore[attr-defined]
    assert service.blocks_back(), (service.decode.status(), service.prefill.status(), service.router.requests)
    counts = service.router.counts
    assert counts["invalid"] > 0 and sum(v for k, v in counts.items() if k.startswith("finished")) > 0, counts
    assert not [k for k in counts if k.startswith("error")], counts
