{{/* The name every object of a release starts with. */}}
{{- define "tidepool.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tidepool.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "tidepool.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component (master, store, agent): pass (list . "master"). */}}
{{- define "tidepool.selector" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ $root.Chart.Name }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* The masters' headless service, whose DNS names the master pods. */}}
{{- define "tidepool.masterHeadless" -}}
{{ include "tidepool.fullname" . }}-master-peers
{{- end -}}

{{/* A master pod's stable DNS name: pass (list . INDEX). */}}
{{- define "tidepool.masterHost" -}}
{{- $root := index . 0 -}}
{{ include "tidepool.fullname" $root }}-master-{{ index . 1 }}.{{ include "tidepool.masterHeadless" $root }}.{{ $root.Release.Namespace }}.svc
{{- end -}}

{{/* Every master's gRPC address, for --masters. */}}
{{- define "tidepool.masters" -}}
{{- $root := . -}}
{{- $addrs := list -}}
{{- range $i := until (int .Values.master.replicas) -}}
{{- $addrs = append $addrs (printf "%s:%d" (include "tidepool.masterHost" (list $root $i)) (int $root.Values.ports.grpc)) -}}
{{- end -}}
{{ join "," $addrs }}
{{- end -}}

{{/* The initial voters, id=raftaddr for each of the first
master.initialReplicas masters, for --peers. */}}
{{- define "tidepool.peers" -}}
{{- $root := . -}}
{{- $n := int .Values.master.initialReplicas -}}
{{- if or (lt $n 1) (gt $n (int .Values.master.replicas)) -}}
{{- fail (printf "master.initialReplicas is %d: it must be from 1 to master.replicas (%d)" $n (int .Values.master.replicas)) -}}
{{- end -}}
{{- $peers := list -}}
{{- range $i := until $n -}}
{{- $peers = append $peers (printf "%s-master-%d=%s:%d" (include "tidepool.fullname" $root) $i (include "tidepool.masterHost" (list $root $i)) (int $root.Values.ports.raft)) -}}
{{- end -}}
{{ join "," $peers }}
{{- end -}}
