{{/*
Gossip cluster mode (config.gossip.enabled): the pieces the DaemonSet includes. Each define is
empty while gossip is off, so a standalone install renders exactly as before.

- ports 7946 UDP and TCP (config.gossip.port), with hostPort when the pod uses the node's network;
- gossip.advertise_address from the downward API: the pod IP, or the node IP with hostNetwork;
- gossip.seeds_dns: the headless Service of this region's agents (unless config sets one);
- the keyring and TLS Secrets mounted read-only as whole volumes (never subPath), so the kubelet's
  update of a Secret reaches the running agent, which re-reads the files (KeyringWatcher, GossipTls.run).
*/}}

{{- define "region-agent.gossipEnabled" -}}
{{- if (.Values.config.gossip | default dict).enabled }}true{{ end -}}
{{- end }}

{{- define "region-agent.gossipPort" -}}
{{- (.Values.config.gossip | default dict).port | default 7946 -}}
{{- end }}

{{/* Where the gossip Secrets are mounted (read-only) in the agent container. */}}
{{- define "region-agent.gossipKeyringDir" -}}/var/run/secrets/region-agent/gossip-keyring{{- end }}
{{- define "region-agent.gossipTlsDir" -}}/var/run/secrets/region-agent/gossip-tls{{- end }}

{{- define "region-agent.gossipServiceName" -}}
{{- printf "%s-gossip" (include "region-agent.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end }}

{{/* Environment (both containers: the settings must validate in each; only the agent mounts the files). */}}
{{- define "region-agent.gossipEnv" -}}
{{- if include "region-agent.gossipEnabled" . }}
{{- if and (not .Values.gossip.keyring.existingSecret) (not .Values.config.gossip.keyring_file) }}
{{- fail "config.gossip.enabled needs gossip.keyring.existingSecret (a Secret with keyring.json from `region-agent keys init`)" }}
{{- end }}
{{- if and (not .Values.gossip.tls.existingSecret) (not .Values.config.gossip.tls_cert_file) (not .Values.config.gossip.allow_unsigned) }}
{{- fail "config.gossip.enabled needs gossip.tls.existingSecret (the region's identity certificate from `region-agent keys cert --region`), or config.gossip.allow_unsigned: true for a lab" }}
{{- end }}
- name: REGION_AGENT_GOSSIP__ADVERTISE_ADDRESS
  valueFrom: {fieldRef: {fieldPath: {{ if .Values.hostNetwork }}status.hostIP{{ else }}status.podIP{{ end }}}}
{{- if and .Values.gossip.headlessService (not .Values.config.gossip.seeds_dns) }}
- name: REGION_AGENT_GOSSIP__SEEDS_DNS
  value: {{ printf "%s.%s.svc.%s" (include "region-agent.gossipServiceName" .) .Release.Namespace .Values.gossip.clusterDomain | quote }}
{{- end }}
{{- if .Values.gossip.keyring.existingSecret }}
- name: REGION_AGENT_GOSSIP__KEYRING_FILE
  value: {{ printf "%s/%s" (include "region-agent.gossipKeyringDir" .) .Values.gossip.keyring.key | quote }}
{{- end }}
{{- if .Values.gossip.tls.existingSecret }}
- name: REGION_AGENT_GOSSIP__TLS_CA_FILE
  value: {{ printf "%s/%s" (include "region-agent.gossipTlsDir" .) .Values.gossip.tls.ca | quote }}
- name: REGION_AGENT_GOSSIP__TLS_CERT_FILE
  value: {{ printf "%s/%s" (include "region-agent.gossipTlsDir" .) .Values.gossip.tls.cert | quote }}
- name: REGION_AGENT_GOSSIP__TLS_KEY_FILE
  value: {{ printf "%s/%s" (include "region-agent.gossipTlsDir" .) .Values.gossip.tls.key | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* Container ports of the agent: UDP for probes and broadcasts, TCP for push-pull streams. */}}
{{- define "region-agent.gossipPorts" -}}
{{- if include "region-agent.gossipEnabled" . }}
{{- $port := include "region-agent.gossipPort" . | int }}
- {name: gossip-udp, containerPort: {{ $port }}, protocol: UDP{{ if .Values.hostNetwork }}, hostPort: {{ $port }}{{ end }}}
- {name: gossip-tcp, containerPort: {{ $port }}, protocol: TCP{{ if .Values.hostNetwork }}, hostPort: {{ $port }}{{ end }}}
{{- end }}
{{- end }}

{{/* Mounts of the agent container (the health sidecar needs no gossip secret). */}}
{{- define "region-agent.gossipVolumeMounts" -}}
{{- if include "region-agent.gossipEnabled" . }}
{{- if .Values.gossip.keyring.existingSecret }}
- {name: gossip-keyring, mountPath: {{ include "region-agent.gossipKeyringDir" . }}, readOnly: true}
{{- end }}
{{- if .Values.gossip.tls.existingSecret }}
- {name: gossip-tls, mountPath: {{ include "region-agent.gossipTlsDir" . }}, readOnly: true}
{{- end }}
{{- end }}
{{- end }}

{{- define "region-agent.gossipVolumes" -}}
{{- if include "region-agent.gossipEnabled" . }}
{{- if .Values.gossip.keyring.existingSecret }}
- name: gossip-keyring
  secret: {secretName: {{ .Values.gossip.keyring.existingSecret }}, defaultMode: 0440}
{{- end }}
{{- if .Values.gossip.tls.existingSecret }}
- name: gossip-tls
  secret: {secretName: {{ .Values.gossip.tls.existingSecret }}, defaultMode: 0440}
{{- end }}
{{- end }}
{{- end }}
