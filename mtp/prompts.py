"""The prompts a head is trained on and measured with: the written lists, topic x form and
installed packages' docstrings (training), the held-out list (`pdserve bench acceptance`), and the
chat template every one of them goes through. The lists are in mtp/prompt_lists/."""

from __future__ import annotations

import ast
import random
import sys
import time
from pathlib import Path
from typing import Any

LISTS_DIR = Path(__file__).parent / "prompt_lists"
TRAIN_PROMPTS = LISTS_DIR / "train_prompts.txt"
TRAIN_TOPICS = LISTS_DIR / "train_topics.txt"
HELDOUT_PROMPTS = LISTS_DIR / "heldout_prompts.txt"
HELDOUT_NEW_TOKENS = 96  # as `pdserve bench acceptance` answers them
TOPIC_FORMS = (
    "Tell me about {t}.", "Explain {t} in simple terms.", "Write a short poem about {t}.",
    "Give me three interesting facts about {t}.", "What are the pros and cons of {t}?",
    "Write a paragraph for a school report on {t}.", "What should a beginner know about {t}?",
    "Write a short story that involves {t}.", "Why is {t} important?",
    "Summarize the history of {t} in a few sentences.", "Ask me three quiz questions about {t}.",
)
TEXT_FORMS = (
    "Summarize the following text in a few sentences:\n\n{t}", "Explain this to a beginner:\n\n{t}",
    "What is the main idea of this passage?\n\n{t}", "Rewrite the following in plain English:\n\n{t}",
    "Write three questions someone might ask after reading this:\n\n{t}", "Continue this text:\n\n{t}",
)


def read_prompts(path: str | Path) -> list[str]:
    """Non-empty lines that do not start with '#'."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [s.strip() for s in lines if s.strip() and not s.lstrip().startswith("#")]


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    """The prompt as the demo sends it: through the chat template when the model has one."""
    if getattr(tokenizer, "has_chat_template", False):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    return list(tokenizer.encode(text, add_special_tokens=True))


def package_texts(limit: int, seed: int, seconds: float = 20.0) -> list[str]:
    """Module docstrings of installed packages (site-packages), 200..600 characters each."""
    roots = [Path(p) for p in sys.path if p.endswith(("site-packages", "dist-packages")) and Path(p).is_dir()]
    files = sorted(f for r in roots for pattern in ("*/*.py", "*/*/*.py") for f in r.glob(pattern))
    random.Random(seed).shuffle(files)
    out: list[str] = []
    deadline = time.monotonic() + seconds
    for f in files:
        if len(out) >= limit or time.monotonic() > deadline:
            break
        text = _docstring(f)
        if text:
            out.append(text)
    return out


def _docstring(path: Path) -> str | None:
    try:
        if path.stat().st_size > 200_000:
            return None
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
        return None
    if not doc or len(doc) < 200:
        return None
    return doc[:600].rsplit(" ", 1)[0] if len(doc) > 600 else doc


def training_prompts(num_package_texts: int, seed: int) -> list[str]:
    """Written prompts, topic x form prompts, and package text x form prompts (shuffled)."""
    rng = random.Random(seed)
    prompts = read_prompts(TRAIN_PROMPTS)
    prompts += [f.format(t=t) for t in read_prompts(TRAIN_TOPICS) for f in TOPIC_FORMS]
    prompts += [rng.choice(TEXT_FORMS).format(t=t) for t in package_texts(num_package_texts, seed)]
    rng.shuffle(prompts)
    return prompts
