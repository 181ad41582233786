"""`pdserve bench structured`: its 50 schemas are valid, compile, and bound every free string and
array (so a small model's constrained output ends); the bench runs in-process on the tiny model
and against a real local HTTP server, and reports. (Whether outputs validate waits for the
engine's masking: not checked here.)"""

from __future__ import annotations

import json

import jsonschema
import pytest

from bench.structured import SCHEMAS, load_items
from deploy.cli import main
from engine.grammar.structured import StructuredSpec
from router.structured_api import check_compiles
from tests.router.real_service import RealService

ITEMS = json.loads(SCHEMAS.read_text(encoding="utf-8"))


def test_fifty_named_schemas_each_with_a_prompt():
    assert len(ITEMS) == 50 and len({i["name"] for i in ITEMS}) == 50
    assert all(isinstance(i["prompt"], str) and 10 <= len(i["prompt"]) <= 200 for i in ITEMS)


@pytest.mark.parametrize("item", ITEMS, ids=[i["name"] for i in ITEMS])
def test_each_schema_is_valid_compiles_and_is_bounded(item):
    schema = item["schema"]
    jsonschema.Draft202012Validator.check_schema(schema)
    check_compiles(StructuredSpec.json_schema(schema))
    assert schema["type"] == "object" and schema["required"]
    for node in _nodes(schema):
        if node.get("type") == "string" and "enum" not in node and "pattern" not in node:
            assert 1 <= node.get("maxLength", 10**9) <= 40, node
        if node.get("type") == "array":
            assert node.get("maxItems", 10**9) <= 5 and "minItems" in node, node
        if node.get("type") in ("integer", "number"):
            assert "minimum" in node and "maximum" in node, node
        if node.get("type") == "object":
            assert node["additionalProperties"] is False and set(node["required"]) <= set(node["properties"])


def _nodes(schema: dict):
    yield schema
    for sub in schema.get("properties", {}).values():
        yield from _nodes(sub)
    if "items" in schema:
        yield from _nodes(schema["items"])


def test_in_process_bench_runs_and_reports(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["bench", "structured", "--model", "tiny", "--num-schemas", "2", "--max-tokens", "16",
                 "--spec-tokens", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["schemas"] == 2 and set(report["runs"]) == {"k=0 json_schema", "k=2 json_schema", "k=0 free",
                                                              "k=2 free"}
    for name, run in report["runs"].items():
        assert run["requests"] == 2 and 0 <= run["parsed_pct"] <= 100 and 0 <= run["valid_pct"] <= run["parsed_pct"]
        assert 0 < run["mean_output_tokens"] <= 16
        if name.startswith("k=2"):
            assert 0 <= run["acceptance"] <= 1 and len(run["acceptance_by_position"]) == 2
            assert run["same_tokens_as_k0"] is True  # greedy: MTP keeps the plain tokens
    assert "k=2 json_schema" in capsys.readouterr().out


def test_http_bench_runs_and_reports(tmp_path):
    service = RealService("colocated", max_model_len=256)
    try:
        out = tmp_path / "r.json"
        assert main(["bench", "structured", "--base-url", service.base, "--num-schemas", "2", "--max-tokens", "16",
                     "--out", str(out)]) == 0
    finally:
        service.close()
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == {"http", "http_stream"} and runs["http_stream"]["same_text_as_http"] is True
    assert all(r["requests"] == 2 and 0 < r["mean_output_tokens"] <= 16 for r in runs.values())


def test_load_items_refuses_a_file_without_prompts(tmp_path):
    bad = tmp_path / "s.json"
    bad.write_text(json.dumps([{"name": "x", "schema": {}}]))
    with pytest.raises(ValueError):
        load_items(str(bad), None)
