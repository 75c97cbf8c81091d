"""The Kubernetes manifests (deploy/k8s/) and the GPU Dockerfile, checked without a cluster.

``kubectl apply --dry-run=client`` still needs an API server (it downloads the OpenAPI
schema and maps kinds through discovery), so the check is done here instead:

1. every YAML document parses, has apiVersion/kind/metadata.name, and each resource is
   validated against the official Kubernetes OpenAPI schema (strict: unknown fields are
   errors) for 1.29 and 1.37 with the ``kubernetes-validate`` package (PyPI; its
   schemas ship inside the wheel, nothing is downloaded). Without the package this part
   skips, except under CI=true, where it must run;
2. what a schema cannot see: selectors match pod labels (Deployments, Service,
   PodDisruptionBudget, NetworkPolicy), the HPA targets a Deployment that requests CPU,
   probes point at /healthz and /readyz on a declared port, secrets come from the Secret
   (never inline values), the Secret holds placeholders only and no kustomization
   applies it, the ConfigMap's values load through bot/config.py, graceful-shutdown
   budgets fit the grace period, the GPU variant asks for nvidia.com/gpu and builds its
   engine in an init container;
3. where ``kubectl`` is on PATH (not in CI), ``kubectl kustomize`` renders both variants.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from bot.config import REPO_ROOT, _SECRET_ENV, _SECRET_KEYS, load_config
from tests.redis_server import in_ci

K8S = REPO_ROOT / "deploy" / "k8s"
VARIANTS = ("cpu", "gpu")
SCHEMA_VERSIONS = ("1.29.0", "1.37.0")  # an older supported release and the newest the package knows
PLACEHOLDER = "REPLACE_ME"
EXPECTED_API = {
    "Deployment": "apps/v1", "Service": "v1", "ConfigMap": "v1", "Secret": "v1",
    "HorizontalPodAutoscaler": "autoscaling/v2", "PodDisruptionBudget": "policy/v1",
    "NetworkPolicy": "networking.k8s.io/v1", "Kustomization": "kustomize.config.k8s.io/v1beta1",
}
#: Environment variables that hold secrets (bot/config.py reads these only from the environment).
SECRET_ENV_NAMES = {name for name, key in _SECRET_ENV.items() if key in _SECRET_KEYS} | {"HEALTHBOT_WECHAT_APPSECRET"}
_SECRETISH = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|AES_KEY|API_KEY|CREDENTIAL", re.I)


def yaml_files() -> list[Path]:
    return sorted(K8S.rglob("*.yaml"))


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]


def kustomization_resources(folder: Path) -> list[Path]:
    """The manifest files a ``kubectl apply -k folder`` applies (following ../common)."""
    kust = documents(folder / "kustomization.yaml")[0]
    out: list[Path] = []
    for entry in kust.get("resources", []):
        target = (folder / entry).resolve()
        out.extend(kustomization_resources(target) if target.is_dir() else [target])
    return out


def variant(name: str) -> list[dict]:
    """Every resource of the ``cpu`` or ``gpu`` variant."""
    return [d for f in kustomization_resources(K8S / name) for d in documents(f)]


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def matches(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def containers(deployment: dict, init: bool = True) -> list[dict]:
    spec = deployment["spec"]["template"]["spec"]
    return spec["containers"] + (spec.get("initContainers", []) if init else [])


def healthbot_deployments(docs: list[dict]) -> list[dict]:
    return [d for d in of_kind(docs, "Deployment")
            if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == "bot"]


# ---------------------------------------------------------------- 1. parse + schema

def test_every_document_parses_with_apiversion_kind_and_name():
    files = yaml_files()
    assert len(files) >= 10, files
    for path in files:
        docs = documents(path)
        assert docs, f"{path}: empty"
        for doc in docs:
            assert isinstance(doc, dict), path
            kind = doc.get("kind")
            assert kind in EXPECTED_API, f"{path}: unexpected kind {kind!r}"
            assert doc.get("apiVersion") == EXPECTED_API[kind], f"{path}: {kind} apiVersion {doc.get('apiVersion')}"
            if kind != "Kustomization":
                assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"]), path


def _validator():
    try:
        import kubernetes_validate
    except ImportError:
        reason = "kubernetes-validate not installed: pip install kubernetes-validate (schemas ship in the wheel)"
        if in_ci():
            pytest.fail(f"{reason}; CI=true, so the schema check must run", pytrace=False)
        pytest.skip(reason)
    return kubernetes_validate


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
def test_every_resource_passes_the_kubernetes_openapi_schema_strictly(version):
    kv = _validator()
    checked = 0
    for path in yaml_files():
        for doc in documents(path):
            if doc["kind"] == "Kustomization":  # not an API object
                continue
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as exc:
                pytest.fail(f"{path.relative_to(REPO_ROOT)} {doc['kind']}/{doc['metadata']['name']} "
                            f"(Kubernetes {version}): {exc.message} at {list(exc.path)}")
            checked += 1
    assert checked >= 11


def test_the_schema_check_catches_a_misspelt_field():
    kv = _validator()
    broken = documents(K8S / "cpu" / "deployment.yaml")[0]
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"httpGet": {"path": "/readyz"}}
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, SCHEMA_VERSIONS[-1], strict=True)


# ---------------------------------------------------------------- 2. what a schema cannot see

def test_kustomizations_name_existing_files_and_every_manifest_is_applied():
    applied = {p for v in VARIANTS for p in kustomization_resources(K8S / v)}
    for path in applied:
        assert path.exists(), path
    manifests = {p.resolve() for p in yaml_files() if p.name != "kustomization.yaml"}
    assert manifests - applied == {(K8S / "common" / "secret.example.yaml").resolve()}


@pytest.mark.parametrize("name", VARIANTS)
def test_selectors_match_pod_labels(name):
    docs = variant(name)
    deployments = of_kind(docs, "Deployment")
    assert {d["metadata"]["name"] for d in deployments} >= {"healthbot-redis"}
    for dep in deployments:
        assert matches(dep["spec"]["selector"]["matchLabels"], dep["spec"]["template"]["metadata"]["labels"]), \
            dep["metadata"]["name"]
    pods = [d["spec"]["template"] for d in deployments]
    for svc in of_kind(docs, "Service"):
        selected = [p for p in pods if matches(svc["spec"]["selector"], p["metadata"]["labels"])]
        assert selected, f"Service {svc['metadata']['name']} selects no pod"
        for port in svc["spec"]["ports"]:
            named = {p.get("name") for pod in selected for c in pod["spec"]["containers"] for p in c.get("ports", [])}
            assert port["targetPort"] in named, (svc["metadata"]["name"], port)
    for pdb in of_kind(docs, "PodDisruptionBudget"):
        assert any(matches(pdb["spec"]["selector"]["matchLabels"], p["metadata"]["labels"]) for p in pods)
    for pol in of_kind(docs, "NetworkPolicy"):
        assert any(matches(pol["spec"]["podSelector"]["matchLabels"], p["metadata"]["labels"]) for p in pods)
        for rule in pol["spec"]["ingress"]:
            for peer in rule["from"]:
                assert any(matches(peer["podSelector"]["matchLabels"], p["metadata"]["labels"]) for p in pods)
    bots = healthbot_deployments(docs)
    assert len(bots) == 1, "one healthbot Deployment per variant"


def test_the_two_variants_do_not_claim_each_others_pods():
    cpu, gpu = (healthbot_deployments(variant(v))[0] for v in VARIANTS)
    assert not matches(cpu["spec"]["selector"]["matchLabels"], gpu["spec"]["template"]["metadata"]["labels"])
    assert not matches(gpu["spec"]["selector"]["matchLabels"], cpu["spec"]["template"]["metadata"]["labels"])


@pytest.mark.parametrize("name", VARIANTS)
def test_hpa_scales_the_healthbot_deployment_which_requests_cpu(name):
    docs = variant(name)
    (hpa,) = of_kind(docs, "HorizontalPodAutoscaler")
    (bot,) = healthbot_deployments(docs)
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == ("apps/v1", "Deployment", bot["metadata"]["name"])
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    assert any(m["type"] == "Resource" and m["resource"]["name"] == "cpu" for m in hpa["spec"]["metrics"])
    for c in containers(bot, init=False):
        assert c["resources"]["requests"]["cpu"], "utilization needs a CPU request"


@pytest.mark.parametrize("name", VARIANTS)
def test_probes_point_at_healthz_and_readyz_on_the_http_port(name):
    (bot,) = healthbot_deployments(variant(name))
    (c,) = [c for c in containers(bot, init=False) if c["name"] == "healthbot"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8080}
    assert "--port" in c["command"] and c["command"][c["command"].index("--port") + 1] == "8080"
    assert c["command"][c["command"].index("--host") + 1] == "0.0.0.0"
    expected = {"livenessProbe": "/healthz", "startupProbe": "/healthz", "readinessProbe": "/readyz"}
    for probe, path in expected.items():
        get = c[probe]["httpGet"]
        assert (get["path"], get["port"]) == (path, "http"), probe
    # /readyz waits up to 0.5 s for the store's ping (bot/app.py STORE_PING_TIMEOUT_S).
    assert c["readinessProbe"]["timeoutSeconds"] >= 1


@pytest.mark.parametrize("name", VARIANTS)
def test_shutdown_fits_the_grace_period(name):
    docs = variant(name)
    (bot,) = healthbot_deployments(docs)
    (cm,) = of_kind(docs, "ConfigMap")
    shutdown_s = float(cm["data"]["HEALTHBOT_SERVER_SHUTDOWN_TIMEOUT_S"])
    (c,) = [c for c in containers(bot, init=False) if c["name"] == "healthbot"]
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    grace = bot["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert float(pre_stop[1]) + shutdown_s < grace


def _env_of(c: dict) -> list[dict]:
    return c.get("env", [])


@pytest.mark.parametrize("name", VARIANTS)
def test_secrets_come_from_the_secret_never_inline(name):
    docs = variant(name)
    assert not of_kind(docs, "Secret"), "the Secret is created by hand, never applied with placeholders"
    for dep in of_kind(docs, "Deployment"):
        for c in containers(dep):
            for env in _env_of(c):
                if _SECRETISH.search(env["name"]):
                    assert "value" not in env, f"{c['name']}: {env['name']} is inline"
                    assert "secretKeyRef" in env["valueFrom"], env
    (bot,) = healthbot_deployments(docs)
    (server,) = [c for c in containers(bot, init=False) if c["name"] == "healthbot"]
    refs = [e for e in server["envFrom"] if "secretRef" in e]
    assert [r["secretRef"]["name"] for r in refs] == ["healthbot-secrets"]
    assert not refs[0]["secretRef"].get("optional", False)
    for cm in of_kind(docs, "ConfigMap"):
        for key, value in cm["data"].items():
            assert key not in SECRET_ENV_NAMES and not _SECRETISH.search(key), f"secret {key} in a ConfigMap"


def test_the_secret_example_holds_placeholders_only():
    (secret,) = documents(K8S / "common" / "secret.example.yaml")
    assert secret["kind"] == "Secret" and "data" not in secret
    assert secret["metadata"]["name"] == "healthbot-secrets"
    assert set(secret["stringData"]) >= {"HEALTHBOT_WECHAT_TOKEN", "HEALTHBOT_CONSOLE_TOKEN"}
    assert set(secret["stringData"]) <= SECRET_ENV_NAMES | {"HEALTHBOT_WECHAT_APPID"}
    assert set(secret["stringData"].values()) == {PLACEHOLDER}


@pytest.mark.parametrize("name", VARIANTS)
def test_the_configmap_and_container_env_load_as_a_valid_config(name, tmp_path):
    docs = variant(name)
    (cm,) = of_kind(docs, "ConfigMap")
    (bot,) = healthbot_deployments(docs)
    (server,) = [c for c in containers(bot, init=False) if c["name"] == "healthbot"]
    env = {**cm["data"], **{e["name"]: e["value"] for e in _env_of(server) if "value" in e}}
    cfg = load_config(env=env)  # raises ConfigError on an unknown key or a bad value
    assert cfg.store_url.startswith("redis://healthbot-redis:6379/")
    svc = [s for s in of_kind(docs, "Service") if s["metadata"]["name"] == "healthbot-redis"]
    assert svc and svc[0]["spec"]["ports"][0]["port"] == 6379
    assert set(cfg.inference.engine_order) <= {"tensorrt", "torch_cuda", "onnxruntime"}


def test_gpu_variant_asks_for_a_gpu_and_builds_its_engine_in_an_init_container():
    (bot,) = healthbot_deployments(variant("gpu"))
    spec = bot["spec"]["template"]["spec"]
    assert spec["nodeSelector"], "GPU pods go to GPU nodes"
    assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    (init,) = spec["initContainers"]
    (server,) = spec["containers"]
    for c in (init, server):
        assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == 1
    assert "healthbot build-engine" in " ".join(init["command"])
    assert init["image"] == server["image"]
    engines = {e["name"]: e["value"] for e in _env_of(server)}["HEALTHBOT_INFERENCE_ENGINES_DIR"]
    assert {e["name"]: e["value"] for e in _env_of(init)}["HEALTHBOT_INFERENCE_ENGINES_DIR"] == engines
    assert f"--engines-dir {engines}" in " ".join(init["command"])
    mounted = lambda c: {m["name"]: m["mountPath"] for m in c["volumeMounts"]}  # noqa: E731
    shared = set(mounted(init)) & set(mounted(server))
    assert any(mounted(init)[v] == mounted(server)[v] == engines for v in shared)
    assert {e["name"]: e["value"] for e in _env_of(server)}["HEALTHBOT_INFERENCE_ENGINE_ORDER"].startswith("tensorrt")


def test_gpu_dockerfile_builds_on_nvidia_tensorrt_and_runs_as_the_deployments_user():
    text = (REPO_ROOT / "deploy" / "Dockerfile.gpu").read_text(encoding="utf-8")
    tag = re.search(r"^ARG TRT_TAG=(\S+)$", text, re.M)
    assert tag and re.fullmatch(r"\d{2}\.\d{2}", tag[1])
    assert re.search(r"^FROM nvcr\.io/nvidia/tensorrt:\$\{TRT_TAG\}-py3$", text, re.M)
    assert "healthbot prepare-model" in text and "healthbot build-engine" in text
    uid = re.search(r"useradd [^\n]*--uid (\d+) healthbot", text)
    (bot,) = healthbot_deployments(variant("gpu"))
    assert uid and int(uid[1]) == bot["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    for name in ("bot", "adapters", "inference", "safety"):
        assert f"COPY {name} {name}" in text


# ---------------------------------------------------------------- 3. kustomize, where kubectl exists

@pytest.mark.parametrize("name", VARIANTS)
def test_kubectl_kustomize_renders_the_variant(name):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not on PATH (optional: the schema check above covers CI)")
    done = subprocess.run([kubectl, "kustomize", str(K8S / name)], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "KUBECONFIG": "/dev/null", "HOME": "/tmp"})
    assert done.returncode == 0, done.stderr
    rendered = [d for d in yaml.safe_load_all(done.stdout) if d]
    kinds = sorted(d["kind"] for d in rendered)
    assert kinds == sorted(d["kind"] for d in variant(name))
    images = {c["image"] for d in of_kind(rendered, "Deployment") for c in containers(d)}
    assert f"registry.example.com/healthbot{'-gpu' if name == 'gpu' else ''}:0.1.0" in images
