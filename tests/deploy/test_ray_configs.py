"""deploy/ray: every `ray up` cluster config passes Ray's own checks (ray-schema.json through
`prepare_config` + `validate_config`, as `ray up` runs them), and agrees with the pdserve
config it starts (resources offered = resources asked for)."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from deploy.config import ServiceConfig

RAY_DIR = Path(__file__).resolve().parents[2] / "deploy" / "ray"
CLUSTERS = sorted(p.name for p in RAY_DIR.glob("*.yaml") if p.name != "pdserve.yaml")


def ray_checked(config: dict) -> dict:
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def load(name: str) -> dict:
    return yaml.safe_load((RAY_DIR / name).read_text())


def test_both_providers_shipped():
    assert {load(n)["provider"]["type"] for n in CLUSTERS} >= {"aws", "local"}


@pytest.mark.parametrize("name", CLUSTERS)
def test_cluster_config_passes_ray_validation(name):
    prepared = ray_checked(load(name))
    assert prepared["head_node_type"] in prepared["available_node_types"]


@pytest.mark.parametrize("name", CLUSTERS)
def test_unknown_key_is_rejected_by_ray_schema(name):
    bad = load(name) | {"setup_comands": ["typo"]}
    with pytest.raises(jsonschema.ValidationError):
        ray_checked(bad)


@pytest.mark.parametrize("name", CLUSTERS)
def test_head_starts_pdserve_joining_the_cluster(name):
    config = load(name)
    start = " ".join(config["head_start_ray_commands"])
    assert "RAY_AUTH_MODE=token nohup pdserve up --address auto --config ~/pdserve.yaml" in start
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"  # one token, every node
    assert config["file_mounts"]["~/pdserve.yaml"] == "deploy/ray/pdserve.yaml"
    assert any("pdserve-src" in c for c in config["setup_commands"])  # the package gets installed
    assert "--dashboard-host=0.0.0.0" not in start  # nothing listens on every interface


def offered_resources(config: dict) -> set[str]:
    """Custom resources any node of the cluster offers (node types, or `ray start --resources`)."""
    names = {r for t in config.get("available_node_types", {}).values() for r in t.get("resources", {})}
    text = " ".join(config["head_start_ray_commands"] + config["worker_start_ray_commands"])
    names |= set(re.findall(r"pdserve_[a-z]+", text))
    if "pdserve_$ROLE" in text:  # local provider: the role is picked per host in the start command
        names |= {f"pdserve_{role}" for role in re.findall(r"ROLE=([a-z]+)", text)}
    return names


@pytest.mark.parametrize("name", CLUSTERS)
def test_service_config_asks_only_for_offered_resources(name):
    cfg = ServiceConfig.load(RAY_DIR / "pdserve.yaml")
    asked = set(cfg.prefill.resources) | set(cfg.decode.resources) | set(cfg.cluster.router_resources)
    assert asked == {"pdserve_prefill", "pdserve_decode", "pdserve_router"}
    assert asked <= offered_resources(load(name))


def test_aws_gpu_worker_types_are_split_by_role():
    types = load("aws.yaml")["available_node_types"]
    roles = {name: set(t["resources"]) & {"pdserve_prefill", "pdserve_decode"} for name, t in types.items()}
    assert sorted(map(sorted, filter(None, roles.values()))) == [["pdserve_decode"], ["pdserve_prefill"]]


def test_service_config_binds_node_ips_not_every_interface():
    cfg = ServiceConfig.load(RAY_DIR / "pdserve.yaml")
    assert cfg.router.host == "auto" and cfg.cluster.node_host == "auto"
    assert cfg.cluster.address == "auto"
