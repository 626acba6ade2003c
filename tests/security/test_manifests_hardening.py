"""The deployment files, read offline: every pod and container locked down (non-root, no
privilege escalation, no capabilities, read-only root with a writable /tmp, RuntimeDefault
seccomp), Secrets for the API key, the Redis password and TLS and the link keys, TLS Redis with a
password, pinned images, a grace period longer than the drain, and NetworkPolicies that allow
exactly the design's paths (evaluated here as a CNI would)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = sorted((ROOT / "k8s").glob("*.yaml"))
COMPOSE = sorted(ROOT.glob("docker-compose*.yml"))
SECRETS = {"sarathi-redis-auth", "sarathi-redis-tls", "sarathi-gateway-api-key", "sarathi-link-keys"}
DRAIN_DEFAULT_S = 30.0  # the gateway's --drain-timeout default


def k8s_docs():
    return [d for p in K8S for d in yaml.safe_load_all(p.read_text()) if d]


def workloads():
    return [d for d in k8s_docs() if d["kind"] in ("Deployment", "StatefulSet")]


def component(d) -> str:
    return d["metadata"]["labels"]["app.kubernetes.io/component"]


def pod_spec(d) -> dict:
    return d["spec"]["template"]["spec"]


def env_of(container) -> dict:
    return {e["name"]: e for e in container.get("env", [])}


@pytest.mark.parametrize("d", workloads(), ids=component)
def test_every_pod_and_container_is_locked_down(d):
    spec = pod_spec(d)
    pod = spec["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] > 0
    assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["automountServiceAccountToken"] is False
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for c in spec["containers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, c["name"]
        assert sc["readOnlyRootFilesystem"] is True, c["name"]
        assert sc["capabilities"] == {"drop": ["ALL"]}, c["name"]
        assert not sc.get("privileged") and sc.get("runAsUser", 1) > 0, c["name"]
        # what it may write: emptyDirs and the data volume only, never a Secret
        for m in c.get("volumeMounts", []):
            v = volumes.get(m["name"])
            if v is not None and "secret" in v:
                assert m.get("readOnly") is True, (c["name"], m)
        if c["args"][:1] in (["gateway"], ["scheduler"], ["worker"]):
            tmp = next(m for m in c["volumeMounts"] if m["mountPath"] == "/tmp")
            assert "emptyDir" in volumes[tmp["name"]]
            assert env_of(c)["HOME"]["value"] == "/tmp"


def test_images_are_pinned():
    images = [c["image"] for d in workloads() for c in pod_spec(d)["containers"]]
    for p in COMPOSE:
        images += [s["image"] for s in (yaml.safe_load(p.read_text())["services"] or {}).values() if "image" in s]
        images += re.findall(r"^\s+image: *([^\s&*#]+)", p.read_text(), re.M)  # anchors and comments too
    assert images
    for image in images:
        name, _, tag = image.rpartition(":")
        assert name and tag and tag != "latest" and re.search(r"\d", tag), image


def test_the_gateway_grace_period_outlasts_its_drain():
    (gw,) = [d for d in workloads() if component(d) == "gateway"]
    (c,) = pod_spec(gw)["containers"]
    drain = float(env_of(c).get("SARATHI_DRAIN_TIMEOUT", {}).get("value", DRAIN_DEFAULT_S))
    assert pod_spec(gw)["terminationGracePeriodSeconds"] > drain
    for d in workloads():
        assert pod_spec(d).get("terminationGracePeriodSeconds", 30) >= 30


def test_secrets_carry_the_api_key_the_redis_password_tls_and_the_link_keys():
    named = set()
    for d in workloads():
        spec = pod_spec(d)
        for v in spec.get("volumes", []):
            if "secret" in v:
                named.add(v["secret"]["secretName"])
        for c in spec["containers"]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    named.add(ref["name"])
                value = str(e.get("value", ""))
                assert not re.search(r"(password|api_key|secret)", e["name"].lower()) or "FILE" in e["name"] \
                    or ref, f"a credential inline in {c['name']}: {e['name']}"
                assert "@" not in value or not value.startswith("redis"), "a password in a Redis URL"
            if c["args"][:1] == ["gateway"]:
                assert env_of(c)["SARATHI_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "sarathi-gateway-api-key"
            if c["args"][:1] in (["gateway"], ["scheduler"]):
                env = env_of(c)
                assert env["SARATHI_REDIS_URL"]["value"].startswith("rediss://")
                assert env["SARATHI_REDIS_PASSWORD_FILE"]["value"].startswith("/etc/sarathi/redis-auth/")
                assert env["SARATHI_REDIS_TLS_CA_FILE"]["value"] == "/etc/sarathi/redis-tls/ca.crt"
    assert named == SECRETS


def test_redis_requires_the_password_and_speaks_only_tls():
    (redis,) = [d for d in workloads() if component(d) == "redis"]
    (c,) = pod_spec(redis)["containers"]
    script = " ".join(c["command"] + c["args"])
    assert "requirepass" in script and "--port 0" in script and "--tls-port 6379" in script
    assert "$REDISCLI_AUTH" in script and "protected-mode" not in script
    assert env_of(c)["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"] == {"name": "sarathi-redis-auth", "key": "password"}


def test_disaggregated_workers_and_their_scheduler_hold_only_their_roles_link_keys():
    for d in workloads():
        comp = component(d)
        if comp not in ("prefill", "decode", "pd-scheduler"):
            continue
        spec = pod_spec(d)
        (keys,) = [v for v in spec["volumes"] if v.get("secret", {}).get("secretName") == "sarathi-link-keys"]
        files = {i["key"] for i in keys["secret"]["items"]}
        if comp == "pd-scheduler":
            assert files == {"scheduler.key_secret", "worker.key"}
        else:
            assert files == {"worker.key_secret", "authorized_schedulers", "authorized_workers"}
        for c in spec["containers"]:
            assert env_of(c)["SARATHI_LINK_KEYS"]["value"] == "/etc/sarathi/link-keys"


# ------------------------------------------------------------------------------------------------
# NetworkPolicies, evaluated: which (source component -> destination component, port) pass
# ------------------------------------------------------------------------------------------------
COMPONENTS = ["gateway", "redis", "replica", "replica-parallel", "pd-scheduler", "prefill", "decode"]
PORTS = [53, 5555, 5600, 6379, 8000, 9100]


def _selects(selector: dict, labels: dict) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for ex in selector.get("matchExpressions", []):
        assert ex["operator"] == "In", ex
        if labels.get(ex["key"]) not in ex["values"]:
            return False
    return True


def _peer_matches(peer: dict, labels: dict) -> bool:
    """A peer in our namespace: a namespaceSelector that needs labels (another namespace) does not match."""
    ns = peer.get("namespaceSelector")
    if ns is not None and ns != {}:
        return False
    if "podSelector" not in peer:
        return ns == {}  # any pod of any namespace
    return _selects(peer["podSelector"], labels)


def _allowed(policies, kind: str, pod: dict, peer: dict, port: int) -> bool:
    """kind Ingress: may `peer` reach `pod` on `port`; Egress: may `pod` reach `peer`."""
    mine = [p["spec"] for p in policies if kind in p["spec"]["policyTypes"] and _selects(p["spec"]["podSelector"], pod)]
    if not mine:
        return True  # no policy isolates this pod in this direction
    side = "from" if kind == "Ingress" else "to"
    for spec in mine:
        for rule in spec.get(kind.lower(), []) or []:
            peers_ok = side not in rule or any(_peer_matches(q, peer) for q in rule[side])
            ports_ok = "ports" not in rule or any(p["port"] == port for p in rule["ports"])
            if peers_ok and ports_ok:
                return True
    return False


def reachable() -> set[tuple[str, str, int]]:
    policies = [d for d in k8s_docs() if d["kind"] == "NetworkPolicy"]
    out = set()
    for src in COMPONENTS:
        for dst in COMPONENTS:
            s = {"app.kubernetes.io/name": "sarathi", "app.kubernetes.io/component": src}
            t = {"app.kubernetes.io/name": "sarathi", "app.kubernetes.io/component": dst}
            for port in PORTS:
                if src == dst:
                    continue
                if _allowed(policies, "Egress", s, t, port) and _allowed(policies, "Ingress", t, s, port):
                    out.add((src, dst, port))
    return out


def test_network_policies_allow_exactly_the_designs_paths():
    assert reachable() == {
        ("gateway", "redis", 6379),
        ("replica", "redis", 6379), ("replica-parallel", "redis", 6379), ("pd-scheduler", "redis", 6379),
        ("pd-scheduler", "prefill", 5555), ("pd-scheduler", "decode", 5555), ("pd-scheduler", "decode", 5600),
        ("prefill", "decode", 5600),
    }


def test_every_sarathi_pod_is_isolated_by_default():
    policies = [d for d in k8s_docs() if d["kind"] == "NetworkPolicy"]
    deny = [p for p in policies if p["spec"]["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "sarathi"}}
            and set(p["spec"]["policyTypes"]) == {"Ingress", "Egress"}
            and not p["spec"].get("ingress") and not p["spec"].get("egress")]
    assert len(deny) == 1
    for d in workloads():  # every workload's pods carry the label the default deny selects
        assert d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == "sarathi"
    outside = {"app.kubernetes.io/name": "other"}  # a pod of another app in the namespace
    for dst in COMPONENTS:
        t = {"app.kubernetes.io/name": "sarathi", "app.kubernetes.io/component": dst}
        for port in PORTS:
            if dst != "gateway":
                assert not _allowed(policies, "Ingress", t, outside, port), (dst, port)
    assert _allowed(policies, "Ingress", {"app.kubernetes.io/name": "sarathi", "app.kubernetes.io/component":
                                           "gateway"}, outside, 8000)


def test_the_network_policies_pass_strict_schema_validation():
    bin_dir = Path(sys.executable).parent
    r = subprocess.run([bin_dir / "kubernetes-validate", "--strict", ROOT / "k8s" / "network-policy.yaml"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# ------------------------------------------------------------------------------------------------
# compose
# ------------------------------------------------------------------------------------------------
def test_compose_redis_wants_the_password_and_the_gateway_the_api_key():
    base = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    svc = base["services"]
    redis_start = " ".join(svc["redis"]["entrypoint"])
    assert "requirepass" in redis_start and "/run/secrets/redis_password" in redis_start
    assert svc["redis"]["secrets"] == ["redis_password"] and "ports" not in svc["redis"]
    assert "ports" not in svc["worker"]
    for p in COMPOSE:
        assert "protected-mode" not in p.read_text(), p.name
    gw = svc["gateway"]
    assert gw["environment"]["SARATHI_API_KEY"].startswith("${SARATHI_API_KEY:?")
    assert gw["stop_grace_period"] == "45s"
    for name in ("gateway", "scheduler"):
        env = svc[name]["environment"]
        assert env["SARATHI_REDIS_PASSWORD_FILE"] == "/run/secrets/redis_password"
        assert "redis_password" in svc[name]["secrets"]
    assert svc["scheduler"]["ports"] == ["127.0.0.1:9100:9100"]
    for name in ("gateway", "scheduler", "worker"):
        s = svc[name]
        assert s["read_only"] is True and "/tmp" in s["tmpfs"] and s["cap_drop"] == ["ALL"]
        assert "no-new-privileges:true" in s["security_opt"]
    assert base["secrets"]["redis_password"]["file"].startswith("${SARATHI_SECRETS_DIR:?")
