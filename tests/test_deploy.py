"""deploy/: the Kubernetes manifests against the Kubernetes object schemas
(kubernetes-validate, strict: unknown fields are errors), the kustomization as kustomize
renders it, and what must hold across the files (ports, names, the discovery the
scheduler is given, the RBAC it needs); the compose file and the systemd units by their
structure. No cluster, container engine or systemd runs here: what was run is in
deploy/README.md."""

from __future__ import annotations

import configparser
import copy
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
KUBE = DEPLOY / "kubernetes"
# The oldest Kubernetes the manifests are meant for (EndpointSlice v1 is GA since 1.21).
KUBE_VERSION = "1.29"


def kustomization() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
    return data


def rendered() -> list[dict[str, Any]]:
    """The objects ``kubectl apply -k`` would send: kustomize's own rendering where
    kubectl is installed, else the same assembled here (namespace, labels, image)."""
    kubectl = shutil.which("kubectl")
    if kubectl is not None:
        out = subprocess.run(
            [kubectl, "kustomize", str(KUBE)], check=True, capture_output=True, text=True
        ).stdout
        return [doc for doc in yaml.safe_load_all(out) if doc]
    spec = kustomization()
    docs: list[dict[str, Any]] = []
    for name in spec["resources"]:
        for doc in yaml.safe_load_all((KUBE / name).read_text()):
            if doc["kind"] != "Namespace":
                doc["metadata"]["namespace"] = spec["namespace"]
            docs.append(doc)
    return docs


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for doc in docs:
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise AssertionError(f"no {kind} {name}")


def container(doc: dict[str, Any]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = doc["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def args_of(doc: dict[str, Any]) -> dict[str, str]:
    """``--name=value`` arguments of a Deployment's container."""
    return dict(arg.removeprefix("--").split("=", 1) for arg in container(doc)["args"][1:])


def test_every_manifest_is_in_the_kustomization_and_valid() -> None:
    listed = set(kustomization()["resources"])
    assert listed == {p.name for p in KUBE.glob("*.yaml")} - {"kustomization.yaml"}
    docs = rendered()
    assert len(docs) == 14
    for doc in docs:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "agentenv", doc["metadata"]["name"]


def test_the_schema_check_refuses_what_it_should() -> None:
    """The validation above can fail: a misspelt field and a wrong type are caught."""
    node = find(rendered(), "DaemonSet", "aenv-node")
    misspelt = copy.deepcopy(node)
    misspelt["spec"]["template"]["spec"]["containers"][0]["securityContxt"] = {}
    wrong_type = copy.deepcopy(node)
    wrong_type["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "soon"
    for bad in (misspelt, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, KUBE_VERSION, strict=True)


def test_nodes_are_a_privileged_daemonset_behind_a_headless_service() -> None:
    docs = rendered()
    node = find(docs, "DaemonSet", "aenv-node")
    spec = node["spec"]["template"]["spec"]
    main = container(node)
    assert main["securityContext"]["privileged"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in main["volumeMounts"]}
    assert volumes["kvm"]["hostPath"] == {"path": "/dev/kvm", "type": "CharDevice"}
    assert mounts["kvm"] == "/dev/kvm"
    assert volumes["data"]["hostPath"]["path"] == "/var/lib/agentenv"
    env = {e["name"]: e for e in main["env"]}
    assert mounts["data"] == env["AENV_HOME"]["value"]
    # Every AENV_ variable the node is given is a setting it knows (it refuses others).
    from agentenv.config import Config

    known = {f"AENV_{name.upper()}" for name in Config.model_fields}
    config_map = find(docs, "ConfigMap", "aenv-config")["data"]
    given = {n for n in [*env, *config_map] if n.startswith("AENV_")}
    assert given <= known, given - known
    listen_port = int(env["AENV_LISTEN"]["value"].rsplit(":", 1)[1])
    assert env["AENV_NODE_URL"]["value"] == f"http://$(POD_IP):{listen_port}"
    assert env["AENV_NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    service = find(docs, "Service", "aenv-node")
    assert service["spec"]["clusterIP"] == "None"
    assert (
        service["spec"]["selector"].items()
        <= node["spec"]["template"]["metadata"]["labels"].items()
    )
    assert service["spec"]["ports"] == [{"name": "api", "port": listen_port, "targetPort": 8000}]


def test_the_scheduler_discovers_the_node_service_with_the_rbac_it_needs() -> None:
    docs = rendered()
    scheduler = find(docs, "Deployment", "aenv-scheduler")
    # Replicas share everything through Redis (agentenv.cluster.store), so more than one.
    assert scheduler["spec"]["replicas"] == 2
    args = args_of(scheduler)
    assert args["discovery"] == "kubernetes:agentenv/aenv-node:8000"
    redis = find(docs, "Service", "aenv-redis")
    assert args["redis"] == f"redis://aenv-redis:{redis['spec']['ports'][0]['port']}/0"
    account = scheduler["spec"]["template"]["spec"]["serviceAccountName"]
    binding = find(docs, "RoleBinding", "aenv-scheduler-endpointslices")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": "agentenv"}
    ]
    role = find(docs, "Role", binding["roleRef"]["name"])
    assert {"list", "get"} <= set(role["rules"][0]["verbs"])
    assert role["rules"][0]["apiGroups"] == ["discovery.k8s.io"]
    assert role["rules"][0]["resources"] == ["endpointslices"]
    # What the scheduler runs accepts exactly these arguments.
    from agentenv.cluster.discovery import EndpointSliceDiscovery, open_discovery

    discovery = open_discovery(args["discovery"])
    assert isinstance(discovery, EndpointSliceDiscovery)
    assert (discovery.namespace, discovery.service) == ("agentenv", "aenv-node")


def test_gateways_are_two_and_everyone_shares_the_api_key_secret() -> None:
    docs = rendered()
    gateway = find(docs, "Deployment", "aenv-gateway")
    assert gateway["spec"]["replicas"] == 2
    scheduler_service = find(docs, "Service", "aenv-scheduler")
    port = scheduler_service["spec"]["ports"][0]["port"]
    assert args_of(gateway)["scheduler"] == f"http://aenv-scheduler:{port}"
    secret = find(docs, "Secret", "aenv-secrets")
    for name in ("aenv-gateway", "aenv-scheduler"):
        env = {e["name"]: e for e in container(find(docs, "Deployment", name))["env"]}
        ref = env["AENV_API_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "aenv-secrets" and ref["key"] in secret["stringData"]
    node_env = {e["name"]: e for e in container(find(docs, "DaemonSet", "aenv-node"))["env"]}
    for name in ("AENV_API_KEY", "AENV_ENVD_TOKEN_KEY", "AWS_SECRET_ACCESS_KEY"):
        assert node_env[name]["valueFrom"]["secretKeyRef"]["key"] in secret["stringData"]


def test_compose_runs_two_nodes_a_gateway_a_scheduler_redis_and_s3() -> None:
    compose = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"redis", "s3", "scheduler", "gateway", "node-0", "node-1"}
    for name in ("node-0", "node-1"):
        node = services[name]
        assert node["privileged"] is True and "/dev/kvm:/dev/kvm" in node["devices"]
        env = node["environment"]
        assert env["AENV_NODE_ID"] == name and env["AENV_NODE_URL"] == f"http://{name}:8000"
        assert env["AENV_SCHEDULER_URL"] == "http://scheduler:9090"
        assert env["AENV_REPOSITORY"].startswith("s3://")
        assert env["AWS_ENDPOINT_URL_S3"] == "http://s3:8333"
    discovery = services["scheduler"]["command"][-1]
    assert discovery == "--discovery=static:http://node-0:8000,http://node-1:8000"
    assert "--scheduler=http://scheduler:9090" in services["gateway"]["command"]
    assert services["gateway"]["ports"] == ["8080:8080"]
    dockerfile = (ROOT / compose["x-image"]["build"]["dockerfile"]).read_text()
    assert "scripts/install" in dockerfile


def test_systemd_units_run_the_installed_commands() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for unit, command in (
        ("aenv-node.service", "aenv-server"),
        ("aenv-gateway.service", "aenv-gateway"),
        ("aenv-scheduler.service", "aenv-scheduler"),
    ):
        parser = configparser.ConfigParser(strict=False, interpolation=None)
        parser.optionxform = str  # type: ignore[assignment,method-assign]
        parser.read(DEPLOY / "systemd" / unit)
        assert set(parser.sections()) == {"Unit", "Service", "Install"}
        argv = shlex.split(parser["Service"]["ExecStart"])
        assert argv[0] == f"/opt/agentenv/.venv/bin/{command}" and command in scripts
        env_file = Path(parser["Service"]["EnvironmentFile"])
        example = DEPLOY / "systemd" / f"{env_file.stem}.env.example"
        names = {
            line.split("=", 1)[0]
            for line in example.read_text().splitlines()
            if line and not line.startswith("#")
        }
        for arg in argv[1:]:
            if arg.startswith("${"):
                assert arg[2:-1] in names, (unit, arg)
    node_env = (DEPLOY / "systemd" / "node.env.example").read_text()
    from agentenv.config import Config

    known = {f"AENV_{name.upper()}" for name in Config.model_fields}
    given = {line.split("=", 1)[0] for line in node_env.splitlines() if line.startswith("AENV_")}
    assert given <= known, given - known
