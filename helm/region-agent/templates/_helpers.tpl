{{- define "region-agent.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}{{ .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}{{ end }}
{{- end }}

{{- define "region-agent.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "region-agent.labels" -}}
{{ include "region-agent.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
region-agent.io/region: {{ .Values.config.region }}
{{- end }}

{{- define "region-agent.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}{{ default (include "region-agent.fullname" .) .Values.serviceAccount.name }}
{{- else }}{{ default "default" .Values.serviceAccount.name }}{{ end }}
{{- end }}

{{/* Seconds Kubernetes waits after SIGTERM: the drain, the graceful stop, and 5 s of margin. */}}
{{- define "region-agent.terminationGrace" -}}
{{- $drain := .Values.config.shutdown_drain_seconds | default 5 -}}
{{- $budget := .Values.config.shutdown_budget | default 15 -}}
{{- add (ceil $drain | int) (ceil $budget | int) 5 -}}
{{- end }}

{{/* Where each referenced Secret is mounted, and the setting its path goes to. */}}
{{- define "region-agent.secretPaths" -}}
tsigKeys: {dir: /var/run/secrets/region-agent/tsig, env: REGION_AGENT_DNS__ACME__TSIG_KEYS_FILE}
operatorToken: {dir: /var/run/secrets/region-agent/operator, env: REGION_AGENT_HEALTH__OPERATOR_TOKEN_FILE}
usageToken: {dir: /var/run/secrets/region-agent/usage, env: REGION_AGENT_USAGE__TOKEN_FILE}
geoipUrl: {dir: /var/run/secrets/region-agent/geoip, env: REGION_AGENT_DNS__GEOIP__URL_FILE}
{{- end }}

{{/* Environment of both containers: downward API, sidecar mode, secret file paths (they win over agent.yaml). */}}
{{- define "region-agent.env" -}}
- name: REGION_AGENT_NODE
  valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
- name: REGION_AGENT_KUBE__NODE_NAME
  valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
- name: POD_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
{{- if .Values.healthSidecar.enabled }}
- name: REGION_AGENT_HEALTH__MODE
  value: sidecar
{{- end }}
{{- include "region-agent.gossipEnv" . }}
{{- include "region-agent.operatorEnv" . }}
{{- $paths := include "region-agent.secretPaths" . | fromYaml }}
{{- range $name, $ref := .Values.secrets }}
{{- if $ref.existingSecret }}
- name: {{ (get $paths $name).env }}
  value: {{ printf "%s/%s" (get $paths $name).dir $ref.key }}
{{- end }}
{{- end }}
{{- end }}

{{- define "region-agent.volumeMounts" -}}
- {name: config, mountPath: /etc/region-agent, readOnly: true}
- {name: run, mountPath: /run/region-agent}
- {name: tmp, mountPath: /tmp}
- {name: geoip-cache, mountPath: /var/cache/region-agent}
{{- $paths := include "region-agent.secretPaths" . | fromYaml }}
{{- range $name, $ref := .Values.secrets }}
{{- if $ref.existingSecret }}
- {name: secret-{{ lower $name }}, mountPath: {{ (get $paths $name).dir }}, readOnly: true}
{{- end }}
{{- end }}
{{- end }}

{{/*
The operator listener (/metrics, /zone, /status, the control API) is closed unless a value opens it:
without config.health.operator_listen_addresses it listens on 127.0.0.1 (reach it with kubectl
port-forward), or on 0.0.0.0 when a token is required (secrets.operatorToken) or
operatorListener.allowWithoutToken says so. "open" when it listens beyond the pod's loopback.
*/}}
{{- define "region-agent.operatorOpen" -}}
{{- with (.Values.config.health | default dict).operator_listen_addresses }}
{{- range . }}{{ if not (or (eq . "127.0.0.1") (eq . "::1")) }}open{{ end }}{{ end }}
{{- else }}
{{- if or .Values.secrets.operatorToken.existingSecret .Values.operatorListener.allowWithoutToken }}open{{ end }}
{{- end }}
{{- end }}

{{/* Environment for the operator listener's addresses (when config does not set them), and the refusals. */}}
{{- define "region-agent.operatorEnv" -}}
{{- $open := include "region-agent.operatorOpen" . }}
{{- if and $open (not .Values.secrets.operatorToken.existingSecret) (not .Values.operatorListener.allowWithoutToken) }}
{{- fail "config.health.operator_listen_addresses opens the operator listener (metrics, zone, the control API) beyond the pod without a token: set secrets.operatorToken.existingSecret, or operatorListener.allowWithoutToken: true" }}
{{- end }}
{{- if and (not $open) .Values.healthSidecar.enabled }}
{{- fail "healthSidecar.enabled: the kubelet probes the agent on its operator port, which listens on 127.0.0.1 only: set secrets.operatorToken.existingSecret (the listener then opens with a token), or operatorListener.allowWithoutToken: true" }}
{{- end }}
{{- if and (not $open) .Values.serviceMonitor.enabled }}
{{- fail "serviceMonitor.enabled: Prometheus can not scrape an operator listener on 127.0.0.1: set secrets.operatorToken.existingSecret (the listener then opens with a token), or operatorListener.allowWithoutToken: true" }}
{{- end }}
{{- if not (.Values.config.health | default dict).operator_listen_addresses }}
- name: REGION_AGENT_HEALTH__OPERATOR_LISTEN_ADDRESSES
  value: {{ if $open }}'["0.0.0.0"]'{{ else }}'["127.0.0.1"]'{{ end }}
{{- end }}
{{- end }}
