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
The one annotation prefix of a release (plugin.annotationPrefix, the plugin's own default otherwise): the plugin
writes under it, the admission policy lets it write there, the fleet controller reads it and taints with
<prefix>/quarantine, and the DaemonSet tolerates that taint. Set anywhere else (a flag in extraArgs) they would part.
*/}}
{{- define "gpu-health.annotationPrefix" -}}
{{- .Values.plugin.annotationPrefix | default "gpu-health.io" -}}
{{- end -}}

{{- define "gpu-health.quarantineTaint" -}}
{{- printf "%s/quarantine" (include "gpu-health.annotationPrefix" .) -}}
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
{{- $doc := merge (dict "version" "v1") (deepCopy .Values.controller.config) -}}
{{- /* Only a prefix moved off the default is written, so the default file stays components/controller's. */ -}}
{{- if .Values.plugin.annotationPrefix }}{{ $_ := set $doc "annotationPrefix" .Values.plugin.annotationPrefix }}{{ end -}}
{{- toYaml $doc -}}
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

{{/*
DRA mode's host directories: the hostPaths key, the plugin's flag for it and the plugin's default. Mounted at the
same path inside the pod (the kubelet connects to what the plugin registers, the runtime reads the CDI specs where
it writes them); the flag is passed only for a path moved off the default, so the default rendering is
manifests/overlays/dra's.
*/}}
{{- define "gpu-health.draPaths" -}}
- {key: draPlugin, volume: dra-plugin, flag: --dra-plugin-dir, default: /var/lib/kubelet/plugins/gpu.gpu-health.io, type: DirectoryOrCreate}
- {key: pluginsRegistry, volume: plugins-registry, flag: --dra-registry-dir, default: /var/lib/kubelet/plugins_registry, type: Directory}
- {key: cdiSpecs, volume: cdi, flag: --cdi-spec-dir, default: /var/run/cdi, type: DirectoryOrCreate}
{{- end -}}

{{- define "gpu-health.dra" -}}
{{- if eq .Values.mode "dra" }}dra{{ end -}}
{{- end -}}

{{/*
mode: dra's per-profile DeviceClasses, as a YAML list of {profile, class, resource}: one for each of
dra.migProfiles. A `+` (1g.10gb+me) cannot be in a DeviceClass name (a DNS subdomain) nor in an extended resource
name, so it becomes `.` there, as NVIDIA's plugin names that resource (nvidia.com/mig-1g.10gb.me); the selector
keeps the profile as the driver writes it. The resource is in dra.extendedResourceName's domain, as device-plugin
mode's mixed strategy puts it; none without one. The schema already refuses a profile that cannot make a name;
these checks hold for a rendering that skipped it (--skip-schema-validation), and two profiles that map to one name.
*/}}
{{- define "gpu-health.draMigClasses" -}}
{{- $domain := "" }}
{{- with .Values.dra.extendedResourceName }}{{ $domain = index (splitList "/" .) 0 }}{{ end }}
{{- $seen := dict }}
{{- range .Values.dra.migProfiles }}
{{- $name := replace "+" "." (toString .) }}
{{- $class := printf "mig-%s.gpu-health.io" $name }}
{{- if or (gt (len $class) 253) (not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$" $class)) (gt (len (printf "mig-%s" $name)) 63) }}
{{- fail (printf "dra.migProfiles: %q makes no valid DeviceClass name (%s) or extended resource name (mig-%s): a profile is DNS labels (lower-case letters and digits, '-' inside) joined by '.' or '+', at most 59 characters" (toString .) $class $name) }}
{{- end }}
{{- if hasKey $seen $class }}
{{- fail (printf "dra.migProfiles: %q and %q both make the DeviceClass %s ('+' becomes '.')" (get $seen $class) (toString .) $class) }}
{{- end }}
{{- $_ := set $seen $class (toString .) }}
- profile: {{ toString . | quote }}
  class: {{ $class | quote }}
  resource: {{ if $domain }}{{ printf "%s/mig-%s" $domain $name | quote }}{{ else }}""{{ end }}
{{- end }}
{{- end -}}

{{/*
Values that mean nothing in the chosen mode stop the rendering with one line naming the value: left in, each
would be silently ignored by the plugin or refused by it at start on every node.
*/}}
{{- define "gpu-health.checkMode" -}}
{{- $v := .Values -}}
{{- range $arg := $v.extraArgs }}
{{- range list "--mode" "--dra-plugin-dir" "--dra-registry-dir" "--cdi-spec-dir" "--nvsentinel-socket" "--device-api-socket" "--kernel-log" }}
{{- if or (eq $arg .) (hasPrefix (printf "%s=" .) $arg) }}
{{- fail (printf "extraArgs: %s is set by the chart (mode, hostPaths, nvsentinel, deviceApi, kernelLog), not by extraArgs" .) }}
{{- end }}
{{- end }}
{{- end }}
{{- range $where, $args := dict "extraArgs" $v.extraArgs "controller.extraArgs" $v.controller.extraArgs }}
{{- range $arg := $args }}
{{- if or (eq $arg "--annotation-prefix") (hasPrefix "--annotation-prefix=" $arg) }}
{{- fail (printf "%s: --annotation-prefix is set by the chart from plugin.annotationPrefix (the plugin, the admission policy, the controller and the quarantine toleration share it), not by extraArgs" $where) }}
{{- end }}
{{- end }}
{{- end }}
{{- if include "gpu-health.dra" . }}
{{- if semverCompare "<1.34.0-0" .Capabilities.KubeVersion.Version }}
{{- fail (printf "mode: dra needs Kubernetes >= 1.34 (resource.k8s.io/v1), this cluster is %s (docs/dra.md, \"Gates per Kubernetes version\")" .Capabilities.KubeVersion.Version) }}
{{- end }}
{{- if not $v.clusterReporting.enabled }}
{{- fail "clusterReporting.enabled: false takes the plugin's API access away, which mode: dra needs (it publishes a ResourceSlice and reads the claims it prepares)" }}
{{- end }}
{{- if eq $v.migStrategy "single" }}
{{- fail "migStrategy: single is device-plugin mode's; in mode: dra use mixed: every MIG instance is then a device of its own, which the classes mig.gpu-health.io and mig-<profile>.gpu-health.io select" }}
{{- end }}
{{- /* mode: dra shares a GPU in place (docs/dra.md, "Shared GPUs"): what only replicas advertised as devices of
their own mean is refused here, as the plugin refuses it at start. */}}
{{- $ts := (($v.sharing | default dict).timeSlicing | default dict) }}
{{- if and $ts.allocationPolicy (ne $ts.allocationPolicy "distributed") }}
{{- fail "sharing.timeSlicing.allocationPolicy: in mode: dra the scheduler places claims on shared GPUs; remove it or set distributed" }}
{{- end }}
{{- if $ts.renameByDefault }}
{{- fail "sharing.timeSlicing.renameByDefault: mode: dra keeps a shared GPU's name and class, a claim asks for a share of it (docs/dra.md, \"Shared GPUs\"); remove it" }}
{{- end }}
{{- if $ts.failRequestsGreaterThanOne }}
{{- fail "sharing.timeSlicing.failRequestsGreaterThanOne: in mode: dra a claim takes one share unless it asks for more, never more than replicas; remove it" }}
{{- end }}
{{- range $i, $r := ($ts.resources | default list) }}
{{- if $r.rename }}
{{- fail (printf "sharing.timeSlicing.resources[%d].rename: mode: dra keeps a shared GPU's name and class, a claim asks for a share of it (docs/dra.md, \"Shared GPUs\"); remove it" $i) }}
{{- end }}
{{- if $r.failRequestsGreaterThanOne }}
{{- fail (printf "sharing.timeSlicing.resources[%d].failRequestsGreaterThanOne: in mode: dra a claim takes one share unless it asks for more, never more than replicas; remove it" $i) }}
{{- end }}
{{- end }}
{{- if $v.cdi.enabled }}
{{- fail "cdi.enabled: CDI names from Allocate are device-plugin mode's; mode: dra always hands GPUs over through CDI specs (hostPaths.cdiSpecs)" }}
{{- end }}
{{- if $v.remediation.enabled }}
{{- fail "remediation.enabled: evicting the pods of a failing GPU is device-plugin mode's (it finds them through PodResources); in mode: dra use plugin.draUnhealthyTaintEffect: NoExecute" }}
{{- end }}
{{- if include "gpu-health.surge" . }}
{{- fail "updateStrategy.rollingUpdate.maxSurge: a surge rollout (--handover) is device-plugin mode's; in mode: dra two plugins on a node would both write its ResourceSlice and prepare claims: keep maxSurge 0" }}
{{- end }}
{{- if hasKey $v.plugin "resourceName" }}
{{- fail "plugin.resourceName is device-plugin mode's; in mode: dra the DeviceClass gpu.gpu-health.io names the extended resource (dra.extendedResourceName)" }}
{{- end }}
{{- if hasKey $v.plugin "correlateOn" }}
{{- fail "plugin.correlateOn is device-plugin mode's; mode: dra has no pod correlation (the scheduler keeps pods off tainted devices, and a claim's pod status carries each device's health)" }}
{{- end }}
{{- else }}
{{- range list "draDegradedHealth" "draUnhealthyTaintEffect" "draDegradedTaint" }}
{{- if hasKey $v.plugin . }}
{{- fail (printf "plugin.%s is mode: dra's; this release is mode: device-plugin" .) }}
{{- end }}
{{- end }}
{{- range fromYamlArray (include "gpu-health.draPaths" .) }}
{{- if ne (get $v.hostPaths .key) .default }}
{{- fail (printf "hostPaths.%s is mode: dra's; this release is mode: device-plugin (leave it at %s)" .key .default) }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}
