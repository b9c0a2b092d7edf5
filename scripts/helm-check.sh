#!/usr/bin/env bash
# The chart check to run before a release: `helm lint` and `helm template` piped to
# kubernetes-validate (https://github.com/willthames/kubernetes-validate), for the minimal
# install values and for every optional part turned on. Without helm it says so and exits 0:
# the chart's schema and settings correspondence are tested without helm (tests/deploy/).
set -euo pipefail
cd "$(dirname "$0")/.."
chart=helm/region-agent
if ! command -v helm >/dev/null 2>&1; then
  echo "helm-check: helm is not installed; skipped (tests/deploy/ checks the values schema without it)" >&2
  exit 0
fi
validate=(cat)
if command -v kubernetes-validate >/dev/null 2>&1; then
  # --strict: unknown fields are errors (a CRD without a schema, the ServiceMonitor, is only a warning)
  validate=(kubernetes-validate --strict --kubernetes-version "${KUBERNETES_VERSION:-1.30.0}" -)
else
  echo "helm-check: kubernetes-validate is not installed (pip install kubernetes-validate); rendering only" >&2
fi
all_on=(--set healthSidecar.enabled=true --set serviceMonitor.enabled=true --set networkPolicy.enabled=true
        --set secrets.tsigKeys.existingSecret=tsig --set secrets.operatorToken.existingSecret=operator
        --set secrets.usageToken.existingSecret=usage
        --set config.gossip.enabled=true --set gossip.keyring.existingSecret=gossip-keyring
        --set gossip.tls.existingSecret=gossip-tls)
helm lint --strict "$chart" -f "$chart/ci/test-values.yaml"
helm lint --strict "$chart" -f "$chart/ci/test-values.yaml" "${all_on[@]}"
helm template ra "$chart" -f "$chart/ci/test-values.yaml" | "${validate[@]}"
helm template ra "$chart" -f "$chart/ci/test-values.yaml" "${all_on[@]}" | "${validate[@]}"
helm template ra "$chart" -f "$chart/ci/test-values.yaml" --set hostNetwork=true --set config.dns.port=5353 \
  --set dnsPolicy=ClusterFirstWithHostNet | "${validate[@]}"
# values.yaml alone must fail: an install has to name its region and zone
if helm template ra "$chart" >/dev/null 2>&1; then
  echo "helm-check: values without a region and zone were accepted" >&2
  exit 1
fi
echo "helm-check: ok"
