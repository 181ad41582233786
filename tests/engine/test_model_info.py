"""A router's view of a model (engine/model/info.py) comes without torch: the router process imports
none, so it starts in a fraction of a node's time (its config, tokenizer and EOS ids only). A tokenizer
imports jinja2 only to compile its chat template, which a node never does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import sys
import deploy.router_actor
from engine.model.info import load_model_info
infos = [load_model_info(name, fmt) for name, fmt in (("tiny", "auto"), ("smollm2", "auto"),
         ("llama-3.1-8b", "dummy"), ("smollm2", "dummy"))]
print([(i.name, i.config.vocab_size, len(i.eos_token_ids)) for i in infos])
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
print("jinja2" in sys.modules)
infos[1].tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
print("jinja2" in sys.modules, infos[1].tokenizer.prepare_chat_template() is infos[1].tokenizer.prepare_chat_template())
"""


def test_a_routers_model_info_imports_no_torch() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}).stdout.splitlines()
    assert out[0] == "[('tiny', 320, 1), ('smollm2', 49152, 1), ('llama-3.1-8b', 128256, 0), ('smollm2', 49152, 0)]"
    assert out[1] == "[]"
    assert out[2:] == ["False", "True True"]
