{{/* Object name prefix: "<release>-kvroute", or the release name when it already says kvroute. */}}
{{- define "kvroute.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Names of the objects other templates refer to, defined once. */}}
{{- define "kvroute.workers.name" -}}{{ include "kvroute.fullname" . }}-worker{{- end -}}
{{- define "kvroute.service.name" -}}{{ include "kvroute.fullname" . }}-workers{{- end -}}
{{- define "kvroute.headless.name" -}}{{ include "kvroute.fullname" . }}-workers-headless{{- end -}}
{{- define "kvroute.router.name" -}}{{ include "kvroute.fullname" . }}-router{{- end -}}
{{- define "kvroute.epp.name" -}}{{ include "kvroute.fullname" . }}-epp{{- end -}}
{{- define "kvroute.pool.name" -}}{{ include "kvroute.fullname" . }}-pool{{- end -}}
{{- define "kvroute.router.mesh.name" -}}{{ include "kvroute.fullname" . }}-router-mesh{{- end -}}
{{- define "kvroute.epp.mesh.name" -}}{{ include "kvroute.fullname" . }}-epp-mesh{{- end -}}
{{- define "kvroute.headless.fqdn" -}}
{{- printf "%s.%s.svc.%s" (include "kvroute.headless.name" .) .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{- define "kvroute.selectorLabels" -}}
app.kubernetes.io/name: {{ default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvroute.labels" -}}
{{ include "kvroute.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Pods of one component: call with (dict "ctx" $ "component" "worker"). */}}
{{- define "kvroute.componentSelector" -}}
{{ include "kvroute.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kvroute.componentLabels" -}}
{{ include "kvroute.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kvroute.image" -}}
{{- printf "%s:%s" .Values.router.image.repository (default .Chart.AppVersion .Values.router.image.tag) -}}
{{- end -}}

{{/* --kv-events-config: vLLM binds both sockets because the host is "*". */}}
{{- define "kvroute.kvEventsConfig" -}}
{{- $ev := .Values.workers.kvEvents -}}
{{- dict "enable_kv_cache_events" true "publisher" "zmq" "endpoint" (printf "tcp://*:%d" (int $ev.port)) "replay_endpoint" (printf "tcp://*:%d" (int $ev.replayPort)) "topic" $ev.topic | toJson -}}
{{- end -}}

{{/* The engine arguments of every worker (the reference experiment's). */}}
{{- define "kvroute.workerArgs" -}}
- {{ .Values.model.path | quote }}
- --served-model-name
- {{ .Values.model.servedName | quote }}
- --host
- 0.0.0.0
- --port
- {{ .Values.workers.port | quote }}
- --max-model-len
- {{ .Values.workers.maxModelLen | quote }}
- --enable-prefix-caching
- --enable-prompt-tokens-details
- --kv-cache-memory-bytes
- {{ .Values.workers.kvCacheMemoryBytes | int64 | quote }}
{{- with .Values.workers.blockSize }}
- --block-size
- {{ . | quote }}
{{- end }}
- --kv-events-config
- {{ include "kvroute.kvEventsConfig" . | quote }}
{{- range .Values.workers.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/*
The router's command line, in one place. `kvroute serve` finds the workers through the headless
Service — its DNS name re-resolved (dns), or its EndpointSlices watched (k8s) — subscribes to
every worker's KV events and replay sockets on their fixed ports, and routes with the policy.
It listens on all addresses: the default, 127.0.0.1, is unreachable from outside the pod.
*/}}
{{- define "kvroute.routerArgs" -}}
- serve
- --host
- 0.0.0.0
- --port
- {{ .Values.router.port | quote }}
{{ include "kvroute.routingArgs" . }}
{{- if .Values.router.mesh.enabled }}
{{ include "kvroute.meshArgs" (dict "ctx" . "service" (include "kvroute.router.mesh.name" .) "port" .Values.router.mesh.port) }}
{{- end }}
{{- range .Values.router.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* The Endpoint Picker's command line (gateway mode): the same routing as the router's. */}}
{{- define "kvroute.eppArgs" -}}
- epp
- --host
- 0.0.0.0
- --grpc-port
- {{ .Values.gateway.grpcPort | quote }}
- --port
- {{ .Values.gateway.metricsPort | quote }}
{{ include "kvroute.routingArgs" . }}
{{- if .Values.gateway.mesh.enabled }}
{{ include "kvroute.meshArgs" (dict "ctx" . "service" (include "kvroute.epp.mesh.name" .) "port" .Values.gateway.mesh.port) }}
{{- end }}
{{- range .Values.gateway.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/*
The replica mesh's flags, for the routers' and the Endpoint Pickers' alike: publish on the mesh
port, and take as peers every pod the component's headless mesh Service resolves to (its own
address is skipped). Call with (dict "ctx" $ "service" NAME "port" PORT).
*/}}
{{- define "kvroute.meshArgs" -}}
- --mesh-bind
- {{ printf "0.0.0.0:%d" (int .port) | quote }}
- --peer
- {{ printf "%s.%s.svc.%s:%d" .service .ctx.Release.Namespace .ctx.Values.clusterDomain (int .port) | quote }}
{{- end -}}

{{/* How the router and the Endpoint Picker find workers and route (router.* values). */}}
{{- define "kvroute.routingArgs" -}}
{{- if eq .Values.router.discovery "dns" }}
- --dns
- {{ printf "%s:%d" (include "kvroute.headless.fqdn" .) (int .Values.workers.port) }}
{{- else if eq .Values.router.discovery "k8s" }}
- --k8s-service
- {{ printf "%s/%s:http" .Release.Namespace (include "kvroute.headless.name" .) }}
{{- else if eq .Values.router.discovery "pool" }}
{{- if not .Values.gateway.enabled }}
{{- fail "router.discovery=pool follows the InferencePool of gateway mode: set gateway.enabled=true" }}
{{- end }}
- --pool
- {{ printf "%s/%s" .Release.Namespace (include "kvroute.pool.name" .) }}
{{- else }}
{{- fail (printf "router.discovery must be dns, k8s or pool, not %q" .Values.router.discovery) }}
{{- end }}
- --kv-events-port
- {{ .Values.workers.kvEvents.port | quote }}
- --kv-replay-port
- {{ .Values.workers.kvEvents.replayPort | quote }}
- --kv-events-topic
- {{ .Values.workers.kvEvents.topic | quote }}
- --policy
- {{ .Values.router.policy }}
{{- with .Values.workers.blockSize }}
- --block-size
- {{ . | quote }}
{{- end }}
{{- with .Values.router.tokenizer }}
- --tokenizer
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* The URL the bench Job measures. */}}
{{- define "kvroute.bench.url" -}}
{{- if eq .Values.bench.target "service" -}}
{{- printf "http://%s:%d" (include "kvroute.service.name" .) (int .Values.workers.port) -}}
{{- else if eq .Values.bench.target "router" -}}
{{- if not .Values.router.enabled -}}
{{- fail "bench.target=router needs router.enabled=true" -}}
{{- end -}}
{{- printf "http://%s:%d" (include "kvroute.router.name" .) (int .Values.router.port) -}}
{{- else -}}
{{- fail (printf "bench.target must be service or router, not %q" .Values.bench.target) -}}
{{- end -}}
{{- end -}}

{{/* The shared models volume (call only when models.volume is set). */}}
{{- define "kvroute.modelsVolume" -}}
- name: models
{{ toYaml .Values.models.volume | indent 2 }}
{{- end -}}
