{{/* The chart name, or nameOverride. */}}
{{- define "omnikube.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* "<release>-<chart>" (just the release name when it already contains the chart name), or
fullnameOverride; the name of every object the chart creates. */}}
{{- define "omnikube.fullname" -}}
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

{{/* "<chart>-<version>" for the helm.sh/chart label. */}}
{{- define "omnikube.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object of the chart. */}}
{{- define "omnikube.labels" -}}
helm.sh/chart: {{ include "omnikube.chart" . }}
{{ include "omnikube.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: omnikube
{{- end }}

{{/* Labels that select the operator pods; never change them (a Deployment's selector is immutable).
The component label keeps them apart from the router and stage pods the operator creates, which also
carry app.kubernetes.io/name: omnikube. */}}
{{- define "omnikube.selectorLabels" -}}
app.kubernetes.io/name: {{ include "omnikube.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* The ServiceAccount the operator runs as. */}}
{{- define "omnikube.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "omnikube.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The operator image reference. */}}
{{- define "omnikube.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The Lease the operator elects its leader on (omni_operator.runner.OperatorConfig.lease_name). */}}
{{- define "omnikube.leaseName" -}}
omnikube-operator
{{- end }}
