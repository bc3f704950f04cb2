{{/*
Names. The plugin's objects are named after the chart, not the release: there is one plugin per cluster and its
cluster-scoped objects (ClusterRole, admission policy) must keep the names the admission policy and the docs use.
*/}}
{{- define "gpu-health.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gpu-health.fullname" -}}
{{- default .Chart.Name .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gpu-health.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride -}}
{{- end -}}

{{- define "gpu-health.controller.fullname" -}}
{{- default "gpu-health-controller" .Values.controller.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gpu-health.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/*
Labels. The selector labels are those of manifests/: a DaemonSet's selector cannot change, so a release must
select exactly what `kubectl apply -k manifests/base` selects. Helm's own labels go on the objects only.
*/}}
{{- define "gpu-health.helmLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}

{{- define "gpu-health.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpu-health.name" . }}
{{- end -}}

{{- define "gpu-health.labels" -}}
{{ include "gpu-health.selectorLabels" . }}
app.kubernetes.io/part-of: gpu-health-device-plugin
{{ include "gpu-health.helmLabels" . }}
{{- end -}}

{{- define "gpu-health.controller.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpu-health.controller.fullname" . }}
{{- end -}}

{{- define "gpu-health.controller.labels" -}}
{{ include "gpu-health.controller.selectorLabels" . }}
app.kubernetes.io/part-of: gpu-health-device-plugin
app.kubernetes.io/component: controller
{{ include "gpu-health.helmLabels" . }}
{{- end -}}

{{/*
The plugin's config file. Only what the values set is written, so the file stays as short as manifests/base's;
the switches (cdi, node condition, cluster reporting, remediation) are flags in the DaemonSet, as in the
components, because flags win over the file.
*/}}
{{- define "gpu-health.configFile" -}}
{{- $plugin := deepCopy .Values.plugin -}}
{{- if ne .Values.migStrategy "none" }}{{ $_ := set $plugin "migStrategy" .Values.migStrategy }}{{ end -}}
{{- $_ := set $plugin "failOnInitError" .Values.failOnInitError -}}
{{- $doc := dict "version" "v1" "plugin" $plugin "health" .Values.health -}}
{{- if .Values.sharing }}{{ $_ := set $doc "sharing" .Values.sharing }}{{ end -}}
{{- toYaml $doc -}}
{{- end -}}

{{- define "gpu-health.controller.configFile" -}}
{{- toYaml (merge (dict "version" "v1") (deepCopy .Values.controller.config)) -}}
{{- end -}}

{{/*
Non-empty when the update strategy starts a node's new plugin pod before its old one stops (maxSurge not 0); the
new plugin must then wait for the old one's state dir instead of refusing it (--handover; components/surge-upgrade).
*/}}
{{- define "gpu-health.surge" -}}
{{- if eq (.Values.updateStrategy.type | default "RollingUpdate") "RollingUpdate" -}}
{{- $surge := dig "rollingUpdate" "maxSurge" 0 .Values.updateStrategy | toString -}}
{{- if not (has $surge (list "0" "0%" "")) }}surge{{ end -}}
{{- end -}}
{{- end -}}

{{/* The probes' port: by name on the pod network, by number on the host's, where no port is declared. */}}
{{- define "gpu-health.metricsPort" -}}
{{- if .Values.hostNetwork }}9402{{ else }}metrics{{ end -}}
{{- end -}}
