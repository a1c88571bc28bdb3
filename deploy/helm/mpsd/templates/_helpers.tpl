{{/*
Labels of every object: app.kubernetes.io/name, as in the Kustomize tree, plus Helm's own. Pod
templates and selectors carry only the Kustomize ones (selectors cannot change after install).
*/}}
{{- define "mpsd.labels" -}}
app.kubernetes.io/name: mpsd
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}

{{/*
Pod template labels: the selector's (fixed at install: selectors are immutable) plus the release.
Nothing that changes between chart versions (helm.sh/chart, app.kubernetes.io/version): a pod
template that changes rolls mpsd, and leaves the OnDelete holder out of date.
Arguments: dict "root" $ "component" COMPONENT
*/}}
{{- define "mpsd.podLabels" -}}
app.kubernetes.io/name: mpsd
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- end }}

{{- define "mpsd.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* The holder's image: its own tag, never the chart's appVersion (see values.yaml). */}}
{{- define "mpsd.holderImage" -}}
{{ .Values.holder.image.repository }}:{{ .Values.holder.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/*
A tmpfs size (schema: digits and K, Ki, M, Mi, G or Gi, all powers of 1024, as
mpsd.plugin.regionfs reads it) in bytes; fails above 1Ti: the kernel takes any size, and the
pages are the node's memory. Arguments: dict "name" VALUE-NAME "size" SIZE
*/}}
{{- define "mpsd.tmpfsBytes" -}}
{{- $size := toString .size -}}
{{- $units := dict "" 1 "K" 1024 "Ki" 1024 "M" 1048576 "Mi" 1048576 "G" 1073741824 "Gi" 1073741824 -}}
{{- $digits := regexFind "^[0-9]+" $size -}}
{{- $unit := trimPrefix $digits $size -}}
{{- $bytes := mul (atoi $digits) (get $units $unit) -}}
{{- if or (gt (len $digits) 13) (gt $bytes 1099511627776) -}}
{{- fail (printf "%s: %s is over 1Ti (1024Gi): a tmpfs holds node memory; size it to what pods write" .name $size) -}}
{{- end -}}
{{- $bytes -}}
{{- end }}

{{/*
mpsd's configuration (YAML): deploy/base/config.yaml, the `dra` section of
deploy/overlays/dra/config.yaml in dra mode, what mode, ipcMode and holder.enabled decide, and
.Values.config over all of it. Read back with `include "mpsd.config" . | fromYaml`. A setting
that contradicts mode, ipcMode or holder.enabled, or a tmpfs outside stateDir, fails the
render with one line.
*/}}
{{- define "mpsd.config" -}}
{{- $cfg := .Files.Get "files/config.yaml" | fromYaml -}}
{{- $dp := $cfg.devicePlugin -}}
{{- $_ := set $dp "enabled" (eq .Values.mode "devicePlugin") -}}
{{- $_ := set $dp "ipcMode" .Values.ipcMode -}}
{{- if eq .Values.mode "dra" -}}
{{- $_ := set $cfg "dra" (.Files.Get "files/dra-config.yaml" | fromYaml).dra -}}
{{- end -}}
{{- $_ := set $cfg "daemonLifecycle" (ternary "independent" "owned" .Values.holder.enabled) -}}
{{- $want := deepCopy $cfg -}}
{{- $cfg = mergeOverwrite $cfg (deepCopy .Values.config) -}}
{{- if ne (toString $cfg.devicePlugin.enabled) (toString $want.devicePlugin.enabled) -}}
{{- fail (printf "config.devicePlugin.enabled: %v contradicts mode %s; set mode (devicePlugin or dra) instead" $cfg.devicePlugin.enabled .Values.mode) -}}
{{- end -}}
{{- if ne (toString (dig "dra" "enabled" false $cfg)) (toString (eq .Values.mode "dra")) -}}
{{- fail (printf "config.dra.enabled: %v contradicts mode %s; set mode (devicePlugin or dra) instead" (dig "dra" "enabled" false $cfg) .Values.mode) -}}
{{- end -}}
{{- if ne $cfg.devicePlugin.ipcMode .Values.ipcMode -}}
{{- fail (printf "config.devicePlugin.ipcMode: %v contradicts ipcMode %s; set ipcMode (hostIPC or tmpfs) instead" $cfg.devicePlugin.ipcMode .Values.ipcMode) -}}
{{- end -}}
{{- if ne $cfg.daemonLifecycle $want.daemonLifecycle -}}
{{- fail (printf "config.daemonLifecycle: %v contradicts holder.enabled %v (true: independent, false: owned)" $cfg.daemonLifecycle .Values.holder.enabled) -}}
{{- end -}}
{{- $state := printf "%s/" (trimSuffix "/" $cfg.stateDir) -}}
{{- if not (hasPrefix $state $cfg.devicePlugin.regionDir) -}}
{{- fail (printf "config.devicePlugin.regionDir: %v must be inside stateDir %v (its tmpfs is mounted there)" $cfg.devicePlugin.regionDir $cfg.stateDir) -}}
{{- end -}}
{{- if and (eq .Values.ipcMode "tmpfs") (not (hasPrefix $state $cfg.devicePlugin.shmDir)) -}}
{{- fail (printf "config.devicePlugin.shmDir: %v must be inside stateDir %v (its tmpfs is mounted there)" $cfg.devicePlugin.shmDir $cfg.stateDir) -}}
{{- end -}}
{{- if not (regexMatch ":[0-9]+$" (toString $cfg.metricsAddress)) -}}
{{- fail (printf "config.metricsAddress: %q: the probes and the Service need a host:port" (toString $cfg.metricsAddress)) -}}
{{- end -}}
{{- $port := toString $cfg.metricsAddress | splitList ":" | last -}}
{{- if or (gt (len $port) 5) (lt (atoi $port) 1) (gt (atoi $port) 65535) -}}
{{- fail (printf "config.metricsAddress: %q: port %s is outside 1-65535" (toString $cfg.metricsAddress) $port) -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end }}

{{/* The port of config.metricsAddress (probes, container port, Service). */}}
{{- define "mpsd.metricsPort" -}}
{{- (include "mpsd.config" . | fromYaml).metricsAddress | splitList ":" | last -}}
{{- end }}

{{/*
Where the pods run (mpsd and the holder alike): nodeSelectorTerms as the required node
affinity, narrowed by nodeSelector, with the rest of affinity (preferred node affinity, pod
(anti-)affinity) beside it; tolerating GPU taints; the RuntimeClass when one is named.
*/}}
{{- define "mpsd.placement" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
priorityClassName: {{ .Values.priorityClassName }}
{{- with .Values.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $required := dict "requiredDuringSchedulingIgnoredDuringExecution" (dict "nodeSelectorTerms" .Values.nodeSelectorTerms) }}
{{- $affinity := deepCopy .Values.affinity }}
{{- $_ := set $affinity "nodeAffinity" (merge $required (get $affinity "nodeAffinity" | default dict)) }}
affinity:
  {{- toYaml $affinity | nindent 2 }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The NVIDIA runtime's variables: device nodes, driver libraries and MPS binaries. */}}
{{- define "mpsd.nvidiaEnv" -}}
- name: NVIDIA_VISIBLE_DEVICES
  value: all
- name: NVIDIA_DRIVER_CAPABILITIES
  value: compute,utility
{{- end }}

{{/*
An init container that mounts a size-limited tmpfs inside stateDir (privileged: mount(2) and
Bidirectional propagation), as the Kustomize tree's region-tmpfs and shm-tmpfs.
Arguments: dict "root" $ "name" "region-tmpfs" "path" PATH "tmpfs" (size, inodes) "shm" BOOL
"image" IMAGE (the values' image or holder.image)
*/}}
{{- define "mpsd.tmpfsInit" -}}
{{- $cfg := include "mpsd.config" .root | fromYaml -}}
- name: {{ .name }}
  image: {{ printf "%s:%s" .image.repository (.image.tag | default .root.Chart.AppVersion) }}
  imagePullPolicy: {{ .image.pullPolicy }}
  command: {{ concat (list "python" "-m" "mpsd.plugin.regionfs" .path (toString .tmpfs.size) "--inodes" (toString .tmpfs.inodes)) (ternary (list "--mode" "1777" "--label" "shmDir") (list) .shm) | toJson }}
  securityContext:
    # privileged: mount(2) needs CAP_SYS_ADMIN and Bidirectional propagation
    privileged: true
    # root: mounting is root's
    runAsUser: 0
  resources:
    requests:
      cpu: 10m
      memory: 32Mi
    limits:
      memory: 128Mi
  volumeMounts:
    - name: state-dir
      mountPath: {{ $cfg.stateDir }}
      mountPropagation: Bidirectional
{{- end }}

{{/*
The daemon's capabilities and user, shared by mpsd's and the holder's containers (deploy/README.md,
"Privileges"); SYS_ADMIN is added for exclusiveProcess (a compute-mode change is an admin call)
and for mig.privileged (the toolkit's MIG monitor capability needs it), to mpsd only.
*/}}
{{- define "mpsd.securityContext" -}}
# Not privileged: GPU access comes from the NVIDIA runtime (env above).
privileged: false
# root: the control daemon starts one server per client UID (fork, setuid, exec), and the
# pipe, log and state dirs on the host are root's.
runAsUser: 0
runAsGroup: 0
# no_new_privs: nothing here needs setuid binaries or file capabilities.
allowPrivilegeEscalation: false
# Drop everything, add back only: SETUID, SETGID (servers run as their client's UID/GIDs),
# KILL (signal servers of other UIDs), CHOWN, FOWNER, DAC_OVERRIDE (files of other UIDs in the
# pipe, log and region dirs), SYS_PTRACE for mpsd (read the sessions held on an adopted daemon's
# control sockets: without it a silent daemon is only reported, never judged hung, docs/security.md),
# and SYS_ADMIN with exclusiveProcess (nvidia-smi -c) or mig.privileged (NVML's MIG view, docs/mig.md).
capabilities:
  drop: ["ALL"]
  add: {{ concat (list "SETUID" "SETGID" "KILL" "CHOWN" "FOWNER" "DAC_OVERRIDE") (ternary (list "SYS_PTRACE") (list) (default false .ptrace)) (ternary (list "SYS_ADMIN") (list) (or (and .exclusive true) (default false .mig))) | toJson }}
{{- if .dra }}
# SELinux: the reference DRA drivers run privileged (spc_t); mpsd takes that domain only, so it may
# write the kubelet's plugin directories and /var/run/cdi on an enforcing node (docs/security.md).
seLinuxOptions:
  type: spc_t
{{- end }}
{{- end }}

{{/*
What the nodes keep across upgrades, as JSON (mpsd.io/node-settings on both DaemonSets; checked
by templates/checks.yaml): the holder's pod template (a checksum; "off" without a holder), the
ipcMode, and the tmpfs sizes (a mount keeps its size until it is gone).
*/}}
{{- define "mpsd.nodeSettings" -}}
{{- $holder := "off" -}}
{{- if .Values.holder.enabled -}}
{{- $holder = include "mpsd.holderPod" . | fromYaml | toJson | sha256sum | trunc 16 -}}
{{- end -}}
{{- $region := printf "%s/%v" (toString .Values.regionTmpfs.size) .Values.regionTmpfs.inodes -}}
{{- $_ := include "mpsd.tmpfsBytes" (dict "name" "regionTmpfs.size" "size" .Values.regionTmpfs.size) -}}
{{- $shm := "none" -}}
{{- if eq .Values.ipcMode "tmpfs" -}}
{{- $shm = printf "%s/%v" (toString .Values.shmTmpfs.size) .Values.shmTmpfs.inodes -}}
{{- $_ := include "mpsd.tmpfsBytes" (dict "name" "shmTmpfs.size" "size" .Values.shmTmpfs.size) -}}
{{- end -}}
{{- dict "holderPod" $holder "ipcMode" .Values.ipcMode "regionTmpfs" $region "shmTmpfs" $shm | toJson -}}
{{- end }}
