"""Specification of the Helm chart in helm/stackpin.

The chart is linted and rendered with `helm` (installed by .ci/tools.sh), with its default values and with the
multi-stack GPU fleet of ci/values-gpu-fleet.yaml; every rendered manifest is validated offline against the
Kubernetes API schemas (kubernetes-validate, strict: unknown fields are errors). CRD kinds have no schema there:
they are validated against typed models of their CRDs instead, and their shape is checked here. The rendered
proxy configuration is loaded by the proxy's own loader.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tests.support.helm_chart import (
    CHART,
    CONFIG_PATH,
    DASHBOARDS,
    FLEET_VALUES,
    NAMESPACE,
    RELEASE,
    Manifest,
    backend_name,
    container,
    find,
    flags,
    helm,
    one,
    pod_specs,
    proxy_config,
    render,
    values_of,
)

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
