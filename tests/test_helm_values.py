"""Values the chart refuses with a clear message, and the variants it must render: one proxy without Redis,
host-path weights, stacks scaled to zero, the fleet heartbeat, helm test, alert rules."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.helm_chart import (
    CHART,
    CONFIG_PATH,
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
        ({"stacks": [{**TINY, "gpus": 1, "dtype": "fp32"}]}, "the kernels on GPUs run bf16 or fp16"),
        ({"stacks": [{**TINY, "gpus": 1, "kernelMode": "default"}]}, "the kernels on GPUs run bf16 or fp16"),
        ({"stacks": [TINY, TINY]}, "appears twice"),
        ({"stacks": [{**TINY, "maxBatchSize": 512}]}, "maxStepTokens must be at least maxBatchSize"),
        ({"stacks": [{**TINY, "gpus": 1, "dtype": "bf16", "kvSplitSize": 96}]}, "a multiple of 64"),
        ({"stacks": [{**TINY, "kvSplitSize": 100}]}, "kvSplitSize"),
        ({"stacks": [{**TINY, "name": "x" * 60}]}, "longer than 63"),
        (
            {"upstreams": [{"name": "tiny-cpu", "url": "https://api.example", "stack": {"model": "m"}}]},
            "name of a stack",
        ),
        ({"upstreams": [{"name": "api", "url": "https://api.example"}]}, "upstreams.0: stack is required"),
        (
            {"upstreams": [{"name": "v", "kind": "vllm", "url": "http://v:8000", "stack": {"model": "m"}}]},
            "upstreams.0: Must not validate the schema (not)",
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


def test_the_kv_split_reaches_the_backend_only_when_a_stack_names_it(tmp_path: Path) -> None:
    # Without the key the backend's own default applies, and an image from before the flag existed still starts.
    path = tmp_path / "values.yaml"
    older, pinned = {**TINY, "name": "older"}, {**TINY, "name": "pinned", "kvSplitSize": 256}
    path.write_text(yaml.safe_dump({"stacks": [older, pinned]}))
    manifests = render(path)
    args = {
        s["name"]: container(one(manifests, "Deployment", backend_name(s)), "backend")["args"]
        for s in (older, pinned)
    }
    assert "--kv-split-size" not in args["older"]
    assert flags(args["pinned"])["--kv-split-size"] == "256"


def test_serving_features_and_expert_capacity_reach_the_backend_as_its_flags(tmp_path: Path) -> None:
    path = tmp_path / "values.yaml"
    plain = {**TINY, "name": "plain"}
    featured = {
        **TINY,
        "name": "featured",
        "prefixCache": False,
        "speculativeTokens": 4,
        "matmulPlans": "none",
    }
    capped = {**TINY, "name": "capped", "expertCapacityFactor": 1.25, "expertOverflow": "next_expert"}
    path.write_text(yaml.safe_dump({"stacks": [plain, featured, capped]}))
    manifests = render(path)
    args = {
        s["name"]: container(one(manifests, "Deployment", backend_name(s)), "backend")["args"]
        for s in (plain, featured, capped)
    }
    for flag in ("--no-prefix-cache", "--speculative-tokens", "--matmul-plans", "--expert-capacity-factor"):
        assert flag not in args["plain"], "unset, the backend's own defaults apply"
    assert flags(args["featured"])["--no-prefix-cache"] is None
    assert flags(args["featured"])["--speculative-tokens"] == "4"
    assert flags(args["featured"])["--matmul-plans"] == "none"
    assert flags(args["capped"])["--expert-capacity-factor"] == "1.25"
    assert flags(args["capped"])["--expert-overflow"] == "next_expert"


@pytest.mark.parametrize(
    ("stack", "message"),
    [
        ({"expertOverflow": "next_expert"}, "set expertCapacityFactor too"),
        ({"expertCapacityFactor": 0}, "expertCapacityFactor"),
        ({"expertCapacityFactor": 1.0, "expertOverflow": "drop"}, "expertOverflow"),
        ({"speculativeTokens": -1}, "speculativeTokens"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_expert_and_speculation_values_that_make_no_sense_are_refused(
    stack: dict[str, Any], message: str, tmp_path: Path
) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump({"stacks": [{**TINY, **stack}]}))
    result = helm("template", RELEASE, CHART, "-f", path)
    assert result.returncode != 0, f"rendered although {stack}"
    assert message in result.stderr


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
    from proxy.commands.cli import main

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
    from proxy.commands.cli import main

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
    from proxy.commands.cli import main

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


def test_an_engine_among_the_upstreams_reaches_the_proxy_with_its_kind_and_no_declared_stack(
    tmp_path: Path,
) -> None:
    path = tmp_path / "values.yaml"
    engines = [
        {"name": "vllm-a", "kind": "vllm", "url": "http://vllm-a:8000"},
        {"name": "ollama-a", "kind": "ollama", "url": "http://ollama-a:11434", "model": "smollm2:135m"},
    ]
    path.write_text(yaml.safe_dump({"upstreams": engines}))
    replicas = {r["name"]: r for r in proxy_config(render(path))["replicas"]}
    assert replicas["vllm-a"] == {"name": "vllm-a", "kind": "vllm", "url": "http://vllm-a:8000"}
    assert replicas["ollama-a"]["model"] == "smollm2:135m" and "stack" not in replicas["ollama-a"]
