"""`pdserve bench structured`: outputs held to JSON schemas (issue 28).

Sends each prompt of bench/structured_schemas.json (50 JSON schemas, each with a short chat
prompt asking for it) with its schema as OpenAI's `response_format` json_schema, either to a
running server's HTTP API (`--base-url`; every request streaming and not) or in-process to the
single-process engine (`--model`, bench/structured_local.py: k draft tokens and none, with the
constraint and without). Reports per run the share of outputs that parse as JSON, the share the
schema validates (jsonschema, Draft 2020-12), the mean output tokens, and, in-process, whether
the k-draft outputs equal the plain ones token for token and the MTP acceptance (accepted drafts
/ proposed) with and without the constraint. Prints a table; writes the JSON report to `--out`.

Until the engine masks (engine/grammar/compiler.py) a constraint does not change the tokens: parsed and
validated shares are then the model's own, and the constrained and free runs match.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import settings
from bench.extras import require
from engine.grammar.structured import StructuredSpec

SCHEMAS = Path(__file__).resolve().with_name("structured_schemas.json")


def add_arguments(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("target (one of)")
    t.add_argument("--base-url", default=None, help="a server's HTTP address (OpenAI API), e.g. http://127.0.0.1:8000")
    t.add_argument("--model", default=None, help="in-process: tiny, smollm2, a path")
    p.add_argument("--api-key", default=None, help="--base-url: the server's API key (default: PDSERVE_API_KEY)")
    p.add_argument("--device", default="cpu", help="in-process: cpu, cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--spec-tokens", type=int, default=3, help="in-process: k, draft tokens per step (compared with 0)")
    p.add_argument("--batch", type=int, default=8, help="in-process: requests decoded together")
    p.add_argument("--schemas", default=str(SCHEMAS), help="a JSON list of {name, prompt, schema}")
    p.add_argument("--num-schemas", type=int, default=None, help="use the first N")
    p.add_argument("--max-tokens", type=int, default=512, help="room for the largest answer the schemas allow (one needs > 256)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=8, help="--base-url: requests in flight")
    p.add_argument("--out", default="structured_results.json", help="write the JSON report here")


def run(args: argparse.Namespace) -> int:
    if (args.base_url is None) == (args.model is None):
        raise ValueError("give exactly one of --base-url and --model")
    items = load_items(args.schemas, args.num_schemas)
    if args.base_url:
        report = {"target": args.base_url, "runs": run_http(args, items)}
    else:
        from bench.structured_local import run_local

        report = run_local(args, items)
    report["runs"] = {name: _scored(items, r) for name, r in report["runs"].items()}
    report.update(schemas=len(items), schemas_file=Path(args.schemas).name, max_tokens=args.max_tokens,
                  temperature=args.temperature)
    print_table(report)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def load_items(path: str, limit: int | None) -> list[dict]:
    items = json.loads(Path(path).read_text(encoding="utf-8"))[:limit]
    if not items or not all({"name", "prompt", "schema"} <= set(i) for i in items):
        raise ValueError(f"{path}: want a non-empty list of {{name, prompt, schema}}")
    return items  # type: ignore[no-any-return]


def _scored(items: list[dict], run: dict) -> dict[str, Any]:
    """A run's `texts` and `tokens` (one per item) replaced by their scores."""
    run = dict(run)
    return {**score(items, run.pop("texts"), run.pop("tokens")), **run}


def score(items: list[dict], texts: list[str], tokens: list[int]) -> dict[str, Any]:
    """Parsed and validated shares (%) of `texts` against their items' schemas, mean tokens."""
    jsonschema = require("jsonschema")

    parsed = valid = 0
    failed = []
    for item, text, n_tok in zip(items, texts, tokens, strict=True):
        try:
            obj = json.loads(text)
        except ValueError:
            failed.append({"name": item["name"], "why": "does not parse", "tokens": n_tok, "tail": text[-60:]})
            continue
        parsed += 1
        ok = jsonschema.Draft202012Validator(item["schema"]).is_valid(obj)
        valid += ok
        if not ok:
            failed.append({"name": item["name"], "why": "does not validate", "tokens": n_tok, "tail": text[-60:]})
    n = len(items)
    return {"requests": n, "parsed_pct": round(100 * parsed / n, 1), "valid_pct": round(100 * valid / n, 1),
            "mean_output_tokens": round(sum(tokens) / n, 1), "failed": failed}


# ---- a running server --------------------------------------------------------------------------
def run_http(args: argparse.Namespace, items: list[dict]) -> dict[str, dict]:
    """Every item non-streaming, then streaming: per run the texts, output tokens and seconds."""
    openai = require("openai")

    client = openai.OpenAI(base_url=args.base_url.rstrip("/") + "/v1", api_key=args.api_key or settings.API_KEY or "none",
                           max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    runs = {}
    for name, stream in (("http", False), ("http_stream", True)):
        start = time.perf_counter()
        with ThreadPoolExecutor(max(1, args.concurrency)) as pool:
            answers = list(pool.map(lambda item, s=stream: _ask(client, model, item, s, args), items))
        runs[name] = {"texts": [a[0] for a in answers], "tokens": [a[1] for a in answers],
                      "seconds": round(time.perf_counter() - start, 2)}
    runs["http_stream"]["same_text_as_http"] = runs["http_stream"]["texts"] == runs["http"]["texts"]
    return runs


def _ask(client: Any, model: str, item: dict, stream: bool, args: argparse.Namespace) -> tuple[str, int]:
    """One chat request with the item's schema: (text, output tokens)."""
    fmt = {"type": "json_schema", "json_schema": {"name": item["name"], "schema": item["schema"], "strict": True}}
    kwargs = dict(model=model, messages=[{"role": "user", "content": item["prompt"]}], max_tokens=args.max_tokens,
                  temperature=args.temperature, seed=args.seed, response_format=fmt)
    if not stream:
        out = client.chat.completions.create(**kwargs)
        return out.choices[0].message.content or "", out.usage.completion_tokens
    text, tokens = "", 0
    for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        text += "".join(c.delta.content or "" for c in chunk.choices)
        tokens = chunk.usage.completion_tokens if chunk.usage else tokens
    return text, tokens


# ---- the report ----------------------------------------------------------------------------------
def print_table(report: dict) -> None:
    where = report.get("target") or f"{report['model']} on {report['device']}"
    print(f"structured outputs: {report['schemas']} schemas from {report['schemas_file']}, {where}, "
          f"max_tokens {report['max_tokens']}, temperature {report['temperature']}")
    print(f"  {'run':<22}{'parsed %':>9}{'valid %':>9}{'mean tok':>10}{'accept':>8}  same tokens as k=0")
    for name, r in report["runs"].items():
        accept = r.get("acceptance")
        same = r.get("same_tokens_as_k0", r.get("same_text_as_http", ""))
        print(f"  {name:<22}{r['parsed_pct']:>9.1f}{r['valid_pct']:>9.1f}{r['mean_output_tokens']:>10.1f}"
              f"{'' if accept is None else f'{accept:.3f}':>8}  {same}")


def tools_spec(n: int) -> StructuredSpec:
    """The grammar of tool_choice "required" over the first `n` schemas as functions, parallel
    calls allowed: what the router holds such a request to (router/tool_api.py)."""
    from router.tool_api import Tool, ToolSettings, plan

    items = json.loads(SCHEMAS.read_text())[:n]
    if not 1 <= n <= len(items):
        raise ValueError(f"--structured-tools takes 1 to {len(items)} functions, not {n}")
    tools = [Tool.model_validate({"type": "function", "function": {"name": it["name"], "parameters": it["schema"]}})
             for it in items]
    tool_plan = plan(tools, "required", True, ToolSettings())
    assert tool_plan is not None and tool_plan.spec is not None
    return tool_plan.spec
