{{/* Names, labels, the rendered proxy configuration, and the checks that refuse a broken fleet. */}}

{{- define "stackpin.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "stackpin.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "stackpin.selectorLabels" -}}
app.kubernetes.io/name: {{ include "stackpin.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "stackpin.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "stackpin.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: stackpin
{{- end }}

{{/* By digest when one is given: a tag can move, and the image's software enters every stack's fingerprint. */}}
{{- define "stackpin.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{- define "stackpin.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "stackpin.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The backend Deployment and Service of one stack: (dict "root" $ "stack" $stack). */}}
{{- define "stackpin.backendName" -}}
{{- printf "%s-backend-%s" (include "stackpin.fullname" .root) .stack.name }}
{{- end }}

{{/* An environment variable name derived from a resource name: acme-eu -> ACME_EU. */}}
{{- define "stackpin.envName" -}}
{{- . | upper | replace "-" "_" | replace "." "_" }}
{{- end }}

{{- define "stackpin.tenantKeyEnv" -}}
{{- default (printf "STACKPIN_KEY_%s" (include "stackpin.envName" .name)) .apiKeyEnv }}
{{- end }}

{{- define "stackpin.upstreamKeyEnv" -}}
{{- default (printf "STACKPIN_UPSTREAM_KEY_%s" (include "stackpin.envName" .name)) .apiKeyEnv }}
{{- end }}

{{/*
The proxy's stackpin.toml. Built as a dict and written with toToml so that prompt texts are escaped correctly.
Helm reads numbers from values as floats: the integers the chart writes go through `int`.
*/}}
{{- define "stackpin.config" -}}
{{- $cfg := dict "log_level" .Values.proxy.logLevel }}
{{- $_ := set $cfg "server" (dict "host" "0.0.0.0" "port" (int .Values.proxy.port)) }}
{{- /* The chart runs its backends as Deployments; the proxy must not start one of its own. */}}
{{- $_ := set $cfg "local_backend" (dict "enabled" "off") }}
{{- if not .Values.store.existingSecret }}
{{- $_ := set $cfg "store" (dict "url" .Values.store.url) }}
{{- end }}
{{- $_ := set $cfg "log" (dict "signing_key_env" "STACKPIN_LOG_KEY" "public_keys" .Values.log.publicKeys) }}
{{- if .Values.fleet.enabled }}
{{- $fleet := dict "key_prefix" (include "stackpin.fleetKeyPrefix" .) }}
{{- if not .Values.fleet.existingSecret }}
{{- $_ := set $fleet "redis_url" .Values.fleet.redisUrl }}
{{- end }}
{{- $_ := set $cfg "fleet" $fleet }}
{{- end }}
{{- $replicas := list }}
{{- range .Values.stacks }}
{{- $url := printf "http://%s:%d" (include "stackpin.backendName" (dict "root" $ "stack" .)) (int $.Values.backend.port) }}
{{- $replicas = append $replicas (dict "name" .name "url" $url) }}
{{- end }}
{{- range .Values.upstreams }}
{{- $replica := dict "name" .name "url" .url }}
{{- if .kind }}
{{- $_ := set $replica "kind" .kind }}
{{- end }}
{{- if .model }}
{{- $_ := set $replica "model" .model }}
{{- end }}
{{- if .endpoints }}
{{- $_ := set $replica "endpoints" .endpoints }}
{{- end }}
{{- if .apiKey }}
{{- $_ := set $replica "api_key_env" (include "stackpin.upstreamKeyEnv" .) }}
{{- end }}
{{- if .stack }}
{{- $_ := set $replica "stack" .stack }}
{{- end }}
{{- $replicas = append $replicas $replica }}
{{- end }}
{{- if $replicas }}
{{- $_ := set $cfg "replicas" $replicas }}
{{- end }}
{{- if .Values.prompts }}
{{- $_ := set $cfg "prompts" .Values.prompts }}
{{- end }}
{{- if .Values.routes }}
{{- $_ := set $cfg "routes" .Values.routes }}
{{- end }}
{{- $tenants := list }}
{{- range .Values.tenants }}
{{- $tenant := dict "name" .name }}
{{- if .apiKey }}
{{- $_ := set $tenant "api_key_env" (include "stackpin.tenantKeyEnv" .) }}
{{- end }}
{{- if .apiKeySha256 }}
{{- $_ := set $tenant "api_key_sha256" .apiKeySha256 }}
{{- end }}
{{- if .requestsPerMinute }}
{{- $_ := set $tenant "requests_per_minute" (int .requestsPerMinute) }}
{{- end }}
{{- if .tokensPerMinute }}
{{- $_ := set $tenant "tokens_per_minute" (int .tokensPerMinute) }}
{{- end }}
{{- $tenants = append $tenants $tenant }}
{{- end }}
{{- $_ := set $cfg "tenants" $tenants }}
{{- mergeOverwrite (deepCopy .Values.proxy.extraConfig) $cfg | toToml }}
{{- end }}

{{/* One Redis can hold several fleets: each release keeps its keys apart. */}}
{{- define "stackpin.fleetKeyPrefix" -}}
{{- default (printf "stackpin:%s:%s:" .Release.Namespace .Release.Name) .Values.fleet.keyPrefix }}
{{- end }}

{{/*
The heartbeat sidecar's environment: Redis and the key prefix only. It reads no configuration file, so it never
needs the proxy's client or upstream keys.
*/}}
{{- define "stackpin.fleetEnv" -}}
{{- if .Values.fleet.existingSecret }}
- name: STACKPIN_FLEET__REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.fleet.existingSecret }}
      key: {{ .Values.fleet.existingSecretKey }}
{{- else }}
- name: STACKPIN_FLEET__REDIS_URL
  value: {{ .Values.fleet.redisUrl | quote }}
{{- end }}
- name: STACKPIN_FLEET__KEY_PREFIX
  value: {{ include "stackpin.fleetKeyPrefix" . | quote }}
{{- end }}

{{/* Environment of every process that reads stackpin.toml: the proxy and the migration Job. */}}
{{- define "stackpin.proxyEnv" -}}
- name: STACKPIN_LOG_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.log.signingKey.secretName }}
      key: {{ .Values.log.signingKey.secretKey }}
{{- if .Values.store.existingSecret }}
- name: STACKPIN_STORE__URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.store.existingSecret }}
      key: {{ .Values.store.existingSecretKey }}
{{- end }}
{{- if and .Values.fleet.enabled .Values.fleet.existingSecret }}
- name: STACKPIN_FLEET__REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.fleet.existingSecret }}
      key: {{ .Values.fleet.existingSecretKey }}
{{- end }}
{{- range .Values.upstreams }}
{{- if .apiKey }}
- name: {{ include "stackpin.upstreamKeyEnv" . }}
  valueFrom:
    secretKeyRef:
      name: {{ .apiKey.secretName }}
      key: {{ .apiKey.secretKey }}
{{- end }}
{{- end }}
{{- range .Values.tenants }}
{{- if .apiKey }}
- name: {{ include "stackpin.tenantKeyEnv" . }}
  valueFrom:
    secretKeyRef:
      name: {{ .apiKey.secretName }}
      key: {{ .apiKey.secretKey }}
{{- end }}
{{- end }}
{{- with .Values.proxy.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The container security context and the writable /tmp every pod gets. */}}
{{- define "stackpin.containerSecurityContext" -}}
securityContext:
  {{- toYaml .Values.securityContext | nindent 2 }}
{{- end }}

{{- define "stackpin.tmpVolume" -}}
- name: tmp
  emptyDir:
    sizeLimit: 1Gi
{{- end }}

{{/*
Refuses values that would give a fleet that mixes stacks, cannot start, or cannot share state. The proxy's
ConfigMap includes it, so `helm template` and `helm install` fail before anything is applied.
*/}}
{{- define "stackpin.validate" -}}
{{- $scaled := or .Values.proxy.autoscaling.enabled (gt (int .Values.proxy.replicaCount) 1) }}
{{- if and $scaled (not .Values.fleet.enabled) }}
{{- fail "more than one proxy needs shared fleet state: set fleet.enabled=true with a Redis URL, or run one proxy without autoscaling" }}
{{- end }}
{{- if and (not .Values.store.existingSecret) (hasPrefix "sqlite" .Values.store.url) }}
{{- fail "store.url is SQLite, which a stateless proxy with a read-only root cannot keep: give a PostgreSQL URL" }}
{{- end }}
{{- if not .Values.tenants }}
{{- fail "tenants is empty: the proxy listens on every address and refuses to start without a client key" }}
{{- end }}
{{- range .Values.tenants }}
{{- if not (or .apiKey .apiKeySha256) }}
{{- fail (printf "tenant %q needs apiKey (an existing Secret) or apiKeySha256" .name) }}
{{- end }}
{{- end }}
{{- $names := dict }}
{{- range .Values.stacks }}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" (toString .name)) }}
{{- fail (printf "stack name %q must be a DNS label: lower case letters, digits and '-'" (toString .name)) }}
{{- end }}
{{- if hasKey $names .name }}
{{- fail (printf "stack name %q appears twice" .name) }}
{{- end }}
{{- $_ := set $names .name true }}
{{- $service := include "stackpin.backendName" (dict "root" $ "stack" .) }}
{{- if gt (len $service) 63 }}
{{- fail (printf "stack %q: the Service name %q is longer than 63 characters" .name $service) }}
{{- end }}
{{- if not (hasKey $.Values.hardware (toString .hardware)) }}
{{- fail (printf "stack %q: hardware %q is not a key of .Values.hardware (%s)" .name (toString .hardware) (keys $.Values.hardware | sortAlpha | join ", ")) }}
{{- end }}
{{- if not (has .kernelMode (list "batch_invariant" "default")) }}
{{- fail (printf "stack %q: kernelMode must be batch_invariant or default" .name) }}
{{- end }}
{{- if not (has .dtype (list "fp32" "bf16" "fp16")) }}
{{- fail (printf "stack %q: dtype must be fp32, bf16 or fp16" .name) }}
{{- end }}
{{- if and (gt (int (default 0 .gpus)) 0) (eq .dtype "fp32") }}
{{- fail (printf "stack %q: the kernels on GPUs run bf16 or fp16 on the tensor cores; set dtype to bf16 (or fp16)" .name) }}
{{- end }}
{{- if and (gt (int (default 0 .gpus)) 0) (ne (mod (int (default 128 .kvSplitSize)) 64) 0) }}
{{- fail (printf "stack %q: the GPU attention walks keys in tiles of 64; set kvSplitSize to a multiple of 64" .name) }}
{{- end }}
{{- if and .expertOverflow (not .expertCapacityFactor) }}
{{- fail (printf "stack %q: expertOverflow says what a capped expert does with the tokens it refuses; set expertCapacityFactor too, or remove expertOverflow" .name) }}
{{- end }}
{{- if gt (int (default 32 .maxBatchSize)) (int (default 256 .maxStepTokens)) }}
{{- fail (printf "stack %q: maxStepTokens must be at least maxBatchSize" .name) }}
{{- end }}
{{- if not .model }}
{{- fail (printf "stack %q: model (a folder under /models) is required" .name) }}
{{- end }}
{{- end }}
{{- range .Values.upstreams }}
{{- if hasKey $names .name }}
{{- fail (printf "upstream %q has the name of a stack" .name) }}
{{- end }}
{{- $_ := set $names .name true }}
{{- end }}
{{- end }}
