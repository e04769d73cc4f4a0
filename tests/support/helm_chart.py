"""The Helm chart under test: helm itself, rendering with values, and finding things in what it renders.

Shared by the chart tests (test_helm_schemas.py, test_helm.py, test_helm_values.py)."""

from __future__ import annotations

import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
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


def flags(args: list[str]) -> dict[str, str | None]:
    """`serve --model x --no-prefix-cache --dtype bf16` -> {"--model": "x", "--no-prefix-cache": None, ...}."""
    found: dict[str, str | None] = {}
    rest = args[1:]
    while rest:
        flag, rest = rest[0], rest[1:]
        assert flag.startswith("--"), f"{flag!r} is no flag: {args}"
        if rest and not rest[0].startswith("--"):
            found[flag], rest = rest[0], rest[1:]
        else:
            found[flag] = None
    return found


def proxy_config(manifests: list[Manifest]) -> dict[str, Any]:
    return tomllib.loads(one(manifests, "ConfigMap", RELEASE)["data"]["stackpin.toml"])
