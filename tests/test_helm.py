"""Specification of the Helm chart in helm/stackpin.

The chart is linted and rendered with `helm` (installed by .ci/tools.sh), with its default values and with the
multi-stack GPU fleet of ci/values-gpu-fleet.yaml; every rendered manifest is validated offline against the
Kubernetes API schemas (kubernetes-validate, strict: unknown fields are errors). CRD kinds have no schema there:
they are validated against typed models of their CRDs instead, and their shape is checked here. The rendered
proxy configuration is loaded by the proxy's own loader.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from pydantic import BaseModel, ValidationError

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm" / "stackpin"
FLEET_VALUES = CHART / "ci" / "values-gpu-fleet.yaml"
DASHBOARDS = REPO / "dashboards"
RELEASE = "stackpin"
NAMESPACE = "stackpin"
# The helm and kubectl that .ci/tools.sh installs are those of Kubernetes 1.31; the chart's kubeVersion allows 1.25.
KUBERNETES_VERSION = "1.31.0"
OLDEST_KUBERNETES_VERSION = "1.25.0"
# Custom resources the chart renders; kubernetes-validate has no schema for them (see crd_model).
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule")}
CONFIG_PATH = "/etc/stackpin/stackpin.toml"

Manifest = dict[str, Any]


def _helm_binary() -> str:
    local = REPO / ".tools" / "bin" / "helm"
    found = str(local) if local.exists() else shutil.which("helm")
    if found is None:
        pytest.fail("helm is not installed: run .ci/tools.sh")
    return found


def helm(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_helm_binary(), *map(str, args)],
        capture_output=True,
        text=True,
        check=False,
        stdin=subprocess.DEVNULL,
    )


def render(*values_files: Path, chart: Path = CHART) -> list[Manifest]:
    flags: list[str | Path] = []
    for path in values_files:
        flags += ["-f", path]
    result = helm(
        "template", RELEASE, chart, "--namespace", NAMESPACE, "--kube-version", KUBERNETES_VERSION, *flags
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def values_of(*values_files: Path) -> dict[str, Any]:
    """The chart's defaults overlaid with the given files, as helm merges them (maps merge, lists replace)."""

    def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
        merged = dict(base)
        for key, value in over.items():
            both_maps = isinstance(value, dict) and isinstance(merged.get(key), dict)
            merged[key] = merge(merged[key], value) if both_maps else value
        return merged

    values: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    for path in values_files:
        values = merge(values, yaml.safe_load(path.read_text()))
    return values


VARIANTS = {"default": (), "gpu-fleet": (FLEET_VALUES,)}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Manifest]]:
    return {name: render(*files) for name, files in VARIANTS.items()}


@pytest.fixture(params=sorted(VARIANTS))
def variant(
    request: pytest.FixtureRequest, rendered: dict[str, list[Manifest]]
) -> tuple[list[Manifest], dict]:
    return rendered[request.param], values_of(*VARIANTS[request.param])


def find(manifests: list[Manifest], kind: str, name: str | None = None) -> list[Manifest]:
    return [m for m in manifests if m["kind"] == kind and (name is None or m["metadata"]["name"] == name)]


def one(manifests: list[Manifest], kind: str, name: str) -> Manifest:
    found = find(manifests, kind, name)
    assert len(found) == 1, f"expected one {kind} {name!r}, found {len(found)}"
    return found[0]


def pod_specs(manifests: list[Manifest]) -> list[tuple[str, dict[str, Any]]]:
    """Every pod the chart can start: those of its workloads, and bare Pods (the `helm test` probe)."""
    specs = [
        (f"{m['kind']}/{m['metadata']['name']}", m["spec"]["template"]["spec"])
        for m in manifests
        if m["kind"] in {"Deployment", "Job", "StatefulSet", "DaemonSet"}
    ]
    return specs + [(f"Pod/{m['metadata']['name']}", m["spec"]) for m in manifests if m["kind"] == "Pod"]


def container(manifest: Manifest, name: str) -> dict[str, Any]:
    (found,) = [c for c in manifest["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return found


def backend_name(stack: dict[str, Any]) -> str:
    return f"{RELEASE}-backend-{stack['name']}"


def flags(args: list[str]) -> dict[str, str]:
    """`serve --model x --dtype bf16` -> {"--model": "x", "--dtype": "bf16"}."""
    return dict(zip(args[1::2], args[2::2], strict=True))


def proxy_config(manifests: list[Manifest]) -> dict[str, Any]:
    return tomllib.loads(one(manifests, "ConfigMap", RELEASE)["data"]["stackpin.toml"])


# --- helm lint and the Kubernetes schemas ----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_lint_passes(name: str) -> None:
    flags_: list[str | Path] = [arg for path in VARIANTS[name] for arg in ("-f", path)]
    result = helm("lint", "--strict", CHART, *flags_)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES_VERSION, KUBERNETES_VERSION])
def test_every_manifest_validates_against_the_kubernetes_schemas(
    variant: tuple[list[Manifest], dict], version: str
) -> None:
    manifests, _ = variant
    errors = []
    for manifest in manifests:
        if (manifest["apiVersion"], manifest["kind"]) in CRD_KINDS:
            continue  # test_custom_resources_validate_against_their_crd_models
        try:
            kubernetes_validate.validate(manifest, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(part) for part in e.path)
            errors.append(f"{manifest['kind']}/{manifest['metadata']['name']}: {path}: {e.message}")
    assert not errors, "\n".join(errors)


def crd_model(manifest: Manifest) -> type[BaseModel]:
    # Imported here: the operator's models take seconds to import, and only these tests need them.
    from cloudcoil.models.prometheus_operator.v1 import PrometheusRule, ServiceMonitor

    models: dict[tuple[str, str], type[BaseModel]] = {
        ("monitoring.coreos.com/v1", "ServiceMonitor"): ServiceMonitor,
        ("monitoring.coreos.com/v1", "PrometheusRule"): PrometheusRule,
    }
    return models[(manifest["apiVersion"], manifest["kind"])]


def validate_custom_resource(manifest: Manifest) -> None:
    """Types and required fields from the CRD's model; a field the model does not know is an error too."""
    model = crd_model(manifest)
    parsed = model.model_validate(manifest).model_dump(by_alias=True, exclude_unset=True, mode="json")
    assert parsed == manifest, f"{manifest['kind']} has fields its CRD does not define"


def test_custom_resources_validate_against_their_crd_models(rendered: dict[str, list[Manifest]]) -> None:
    custom = [m for m in rendered["gpu-fleet"] if (m["apiVersion"], m["kind"]) in CRD_KINDS]
    assert {m["kind"] for m in custom} == {"ServiceMonitor", "PrometheusRule"}, (
        "the GPU fleet values switch both on"
    )
    for manifest in custom:
        validate_custom_resource(manifest)


@pytest.mark.parametrize(
    ("corrupt", "error"),
    [
        (lambda d: d["spec"]["endpoints"][0].update(interval=30), ValidationError),
        (lambda d: d["spec"].pop("selector"), ValidationError),
        (lambda d: d["spec"].update(endpointz=[]), AssertionError),
    ],
    ids=["wrong-type", "missing-required", "unknown-field"],
)
def test_crd_validation_rejects_a_broken_custom_resource(
    rendered: dict[str, list[Manifest]], corrupt: Any, error: type[Exception]
) -> None:
    (monitor,) = find(rendered["gpu-fleet"], "ServiceMonitor")
    monitor = json.loads(json.dumps(monitor))
    corrupt(monitor)
    with pytest.raises(error):
        validate_custom_resource(monitor)


def test_the_oldest_version_validated_is_the_charts_lower_bound() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == f">={OLDEST_KUBERNETES_VERSION}-0"


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda d: d["spec"].update(replicas="two"),
        lambda d: d["spec"]["template"]["spec"].update(containerz=[]),
        lambda d: d["spec"]["template"]["spec"]["containers"][0].pop("name"),
    ],
    ids=["wrong-type", "unknown-field", "missing-required"],
)
def test_schema_validation_rejects_a_broken_manifest(
    rendered: dict[str, list[Manifest]], corrupt: Any
) -> None:
    deployment = json.loads(json.dumps(one(rendered["default"], "Deployment", RELEASE)))
    kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    corrupt(deployment)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


# --- the proxy -------------------------------------------------------------------------------------------------


def test_the_proxy_is_a_scaled_deployment_behind_a_service(variant: tuple[list[Manifest], dict]) -> None:
    manifests, _ = variant
    deployment = one(manifests, "Deployment", RELEASE)
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    proxy = container(deployment, "proxy")
    assert [proxy["command"][0], *proxy["args"]] == ["stackpin", "serve", "--config", CONFIG_PATH]
    assert {"name": "http", "containerPort": 8080, "protocol": "TCP"} in proxy["ports"]

    service = one(manifests, "Service", RELEASE)
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"

    hpa = one(manifests, "HorizontalPodAutoscaler", RELEASE)
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": RELEASE}
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"

    pdb = one(manifests, "PodDisruptionBudget", RELEASE)
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pdb["spec"]["maxUnavailable"] >= 1


def test_proxy_probes_use_healthz_and_readyz(variant: tuple[list[Manifest], dict]) -> None:
    manifests, _ = variant
    proxy = container(one(manifests, "Deployment", RELEASE), "proxy")
    assert proxy["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert proxy["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}


def test_proxy_config_lists_every_stack_and_upstream(variant: tuple[list[Manifest], dict]) -> None:
    manifests, values = variant
    config = proxy_config(manifests)
    replicas = {r["name"]: r for r in config["replicas"]}
    assert list(replicas) == [s["name"] for s in values["stacks"]] + [u["name"] for u in values["upstreams"]]
    for stack in values["stacks"]:
        service = one(manifests, "Service", backend_name(stack))
        assert replicas[stack["name"]] == {
            "name": stack["name"],
            "url": f"http://{backend_name(stack)}:{service['spec']['ports'][0]['port']}",
        }
    for upstream in values["upstreams"]:
        assert replicas[upstream["name"]]["url"] == upstream["url"]
        assert replicas[upstream["name"]]["stack"] == upstream["stack"]
    assert config["server"] == {"host": "0.0.0.0", "port": 8080}
    assert config["local_backend"] == {"enabled": "off"}
    assert [t["name"] for t in config["tenants"]] == [t["name"] for t in values["tenants"]]


def test_keys_and_urls_come_from_existing_secrets(variant: tuple[list[Manifest], dict]) -> None:
    manifests, values = variant
    config = proxy_config(manifests)
    env = {e["name"]: e for e in container(one(manifests, "Deployment", RELEASE), "proxy").get("env", [])}
    named = [r["api_key_env"] for r in config["replicas"] if "api_key_env" in r]
    named += [t["api_key_env"] for t in config["tenants"] if "api_key_env" in t]
    assert named, "the variants name at least one key"
    for variable in named:
        assert "secretKeyRef" in env[variable]["valueFrom"], variable
    for section, variable, setting in (
        ("store", "STACKPIN_STORE__URL", "url"),
        ("fleet", "STACKPIN_FLEET__REDIS_URL", "redis_url"),
    ):
        secret = values[section]["existingSecret"]
        if secret:
            assert setting not in config.get(section, {}), (
                f"{section}.{setting} is in the Secret, not the file"
            )
            assert env[variable]["valueFrom"]["secretKeyRef"] == {
                "name": secret,
                "key": values[section]["existingSecretKey"],
            }
        else:
            assert variable not in env
            assert config[section][setting]
    assert not find(manifests, "Secret"), "the chart references Secrets; it never writes keys itself"


def test_the_rendered_config_is_accepted_by_the_proxy(
    variant: tuple[list[Manifest], dict], tmp_path: Path
) -> None:
    from proxy.config import load_settings  # here, so that only this test depends on the proxy's code

    manifests, values = variant
    path = tmp_path / "stackpin.toml"
    path.write_text(one(manifests, "ConfigMap", RELEASE)["data"]["stackpin.toml"])
    env = container(one(manifests, "Deployment", RELEASE), "proxy").get("env", [])
    environ = {e["name"]: f"secret-{i}" for i, e in enumerate(env) if "valueFrom" in e}
    settings, secrets = load_settings(path, environ)
    assert [r.name for r in settings.replicas] == [r["name"] for r in proxy_config(manifests)["replicas"]]
    assert set(secrets.tenant_key_hashes.values()) == {t["name"] for t in values["tenants"]}
    limits = {t.name: (t.requests_per_minute, t.tokens_per_minute) for t in settings.tenants}
    assert limits == {
        t["name"]: (t.get("requestsPerMinute"), t.get("tokensPerMinute")) for t in values["tenants"]
    }


def test_a_config_change_rolls_the_proxies(tmp_path: Path) -> None:
    def checksum(*files: Path) -> str:
        deployment = one(render(*files), "Deployment", RELEASE)
        return deployment["spec"]["template"]["metadata"]["annotations"]["checksum/config"]

    changed = tmp_path / "prompt.yaml"
    changed.write_text(yaml.safe_dump({"prompts": {"support@1": "Be brief."}}))
    assert checksum() == checksum()
    assert checksum(changed) != checksum()


# --- the migration hook ----------------------------------------------------------------------------------------


def test_migration_is_a_pre_install_pre_upgrade_hook_job(variant: tuple[list[Manifest], dict]) -> None:
    manifests, _ = variant
    (job,) = find(manifests, "Job")
    annotations = job["metadata"]["annotations"]
    assert set(annotations["helm.sh/hook"].split(",")) == {"pre-install", "pre-upgrade"}
    migrate = container(job, "migrate")
    assert [migrate["command"][0], *migrate["args"]] == ["stackpin", "db", "upgrade", "--config", CONFIG_PATH]
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"

    # Hooks run before the release's own resources exist: the Job's configuration is a hook created before it.
    (config_volume,) = [v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == "config"]
    hook_config = one(manifests, "ConfigMap", config_volume["configMap"]["name"])
    assert hook_config["metadata"]["annotations"]["helm.sh/hook"] == annotations["helm.sh/hook"]
    assert int(hook_config["metadata"]["annotations"]["helm.sh/hook-weight"]) < int(
        annotations["helm.sh/hook-weight"]
    )
    assert hook_config["data"] == one(manifests, "ConfigMap", RELEASE)["data"]
    proxy = container(one(manifests, "Deployment", RELEASE), "proxy")
    assert migrate.get("env") == proxy.get("env"), "the migration reads the configuration as the proxy does"


# --- backends --------------------------------------------------------------------------------------------------


def test_every_stack_gets_a_deployment_with_its_gpus_and_node_selector(
    variant: tuple[list[Manifest], dict],
) -> None:
    manifests, values = variant
    backends = [
        m
        for m in find(manifests, "Deployment")
        if m["metadata"]["labels"]["app.kubernetes.io/component"] == "backend"
    ]
    assert sorted(m["metadata"]["name"] for m in backends) == sorted(
        backend_name(s) for s in values["stacks"]
    )
    for stack in values["stacks"]:
        deployment = one(manifests, "Deployment", backend_name(stack))
        pod = deployment["spec"]["template"]["spec"]
        backend = container(deployment, "backend")
        args = flags(backend["args"])
        assert backend["command"] == ["stackpin-backend"] and backend["args"][0] == "serve"
        assert args["--model"] == f"/models/{stack['model']}"
        assert args["--dtype"] == stack["dtype"]
        assert args["--kernel-mode"] == stack["kernelMode"]
        assert args["--device"] == ("cuda" if stack["gpus"] else "cpu")
        assert args["--port"] == str(values["backend"]["port"])
        limits = backend["resources"].get("limits", {})
        if stack["gpus"]:
            assert limits["nvidia.com/gpu"] == stack["gpus"], stack["name"]
        else:
            assert "nvidia.com/gpu" not in limits
        hardware = values["hardware"][stack["hardware"]]
        assert hardware["nodeSelector"].items() <= pod["nodeSelector"].items(), stack["name"]
        for toleration in hardware["tolerations"]:
            assert toleration in pod["tolerations"]
        assert deployment["spec"]["replicas"] == stack.get("replicas", 1)


def test_a_backend_deployment_never_runs_two_stacks_at_once(variant: tuple[list[Manifest], dict]) -> None:
    manifests, values = variant
    for stack in values["stacks"]:
        deployment = one(manifests, "Deployment", backend_name(stack))
        assert deployment["spec"]["strategy"] == {"type": "Recreate"}, "a rolling update would mix two stacks"
        service = one(manifests, "Service", backend_name(stack))
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= pod_labels.items()
        assert service["spec"]["selector"]["stackpin/stack"] == stack["name"]


def test_backend_probes_and_weights(variant: tuple[list[Manifest], dict]) -> None:
    manifests, values = variant
    for stack in values["stacks"]:
        deployment = one(manifests, "Deployment", backend_name(stack))
        backend = container(deployment, "backend")
        assert backend["startupProbe"]["httpGet"]["path"] == "/healthz"
        assert backend["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert backend["readinessProbe"]["httpGet"]["path"] == "/v1/stack"
        (models,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "models"]
        (mount,) = [m for m in backend["volumeMounts"] if m["name"] == "models"]
        if stack.get("makeTiny"):
            assert "emptyDir" in models
            (init,) = deployment["spec"]["template"]["spec"]["initContainers"]
            assert init["args"] == ["make-tiny", f"/models/{stack['model']}"]
        else:
            assert models["persistentVolumeClaim"] == {
                "claimName": values["backend"]["weights"]["existingClaim"],
                "readOnly": True,
            }
            assert mount["readOnly"] is True


def test_fleet_values_run_two_models_on_two_generations_in_both_kernel_modes() -> None:
    stacks = values_of(FLEET_VALUES)["stacks"]
    assert len({s["model"] for s in stacks}) >= 2
    assert {"nvidia-h200", "nvidia-a100-sxm4-80gb"} <= {s["hardware"] for s in stacks}
    side_by_side = {(s["model"], s["hardware"], s["kernelMode"]) for s in stacks}
    assert any(
        (model, hardware, "default") in side_by_side
        for model, hardware, mode in side_by_side
        if mode == "batch_invariant"
    ), "one model on one generation in both kernel modes"
    assert all(s["gpus"] >= 1 for s in stacks)


# --- security --------------------------------------------------------------------------------------------------


def test_every_pod_runs_unprivileged_on_a_read_only_root(variant: tuple[list[Manifest], dict]) -> None:
    manifests, _ = variant
    specs = pod_specs(manifests)
    assert len(specs) >= 3
    for where, pod in specs:
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        assert pod["automountServiceAccountToken"] is False, where
        tmp_volumes = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        for c in pod["containers"] + pod.get("initContainers", []):
            context = c["securityContext"]
            assert context["readOnlyRootFilesystem"] is True, f"{where}/{c['name']}"
            assert context["allowPrivilegeEscalation"] is False, f"{where}/{c['name']}"
            assert context["capabilities"]["drop"] == ["ALL"], f"{where}/{c['name']}"
            assert not context.get("privileged", False), f"{where}/{c['name']}"
            (tmp,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert tmp["name"] in tmp_volumes, f"{where}/{c['name']}: /tmp must be an emptyDir"


# --- monitoring ------------------------------------------------------------------------------------------------


def test_service_monitor_is_off_by_default(rendered: dict[str, list[Manifest]]) -> None:
    assert not find(rendered["default"], "ServiceMonitor")


def test_service_monitor_scrapes_the_proxy_and_every_backend(rendered: dict[str, list[Manifest]]) -> None:
    manifests = rendered["gpu-fleet"]
    (monitor,) = find(manifests, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert (
        monitor["metadata"]["labels"]["release"]
        == values_of(FLEET_VALUES)["monitoring"]["serviceMonitor"]["labels"]["release"]
    )
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"

    def selected(service: Manifest) -> bool:
        labels = service["metadata"]["labels"]
        selector = monitor["spec"]["selector"]
        if not selector["matchLabels"].items() <= labels.items():
            return False
        return all(
            labels.get(e["key"]) in e["values"]
            for e in selector.get("matchExpressions", [])
            if e["operator"] == "In"
        )

    services = find(manifests, "Service")
    assert all(selected(s) for s in services), "every Service of the release exports /metrics"
    for service in services:
        assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}


def test_dashboards_ship_as_configmaps_for_grafana(variant: tuple[list[Manifest], dict]) -> None:
    manifests, _ = variant
    shipped = {}
    for config_map in find(manifests, "ConfigMap"):
        if config_map["metadata"]["labels"].get("grafana_dashboard") == "1":
            ((name, content),) = config_map["data"].items()
            shipped[name] = json.loads(content)
    expected = {path.name: json.loads(path.read_text()) for path in DASHBOARDS.glob("*.json")}
    assert shipped == expected


def test_the_packaged_chart_carries_its_dashboards(tmp_path: Path) -> None:
    result = helm("package", CHART, "--destination", tmp_path)
    assert result.returncode == 0, result.stderr
    (archive,) = tmp_path.glob("stackpin-*.tgz")
    manifests = render(chart=archive)
    dashboards = [m for m in find(manifests, "ConfigMap") if "grafana_dashboard" in m["metadata"]["labels"]]
    assert len(dashboards) == len(list(DASHBOARDS.glob("*.json")))


# --- values the chart refuses ----------------------------------------------------------------------------------

TINY = {
    "name": "tiny",
    "model": "m",
    "dtype": "fp32",
    "kernelMode": "batch_invariant",
    "hardware": "cpu-x86_64-avx512",
    "gpus": 0,
}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"fleet": {"enabled": False}}, "shared fleet state"),
        ({"store": {"url": "sqlite+aiosqlite:///stackpin.db"}}, "SQLite"),
        ({"tenants": []}, "tenants is empty"),
        ({"tenants": [{"name": "keyless"}]}, "keyless"),
        ({"stacks": [{**TINY, "hardware": "tpu-v5"}]}, 'hardware "tpu-v5" is not a key'),
        ({"stacks": [{**TINY, "name": "Tiny_CPU"}]}, "DNS label"),
        ({"stacks": [{**TINY, "kernelMode": "fast"}]}, "kernelMode"),
        ({"stacks": [{**TINY, "dtype": "int3"}]}, "dtype"),
        ({"stacks": [TINY, TINY]}, "appears twice"),
        ({"stacks": [{**TINY, "maxBatchSize": 512}]}, "maxStepTokens must be at least maxBatchSize"),
        ({"stacks": [{**TINY, "name": "x" * 60}]}, "longer than 63"),
        (
            {"upstreams": [{"name": "tiny-cpu", "url": "https://api.example", "stack": {"model": "m"}}]},
            "name of a stack",
        ),
        ({"stacks": [{**TINY, "kernel_mode": "default"}]}, "Additional property kernel_mode is not allowed"),
        ({"stack": [TINY]}, "Additional property stack is not allowed"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_values_that_would_break_the_fleet_are_refused(
    values: dict[str, Any], message: str, tmp_path: Path
) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    result = helm("template", RELEASE, CHART, "-f", path)
    assert result.returncode != 0, f"rendered although {values}"
    assert message in result.stderr


def test_every_container_runs_the_one_image_by_digest_when_given(
    variant: tuple[list[Manifest], dict],
) -> None:
    manifests, values = variant
    image = values["image"]
    expected = (
        f"{image['repository']}@{image['digest']}"
        if image["digest"]
        else f"{image['repository']}:{image['tag'] or yaml.safe_load((CHART / 'Chart.yaml').read_text())['appVersion']}"
    )
    for where, pod in pod_specs(manifests):
        for c in pod["containers"] + pod.get("initContainers", []):
            assert c["image"] == expected, f"{where}/{c['name']}"


def test_one_proxy_may_run_without_redis(tmp_path: Path) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(
        yaml.safe_dump(
            {"fleet": {"enabled": False}, "proxy": {"replicaCount": 1, "autoscaling": {"enabled": False}}}
        )
    )
    manifests = render(path)
    assert "fleet" not in proxy_config(manifests)
    assert one(manifests, "Deployment", RELEASE)["spec"]["replicas"] == 1
    assert not find(manifests, "HorizontalPodAutoscaler")


def test_weights_may_come_from_a_host_path(tmp_path: Path) -> None:
    path = tmp_path / "values.yaml"
    stack = {**TINY, "name": "on-host"}
    path.write_text(yaml.safe_dump({"backend": {"weights": {"hostPath": "/srv/models"}}, "stacks": [stack]}))
    deployment = one(render(path), "Deployment", backend_name(stack))
    (models,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "models"]
    assert models == {"name": "models", "hostPath": {"path": "/srv/models", "type": "Directory"}}
    (mount,) = [m for m in container(deployment, "backend")["volumeMounts"] if m["name"] == "models"]
    assert mount == {"name": "models", "mountPath": "/models", "readOnly": True}


def test_a_stack_can_be_scaled_to_zero_and_stays_listed(tmp_path: Path) -> None:
    path = tmp_path / "values.yaml"
    stack = {**TINY, "name": "parked", "replicas": 0}
    path.write_text(yaml.safe_dump({"stacks": [stack]}))
    manifests = render(path)
    assert one(manifests, "Deployment", backend_name(stack))["spec"]["replicas"] == 0
    assert [r["name"] for r in proxy_config(manifests)["replicas"]] == ["parked"]


def test_only_the_proxies_and_listed_peers_reach_the_backends(variant: tuple[list[Manifest], dict]) -> None:
    manifests, values = variant
    (policy,) = find(manifests, "NetworkPolicy")
    selector = policy["spec"]["podSelector"]["matchLabels"]
    backends = [one(manifests, "Deployment", backend_name(s)) for s in values["stacks"]]
    assert all(selector.items() <= d["spec"]["template"]["metadata"]["labels"].items() for d in backends)
    proxy_labels = one(manifests, "Deployment", RELEASE)["spec"]["template"]["metadata"]["labels"]
    assert not selector.items() <= proxy_labels.items()

    (rule,) = policy["spec"]["ingress"]
    proxies, backends_themselves, *extra = rule["from"]
    assert proxies["podSelector"]["matchLabels"].items() <= proxy_labels.items()
    assert backends_themselves["podSelector"]["matchLabels"] == selector  # the heartbeat polls its own pod
    assert extra == values["networkPolicy"]["backendIngressFrom"]
    assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]


def test_backend_arguments_are_accepted_by_the_backend_cli(
    variant: tuple[list[Manifest], dict], capsys: pytest.CaptureFixture[str]
) -> None:
    # Imported here: it loads torch. Every flag is parsed and validated before the model folder is looked at, so
    # the one complaint left on this machine, which has no /models, is that folder.
    from pinned_backend.cli import main

    manifests, values = variant
    for stack in values["stacks"]:
        args = container(one(manifests, "Deployment", backend_name(stack)), "backend")["args"]
        with pytest.raises(SystemExit) as exit_:
            main(args)
        error = capsys.readouterr().err
        assert exit_.value.code == 2 and f"--model: /models/{stack['model']} is not a directory" in error, (
            error
        )


def test_proxy_and_migration_arguments_are_accepted_by_the_proxy_cli(
    variant: tuple[list[Manifest], dict], capsys: pytest.CaptureFixture[str]
) -> None:
    # The command lines parse; what is left on this machine is the configuration file the pod would mount.
    from proxy.cli import main

    manifests, _ = variant
    (job,) = find(manifests, "Job")
    for process in (container(one(manifests, "Deployment", RELEASE), "proxy"), container(job, "migrate")):
        assert process["command"] == ["stackpin"]
        assert main(process["args"]) == 2
        error = capsys.readouterr().err
        assert f"configuration file {CONFIG_PATH} does not exist" in error, error


def test_in_fleet_mode_every_backend_pod_registers_itself_through_a_heartbeat_sidecar(
    variant: tuple[list[Manifest], dict],
) -> None:
    manifests, values = variant
    config = proxy_config(manifests)
    proxy_env = {
        e["name"]: e for e in container(one(manifests, "Deployment", RELEASE), "proxy").get("env", [])
    }
    for stack in values["stacks"]:
        heartbeat = container(one(manifests, "Deployment", backend_name(stack)), "heartbeat")
        assert heartbeat["command"] == ["stackpin"] and heartbeat["args"][:2] == ["fleet", "heartbeat"]
        args = dict(zip(heartbeat["args"][2::2], heartbeat["args"][3::2], strict=True))
        # Each pod is a replica of its own: its pod name, its pod address.
        assert args["--name"] == "$(POD_NAME)"
        assert args["--replica-url"] == f"http://$(POD_IP):{values['backend']['port']}"
        env = {e["name"]: e for e in heartbeat["env"]}
        assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        # The same Redis and key prefix as the proxies, and none of their keys.
        assert env["STACKPIN_FLEET__KEY_PREFIX"]["value"] == config["fleet"]["key_prefix"]
        redis = env["STACKPIN_FLEET__REDIS_URL"]
        if "redis_url" in config["fleet"]:
            assert redis["value"] == config["fleet"]["redis_url"]
        else:
            assert redis["valueFrom"] == proxy_env["STACKPIN_FLEET__REDIS_URL"]["valueFrom"]
        assert set(env) == {"POD_NAME", "POD_IP", "STACKPIN_FLEET__REDIS_URL", "STACKPIN_FLEET__KEY_PREFIX"}


def test_each_release_keeps_its_fleet_keys_apart(variant: tuple[list[Manifest], dict]) -> None:
    manifests, _ = variant
    assert proxy_config(manifests)["fleet"]["key_prefix"] == f"stackpin:{NAMESPACE}:{RELEASE}:"


def test_without_fleet_mode_there_is_no_heartbeat(tmp_path: Path) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(
        yaml.safe_dump(
            {"fleet": {"enabled": False}, "proxy": {"replicaCount": 1, "autoscaling": {"enabled": False}}}
        )
    )
    manifests = render(path)
    for stack in values_of(path)["stacks"]:
        names = [
            c["name"]
            for c in one(manifests, "Deployment", backend_name(stack))["spec"]["template"]["spec"][
                "containers"
            ]
        ]
        assert names == ["backend"]


def test_heartbeat_arguments_are_accepted_by_the_proxy_cli(
    rendered: dict[str, list[Manifest]], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every flag parses; with no Redis named in this test's environment the command stops there, before any I/O.
    from proxy.cli import main

    monkeypatch.delenv("STACKPIN_FLEET__REDIS_URL", raising=False)
    (backend, *_) = [m for m in find(rendered["gpu-fleet"], "Deployment") if m["metadata"]["name"] != RELEASE]
    assert main(container(backend, "heartbeat")["args"]) == 2
    error = capsys.readouterr().err
    assert "fleet heartbeat needs Redis" in error, error


def test_helm_test_probes_every_stack_through_the_proxy(variant: tuple[list[Manifest], dict]) -> None:
    manifests, values = variant
    (pod,) = find(manifests, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    service = one(manifests, "Service", RELEASE)
    tenant = next(t for t in values["tenants"] if "apiKey" in t)
    probes = pod["spec"]["containers"]
    assert len(probes) == len(values["stacks"])
    for stack, probe in zip(values["stacks"], probes, strict=True):
        args = flags(probe["args"])
        assert probe["args"][0] == "probe"
        assert args["--url"] == f"http://{RELEASE}:{service['spec']['ports'][0]['port']}"
        assert args["--pin"] == (
            f"model={stack['model']}, quantisation={stack['dtype']}, hardware={stack['hardware']}, "
            f"kernel_mode={stack['kernelMode']}"
        )
        (key,) = probe["env"]
        assert key["name"] == args["--api-key-env"]
        assert key["valueFrom"]["secretKeyRef"] == {
            "name": tenant["apiKey"]["secretName"],
            "key": tenant["apiKey"]["secretKey"],
        }


def test_probe_arguments_are_accepted_by_the_proxy_cli(
    rendered: dict[str, list[Manifest]], capsys: pytest.CaptureFixture[str]
) -> None:
    # Every flag parses; pointed at a closed loopback port instead of the Service, the probe stops at connecting.
    from proxy.cli import main

    (pod,) = find(rendered["gpu-fleet"], "Pod")
    args = list(pod["spec"]["containers"][0]["args"])
    args[args.index("--url") + 1] = "http://127.0.0.1:9"
    assert main(args) == 2
    error = capsys.readouterr().err
    assert "cannot reach the proxy" in error, error


def test_alert_rules_parse_and_query_only_exported_metrics(rendered: dict[str, list[Manifest]]) -> None:
    # The dashboards' PromQL checks apply to alert expressions too.
    from prometheus_client import CollectorRegistry

    from pinned_backend.metrics import BackendMetrics
    from proxy.metrics import ProxyMetrics
    from tests.test_dashboards import (
        METRICS_DOC,
        base_name,
        documented_metrics,
        exported_metric_names,
        selectors,
    )

    assert not find(rendered["default"], "PrometheusRule"), "off by default: it needs the CRD"
    (rule_set,) = find(rendered["gpu-fleet"], "PrometheusRule")
    rules = [rule for group in rule_set["spec"]["groups"] for rule in group["rules"]]
    assert {"StackpinReplayDiverged", "StackpinReplicaQuarantined", "StackpinFleetStateStale"} <= {
        rule["alert"] for rule in rules
    }
    documented = documented_metrics(METRICS_DOC.read_text())
    proxy_registry, backend_registry = CollectorRegistry(), CollectorRegistry()
    ProxyMetrics(proxy_registry)
    BackendMetrics(backend_registry)
    exported = exported_metric_names(proxy_registry) | exported_metric_names(backend_registry)
    for rule in rules:
        queried = {base_name(metric, documented) for metric, _ in selectors(rule["expr"])}
        assert queried, f"{rule['alert']} selects no metric"
        assert queried <= exported & documented.keys(), f"{rule['alert']}: {sorted(queried - exported)}"
        assert rule["labels"]["severity"] in {"warning", "critical"} and rule["annotations"]["summary"]
