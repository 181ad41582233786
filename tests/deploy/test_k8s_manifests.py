"""deploy/k8s: the KubeRay RayCluster validates against the KubeRay CRD's OpenAPI schema and
its pod templates, the ConfigMap, Service and NetworkPolicy against Kubernetes' own schemas,
all strictly (a field the schema does not define is an error, as `kubectl apply` does); the
ConfigMap's config parses with pdserve's loader; the pieces agree with each other."""

from __future__ import annotations

import copy
import gzip
import json
import re
import tempfile
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from deploy.config import ServiceConfig
from router.grpc_health import GENERATION_SERVICE

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
CRD_SCHEMA = Path(__file__).parent / "data" / "rayclusters.ray.io.v1.schema.json.gz"
K8S_VERSION = "1.30.0"
OBJECT_META = {"name", "namespace", "labels", "annotations"}


def documents() -> list[dict]:
    return [d for p in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def by_kind(kind: str) -> list[dict]:
    return [d for d in documents() if d["kind"] == kind]


def strict(schema: dict) -> dict:
    """Close every object the schema describes: unknown fields become errors (structural
    schemas prune them silently; kubectl's strict field validation refuses them)."""
    schema = copy.deepcopy(schema)

    def close(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for v in node.values():
                close(v)
        elif isinstance(node, list):
            for v in node:
                close(v)

    close(schema)
    return schema


@pytest.fixture(scope="module")
def raycluster_validator():
    schema = json.loads(gzip.decompress(CRD_SCHEMA.read_bytes()))
    return jsonschema.Draft7Validator(strict(schema))


def k8s_validate(doc: dict) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def raycluster() -> dict:
    (rc,) = by_kind("RayCluster")
    return rc


def pod_templates(rc: dict) -> dict[str, dict]:
    return {"head": rc["spec"]["headGroupSpec"]["template"]} | {
        g["groupName"]: g["template"] for g in rc["spec"]["workerGroupSpecs"]}


def service_config() -> ServiceConfig:
    (cm,) = by_kind("ConfigMap")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(cm["data"]["config.yaml"])
        return ServiceConfig.load(path)


def test_manifest_kinds():
    assert sorted(d["kind"] for d in documents()) == ["ConfigMap", "NetworkPolicy", "RayCluster", "Service"]


def test_raycluster_validates_strictly_against_the_kuberay_crd(raycluster_validator):
    rc = raycluster()
    assert rc["apiVersion"] == "ray.io/v1"
    assert set(rc["metadata"]) <= OBJECT_META
    raycluster_validator.validate(rc)


@pytest.mark.parametrize("path", [
    ("spec", "headGroupSpec", "template", "spec", "containers", 0, "imagePullPolcy"),
    ("spec", "workerGroupSpecs", 0, "replica"),
    ("spec", "headGroupSpec", "template", "spec", "containers", 0, "readinessProbe", "grpc", "serviceName"),
])
def test_an_unknown_field_is_an_error(raycluster_validator, path):
    rc = raycluster()
    node = rc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = "x"
    with pytest.raises(jsonschema.ValidationError):
        raycluster_validator.validate(rc)


@pytest.mark.parametrize("group", ["head", "prefill", "decode"])
def test_pod_templates_validate_against_kubernetes_schemas(group):
    template = pod_templates(raycluster())[group]
    k8s_validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": group}, "template": template})


@pytest.mark.parametrize("kind", ["ConfigMap", "Service", "NetworkPolicy"])
def test_core_objects_validate_against_kubernetes_schemas(kind):
    for doc in by_kind(kind):
        k8s_validate(doc)


def test_kubernetes_validation_is_strict():
    (svc,) = by_kind("Service")
    svc = copy.deepcopy(svc)
    svc["spec"]["clusterIp"] = "None"
    with pytest.raises(kubernetes_validate.ValidationError):
        k8s_validate(svc)


def test_configmap_config_parses_and_matches_the_ray_groups():
    cfg = service_config()
    rc = raycluster()
    offered = {g["groupName"]: g["rayStartParams"]["resources"] for g in rc["spec"]["workerGroupSpecs"]}
    assert set(json.loads(json.loads(offered["prefill"]))) == set(cfg.prefill.resources)
    assert set(json.loads(json.loads(offered["decode"]))) == set(cfg.decode.resources)
    head = json.loads(json.loads(rc["spec"]["headGroupSpec"]["rayStartParams"]["resources"]))
    assert set(head) == set(cfg.cluster.router_resources)
    assert cfg.router.host == "auto" and cfg.cluster.node_host == "auto" and cfg.cluster.address == "auto"


def test_gpu_groups_request_gpus_on_selected_nodes():
    for group, template in pod_templates(raycluster()).items():
        spec = template["spec"]
        limits = spec["containers"][0]["resources"]["limits"]
        if group == "head":
            assert "nvidia.com/gpu" not in limits
        else:
            assert limits["nvidia.com/gpu"] == "1"
            assert spec["nodeSelector"] == {"pdserve/pool": group}


def head_container() -> dict:
    return raycluster()["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]


def test_head_runs_the_service_with_the_configmap():
    head = head_container()
    assert "exec pdserve up --address auto --config /etc/pdserve/config.yaml" in head["args"][0]
    assert {"name": "pdserve-config", "mountPath": "/etc/pdserve", "readOnly": True} in head["volumeMounts"]
    assert raycluster()["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    assert raycluster()["spec"]["authOptions"] == {"mode": "token"}  # the driver gets the token by env


def test_router_ports_probes_and_service_agree():
    cfg, head = service_config(), head_container()
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert ports["grpc"] == cfg.router.port and ports["http"] == 8000
    assert head["livenessProbe"]["grpc"] == {"port": cfg.router.port}  # service "": the router is alive
    assert head["startupProbe"]["grpc"] == {"port": cfg.router.port}
    assert head["readinessProbe"]["grpc"] == {"port": cfg.router.port, "service": GENERATION_SERVICE}
    (svc,) = by_kind("Service")
    assert svc["spec"]["type"] == "ClusterIP"
    assert {(p["name"], p["targetPort"]) for p in svc["spec"]["ports"]} == {("grpc", "grpc"), ("http", "http")}
    assert svc["spec"]["selector"] == {"ray.io/cluster": raycluster()["metadata"]["name"], "ray.io/node-type": "head"}


def test_dockerfile_installs_every_package():
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    packages = re.search(r"include = \[(.*?)\]", pyproject).group(1)  # type: ignore[union-attr]
    for name in re.findall(r'"(\w+)\*"', packages):
        assert f"COPY --chown=ray:users {name} {name}" in text
    ray_version = raycluster()["spec"]["rayVersion"]
    assert f"rayproject/ray:{ray_version}-" in text


def test_every_pod_mounts_the_node_tls_secret_where_the_config_points():
    c = service_config().cluster
    files = {c.node_tls_ca, c.node_tls_cert, c.node_tls_key}
    assert {Path(f).name for f in files if f} == {"ca.crt", "tls.crt", "tls.key"}  # a TLS Secret's keys + ca.crt
    (directory,) = {str(Path(f).parent) for f in files if f}
    for group, template in pod_templates(raycluster()).items():  # the router and every node read them
        spec = template["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = [m for m in spec["containers"][0]["volumeMounts"] if m["mountPath"] == directory]
        assert len(mounts) == 1 and mounts[0]["readOnly"], group
        assert volumes[mounts[0]["name"]]["secret"]["secretName"] == "pdserve-node-tls", group
