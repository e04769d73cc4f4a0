"""The chart lints, and every manifest it renders validates offline against the Kubernetes schemas (strict) or,
for custom resources, against typed models of their CRDs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from pydantic import BaseModel, ValidationError

from tests.support.helm_chart import (
    CHART,
    CRD_KINDS,
    KUBERNETES_VERSION,
    OLDEST_KUBERNETES_VERSION,
    RELEASE,
    VARIANTS,
    Manifest,
    find,
    helm,
    one,
)

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
