package deploy

import (
	"bufio"
	"bytes"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"maps"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"helm.sh/helm/v4/pkg/chart/common"
	"helm.sh/helm/v4/pkg/chart/common/util"
	"helm.sh/helm/v4/pkg/chart/v2/loader"
	"helm.sh/helm/v4/pkg/engine"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
)

// The Secrets values-tls.yaml names, as deploy/README.md's recipe makes
// them from `tidepool certs init`: Secret name -> key -> the file of
// certs init that holds it.
var tlsSecrets = map[string]map[string]string{
	"tidepool-ca":          {"ca.crt": "ca.crt"},
	"tidepool-master-tls":  {"tls.crt": "master.crt", "tls.key": "master.key"},
	"tidepool-store-tls":   {"tls.crt": "store.crt", "tls.key": "store.key"},
	"tidepool-tokens":      {"tokens.json": "tokens.json"},
	"tidepool-agent-token": {"token": "client.token"},
}

// readValues reads values files of the chart and merges them in order, as
// `helm template -f A -f B` does.
func readValues(t *testing.T, files ...string) map[string]any {
	t.Helper()
	vals := map[string]any{}
	for _, f := range files {
		v, err := common.ReadValuesFile(filepath.Join("helm/tidepool", f))
		if err != nil {
			t.Fatal(err)
		}
		mergeValues(vals, v.AsMap())
	}
	return vals
}

func mergeValues(dst, src map[string]any) {
	for k, v := range src {
		if sm, ok := v.(map[string]any); ok {
			if dm, ok := dst[k].(map[string]any); ok {
				mergeValues(dm, sm)
				continue
			}
			cp := map[string]any{}
			mergeValues(cp, sm)
			dst[k] = cp
			continue
		}
		dst[k] = v
	}
}

// renderNotes renders the chart with vals and returns NOTES.txt.
func renderNotes(t *testing.T, vals map[string]any) string {
	t.Helper()
	chrt, err := loader.Load("helm/tidepool")
	if err != nil {
		t.Fatal(err)
	}
	top, err := util.ToRenderValues(chrt, vals, common.ReleaseOptions{Name: "tp", Namespace: "kv", IsInstall: true}, nil)
	if err != nil {
		t.Fatal(err)
	}
	files, err := engine.Engine{Strict: true}.Render(chrt, top)
	if err != nil {
		t.Fatal(err)
	}
	return files["tidepool/templates/NOTES.txt"]
}

// secretFile resolves a file a container reads to the Secret and key the
// kubelet puts there: the mount that holds the path must be read-only, of
// a Secret volume whose items name the path exactly.
func secretFile(spec corev1.PodSpec, c corev1.Container, file string) (secret, key string, err error) {
	for _, m := range c.VolumeMounts {
		rel, ok := strings.CutPrefix(file, m.MountPath+"/")
		if !ok {
			continue
		}
		if !m.ReadOnly {
			return "", "", fmt.Errorf("%s: mount %s is not read-only", file, m.MountPath)
		}
		if m.SubPath != "" {
			return "", "", fmt.Errorf("%s: mount %s has a subPath: a Secret's updates would not reach it", file, m.MountPath)
		}
		for _, v := range spec.Volumes {
			if v.Name != m.Name {
				continue
			}
			if v.Secret == nil {
				return "", "", fmt.Errorf("%s: volume %s is not a Secret", file, v.Name)
			}
			for _, it := range v.Secret.Items {
				if it.Path == rel {
					return v.Secret.SecretName, it.Key, nil
				}
			}
			return "", "", fmt.Errorf("%s: Secret volume %s projects no %s (items %+v)", file, v.Name, rel, v.Secret.Items)
		}
		return "", "", fmt.Errorf("%s: mount %s names no volume", file, m.Name)
	}
	return "", "", fmt.Errorf("%s: no volume is mounted there", file)
}

// checkSecretFlags checks that each flag in want appears once and names a
// file the pod mounts from the Secret and key want gives ("secret/key"),
// that no other --tls-*, --token-file or --tokens flag is passed, and that
// every Secret volume is mounted, read-only, and keeps keys and tokens from
// other users.
func checkSecretFlags(t *testing.T, what string, spec corev1.PodSpec, want map[string]string) {
	t.Helper()
	c := spec.Containers[0]
	for flag, sk := range want {
		vs := flagValue(c.Args, flag)
		if len(vs) != 1 {
			t.Errorf("%s: --%s %q, want one", what, flag, vs)
			continue
		}
		secret, key, err := secretFile(spec, c, vs[0])
		if err != nil {
			t.Errorf("%s: --%s: %v", what, flag, err)
		} else if secret+"/"+key != sk {
			t.Errorf("%s: --%s=%s is %s/%s, want %s", what, flag, vs[0], secret, key, sk)
		}
	}
	for _, a := range c.Args {
		name, _, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		if (strings.HasPrefix(name, "tls-") || name == "token-file" || name == "tokens") && want[name] == "" {
			t.Errorf("%s: unexpected %s", what, a)
		}
	}
	mounted := map[string]bool{}
	for _, m := range c.VolumeMounts {
		mounted[m.Name] = true
	}
	for _, v := range spec.Volumes {
		if v.Secret == nil {
			continue
		}
		if !mounted[v.Name] {
			t.Errorf("%s: Secret volume %s is not mounted", what, v.Name)
		}
		private := false
		for _, it := range v.Secret.Items {
			private = private || strings.HasSuffix(it.Key, ".key") || strings.Contains(it.Key, "token")
		}
		if private && (v.Secret.DefaultMode == nil || *v.Secret.DefaultMode != 0o400) {
			t.Errorf("%s: Secret volume %s holds a key or tokens with mode %v, want 0400", what, v.Name, v.Secret.DefaultMode)
		}
	}
}

// checkHTTPProbes checks that every probe of the pod is plain HTTP on the
// http port: TLS leaves that port as it was.
func checkHTTPProbes(t *testing.T, what string, spec corev1.PodSpec) {
	t.Helper()
	c := spec.Containers[0]
	for name, p := range map[string]*corev1.Probe{"startup": c.StartupProbe, "readiness": c.ReadinessProbe, "liveness": c.LivenessProbe} {
		if p == nil {
			continue
		}
		if p.HTTPGet == nil || p.HTTPGet.Port.String() != "http" || (p.HTTPGet.Scheme != "" && p.HTTPGet.Scheme != corev1.URISchemeHTTP) {
			t.Errorf("%s: %s probe %+v, want plain HTTP on the http port", what, name, p.ProbeHandler)
		}
	}
}

// TestChartTLS: values-tls.yaml mounts each Secret read-only where the
// flags point, into the pods that need it, and the probes stay HTTP.
func TestChartTLS(t *testing.T) {
	objs := render(t, "values-tls.yaml")
	sts := find[appsv1.StatefulSet](objs, "tp-tidepool-master")
	checkSecretFlags(t, "master", sts.Spec.Template.Spec, map[string]string{
		"tls-ca":   "tidepool-ca/ca.crt",
		"tls-cert": "tidepool-master-tls/tls.crt",
		"tls-key":  "tidepool-master-tls/tls.key",
		"tokens":   "tidepool-tokens/tokens.json",
	})
	checkHTTPProbes(t, "master", sts.Spec.Template.Spec)
	if ms := sts.Spec.Template.Spec.Containers[0].VolumeMounts; len(ms) == 0 || ms[0].Name != "data" || ms[0].MountPath != "/data" || ms[0].ReadOnly {
		t.Errorf("master: raft data mount %+v", ms)
	}

	store := find[appsv1.DaemonSet](objs, "tp-tidepool-store")
	spec := store.Spec.Template.Spec
	checkSecretFlags(t, "store", spec, map[string]string{
		"tls-ca":   "tidepool-ca/ca.crt",
		"tls-cert": "tidepool-store-tls/tls.crt",
		"tls-key":  "tidepool-store-tls/tls.key",
	})
	checkHTTPProbes(t, "store", spec)
	if got := flagValue(spec.Containers[0].Args, "advertise"); len(got) != 0 {
		t.Errorf("store: --advertise %q in args: with TLS the command forms it", got)
	}
	if cmd := spec.Containers[0].Command; len(cmd) != 4 || cmd[0] != "/bin/sh" || cmd[1] != "-c" {
		t.Errorf("store: command %q, want the shell that forms --advertise", cmd)
	}
	if ms := spec.Containers[0].VolumeMounts; len(ms) == 0 || ms[0].Name != "ssd" || ms[0].MountPath != "/data/ssd" {
		t.Errorf("store: SSD mount %+v", ms)
	}
	if svc := find[corev1.Service](objs, "tp-tidepool-store"); svc == nil || !svc.Spec.PublishNotReadyAddresses || svc.Spec.ClusterIP != corev1.ClusterIPNone {
		t.Errorf("store Service %+v: with TLS its names must resolve before the stores are ready", svc)
	}

	agent := find[appsv1.DaemonSet](objs, "tp-tidepool-agent")
	checkSecretFlags(t, "agent", agent.Spec.Template.Spec, map[string]string{
		"tls-ca":     "tidepool-ca/ca.crt",
		"token-file": "tidepool-agent-token/token",
	})
	checkHTTPProbes(t, "agent", agent.Spec.Template.Spec)

	// Every Secret a pod mounts is one the recipe makes, with the key.
	for what, spec := range map[string]corev1.PodSpec{"master": sts.Spec.Template.Spec, "store": spec, "agent": agent.Spec.Template.Spec} {
		for _, v := range spec.Volumes {
			if v.Secret == nil {
				continue
			}
			for _, it := range v.Secret.Items {
				if tlsSecrets[v.Secret.SecretName][it.Key] == "" {
					t.Errorf("%s: volume %s reads %s/%s, which deploy/README.md's recipe does not make", what, v.Name, v.Secret.SecretName, it.Key)
				}
			}
		}
	}
	checkFlags(t, objs)

	// A store token, where one is given, is mounted and passed too.
	vals := readValues(t, "values-tls.yaml")
	mergeValues(vals, map[string]any{"store": map[string]any{"tokenSecret": "tidepool-store-token"}})
	objs, err := renderValues(vals)
	if err != nil {
		t.Fatal(err)
	}
	store = find[appsv1.DaemonSet](objs, "tp-tidepool-store")
	checkSecretFlags(t, "store with a token", store.Spec.Template.Spec, map[string]string{
		"tls-ca":     "tidepool-ca/ca.crt",
		"tls-cert":   "tidepool-store-tls/tls.crt",
		"tls-key":    "tidepool-store-tls/tls.key",
		"token-file": "tidepool-store-token/token",
	})
	checkFlags(t, objs)
}

// TestChartTLSOff: without tls.enabled nothing of TLS is rendered, even
// with the Secrets named (values-tls.yaml with enabled false).
func TestChartTLSOff(t *testing.T) {
	vals := readValues(t, "values-tls.yaml")
	mergeValues(vals, map[string]any{"tls": map[string]any{"enabled": false}, "store": map[string]any{"tokenSecret": "x"}})
	for name, vals := range map[string]map[string]any{"default": {}, "values-tls.yaml, disabled": vals} {
		objs, err := renderValues(vals)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		for _, o := range objs {
			var spec corev1.PodSpec
			switch v := o.(type) {
			case *appsv1.StatefulSet:
				spec = v.Spec.Template.Spec
			case *appsv1.DaemonSet:
				spec = v.Spec.Template.Spec
			case *corev1.Service:
				if v.Name == "tp-tidepool-store" && v.Spec.PublishNotReadyAddresses {
					t.Errorf("%s: the store Service publishes not-ready pods", name)
				}
				continue
			default:
				continue
			}
			c := spec.Containers[0]
			if len(c.Command) != 0 {
				t.Errorf("%s: %s runs %q", name, c.Name, c.Command)
			}
			for _, a := range c.Args {
				if strings.HasPrefix(a, "--tls-") || strings.HasPrefix(a, "--token") {
					t.Errorf("%s: %s passes %s", name, c.Name, a)
				}
			}
			for _, v := range spec.Volumes {
				if v.Secret != nil {
					t.Errorf("%s: %s mounts Secret %s", name, c.Name, v.Secret.SecretName)
				}
			}
			if c.Name == "store" {
				if got := flagValue(c.Args, "advertise"); !slices.Equal(got, []string{"$(POD_IP):50061"}) {
					t.Errorf("%s: store --advertise %q", name, got)
				}
			}
		}
	}
}

// TestChartTLSMissingSecrets: tls.enabled without a Secret the enabled
// pods need fails rendering, naming every one missing and no other.
func TestChartTLSMissingSecrets(t *testing.T) {
	const msg = "tls.enabled is true but these values are not set: "
	all := []string{"tls.caSecret", "tls.masterSecret", "tls.storeSecret", "agent.tokenSecret", "tokens.secret"}
	full := func(over map[string]any) map[string]any {
		v := readValues(t, "values-tls.yaml")
		mergeValues(v, over)
		return v
	}
	for _, tc := range []struct {
		name    string
		vals    map[string]any
		missing []string // nil: renders
	}{
		{"nothing named", map[string]any{"tls": map[string]any{"enabled": true}}, all},
		{"no CA", full(map[string]any{"tls": map[string]any{"caSecret": ""}}), []string{"tls.caSecret"}},
		{"no master certificate", full(map[string]any{"tls": map[string]any{"masterSecret": ""}}), []string{"tls.masterSecret"}},
		{"no store certificate", full(map[string]any{"tls": map[string]any{"storeSecret": ""}}), []string{"tls.storeSecret"}},
		{"no store certificate, no stores", full(map[string]any{"tls": map[string]any{"storeSecret": ""}, "store": map[string]any{"enabled": false}}), nil},
		{"no agent token", full(map[string]any{"agent": map[string]any{"tokenSecret": ""}}), []string{"agent.tokenSecret"}},
		{"no tokens file", full(map[string]any{"tokens": map[string]any{"secret": ""}}), []string{"tokens.secret"}},
		{"no agent, no tokens", full(map[string]any{"agent": map[string]any{"enabled": false, "tokenSecret": ""}, "tokens": map[string]any{"secret": ""}}), nil},
		{"a store token, no tokens file", full(map[string]any{"agent": map[string]any{"enabled": false}, "tokens": map[string]any{"secret": ""}, "store": map[string]any{"tokenSecret": "s"}}), []string{"tokens.secret"}},
	} {
		objs, err := renderValues(tc.vals)
		if tc.missing == nil {
			if err != nil {
				t.Errorf("%s: %v", tc.name, err)
			} else if sts := find[appsv1.StatefulSet](objs, "tp-tidepool-master"); len(flagValue(sts.Spec.Template.Spec.Containers[0].Args, "tls-cert")) != 1 {
				t.Errorf("%s: the master has no --tls-cert", tc.name)
			}
			continue
		}
		if err == nil {
			t.Errorf("%s: rendered, want an error naming %v", tc.name, tc.missing)
			continue
		}
		e := err.Error()
		if !strings.Contains(e, msg) {
			t.Errorf("%s: %v, want %q", tc.name, err, msg)
			continue
		}
		_, list, _ := strings.Cut(e, msg)
		for _, v := range all {
			if named := strings.Contains(list, v+" ("); named != slices.Contains(tc.missing, v) {
				t.Errorf("%s: %v: names %s: %v, want %v", tc.name, err, v, named, !named)
			}
		}
	}
}

// kubeExpand expands $(VAR) references as the kubelet does in a
// container's command and args: known variables are replaced, $$ is $,
// and any other reference is left as written.
func kubeExpand(s string, env map[string]string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] != '$' || i+1 == len(s) {
			b.WriteByte(s[i])
			continue
		}
		switch s[i+1] {
		case '$':
			b.WriteByte('$')
			i++
		case '(':
			end := strings.IndexByte(s[i+2:], ')')
			if end < 0 {
				b.WriteString("$(")
				i++
				continue
			}
			name := s[i+2 : i+2+end]
			if v, ok := env[name]; ok {
				b.WriteString(v)
			} else {
				b.WriteString("$(" + name + ")")
			}
			i += 2 + end
		default:
			b.WriteString(s[i : i+2])
			i++
		}
	}
	return b.String()
}

// storeArgv runs the store container's command and args as the kubelet
// and the image would, with a stand-in tidepool on PATH that prints its
// arguments, for a pod at podIP; it returns what tidepool was run with.
func storeArgv(t *testing.T, c corev1.Container, podIP string) []string {
	t.Helper()
	env := map[string]string{"NODE_NAME": "gpu-node-7", "POD_IP": podIP}
	var argv []string
	for _, a := range append(slices.Clone(c.Command), c.Args...) {
		argv = append(argv, kubeExpand(a, env))
	}
	if len(c.Command) == 0 {
		return argv
	}
	bin := t.TempDir()
	if err := os.WriteFile(filepath.Join(bin, "tidepool"), []byte("#!/bin/sh\nfor a; do printf '%s\\n' \"$a\"; done\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = append(os.Environ(), "PATH="+bin+":"+os.Getenv("PATH"), "POD_IP="+podIP, "NODE_NAME=gpu-node-7")
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("store command %q: %v", argv, err)
	}
	return strings.Split(strings.TrimSuffix(string(out), "\n"), "\n")
}

// TestChartTLSStoreAdvertise: with TLS the store runs with the chart's
// args and --advertise naming its pod IP, dashed, under the headless store
// Service, as CoreDNS names an endpoint without a hostname (IPv6 too).
func TestChartTLSStoreAdvertise(t *testing.T) {
	objs := render(t, "values-tls.yaml")
	c := find[appsv1.DaemonSet](objs, "tp-tidepool-store").Spec.Template.Spec.Containers[0]
	for ip, host := range map[string]string{
		"10.244.3.17":      "10-244-3-17.tp-tidepool-store.kv.svc",
		"fd00:10:244::1f7": "fd00-10-244--1f7.tp-tidepool-store.kv.svc",
	} {
		got := storeArgv(t, c, ip)
		var want []string
		for _, a := range c.Args {
			want = append(want, strings.ReplaceAll(a, "$(NODE_NAME)", "gpu-node-7"))
		}
		want = append(want, "--advertise="+host+":50061")
		if !slices.Equal(got, want) {
			t.Errorf("pod IP %s: tidepool runs with\n%q\nwant\n%q", ip, got, want)
		}
	}
}

// readmeHosts are the --host arguments of deploy/README.md's `tidepool
// certs init` recipe.
func readmeHosts(t *testing.T) []string {
	t.Helper()
	b, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	var cmd string
	in := false
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if strings.HasPrefix(line, "tidepool certs init ") {
			in = true
		}
		if in {
			cmd += " " + strings.TrimSuffix(line, "\\")
			if !strings.HasSuffix(line, "\\") {
				break
			}
		}
	}
	var hosts []string
	fields := strings.Fields(cmd)
	for i, f := range fields {
		if f == "--host" && i+1 < len(fields) {
			hosts = append(hosts, strings.Trim(fields[i+1], `'"`))
		}
	}
	if len(hosts) == 0 {
		t.Fatal("deploy/README.md has no `tidepool certs init ... --host` recipe")
	}
	return hosts
}

// certsInit runs `tidepool certs init` with the README's --host arguments.
func certsInit(t *testing.T, bin string) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "certs")
	args := []string{"certs", "init", dir}
	for _, h := range readmeHosts(t) {
		args = append(args, "--host", h)
	}
	if out, err := exec.Command(bin, args...).CombinedOutput(); err != nil {
		t.Fatalf("tidepool %q: %v\n%s", args, err, out)
	}
	return dir
}

func readCert(t *testing.T, file string) *x509.Certificate {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	blk, _ := pem.Decode(b)
	if blk == nil {
		t.Fatalf("%s: no PEM", file)
	}
	c, err := x509.ParseCertificate(blk.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestChartTLSCertNames: the certificates of the README's recipe are valid
// for every name the chart has a master or store dialled at (three
// masters: values-ha.yaml with values-tls.yaml), and a store's pod IP is
// not one, which is why the stores advertise a name.
func TestChartTLSCertNames(t *testing.T) {
	objs, err := renderValues(readValues(t, "values-ha.yaml", "values-tls.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	checkFlags(t, objs)
	dir := certsInit(t, filepath.Join(helpDir, "tidepool"))
	roots := x509.NewCertPool()
	roots.AddCert(readCert(t, filepath.Join(dir, "ca.crt")))
	verify := func(role, host string) error {
		c := readCert(t, filepath.Join(dir, role+".crt"))
		if ou := c.Subject.OrganizationalUnit; len(ou) == 0 || ou[0] != role {
			t.Errorf("%s.crt: OU %q", role, ou)
		}
		// Both serve and call (raft, the masters' registry).
		for _, u := range []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth} {
			if _, err := c.Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{u}}); err != nil {
				t.Errorf("%s.crt for usage %v: %v", role, u, err)
			}
		}
		_, err := c.Verify(x509.VerifyOptions{Roots: roots, DNSName: host, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}})
		return err
	}
	hostOf := func(addr string) string {
		h, _, err := net.SplitHostPort(addr)
		if err != nil {
			t.Fatalf("%q: %v", addr, err)
		}
		return h
	}

	// Where the masters are dialled: --masters of stores and agents, the
	// raft addresses in --peers, each master's --advertise and
	// --raft-advertise (a follower's redirect, raft), and the Service.
	masters := map[string]bool{"tp-tidepool-master.kv": true, "tp-tidepool-master.kv.svc": true, "tp-tidepool-master": true}
	sts := find[appsv1.StatefulSet](objs, "tp-tidepool-master")
	margs := sts.Spec.Template.Spec.Containers[0].Args
	for i := range int(*sts.Spec.Replicas) {
		env := map[string]string{"POD_NAME": fmt.Sprintf("tp-tidepool-master-%d", i)}
		for _, f := range []string{"advertise", "raft-advertise"} {
			for _, v := range flagValue(margs, f) {
				masters[hostOf(kubeExpand(v, env))] = true
			}
		}
	}
	for _, p := range strings.Split(flagValue(margs, "peers")[0], ",") {
		_, addr, _ := strings.Cut(p, "=")
		masters[hostOf(addr)] = true
	}
	for _, ds := range []string{"tp-tidepool-store", "tp-tidepool-agent"} {
		for _, v := range flagValue(find[appsv1.DaemonSet](objs, ds).Spec.Template.Spec.Containers[0].Args, "masters") {
			for _, a := range strings.Split(v, ",") {
				masters[hostOf(a)] = true
			}
		}
	}
	if len(masters) < 6 {
		t.Errorf("master names %v: want three masters' and the Service's", slices.Sorted(maps.Keys(masters)))
	}
	for _, h := range slices.Sorted(maps.Keys(masters)) {
		if err := verify("master", h); err != nil {
			t.Errorf("master certificate for %s: %v", h, err)
		}
	}

	// Where a store is dialled: what it advertises.
	c := find[appsv1.DaemonSet](objs, "tp-tidepool-store").Spec.Template.Spec.Containers[0]
	adv := flagValue(storeArgv(t, c, "10.244.3.17"), "advertise")
	if len(adv) != 1 {
		t.Fatalf("store --advertise %q", adv)
	}
	if err := verify("store", hostOf(adv[0])); err != nil {
		t.Errorf("store certificate for %s: %v", adv[0], err)
	}
	if err := verify("store", "10.244.3.17"); err == nil {
		t.Error("the store certificate is valid for a pod IP")
	}
}

func tlsPort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// TestChartTLSLive runs a master, a store and an agent on loopback with
// the chart's TLS args (values-tls.yaml), each file they name being the
// one of `tidepool certs init` the README's recipe puts in that Secret and
// key, and addresses made local. The store registers with its
// certificate, the agent becomes ready with its token, a value goes
// through the store's TLS rails and back, and the status command
// NOTES.txt prints works with the master's own certificate.
func TestChartTLSLive(t *testing.T) {
	if testing.Short() {
		t.Skip("runs the daemons")
	}
	objs := render(t, "values-tls.yaml")
	checkFlags(t, objs)
	bin := filepath.Join(helpDir, "tidepool")
	certs := certsInit(t, bin)
	work := t.TempDir()
	g, r, mh, e, sh, ah := tlsPort(t), tlsPort(t), tlsPort(t), tlsPort(t), tlsPort(t), tlsPort(t)
	masterHost := "tp-tidepool-master-0.tp-tidepool-master-peers.kv.svc"

	// local is the container's args as the kubelet expands them with env,
	// each mounted file replaced by the certs init file of its Secret and
	// key, then each name in hosts by a local address and each flag that
	// flags names (--name=) by its value there ("" drops it).
	local := func(spec corev1.PodSpec, env, hosts, flags map[string]string) []string {
		c := spec.Containers[0]
		var out []string
		for _, a := range c.Args {
			a = kubeExpand(a, env)
			name, v, ok := strings.Cut(strings.TrimPrefix(a, "--"), "=")
			if ok && (strings.HasPrefix(name, "tls-") || name == "token-file" || name == "tokens") {
				secret, key, err := secretFile(spec, c, v)
				if err != nil {
					t.Fatal(err)
				}
				a = "--" + name + "=" + filepath.Join(certs, tlsSecrets[secret][key])
			}
			for old, nw := range hosts {
				a = strings.ReplaceAll(a, old, nw)
			}
			for prefix, nw := range flags {
				if strings.HasPrefix(a, prefix) {
					a = nw
				}
			}
			if a != "" {
				out = append(out, a)
			}
		}
		return out
	}
	start := func(args []string) { startProcess(t, bin, args) }
	ready := func(what string, port int) {
		t.Helper()
		c := http.Client{Timeout: 2 * time.Second}
		deadline := time.Now().Add(60 * time.Second)
		for {
			resp, err := c.Get(fmt.Sprintf("http://127.0.0.1:%d/readyz", port))
			if err == nil {
				resp.Body.Close()
				if resp.StatusCode == http.StatusOK {
					return
				}
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s not ready on plain HTTP: %v", what, err)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	masterAddr := fmt.Sprintf("127.0.0.1:%d", g)

	sts := find[appsv1.StatefulSet](objs, "tp-tidepool-master")
	start(local(sts.Spec.Template.Spec, map[string]string{"POD_NAME": "tp-tidepool-master-0"}, map[string]string{
		masterHost + ":50051": masterAddr,
		masterHost + ":50052": fmt.Sprintf("127.0.0.1:%d", r),
	}, map[string]string{
		"--listen=": "--listen=" + masterAddr,
		"--raft=":   fmt.Sprintf("--raft=127.0.0.1:%d", r),
		"--http=":   fmt.Sprintf("--http=127.0.0.1:%d", mh),
		"--dir=":    "--dir=" + filepath.Join(work, "master"),
	}))
	ready("master", mh)

	// The store's command adds --advertise with a cluster DNS name; here
	// it is dialled at 127.0.0.1, which certs init's certificates hold.
	store := find[appsv1.DaemonSet](objs, "tp-tidepool-store")
	sargs := local(store.Spec.Template.Spec, map[string]string{"NODE_NAME": "gpu-node-7", "POD_IP": "127.0.0.1"}, map[string]string{
		masterHost + ":50051": masterAddr,
	}, map[string]string{
		"--listen=":    fmt.Sprintf("--listen=127.0.0.1:%d", e),
		"--http=":      fmt.Sprintf("--http=127.0.0.1:%d", sh),
		"--tier=dram:": "--tier=dram:64MiB",
		"--tier=ssd:":  "",
	})
	start(append(sargs, fmt.Sprintf("--advertise=127.0.0.1:%d", e)))
	ready("store", sh)

	agent := find[appsv1.DaemonSet](objs, "tp-tidepool-agent")
	start(local(agent.Spec.Template.Spec, nil, map[string]string{
		masterHost + ":50051": masterAddr,
	}, map[string]string{
		"--socket=": "--socket=" + filepath.Join(work, "agent.sock"),
		"--http=":   fmt.Sprintf("--http=127.0.0.1:%d", ah),
	}))
	ready("agent", ah)

	run := func(args ...string) string {
		t.Helper()
		out, err := exec.Command(bin, args...).CombinedOutput()
		if err != nil {
			t.Fatalf("tidepool %q: %v\n%s", args, err, out)
		}
		return string(out)
	}
	client := []string{"--masters", masterAddr, "--tls-ca", filepath.Join(certs, "ca.crt"), "--token-file", filepath.Join(certs, "client.token")}
	value := filepath.Join(work, "value")
	if err := os.WriteFile(value, bytes.Repeat([]byte("tidepool "), 100000), 0o644); err != nil {
		t.Fatal(err)
	}
	run(append(append([]string{"put", "--no-shm", "--timeout", "30s"}, client...), "k", value)...)
	got := filepath.Join(work, "got")
	run(append(append([]string{"get", "--no-shm", "--timeout", "30s"}, client...), "k", "-o", got)...)
	if a, b := must(os.ReadFile(value)), must(os.ReadFile(got)); !bytes.Equal(a, b) {
		t.Errorf("got %d bytes back, want the %d put", len(b), len(a))
	}
	// NOTES.txt's status command, with the master's own certificate.
	out := run("status", "--masters", masterAddr, "--tls-ca", filepath.Join(certs, "ca.crt"),
		"--tls-cert", filepath.Join(certs, "master.crt"), "--tls-key", filepath.Join(certs, "master.key"))
	if !strings.Contains(out, "gpu-node-7") {
		t.Errorf("status does not show the store:\n%s", out)
	}
	// Without credentials the master refuses.
	if out, err := exec.Command(bin, "status", "--masters", masterAddr, "--tls-ca", filepath.Join(certs, "ca.crt"), "--timeout", "3s").CombinedOutput(); err == nil || !strings.Contains(string(out), "Unauthenticated") {
		t.Errorf("status without a token or certificate: %v, want Unauthenticated:\n%s", err, out)
	}
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// TestChartTLSNotes: NOTES.txt gives the commands with TLS flags that
// point at the mounted files.
func TestChartTLSNotes(t *testing.T) {
	vals := readValues(t, "values-ha.yaml", "values-tls.yaml")
	mergeValues(vals, map[string]any{"master": map[string]any{"replicas": 4}})
	notes := renderNotes(t, vals)
	for _, want := range []string{
		"tidepool status --masters tp-tidepool-master-0.tp-tidepool-master-peers.kv.svc:50051 --tls-ca /etc/tidepool/ca/ca.crt --tls-cert /etc/tidepool/tls/tls.crt --tls-key /etc/tidepool/tls/tls.key",
		"exec -i tp-tidepool-master-0 -- tidepool admin members add ID RAFTADDR GRPCADDR --masters tp-tidepool-master-0.tp-tidepool-master-peers.kv.svc:50051 --tls-ca /etc/tidepool/ca/ca.crt --token-file /dev/stdin < admin.token",
		"the Secret tidepool-agent-token",
	} {
		if !strings.Contains(notes, want) {
			t.Errorf("NOTES.txt lacks %q:\n%s", want, notes)
		}
	}
	// Every file NOTES names is one the master mounts.
	objs, err := renderValues(vals)
	if err != nil {
		t.Fatal(err)
	}
	spec := find[appsv1.StatefulSet](objs, "tp-tidepool-master").Spec.Template.Spec
	for _, f := range strings.Fields(notes) {
		if strings.HasPrefix(f, "/etc/tidepool/") {
			if _, _, err := secretFile(spec, spec.Containers[0], path.Clean(f)); err != nil {
				t.Errorf("NOTES.txt: %v", err)
			}
		}
	}
	if notes := renderNotes(t, map[string]any{}); strings.Contains(notes, "--tls") || !strings.Contains(notes, "tidepool status --masters 127.0.0.1:50051\n") {
		t.Errorf("NOTES.txt without TLS:\n%s", notes)
	}
}
