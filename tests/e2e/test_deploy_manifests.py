"""Deployment files, validated offline: Kubernetes manifests against the API schemas (strict: no
unknown fields), the compose file against the compose spec, plus the properties the design asks
for (GPU request, probes, resources, /dev/shm, SARATHI_<OPTION> configuration)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
MANIFESTS = sorted((ROOT / "k8s").glob("*.yaml"))


def docs():
    return [d for p in MANIFESTS for d in yaml.safe_load_all(p.read_text()) if d]


def find(kind, component):
    return next(d for d in docs() if d["kind"] == kind
                and d["metadata"]["labels"]["app.kubernetes.io/component"] == component)


def containers(kind, component):
    return find(kind, component)["spec"]["template"]["spec"]["containers"]


def test_kubernetes_manifests_pass_strict_schema_validation():
    r = subprocess.run([BIN / "kubernetes-validate", "--strict", *MANIFESTS], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("name", ["docker-compose.yml", "docker-compose.parallel.yml", "docker-compose.local.yml",
                                  "docker-compose.disagg.yml"])
def test_compose_file_passes_the_compose_spec(name):
    r = subprocess.run([BIN / "check-jsonschema", "--builtin-schema", "vendor.compose-spec",
                        ROOT / name], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_parallel_examples_run_tp_2_x_pp_2_with_a_gpu_per_rank():
    worker = yaml.safe_load((ROOT / "docker-compose.parallel.yml").read_text())["services"]["worker"]
    assert (worker["environment"]["SARATHI_TP"], worker["environment"]["SARATHI_PP"]) == ("2", "2")
    spec = find("StatefulSet", "replica-parallel")["spec"]["template"]["spec"]
    w = next(c for c in spec["containers"] if c["name"] == "worker")
    env = {e["name"]: e["value"] for e in w["env"]}
    assert int(env["SARATHI_TP"]) * int(env["SARATHI_PP"]) == int(w["resources"]["limits"]["nvidia.com/gpu"])
    s = next(c for c in spec["containers"] if c["name"] == "scheduler")
    assert {e["name"]: e.get("value") for e in s["env"]}["SARATHI_WORKER_ADDR"] == env["SARATHI_BIND"]


def test_strict_validation_rejects_an_unknown_field(tmp_path):
    bad = yaml.safe_load((ROOT / "k8s" / "gateway.yaml").read_text().split("---")[0])
    bad["spec"]["template"]["spec"]["containers"][0]["gpus"] = 1
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    r = subprocess.run([BIN / "kubernetes-validate", "--strict", path], capture_output=True, text=True)
    assert r.returncode != 0


def test_gateway_is_a_deployment_behind_a_service_with_health_and_ready_probes():
    (gw,) = containers("Deployment", "gateway")
    assert gw["livenessProbe"]["httpGet"]["path"] == "/health"
    assert gw["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert find("Service", "gateway")["spec"]["ports"][0]["targetPort"] == "http"


def test_replica_statefulset_requests_a_gpu_and_mounts_a_memory_backed_shm():
    spec = find("StatefulSet", "replica")["spec"]["template"]["spec"]
    worker = next(c for c in spec["containers"] if c["name"] == "worker")
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in worker["volumeMounts"]
    assert next(v for v in spec["volumes"] if v["name"] == "dshm")["emptyDir"]["medium"] == "Memory"
    scheduler = next(c for c in spec["containers"] if c["name"] == "scheduler")
    assert scheduler["readinessProbe"]["httpGet"]["path"] == "/ready"


def test_every_container_declares_requests_and_limits():
    for d in docs():
        if d["kind"] in ("Deployment", "StatefulSet"):
            for c in d["spec"]["template"]["spec"]["containers"]:
                assert {"requests", "limits"} <= set(c["resources"]), c["name"]


def test_compose_runs_the_four_services_configured_by_sarathi_env_vars():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert set(compose["services"]) == {"redis", "gateway", "scheduler", "worker"}
    for name in ("gateway", "scheduler", "worker"):
        svc = compose["services"][name]
        assert svc["command"] == [name]
        assert all(k.startswith("SARATHI_") for k in svc["environment"])
    assert compose["services"]["scheduler"]["environment"]["SARATHI_WORKER_ADDR"] == "tcp://worker:5555"


@pytest.mark.parametrize("name", ["Dockerfile", ".dockerignore"])
def test_image_files_exist(name):
    assert (ROOT / name).is_file()


def cli_options(command: str) -> set[str]:
    """The SARATHI_<OPTION> names the `sarathi <command>` parser reads."""
    from sarathi.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "cmd").choices[command]
    return {"SARATHI_" + o[2:].upper().replace("-", "_")
            for a in sub._actions for o in a.option_strings if o.startswith("--")}


def deployed_env() -> list[tuple[str, str]]:
    """(command, env var name) for every container of compose and k8s running `sarathi`."""
    pairs = []
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for svc in compose["services"].values():
        if svc.get("command") and svc["command"][0] in ("gateway", "scheduler", "worker"):
            pairs += [(svc["command"][0], k) for k in svc["environment"]]
    for override in ("docker-compose.parallel.yml", "docker-compose.disagg.yml"):
        for name, svc in yaml.safe_load((ROOT / override).read_text())["services"].items():
            command = svc.get("command") or compose["services"][name]["command"]   # else the base's
            pairs += [(command[0], k) for k in svc.get("environment", {})]
    for d in docs():
        if d["kind"] in ("Deployment", "StatefulSet"):
            for c in d["spec"]["template"]["spec"]["containers"]:
                if c.get("args") and c["args"][0] in ("gateway", "scheduler", "worker"):
                    pairs += [(c["args"][0], e["name"]) for e in c.get("env", [])]
    return pairs


# read from the environment by the library itself, not through a CLI option
LIBRARY_ENV = {"SARATHI_LINK_KEYS"}   # the CURVE key directory (a mounted Secret)


def test_every_sarathi_env_var_in_the_deployments_is_an_option_of_its_command():
    unknown = [(cmd, var) for cmd, var in deployed_env()
               if var.startswith("SARATHI_") and var not in cli_options(cmd) | LIBRARY_ENV]
    assert not unknown, f"env vars no CLI option reads: {unknown}"


def test_disaggregated_examples_wire_a_prefill_and_a_decode_worker_to_one_scheduler():
    """compose: the base's worker becomes the decode worker (its kv address on its own name),
    a prefill worker is added, the scheduler names both and no mixed worker; k8s: a prefill and
    a decode StatefulSet, the decode pod advertising its stable DNS name on its kv port."""
    compose = yaml.safe_load((ROOT / "docker-compose.disagg.yml").read_text())["services"]
    sched = compose["scheduler"]["environment"]
    assert sched["SARATHI_WORKER_ADDR"] == ""
    assert sched["SARATHI_PREFILL_WORKER_ADDRS"] == "tcp://prefill-worker:5555"
    assert sched["SARATHI_DECODE_WORKER_ADDRS"] == "tcp://worker:5555"
    assert compose["prefill-worker"]["environment"]["SARATHI_ROLE"] == "prefill"
    assert compose["worker"]["environment"] == {"SARATHI_ROLE": "decode", "SARATHI_KV_ADDRESS": "tcp://worker:5600"}

    def env(component):
        (c,) = containers("StatefulSet", component)
        return c, {e["name"]: e.get("value") for e in c["env"]}

    (_, prefill), (decode_c, decode) = env("prefill"), env("decode")
    assert (prefill["SARATHI_ROLE"], decode["SARATHI_ROLE"]) == ("prefill", "decode")
    kv_port = next(p["containerPort"] for p in decode_c["ports"] if p["name"] == "kv")
    assert decode["SARATHI_KV_ADDRESS"] == f"tcp://$(POD_NAME).sarathi-decode:{kv_port}"
    assert [e["name"] for e in decode_c["env"]].index("POD_NAME") == 0   # defined before it is used
    _, s = env("pd-scheduler")
    assert s["SARATHI_PREFILL_WORKER_ADDRS"] == "tcp://sarathi-prefill-0.sarathi-prefill:5555"
    assert s["SARATHI_DECODE_WORKER_ADDRS"] == "tcp://sarathi-decode-0.sarathi-decode:5555"
    assert s["SARATHI_DISAGGREGATION"] in ("all", "auto") and s["SARATHI_WORKER_ADDR"] == ""


def test_image_builds_the_kernels_and_runs_without_a_compiler():
    """The Dockerfile's shape: a build stage with a compiler installs the package (its install
    compiles the kernel variants); the runtime stage copies only the venv, runs as a non-root
    uid, and forbids a kernel build at run time (a missing build is a logged reason, not a silent
    attempt to compile)."""
    text = (ROOT / "Dockerfile").read_text()
    stages = [s for s in text.split("\nFROM ")[1:]]
    assert len(stages) == 2 and stages[0].split()[2] == "build"
    build, runtime = stages
    assert "gcc" in build and "pip install" in build and "_kernels_*.so" in build
    assert "gcc" not in runtime and "pip install" not in runtime
    assert "COPY --from=build /opt/venv /opt/venv" in runtime
    assert "SARATHI_NATIVE_BUILD=prebuilt" in runtime
    user = next(line.split()[1] for line in runtime.splitlines() if line.startswith("USER "))
    assert user.isdigit() and int(user) != 0
    assert "_kernels_*.so" in (ROOT / ".dockerignore").read_text()   # a host's build never enters the image
