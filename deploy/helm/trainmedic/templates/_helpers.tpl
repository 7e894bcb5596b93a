{{/* Names, labels and the pieces the service and the agent share. */}}

{{- define "trainmedic.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "trainmedic.fullname" -}}
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

{{- define "trainmedic.agentName" -}}
{{- printf "%s-agent" (include "trainmedic.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "trainmedic.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "trainmedic.labels" -}}
helm.sh/chart: {{ include "trainmedic.chart" . }}
app.kubernetes.io/name: {{ include "trainmedic.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: trainmedic
{{- end }}

{{/* Selector labels: the service's pods and the agent's pods are told apart by component. */}}
{{- define "trainmedic.serverSelectorLabels" -}}
app.kubernetes.io/name: {{ include "trainmedic.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: server
{{- end }}

{{- define "trainmedic.agentSelectorLabels" -}}
app.kubernetes.io/name: {{ include "trainmedic.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: agent
{{- end }}

{{- define "trainmedic.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag | toString) }}
{{- end }}

{{/* The Secret holding webhook-token, operator-token, signing-key and verify-key. */}}
{{- define "trainmedic.secretName" -}}
{{- default (include "trainmedic.fullname" .) .Values.existingSecret }}
{{- end }}

{{/* Where the Secret's files appear in the containers. */}}
{{- define "trainmedic.secretDir" -}}/etc/trainmedic/secrets{{- end }}

{{- define "trainmedic.redisUrl" -}}
{{- default (printf "redis://redis.%s.svc:6379/0" .Release.Namespace) .Values.redis.url }}
{{- end }}

{{/* TRAINMEDIC_REDIS_URL, one definition for the service and the agent, so both reach the same Redis. */}}
{{- define "trainmedic.redisEnv" -}}
- name: TRAINMEDIC_REDIS_URL
{{- if .Values.redis.existingSecret }}
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.existingSecret }}
      key: {{ .Values.redis.existingSecretKey }}
{{- else }}
  value: {{ include "trainmedic.redisUrl" . | quote }}
{{- end }}
{{- end }}

{{/* The Service's in-cluster DNS names. */}}
{{- define "trainmedic.serviceHosts" -}}
{{- $name := include "trainmedic.fullname" . }}
{{- $ns := .Release.Namespace }}
{{- list $name (printf "%s.%s" $name $ns) (printf "%s.%s.svc" $name $ns) (printf "%s.%s.svc.%s" $name $ns .Values.clusterDomain) | toJson }}
{{- end }}

{{/* TRAINMEDIC_ALLOWED_HOSTS: the Service's names, every Ingress host, then server.allowedHosts. */}}
{{- define "trainmedic.allowedHosts" -}}
{{- $hosts := include "trainmedic.serviceHosts" . | fromJsonArray }}
{{- if .Values.ingress.enabled }}
{{- range .Values.ingress.hosts }}
{{- $hosts = append $hosts .host }}
{{- end }}
{{- end }}
{{- $hosts = concat $hosts .Values.server.allowedHosts }}
{{- $hosts | uniq | join "," }}
{{- end }}

{{/* TRAINMEDIC_PUBLIC_URL: server.publicUrl, else the first Ingress host, else the Service's URL. */}}
{{- define "trainmedic.publicUrl" -}}
{{- if .Values.server.publicUrl }}
{{- .Values.server.publicUrl }}
{{- else if and .Values.ingress.enabled .Values.ingress.hosts }}
{{- $host := (first .Values.ingress.hosts).host }}
{{- $tls := false }}
{{- range .Values.ingress.tls }}
{{- if has $host (.hosts | default list) }}{{ $tls = true }}{{ end }}
{{- end }}
{{- printf "%s://%s" (ternary "https" "http" $tls) $host }}
{{- else }}
{{- printf "http://%s.%s.svc:%v" (include "trainmedic.fullname" .) .Release.Namespace .Values.service.port }}
{{- end }}
{{- end }}
