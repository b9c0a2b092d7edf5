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
