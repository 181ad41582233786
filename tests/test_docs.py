"""The README and the reference pages in docs/ agree with the code they describe.

Links between the pages resolve; docs/configuration.md lists every config key with its default
and every `pdserve up` flag; BENCHMARKS.md's table of today's figures names, for every row, a
command listed under it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from deploy.cli import build_parser
from deploy.config import ServiceConfig

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]
# Written by a tool from the settings module; a link to it may precede the file in a checkout.
GENERATED = {ROOT / "docs" / "settings.md"}
LINK = re.compile(r"\]\(([^)#\s]*)(#[^)\s]*)?\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    heads = re.findall(r"^#+\s+(.*)$", page.read_text(), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    for target, anchor in LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        path = (page.parent / target).resolve() if target else page
        if path in GENERATED and not path.exists():
            continue
        assert path.exists(), f"{page.name} links to {target}, which does not exist"
        if anchor and path.suffix == ".md":
            assert anchor[1:] in _anchors(path), f"{page.name} links to {target}{anchor}: no such heading"


def test_readme_is_a_short_guide_with_a_picture() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    assert "```mermaid" in text or "```text" in text


def _yaml_block(page: Path, heading: str) -> dict[str, Any]:
    text = page.read_text()
    block = re.search(r"```yaml\n(.*?)```", text[text.index(heading):], flags=re.DOTALL)
    assert block is not None, f"no YAML block after {heading!r} in {page.name}"
    return yaml.safe_load(block.group(1))


def _defaults(model: type[BaseModel]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            out[name] = _defaults(kind)
        else:
            out[name] = field.get_default(call_default_factory=True)
    return out


def test_configuration_page_lists_every_key_with_its_default() -> None:
    documented = _yaml_block(ROOT / "docs" / "configuration.md", "## The YAML file")
    assert documented == _defaults(ServiceConfig)
    ServiceConfig.model_validate(documented)  # and the block itself is a valid config


def _up_flags() -> set[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    up = sub.choices["up"]  # type: ignore[index]
    return {s for a in up._actions for s in a.option_strings if s.startswith("--") and s != "--help"}


def test_configuration_page_lists_every_up_flag() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    missing = sorted(f for f in _up_flags() if not re.search(re.escape(f) + r"(?![\w-])", text))
    assert not missing, f"docs/configuration.md does not name {missing}"


def test_benchmarks_table_names_a_listed_command_for_every_row() -> None:
    text = (ROOT / "BENCHMARKS.md").read_text()
    section = text[text.index("## Figures today"):text.index("## How to add a figure")]
    assert len(section.rstrip().splitlines()) <= 80
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| Figure")]
    # The list under the table: "- A: ...", "  I: ..." or ". L and M (...": a letter, then its command.
    names = re.findall(r"(?:^- |^  |\. )([A-Z])(?: and ([A-Z]))?(?::| \()", section, flags=re.MULTILINE)
    listed = {letter for pair in names for letter in pair if letter}
    assert rows
    for row in rows:
        command = row.rstrip(" |").rsplit("|", 1)[1].strip()
        assert command in listed, f"BENCHMARKS.md row {row[:40]!r} names command {command!r}, not listed"
