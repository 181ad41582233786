"""`pdserve draft-vocab`: the ranking is made from training prompts only, and the command writes
a ranking file the engine loads as its draft vocabulary."""

from __future__ import annotations

import dataclasses
import json

from safetensors import safe_open

from deploy.cli import main
from engine.engine import EngineConfig, LLMEngine
from engine.spec_decode.draft_vocab import read_ranking
from mtp.prompts import HELDOUT_PROMPTS, TRAIN_PROMPTS, read_prompts
from mtp.vocab_rank import ranking_prompts
from tests.engine.conftest import DEVICE


def test_ranking_prompts_are_training_prompts_never_heldout():
    prompts = ranking_prompts(seed=0)
    assert not set(prompts) & set(read_prompts(HELDOUT_PROMPTS))
    assert set(read_prompts(TRAIN_PROMPTS)) <= set(prompts)


def test_draft_vocab_command_writes_a_valid_ranking(tiny, tmp_path, capsys):
    out = tmp_path / "tiny.vocab_rank.safetensors"
    args = ["draft-vocab", "--model", "tiny", "--out", str(out), "--num-prompts", "3", "--tokens", "30",
            "--max-new-tokens", "8", "--batch", "4"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["prompts_answered"] == 3 and report["answer_tokens"] >= 24  # 3 x 8, no early stop
    ids = read_ranking(out, 320)
    assert sorted(ids.tolist()) == list(range(320))
    with safe_open(str(out), framework="pt") as f:
        counts = f.get_tensor("counts").long()
        meta = f.metadata()
    assert int(counts.sum()) == report["answer_tokens"] + report["prompt_tokens"]
    assert bool((counts[:-1] >= counts[1:]).all())
    ties = counts[:-1] == counts[1:]
    assert bool((ids[:-1][ties] < ids[1:][ties]).all())
    assert json.loads(meta["pdserve.model"]) == "tiny"
    engine = LLMEngine(dataclasses.replace(tiny, vocab_rank_path=str(out)),
                       EngineConfig(num_speculative_tokens=2, draft_vocab_size=32, device=DEVICE))
    assert engine.runner.draft_vocab is not None and engine.runner.draft_vocab.ids.tolist() == ids[:32].tolist()
