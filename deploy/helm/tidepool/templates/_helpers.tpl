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

{{/* With tls.enabled, fails rendering unless every Secret the enabled
pods need is named. Included once, from master.yaml. */}}
{{- define "tidepool.tlsCheck" -}}
{{- if .Values.tls.enabled -}}
{{- $missing := list -}}
{{- if not .Values.tls.caSecret -}}
{{- $missing = append $missing "tls.caSecret (a Secret with key ca.crt: the CA that signs the pool's certificates)" -}}
{{- end -}}
{{- if not .Values.tls.masterSecret -}}
{{- $missing = append $missing "tls.masterSecret (a kubernetes.io/tls Secret: the masters' certificate, OU master)" -}}
{{- end -}}
{{- if and .Values.store.enabled (not .Values.tls.storeSecret) -}}
{{- $missing = append $missing "tls.storeSecret (a kubernetes.io/tls Secret: the stores' certificate, OU store; or store.enabled=false)" -}}
{{- end -}}
{{- if and .Values.agent.enabled (not .Values.agent.tokenSecret) -}}
{{- $missing = append $missing "agent.tokenSecret (a Secret with key token: the client token of the agent and its callers; or agent.enabled=false)" -}}
{{- end -}}
{{- if and (not .Values.tokens.secret) (or .Values.agent.enabled (and .Values.store.enabled .Values.store.tokenSecret)) -}}
{{- $missing = append $missing "tokens.secret (a Secret with key tokens.json: the tokens the masters accept, the agent's among them)" -}}
{{- end -}}
{{- if $missing -}}
{{- fail (printf "tls.enabled is true but these values are not set: %s" (join "; " $missing)) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Where the pods mount the Secrets of tls.enabled. */}}
{{- define "tidepool.tlsDir" -}}/etc/tidepool{{- end -}}

{{/* The TLS flags of a daemon with a certificate: pass (list . SECRET),
SECRET its kubernetes.io/tls Secret. Indented for a container's args. */}}
{{- define "tidepool.tlsArgs" -}}
{{- $dir := include "tidepool.tlsDir" (index . 0) -}}
- --tls-ca={{ $dir }}/ca/ca.crt
{{- if index . 1 }}
- --tls-cert={{ $dir }}/tls/tls.crt
- --tls-key={{ $dir }}/tls/tls.key
{{- end }}
{{- end -}}

{{/* The read-only mounts of the Secrets: pass (list . CERTSECRET
TOKENSSECRET TOKENSECRET), each "" where the pod has none. */}}
{{- define "tidepool.tlsMounts" -}}
{{- $dir := include "tidepool.tlsDir" (index . 0) -}}
- {name: tls-ca, mountPath: {{ $dir }}/ca, readOnly: true}
{{- if index . 1 }}
- {name: tls, mountPath: {{ $dir }}/tls, readOnly: true}
{{- end }}
{{- if index . 2 }}
- {name: tokens, mountPath: {{ $dir }}/tokens, readOnly: true}
{{- end }}
{{- if index . 3 }}
- {name: token, mountPath: {{ $dir }}/token, readOnly: true}
{{- end }}
{{- end -}}

{{/* The Secret volumes: pass (list . CERTSECRET TOKENSSECRET TOKENSECRET)
as for tidepool.tlsMounts. Only the keys the daemon reads are projected
(a missing key keeps the pod from starting, with an event naming it);
keys and tokens are readable by the container's user (root) alone. */}}
{{- define "tidepool.tlsVolumes" -}}
{{- $root := index . 0 -}}
- name: tls-ca
  secret:
    secretName: {{ $root.Values.tls.caSecret | quote }}
    items: [{key: ca.crt, path: ca.crt}]
{{- with index . 1 }}
- name: tls
  secret:
    secretName: {{ . | quote }}
    defaultMode: 0400
    items: [{key: tls.crt, path: tls.crt}, {key: tls.key, path: tls.key}]
{{- end }}
{{- with index . 2 }}
- name: tokens
  secret:
    secretName: {{ . | quote }}
    defaultMode: 0400
    items: [{key: tokens.json, path: tokens.json}]
{{- end }}
{{- with index . 3 }}
- name: token
  secret:
    secretName: {{ . | quote }}
    defaultMode: 0400
    items: [{key: token, path: token}]
{{- end }}
{{- end -}}
