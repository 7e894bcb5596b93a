"""The Helm chart (deploy/helm/trainmedic) renders, lints and validates, and says what trainmedic needs.

No Kubernetes API server runs here, so the chart is rendered and validated, not installed: Helm itself
(Helm v4's Go library, bundled in the helm-python-sdk wheel) renders it offline under several values sets
and lints it; every rendered object is validated strictly (unknown fields refused) with kubernetes-validate
against the schemas of Kubernetes 1.28 to 1.33. ServiceMonitor and PrometheusRule are Prometheus Operator
CRDs, which kubernetes-validate does not know: they are validated against the CRDs' own schemas, as
generated into cloudcoil-models-prometheus-operator, made strict the same way.
The one piece that needs a cluster, `lookup` keeping the generated Secret across `helm upgrade`, is
exercised against a stand-in API server that answers only the two requests `lookup` makes.

This module needs no fixture of tests/conftest.py (nor trainmedic itself), so it also runs in a bare venv:
    python -m pytest -q --noconftest tests/test_helm.py
"""
from __future__ import annotations

import base64
import copy
import json
import re
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.cli_contract import check_command

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "trainmedic"
RELEASE, NAMESPACE = "tm", "ml-infra"
FULLNAME = f"{RELEASE}-trainmedic"
KUBE_VERSIONS = ["1.28", "1.29", "1.30", "1.31", "1.32", "1.33"]
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}
SECRET_KEYS = {"webhook-token", "operator-token", "signing-key", "verify-key"}
SECRET_DIR = "/etc/trainmedic/secrets"
STATE_DIR = "/var/lib/trainmedic"

FULL = {
    "agent": {
        "powerActions": {"enabled": True},
        "allowRoots": ["/scratch/checkpoints", "/data/runs"],
        # Helm merges maps with the defaults: null removes the default GPU label.
        "nodeSelector": {"nvidia.com/gpu.present": None, "node-role.example.com/gpu": "a100"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}],
        "runtimeClassName": "nvidia-cdi",
    },
    "ingress": {
        "enabled": True,
        "className": "nginx",
        "hosts": [{"host": "trainmedic.ml.example.org", "paths": [{"path": "/", "pathType": "Prefix"}]}],
        "tls": [{"secretName": "trainmedic-tls", "hosts": ["trainmedic.ml.example.org"]}],
    },
    "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
    "prometheusRule": {"enabled": True},
    "redis": {"url": "rediss://:pw@redis-cluster.data.svc:6380/0"},
    "server": {
        "replicas": 3,
        "workers": 4,
        "alertmanagerUrl": "http://alertmanager-operated.monitoring.svc:9093",
        "prometheusUrl": "http://prometheus-operated.monitoring.svc:9090",
        "notifyUrlSecret": {"name": "slack", "key": "url"},
        "historyMax": 50000,
        "playbooks": {"site.yaml": "playbooks:\n  - name: x\n    matchers: ['alertname=\"X\"']\n"
                                   "    target: job\n    actions: [{empty_cache: {}}]\n"},
    },
}
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "no-agent": {"agent": {"enabled": False}},
    "existing-secret": {"existingSecret": "my-trainmedic-keys",
                        "redis": {"existingSecret": "redis-auth", "existingSecretKey": "url"}},
    "power-ingress-monitoring": FULL,
    "power-privileged": {"agent": {"powerActions": {"enabled": True, "privileged": True}}},
    "node-redis-users": {"agent": {"redisUrlFile": "/etc/trainmedic/redis-url",
                                   "allowRoots": ["/scratch/checkpoints"]}},
}
URL_MOUNT = "/etc/trainmedic/redis-url"


class _StrictLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys silently; Kubernetes clients may not. Refuse them."""


def _no_duplicates(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    keys = [loader.construct_object(k, deep=deep) for k, _ in node.value]
    dupes = {k for k in keys if keys.count(k) > 1}
    if dupes:
        raise yaml.constructor.ConstructorError(None, None, f"duplicate keys {sorted(dupes)}", node.start_mark)
    return loader.construct_mapping(node, deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)


def parse(manifests: dict[str, str]) -> list[dict]:
    """Every object of a render, in file order (NOTES.txt left out)."""
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        objects += [doc for doc in yaml.load_all(text, Loader=_StrictLoader) if doc]
    return objects


def render(values: dict[str, Any], name: str = RELEASE, namespace: str = NAMESPACE) -> dict[str, str]:
    with helm.Chart.load(CHART) as chart:
        return chart.render(copy.deepcopy(values), name=name, namespace=namespace, is_install=True)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: parse(render(values)) for name, values in VALUE_SETS.items()}


def only(objects: list[dict], kind: str) -> dict:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def kinds(objects: list[dict]) -> set[str]:
    return {o["kind"] for o in objects}


def container(workload: dict) -> dict:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def env_of(c: dict) -> dict[str, dict]:
    names = [e["name"] for e in c.get("env", [])]
    assert len(names) == len(set(names)), f"duplicate env vars in {names}"
    return {e["name"]: e for e in c.get("env", [])}


def volumes_of(workload: dict) -> dict[str, dict]:
    return {v["name"]: v for v in workload["spec"]["template"]["spec"].get("volumes", [])}


# --- Helm accepts it -----------------------------------------------------------------------------------

@pytest.mark.parametrize("values_name", sorted(VALUE_SETS))
def test_helm_lint_strict_finds_nothing_but_the_missing_icon(values_name: str) -> None:
    for kube in ("v1.28.0", "v1.33.0"):
        report = helm.lint(CHART, copy.deepcopy(VALUE_SETS[values_name]), strict=True, namespace=NAMESPACE,
                           kube_version=kube)
        assert report["errors"] == [], report
        problems = [m for m in report["messages"] if m["severity"] >= 2]
        assert problems == [], problems
        assert {m["error"] for m in report["messages"]} <= {"icon is recommended"}, report


def test_helm_lint_does_report_a_broken_template(tmp_path: Path) -> None:
    """The lint assertion above can fail: a template that does not parse is an error."""
    broken = tmp_path / "trainmedic"
    shutil.copytree(CHART, broken)
    (broken / "templates" / "broken.yaml").write_text("{{ if .Values.nothing }}\nkind: x\n")
    report = helm.lint(broken, {}, strict=True)
    assert report["errors"] or any(m["severity"] >= 3 for m in report["messages"]), report


@pytest.mark.parametrize("values, where", [
    ({"agent": {"allowroots": ["/scratch"]}}, "allowroots"),                 # a typo is not ignored
    ({"agent": {"allowRoots": ["/"]}}, "allowRoots"),                         # never the whole host
    ({"agent": {"allowRoots": ["/data/../etc"]}}, "allowRoots"),
    ({"agent": {"allowRoots": ["scratch"]}}, "allowRoots"),
    ({"agent": {"powerActions": {"enabled": "yes"}}}, "powerActions"),
    ({"agent": {"scheduler": "pbs"}}, "scheduler"),
    ({"redis": {"url": "http://redis:6379"}}, "redis"),
    ({"server": {"workers": 0}}, "workers"),
    ({"secrets": {"webhookToken": "short"}}, "webhookToken"),
    ({"agent": {"redisUrlFile": "etc/redis-url"}}, "redisUrlFile"),
    ({"agent": {"redisUrlFile": "/etc/../root/redis-url"}}, "redisUrlFile"),
])
def test_values_the_schema_refuses(values: dict, where: str) -> None:
    with pytest.raises(helm.HelmValuesError, match=where):
        render(values)


def test_an_allow_root_may_not_be_a_folder_the_agent_mounts_for_itself() -> None:
    for root in (STATE_DIR, "/tmp", SECRET_DIR):
        with pytest.raises(helm.HelmError, match="allowRoots"):
            render({"agent": {"allowRoots": [root]}})


@pytest.mark.parametrize("path", [f"{STATE_DIR}/redis-url", STATE_DIR, "/scratch/checkpoints/redis-url"])
def test_the_redis_url_file_may_not_be_inside_a_folder_the_agent_writes(path: str) -> None:
    with pytest.raises(helm.HelmError, match=f"agent.redisUrlFile: {path} is inside"):
        render({"agent": {"redisUrlFile": path, "allowRoots": ["/scratch/checkpoints"]}})


def test_the_default_values_render_the_service_the_agent_and_a_secret(rendered: dict) -> None:
    assert kinds(rendered["defaults"]) == {"Deployment", "Service", "DaemonSet", "Secret"}
    names = {(o["kind"], o["metadata"]["name"]) for o in rendered["defaults"]}
    assert ("Deployment", FULLNAME) in names and ("DaemonSet", f"{FULLNAME}-agent") in names


@pytest.mark.parametrize("values_name", sorted(VALUE_SETS))
def test_every_object_lands_in_the_release_namespace_with_the_chart_labels(rendered: dict, values_name: str) -> None:
    for obj in rendered[values_name]:
        meta = obj["metadata"]
        assert meta["namespace"] == NAMESPACE, (obj["kind"], meta)
        assert meta["labels"]["app.kubernetes.io/instance"] == RELEASE
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "Helm"
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", meta["name"]) and len(meta["name"]) <= 63


# --- strict schema validation, Kubernetes 1.28 to 1.33 ---------------------------------------------------

@pytest.mark.parametrize("kube", KUBE_VERSIONS)
@pytest.mark.parametrize("values_name", sorted(VALUE_SETS))
def test_every_object_passes_strict_validation(rendered: dict, values_name: str, kube: str) -> None:
    checked = 0
    core = [o for o in rendered[values_name] if o["kind"] not in CRD_KINDS]
    for obj in rendered[values_name]:
        if obj["kind"] in CRD_KINDS:
            continue  # test_crd_objects_pass_their_crds_strict_schema
        # strict: additionalProperties false everywhere, so a misspelt or misplaced field fails.
        used = kubernetes_validate.validate(obj, kube, strict=True)
        assert used == kube, f"validated {obj['kind']} against {used}, not {kube}"
        checked += 1
    assert checked == len(core) >= 3


def test_strict_validation_does_refuse_a_misplaced_field(rendered: dict) -> None:
    """The validation above can fail: a field in the wrong place or of the wrong type is refused."""
    deployment = copy.deepcopy(only(rendered["defaults"], "Deployment"))
    container(deployment)["readinessProbe"]["path"] = "/readyz"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.33", strict=True)
    daemonset = copy.deepcopy(only(rendered["defaults"], "DaemonSet"))
    daemonset["spec"]["template"]["spec"]["hostPID"] = "yes"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, "1.28", strict=True)


def _strict(schema: Any) -> Any:
    """Refuse unknown fields in every object with declared properties (as kubernetes-validate's strict)."""
    if isinstance(schema, dict):
        if "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
        for value in schema.values():
            _strict(value)
    elif isinstance(schema, list):
        for value in schema:
            _strict(value)
    return schema


def _crd_model(kind: str) -> Any:
    from cloudcoil.models.prometheus_operator import v1

    return getattr(v1, kind)


def _crd_schema(kind: str) -> dict:
    return _strict(_crd_model(kind).model_json_schema(by_alias=True, mode="validation"))


def test_crd_objects_pass_their_crds_strict_schema(rendered: dict) -> None:
    objects = [o for o in rendered["power-ingress-monitoring"] if o["kind"] in CRD_KINDS]
    assert {o["kind"] for o in objects} == CRD_KINDS
    for obj in objects:
        assert obj["apiVersion"] == "monitoring.coreos.com/v1"
        jsonschema.Draft202012Validator(_crd_schema(obj["kind"])).validate(obj)
        _crd_model(obj["kind"]).model_validate(obj)
    bad = copy.deepcopy(only(objects, "ServiceMonitor"))
    bad["spec"]["endpoints"][0]["intervall"] = "30s"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(_crd_schema("ServiceMonitor")).validate(bad)


# --- what trainmedic needs ----------------------------------------------------------------------------

@pytest.mark.parametrize("values_name", sorted(VALUE_SETS))
def test_selectors_match_their_pods_and_the_service_finds_only_the_server(rendered: dict, values_name: str) -> None:
    objects = rendered[values_name]
    pods = {}
    for workload in (o for o in objects if o["kind"] in ("Deployment", "DaemonSet")):
        selector = workload["spec"]["selector"]["matchLabels"]
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), workload["kind"]
        pods[workload["kind"]] = labels
    service = only(objects, "Service")
    assert service["spec"]["selector"].items() <= pods["Deployment"].items()
    if "DaemonSet" in pods:
        assert not service["spec"]["selector"].items() <= pods["DaemonSet"].items()
        agent_selector = only(objects, "DaemonSet")["spec"]["selector"]["matchLabels"]
        assert not agent_selector.items() <= pods["Deployment"].items()
    port = service["spec"]["ports"][0]
    named = {p["name"]: p["containerPort"] for p in container(only(objects, "Deployment"))["ports"]}
    assert named[port["targetPort"]] == 9095
    for monitor in (o for o in objects if o["kind"] == "ServiceMonitor"):
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        assert monitor["spec"]["endpoints"][0]["port"] == port["name"]
        assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
        assert monitor["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]
    for ingress in (o for o in objects if o["kind"] == "Ingress"):
        for rule in ingress["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                backend = path["backend"]["service"]
                assert backend["name"] == service["metadata"]["name"]
                assert backend["port"]["name"] == port["name"]


@pytest.mark.parametrize("values_name", sorted(VALUE_SETS))
def test_the_service_runs_serve_with_probes_on_readyz_and_healthz(rendered: dict, values_name: str) -> None:
    deployment = only(rendered[values_name], "Deployment")
    c = container(deployment)
    workers = str(VALUE_SETS[values_name].get("server", {}).get("workers", 2))
    assert c["command"][:2] == ["trainmedic", "serve"]
    argv = " ".join(c["command"])
    assert "--host 0.0.0.0 --port 9095 --no-agent" in argv and f"--workers {workers}" in argv
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["resources"]["requests"] and c["resources"]["limits"]
    assert deployment["spec"]["replicas"] == VALUE_SETS[values_name].get("server", {}).get("replicas", 2)
    assert c["image"] == "ghcr.io/trainmedic/trainmedic:0.2.0"


@pytest.mark.parametrize("values_name", sorted(VALUE_SETS))
def test_service_and_agent_share_one_redis_url_and_one_secret(rendered: dict, values_name: str) -> None:
    objects = rendered[values_name]
    values = VALUE_SETS[values_name]
    server = container(only(objects, "Deployment"))
    server_env = env_of(server)
    redis_values = values.get("redis", {})
    if redis_values.get("existingSecret"):
        expected = {"name": "TRAINMEDIC_REDIS_URL", "valueFrom": {"secretKeyRef": {
            "name": redis_values["existingSecret"], "key": redis_values["existingSecretKey"]}}}
    else:
        expected = {"name": "TRAINMEDIC_REDIS_URL",
                    "value": redis_values.get("url", f"redis://redis.{NAMESPACE}.svc:6379/0")}
    assert server_env["TRAINMEDIC_REDIS_URL"] == expected
    secret_name = values.get("existingSecret") or FULLNAME
    secrets = [o for o in objects if o["kind"] == "Secret"]
    if values.get("existingSecret"):
        assert secrets == [], "the chart must not make a Secret when existingSecret names one"
    else:
        assert [s["metadata"]["name"] for s in secrets] == [secret_name]
        assert set(secrets[0]["data"]) == SECRET_KEYS
    # The service reads its three secrets from files of that Secret.
    server_volume = volumes_of(only(objects, "Deployment"))["secrets"]["secret"]
    assert server_volume["secretName"] == secret_name
    assert {i["key"] for i in server_volume["items"]} == {"webhook-token", "operator-token", "signing-key"}
    mounts = {m["name"]: m for m in server["volumeMounts"]}
    assert mounts["secrets"]["mountPath"] == SECRET_DIR and mounts["secrets"]["readOnly"] is True
    for var, key in (("TRAINMEDIC_WEBHOOK_TOKEN_FILE", "webhook-token"),
                     ("TRAINMEDIC_OPERATOR_TOKEN_FILE", "operator-token"),
                     ("TRAINMEDIC_SIGNING_KEY_FILE", "signing-key")):
        assert server_env[var] == {"name": var, "value": f"{SECRET_DIR}/{key}"}
    assert not {"TRAINMEDIC_WEBHOOK_TOKEN", "TRAINMEDIC_OPERATOR_TOKEN", "TRAINMEDIC_SIGNING_KEY"} & set(server_env)
    if "DaemonSet" not in kinds(objects):
        return
    daemonset = only(objects, "DaemonSet")
    agent = container(daemonset)
    agent_env = env_of(agent)
    url_file = values.get("agent", {}).get("redisUrlFile")
    if url_file:
        # Each node's own user, from a file its node holds: no agent gets the service's URL, nor another's.
        assert "TRAINMEDIC_REDIS_URL" not in agent_env
        assert agent_env["TRAINMEDIC_REDIS_URL_FILE"] == {"name": "TRAINMEDIC_REDIS_URL_FILE", "value": URL_MOUNT}
        volume = volumes_of(daemonset)["redis-url"]
        assert volume["hostPath"] == {"path": url_file, "type": "File"}
        assert [m for m in agent["volumeMounts"] if m["name"] == "redis-url"] == [
            {"name": "redis-url", "mountPath": URL_MOUNT, "readOnly": True}]
    else:
        assert agent_env["TRAINMEDIC_REDIS_URL"] == server_env["TRAINMEDIC_REDIS_URL"]
        assert "TRAINMEDIC_REDIS_URL_FILE" not in agent_env and "redis-url" not in volumes_of(daemonset)
    # The agent's verify key comes from the same Secret as the service's signing key, and only it.
    agent_volume = volumes_of(daemonset)["verify-key"]["secret"]
    assert agent_volume["secretName"] == server_volume["secretName"]
    assert agent_volume["items"] == [{"key": "verify-key", "path": "verify-key"}]
    assert agent_env["TRAINMEDIC_VERIFY_KEY_FILE"]["value"] == f"{SECRET_DIR}/verify-key"
    assert {m["mountPath"] for m in agent["volumeMounts"] if m["name"] == "verify-key"} == {SECRET_DIR}
    assert not [n for n in agent_env if n.startswith("TRAINMEDIC_SIGNING_KEY")]
    assert "signing-key" not in json.dumps(daemonset)


@pytest.mark.parametrize("values_name", sorted(VALUE_SETS))
def test_the_service_answers_its_dns_names_and_ingress_hosts(rendered: dict, values_name: str) -> None:
    objects = rendered[values_name]
    env = env_of(container(only(objects, "Deployment")))
    hosts = env["TRAINMEDIC_ALLOWED_HOSTS"]["value"].split(",")
    service = only(objects, "Service")["metadata"]["name"]
    for name in (service, f"{service}.{NAMESPACE}", f"{service}.{NAMESPACE}.svc",
                 f"{service}.{NAMESPACE}.svc.cluster.local"):
        assert name in hosts
    assert all(h and ":" not in h and "/" not in h for h in hosts), hosts
    public = env["TRAINMEDIC_PUBLIC_URL"]["value"]
    ingresses = [o for o in objects if o["kind"] == "Ingress"]
    for ingress in ingresses:
        for rule in ingress["spec"]["rules"]:
            assert rule["host"] in hosts
        assert public == f"https://{ingress['spec']['rules'][0]['host']}"  # its host is in tls
    if not ingresses:
        assert public == f"http://{service}.{NAMESPACE}.svc:9095"


@pytest.mark.parametrize("values_name", sorted(VALUE_SETS))
def test_the_cli_accepts_the_commands_the_chart_runs(rendered: dict, values_name: str) -> None:
    for workload in (o for o in rendered[values_name] if o["kind"] in ("Deployment", "DaemonSet")):
        check_command(container(workload)["command"])


def test_optional_service_settings_reach_the_environment(rendered: dict) -> None:
    objects = rendered["power-ingress-monitoring"]
    env = env_of(container(only(objects, "Deployment")))
    assert env["TRAINMEDIC_ALERTMANAGER_URL"]["value"] == FULL["server"]["alertmanagerUrl"]
    assert env["TRAINMEDIC_PROMETHEUS_URL"]["value"] == FULL["server"]["prometheusUrl"]
    assert env["TRAINMEDIC_NOTIFY_URL"]["valueFrom"]["secretKeyRef"] == {"name": "slack", "key": "url"}
    assert env["TRAINMEDIC_HISTORY_MAX"]["value"] == "50000"
    assert env["TRAINMEDIC_PLAYBOOKS"]["value"] == "/etc/trainmedic/playbooks"
    configmap = only(objects, "ConfigMap")
    assert configmap["data"] == FULL["server"]["playbooks"]
    deployment = only(objects, "Deployment")
    assert volumes_of(deployment)["playbooks"]["configMap"]["name"] == configmap["metadata"]["name"]
    mounts = {m["name"]: m["mountPath"] for m in container(deployment)["volumeMounts"]}
    assert mounts["playbooks"] == "/etc/trainmedic/playbooks"
    # Without playbooks in values, the shipped ones: no ConfigMap, no TRAINMEDIC_PLAYBOOKS.
    defaults = env_of(container(only(rendered["defaults"], "Deployment")))
    assert not {"TRAINMEDIC_PLAYBOOKS", "TRAINMEDIC_ALERTMANAGER_URL", "TRAINMEDIC_PROMETHEUS_URL",
                "TRAINMEDIC_NOTIFY_URL", "TRAINMEDIC_DRY_RUN"} & set(defaults)
    assert "ConfigMap" not in kinds(rendered["defaults"])


def test_agent_enabled_false_leaves_the_agent_out(rendered: dict) -> None:
    assert "DaemonSet" not in kinds(rendered["no-agent"])
    assert {"Deployment", "Service", "Secret"} <= kinds(rendered["no-agent"])


@pytest.mark.parametrize("values_name", sorted(n for n in VALUE_SETS if n != "no-agent"))
def test_the_agent_runs_on_gpu_nodes_named_by_the_downward_api(rendered: dict, values_name: str) -> None:
    daemonset = only(rendered[values_name], "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    given = VALUE_SETS[values_name].get("agent", {})
    agent_values = {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "runtimeClassName": "nvidia", "allowRoots": [], **given,
                    "nodeSelector": {"nvidia.com/gpu.present": "true", **given.get("nodeSelector", {})}}
    assert pod["nodeSelector"] == {k: v for k, v in agent_values["nodeSelector"].items() if v is not None}
    assert pod["tolerations"] == agent_values["tolerations"]
    assert pod["runtimeClassName"] == agent_values["runtimeClassName"]
    c = container(daemonset)
    env = env_of(c)
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    cmd = c["command"]
    assert cmd[:4] == ["trainmedic", "agent", "--node", "$(NODE_NAME)"]
    assert cmd[cmd.index("--state-dir") + 1] == STATE_DIR
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--allow-root"] == agent_values["allowRoots"]
    assert cmd[cmd.index("--scheduler") + 1] == "none"
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    # The state dir is on the node, so the state file outlives the pod (it remembers power limits to restore).
    volumes = volumes_of(daemonset)
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    state = [n for n, v in volumes.items() if v.get("hostPath", {}).get("path") == STATE_DIR]
    assert len(state) == 1 and mounts[state[0]]["mountPath"] == STATE_DIR
    assert not mounts[state[0]].get("readOnly", False)


@pytest.mark.parametrize("values_name", sorted(VALUE_SETS))
def test_host_access_only_where_values_ask_for_it(rendered: dict, values_name: str) -> None:
    """No privileged container, no hostPID and no host path but the state dir and the allow-roots."""
    values = VALUE_SETS[values_name]
    agent_values = values.get("agent", {})
    power = agent_values.get("powerActions", {}).get("enabled", False)
    for workload in (o for o in rendered[values_name] if o["kind"] in ("Deployment", "DaemonSet")):
        pod = workload["spec"]["template"]["spec"]
        is_agent = workload["kind"] == "DaemonSet"
        assert pod["automountServiceAccountToken"] is False
        assert not pod.get("hostNetwork") and not pod.get("hostIPC")
        assert bool(pod.get("hostPID")) == (is_agent and power)
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = c.get("securityContext", {})
            privileged = sc.get("privileged", False)
            if is_agent and power:
                assert "SYS_ADMIN" in sc["capabilities"]["add"] and sc["runAsUser"] == 0
                assert privileged == agent_values["powerActions"].get("privileged", False)
            else:
                assert privileged is False
                assert "SYS_ADMIN" not in sc.get("capabilities", {}).get("add", [])
                assert sc["allowPrivilegeEscalation"] is False
            assert "ALL" in sc["capabilities"]["drop"] and sc["readOnlyRootFilesystem"] is True
        host_paths = {v["hostPath"]["path"]: v for v in pod.get("volumes", []) if "hostPath" in v}
        if not is_agent:
            assert host_paths == {}
            assert pod["securityContext"]["runAsNonRoot"] is True
            continue
        roots = agent_values.get("allowRoots", [])
        url_file = agent_values.get("redisUrlFile")
        assert set(host_paths) == {STATE_DIR, *roots, *([url_file] if url_file else [])}
        mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
        for root in roots:
            volume = host_paths[root]
            assert volume["hostPath"]["type"] == "Directory"  # never created by Kubernetes
            assert mounts[volume["name"]]["mountPath"] == root  # same path inside: --allow-root PATH
            assert not mounts[volume["name"]].get("readOnly", False)
        writable = {m["mountPath"] for m in mounts.values() if not m.get("readOnly")}
        assert writable == {STATE_DIR, "/tmp", *roots}


def test_prometheus_rule_carries_the_repository_rules_verbatim(rendered: dict) -> None:
    """The chart's rules/ are copies of config/rules (Helm reads no file outside the chart): keep them equal."""
    chart_rules = sorted(p.name for p in (CHART / "rules").glob("*.yml"))
    repo_rules = sorted(p.name for p in (ROOT / "config" / "rules").glob("*.yml"))
    assert chart_rules == repo_rules
    for name in repo_rules:
        assert (CHART / "rules" / name).read_bytes() == (ROOT / "config" / "rules" / name).read_bytes(), name
    rule = only(rendered["power-ingress-monitoring"], "PrometheusRule")
    expected = []
    for name in repo_rules:
        expected += yaml.safe_load((ROOT / "config" / "rules" / name).read_text())["groups"]
    assert rule["spec"]["groups"] == expected
    assert any("{{ $labels." in json.dumps(g) for g in rule["spec"]["groups"]), "annotations were templated"


def test_notes_say_how_to_wire_alertmanager_and_trainers() -> None:
    notes = render({})["trainmedic/templates/NOTES.txt"]
    assert f"url: http://{FULLNAME}.{NAMESPACE}.svc:9095/webhook" in notes
    assert "send_resolved: true" in notes and "max_alerts: 0" in notes and "credentials_file:" in notes
    assert "verify-key" in notes and "operator-token" in notes
    assert "no node agent" in render({"agent": {"enabled": False}})["trainmedic/templates/NOTES.txt"].lower()
    assert "redis-url" not in notes
    own = render(VALUE_SETS["node-redis-users"])["trainmedic/templates/NOTES.txt"]
    assert "own node's Redis URL from /etc/trainmedic/redis-url" in own and "trainmedic credentials node" in own


# --- the generated Secret ------------------------------------------------------------------------------

def _generated_secret(values: dict | None = None) -> dict:
    return only(parse(render(values or {})), "Secret")


def test_the_generated_keys_are_an_ed25519_pair_trainmedic_accepts() -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

    data = {k: base64.b64decode(v).decode() for k, v in _generated_secret()["data"].items()}
    assert set(data) == SECRET_KEYS
    for token in ("webhook-token", "operator-token"):
        assert re.fullmatch(r"[A-Za-z0-9]{48}", data[token])
    assert data["webhook-token"] != data["operator-token"]
    assert data["signing-key"].startswith("-----BEGIN PRIVATE KEY-----")
    private = serialization.load_pem_private_key(data["signing-key"].encode(), password=None)
    assert isinstance(private, Ed25519PrivateKey)
    assert data["verify-key"].startswith("-----BEGIN CERTIFICATE-----") and "," not in data["verify-key"]
    public = x509.load_pem_x509_certificate(data["verify-key"].encode()).public_key()
    assert isinstance(public, Ed25519PublicKey)
    raw = serialization.Encoding.Raw, serialization.PublicFormat.Raw
    assert public.public_bytes(*raw) == private.public_key().public_bytes(*raw)
    signature = private.sign(b"command")
    public.verify(signature, b"command")  # raises if the two halves do not belong together
    again = {k: base64.b64decode(v).decode() for k, v in _generated_secret()["data"].items()}
    assert again["signing-key"] != data["signing-key"]  # fresh per render when nothing is in the cluster


def test_tokens_given_in_values_are_used_as_they_are() -> None:
    secret = _generated_secret({"secrets": {"webhookToken": "w" * 40, "operatorToken": "o" * 40}})
    assert base64.b64decode(secret["data"]["webhook-token"]) == b"w" * 40
    assert base64.b64decode(secret["data"]["operator-token"]) == b"o" * 40


class _FakeApiServer:
    """Just enough of a Kubernetes API server for Helm's `lookup` of one Secret: the v1 discovery document
    and GET on the Secret (404 when there is none). Every request is recorded."""

    def __init__(self, secret: dict | None) -> None:
        self.secret = secret
        self.requests: list[str] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                fake.requests.append(self.path)
                path = self.path.split("?")[0]
                status, body = 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                     "reason": "NotFound", "code": 404}
                if path == "/api/v1":
                    status, body = 200, {"kind": "APIResourceList", "groupVersion": "v1", "resources": [
                        {"name": "secrets", "singularName": "secret", "namespaced": True, "kind": "Secret",
                         "verbs": ["get", "list"]}]}
                elif path == f"/api/v1/namespaces/{NAMESPACE}/secrets/{FULLNAME}" and fake.secret:
                    status, body = 200, fake.secret
                payload = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> _FakeApiServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def render(self, values: dict) -> dict[str, str]:
        """Render as `helm upgrade` would against this server (cluster-aware: `lookup` asks it)."""
        kubeconfig = yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{self.server.server_port}"}}],
            "users": [{"name": "fake", "user": {"token": "unused"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": NAMESPACE}}],
        })
        with helm.Config(kubeconfig_content=kubeconfig, namespace=NAMESPACE) as cfg, helm.Chart.load(CHART) as chart:
            return cfg.render(chart, copy.deepcopy(values), name=RELEASE, namespace=NAMESPACE, revision=2,
                              is_upgrade=True)


def test_helm_upgrade_keeps_the_generated_secret() -> None:
    first = _generated_secret()
    with _FakeApiServer(first) as api:
        upgraded = only(parse(api.render({})), "Secret")
        changed = only(parse(api.render({"secrets": {"webhookToken": "n" * 40}})), "Secret")
    assert f"/api/v1/namespaces/{NAMESPACE}/secrets/{FULLNAME}" in [r.split("?")[0] for r in api.requests]
    assert upgraded["data"] == first["data"]
    # A token set in values wins over the stored one; the keys stay.
    assert base64.b64decode(changed["data"]["webhook-token"]) == b"n" * 40
    assert {k: changed["data"][k] for k in ("operator-token", "signing-key", "verify-key")} == \
        {k: first["data"][k] for k in ("operator-token", "signing-key", "verify-key")}


def test_a_first_install_against_an_empty_cluster_generates_the_secret() -> None:
    with _FakeApiServer(None) as api:
        secret = only(parse(api.render({})), "Secret")
    assert f"/api/v1/namespaces/{NAMESPACE}/secrets/{FULLNAME}" in [r.split("?")[0] for r in api.requests]
    assert set(secret["data"]) == SECRET_KEYS
    assert base64.b64decode(secret["data"]["signing-key"]).startswith(b"-----BEGIN PRIVATE KEY-----")
