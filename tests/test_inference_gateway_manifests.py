"""k8s/inference-gateway/, validated offline: the core kinds with kubernetes-validate --strict (as
the other manifests), the custom resources and the endpoint picker's configuration against the
strict schemas in k8s/inference-gateway/schemas/, and what ties them together: the pool selects
the model-server pods on their serving port, the picker's profile uses prefix-cache and load
scorers over metrics this server exports, the autoscaler scales the model servers on their
queue, and a draining pod stops being ready."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from referencing import Registry, Resource

ROOT = Path(__file__).resolve().parents[1]
DIR = ROOT / "k8s" / "inference-gateway"
SCHEMAS = DIR / "schemas"
BIN = Path(sys.executable).parent
CUSTOM = {"InferencePool": "inferencepool.yaml", "HTTPRoute": "httproute.yaml", "ScaledObject": "scaledobject.yaml"}


def docs() -> list[dict]:
    return [d for p in sorted(DIR.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def find(kind: str, name: str | None = None) -> dict:
    return next(d for d in docs() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name))


def validator(schema_file: str) -> jsonschema.protocols.Validator:
    registry = Registry().with_resources(
        (p.name, Resource.from_contents(yaml.safe_load(p.read_text()))) for p in SCHEMAS.glob("*.yaml"))
    schema = yaml.safe_load((SCHEMAS / schema_file).read_text())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def picker_configs() -> dict[str, dict]:
    return {k: yaml.safe_load(v) for k, v in find("ConfigMap", "sarathi-epp-config")["data"].items()}


def test_core_kinds_pass_strict_schema_validation(tmp_path):
    core = [d for d in docs() if d["kind"] not in CUSTOM]
    assert {d["kind"] for d in core} >= {"Deployment", "Service", "ConfigMap", "ServiceAccount", "Role",
                                         "RoleBinding", "HorizontalPodAutoscaler"}
    path = tmp_path / "core.yaml"
    path.write_text(yaml.safe_dump_all(core))
    r = subprocess.run([BIN / "kubernetes-validate", "--strict", path], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("kind", sorted(CUSTOM))
def test_custom_resources_match_their_schemas(kind):
    found = [d for d in docs() if d["kind"] == kind]
    assert found
    for d in found:
        validator(CUSTOM[kind]).validate(d)


def test_the_schemas_reject_an_unknown_field_and_a_bad_value():
    pool = json.loads(json.dumps(find("InferencePool")))
    pool["spec"]["targetPortNumber"] = 8000        # an older API version's field
    with pytest.raises(jsonschema.ValidationError):
        validator("inferencepool.yaml").validate(pool)
    scaled = json.loads(json.dumps(find("ScaledObject")))
    scaled["spec"]["triggers"][0]["metricType"] = "Average"
    with pytest.raises(jsonschema.ValidationError):
        validator("scaledobject.yaml").validate(scaled)


def test_the_pool_selects_the_model_servers_on_their_serving_port():
    pool, server = find("InferencePool"), find("Deployment", "sarathi-model-server")
    labels = server["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (c,) = server["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [ports["http"]]
    epp_svc = find("Service", pool["spec"]["endpointPickerRef"]["name"])
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] in [p["port"] for p in epp_svc["spec"]["ports"]]
    route = find("HTTPRoute")
    assert route["spec"]["rules"][0]["backendRefs"][0] == {
        "group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool["metadata"]["name"]}
    epp = find("Deployment", "sarathi-epp")["spec"]["template"]["spec"]["containers"][0]
    assert f"--pool-name={pool['metadata']['name']}" in epp["args"]


def test_a_draining_replica_fails_readiness_before_it_stops():
    spec = find("Deployment", "sarathi-model-server")["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    probe = c["readinessProbe"]
    assert probe["httpGet"] == {"path": "/ready", "port": "http"}   # the gateway answers 503 while draining
    assert probe["periodSeconds"] * probe["failureThreshold"] <= 5   # out of the pool within seconds
    drain = int(next(e["value"] for e in c["env"] if e["name"] == "SARATHI_DRAIN_TIMEOUT"))
    assert spec["terminationGracePeriodSeconds"] > drain


def test_the_picker_profile_uses_prefix_cache_and_load_scorers():
    configs = picker_configs()
    assert set(configs) == {"precise.yaml", "approximate.yaml"}
    for name, cfg in configs.items():
        validator("endpointpickerconfig.yaml").validate(cfg)
        plugins = {p.get("name", p["type"]): p for p in cfg["plugins"]}
        (profile,) = cfg["schedulingProfiles"]
        refs = {r["pluginRef"]: r.get("weight") for r in profile["plugins"]}
        assert set(refs) <= set(plugins), name                  # every reference is defined
        assert {"queue-scorer", "kv-cache-utilization-scorer", "max-score-picker"} <= set(refs)
        prefix = "precise-prefix-cache-scorer" if name == "precise.yaml" else "prefix-cache-scorer"
        assert refs[prefix] > refs["queue-scorer"] == refs["kv-cache-utilization-scorer"] > 0
    precise = {p["type"]: p for p in configs["precise.yaml"]["plugins"]}["precise-prefix-cache-scorer"]
    tokens = precise["parameters"]["indexerConfig"]["tokenProcessorConfig"]
    args = find("Deployment", "sarathi-model-server")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--block-size={tokens['blockSize']}" in args
    events = json.loads(next(a for a in args if a.startswith("--kv-events-config=")).split("=", 1)[1])
    assert events["hash_seed"] == tokens["hashSeed"] and events["connect"] is True
    assert events["topic"].startswith(precise["parameters"]["kvEventsConfig"]["topicFilter"])
    port = int(events["endpoint"].rsplit(":", 1)[1])
    assert events["endpoint"].startswith("tcp://sarathi-epp:")
    assert port in [p["port"] for p in find("Service", "sarathi-epp")["spec"]["ports"]]
    assert "--kv-events-config" in {a.split("=")[0] for a in args} and "--prefix-caching" in args


def test_the_metrics_the_picker_and_the_autoscaler_read_are_exported():
    """The picker's defaults (vllm:num_requests_waiting, vllm:kv_cache_usage_perc, ...) and the
    autoscaler's query name metrics that the scheduler's registry really exports."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from scheduler_svc.metrics import SchedulerMetrics

    m = SchedulerMetrics(CollectorRegistry())
    m.set_worker("SmolLM2-135M-Instruct", "cuda", block_size=16)
    m.observe_stats(dict(running=0, waiting=0, kv_usage=0.0, num_free_blocks=1, num_total_blocks=1,
                         num_preemptions=0, prefix_cache_hit_tokens=0, prefix_cache_query_tokens=0))
    exported = {f.name for f in text_string_to_metric_families(generate_latest(m.registry).decode())}
    assert {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
            "vllm:lora_requests_info", "vllm:cache_config_info"} <= exported
    query = find("ScaledObject")["spec"]["triggers"][0]["metadata"]["query"]
    assert "vllm:num_requests_waiting" in query
    hpa = find("HorizontalPodAutoscaler")
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "vllm_num_requests_waiting"
    for scaler in (find("ScaledObject")["spec"]["scaleTargetRef"], hpa["spec"]["scaleTargetRef"]):
        assert (scaler["kind"], scaler["name"]) == ("Deployment", "sarathi-model-server")
