{{/* Names, labels and the image reference shared by every template of the chart. */}}

{{- define "megatrace.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-scoped base name, at most 63 characters minus room for component suffixes. */}}
{{- define "megatrace.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "megatrace.exporter.fullname" -}}
{{- printf "%s-exporter" (include "megatrace.fullname" .) }}
{{- end }}

{{- define "megatrace.alertbot.fullname" -}}
{{- printf "%s-alertbot" (include "megatrace.fullname" .) }}
{{- end }}

{{- define "megatrace.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "megatrace.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: megatrace
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of one component; call with (dict "ctx" $ "component" "exporter"). */}}
{{- define "megatrace.selectorLabels" -}}
app.kubernetes.io/name: {{ include "megatrace.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Full labels of one component; call with (dict "ctx" $ "component" "exporter"). */}}
{{- define "megatrace.componentLabels" -}}
{{ include "megatrace.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Labels the Prometheus Operator selects on, plus the resource's own extra labels. */}}
{{- define "megatrace.operatorLabels" -}}
{{- $labels := merge (deepCopy (default dict .extra)) (default dict .ctx.Values.prometheusOperator.selectorLabels) }}
{{- with $labels }}{{ toYaml . }}{{ end }}
{{- end }}

{{- define "megatrace.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/* The alert bot's webhook URL as Alertmanager reaches it inside the cluster. */}}
{{- define "megatrace.alertbot.webhookURL" -}}
{{- printf "http://%s.%s.svc:%v/alertmanager" (include "megatrace.alertbot.fullname" .) .Release.Namespace .Values.alertbot.service.port }}
{{- end }}


{{/*
Relabelings of an endpoint of the exporter's ServiceMonitor (dict "sm" the serviceMonitor values,
"endpoint" "" or a name). First `agent_address`, the address the alert bot dials the agent at: the
pod's IP and port as discovered (the node name in `instance` need not resolve, and the pod has no
hostPort); always set, so that overriding `relabelings` cannot leave the bot without a way to reach
the agents. Then, for an endpoint with a name, `endpoint` = that name: the operator labels both
endpoints with their port's name, and two scrapes of one pod would otherwise write the same `up`
series. Then the values' relabelings.
*/}}
{{- define "megatrace.exporter.relabelings" -}}
- sourceLabels: [__address__]
  targetLabel: agent_address
  action: replace
{{- if .endpoint }}
- targetLabel: endpoint
  replacement: {{ .endpoint }}
  action: replace
{{- end }}
{{- with .sm.relabelings }}
{{ toYaml . }}
{{- end }}
{{- end }}
