"""deploy/kubernetes: every manifest is valid against the Kubernetes schemas
(offline, kubernetes-validate's bundled ones, strict: no unknown field), the
proxy's ConfigMap loads with the proxy's own config model, and the pieces
name each other consistently."""

from __future__ import annotations

import ast
import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from ops_helpers import DEPLOY, REPO

from proxy.app import create_app
from proxy.config import parse_config
from proxy.discovery import split_dns_name

kubernetes_validate = pytest.importorskip("kubernetes_validate")

K8S_VERSION = "1.33"
MANIFESTS = DEPLOY / "kubernetes"


def _documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path.name, doc))
    return docs


def _find(kind: str, name: str) -> dict[str, Any]:
    for _, doc in _documents():
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise AssertionError(f"no {kind} {name} in deploy/kubernetes")


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _validate(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize(
    ("source", "doc"),
    _documents(),
    ids=lambda v: v if isinstance(v, str) else f"{v['kind']}/{v['metadata']['name']}",
)
def test_every_manifest_is_valid_against_the_kubernetes_schemas(source, doc):
    _validate(doc)


def test_the_validator_rejects_what_kubernetes_would():
    broken = copy.deepcopy(_find("Deployment", "kvguard-proxy"))
    broken["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(broken)
    typo = copy.deepcopy(_find("Deployment", "kvguard-proxy"))
    _container(typo)["readinesProbe"] = _container(typo).pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(typo)


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    files = {p.name for p in MANIFESTS.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)


def test_the_configmap_config_loads_and_discovers_the_headless_services(
    monkeypatch: pytest.MonkeyPatch,
):
    config_map = _find("ConfigMap", "kvguard-proxy")
    config = parse_config(config_map["data"]["proxy.yaml"], "proxy-config.yaml")
    proxy = _find("Deployment", "kvguard-proxy")
    container = _container(proxy)
    # The proxy listens where its Service, probes and scrape annotation point.
    assert container["ports"][0]["containerPort"] == config.server.port
    assert config.server.host == "0.0.0.0"
    annotations = proxy["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == config.server.port
    assert container["readinessProbe"]["httpGet"]["path"] == "/readiness"
    assert container["livenessProbe"]["httpGet"]["path"] == "/liveness"
    monkeypatch.setenv("KVGUARD_ADMIN_KEY", "from-the-secret")
    served = {
        route.resource.canonical
        for route in create_app(config).router.routes()
        if route.method == "GET" and route.resource is not None
    }
    assert {"/readiness", "/liveness"} <= served
    assert container["resources"]["requests"] and container["resources"]["limits"]
    # The file the command reads is the ConfigMap's key, mounted.
    mount = container["volumeMounts"][0]["mountPath"]
    assert container["command"][-1] == f"{mount}/proxy.yaml"
    # The admin key the config names comes from the environment.
    env = {e["name"] for e in container["env"]}
    assert config.auth.admin_key_env in env

    for pools in config.models.values():
        for role, pool in (("prefill", pools.prefill), ("decode", pools.decode)):
            (entry,) = pool.instances
            assert entry.dns is not None
            host, port = split_dns_name(entry.dns)
            service_name, namespace, *_ = host.split(".")
            service = _find("Service", service_name)
            assert service["metadata"]["namespace"] == namespace
            assert service["spec"]["clusterIP"] == "None", "must be headless"
            assert not service["spec"].get("publishNotReadyAddresses", False)
            assert service["spec"]["ports"][0]["port"] == port
            workload = _find("Deployment", f"vllm-{role}")
            labels = workload["spec"]["template"]["metadata"]["labels"]
            assert service["spec"]["selector"].items() <= labels.items()
            ports = {
                p["name"]: p["containerPort"] for p in _container(workload)["ports"]
            }
            assert ports["http"] == port


def _defines(module: Path, name: str) -> bool:
    """``module`` defines, assigns or imports ``name`` at some level."""
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            if node.name == name:
                return True
        elif isinstance(node, ast.Assign):
            if any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return True
        elif isinstance(node, ast.ImportFrom) and any(
            (a.asname or a.name) == name for a in node.names
        ):
            return True
    return False


def _module_path(dotted: str) -> Path:
    base = REPO / Path(*dotted.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


@pytest.mark.parametrize(
    ("role", "kv_role"), [("prefill", "kv_producer"), ("decode", "kv_consumer")]
)
def test_vllm_workloads_load_kvguard(role, kv_role):
    container = _container(_find("Deployment", f"vllm-{role}"))
    args = container["args"]
    transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert transfer["kv_role"] == kv_role
    assert transfer["kv_connector"] == "KVGuardConnector"
    assert (
        transfer["kv_connector_extra_config"]["inner"]["kv_connector"]
        == "NixlConnector"
    )
    assert transfer["kv_connector_extra_config"]["kv_checksums"]["fail_closed"] is True
    assert transfer["kv_load_failure_policy"] == "fail"
    module = _module_path(transfer["kv_connector_module_path"])
    assert _defines(module, "KVGuardConnector")

    flags = dict(a.split("=", 1) for a in args if a.startswith("--") and "=" in a)
    middleware = flags["--middleware"]
    mod, _, func = middleware.rpartition(".")
    assert _defines(_module_path(mod), func)
    scheduler = flags["--scheduler-cls"]
    assert scheduler == "engine_patch.vllm.scheduler.KVGuardScheduler"
    mod, _, cls = scheduler.rpartition(".")
    if _module_path(mod).exists():  # built beside this work, under this name
        assert _defines(_module_path(mod), cls)
    assert "--enable-scale-out" in args  # the proxy's abort_requests
    annotations = _find("Deployment", f"vllm-{role}")["spec"]["template"]["metadata"][
        "annotations"
    ]
    assert int(annotations["prometheus.io/port"]) == int(flags["--port"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
