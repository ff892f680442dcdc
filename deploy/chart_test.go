package deploy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"helm.sh/helm/v4/pkg/chart/common"
	"helm.sh/helm/v4/pkg/chart/common/util"
	"helm.sh/helm/v4/pkg/chart/v2/loader"
	"helm.sh/helm/v4/pkg/engine"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"sigs.k8s.io/yaml"
)

// types are the Go types of the kinds the chart may render.
var types = map[string]func() any{
	"v1/Service":                              func() any { return &corev1.Service{} },
	"apps/v1/StatefulSet":                     func() any { return &appsv1.StatefulSet{} },
	"apps/v1/DaemonSet":                       func() any { return &appsv1.DaemonSet{} },
	"policy/v1/PodDisruptionBudget":           func() any { return &policyv1.PodDisruptionBudget{} },
	"monitoring.coreos.com/v1/ServiceMonitor": func() any { return &monitoringv1.ServiceMonitor{} },
}

// render renders the chart as `helm template tp helm/tidepool -n kv -f
// valuesFile` would, and decodes each manifest strictly into its type.
func render(t *testing.T, valuesFile string) []any {
	t.Helper()
	vals := map[string]any{}
	if valuesFile != "" {
		v, err := common.ReadValuesFile(filepath.Join("helm/tidepool", valuesFile))
		if err != nil {
			t.Fatal(err)
		}
		vals = v.AsMap()
	}
	objs, err := renderValues(vals)
	if err != nil {
		t.Fatal(err)
	}
	return objs
}

// renderValues renders the chart with vals over its defaults (as `helm
// template tp helm/tidepool -n kv --set ...`) and decodes each manifest
// strictly into its type.
func renderValues(vals map[string]any) ([]any, error) {
	chrt, err := loader.Load("helm/tidepool")
	if err != nil {
		return nil, err
	}
	top, err := util.ToRenderValues(chrt, vals, common.ReleaseOptions{Name: "tp", Namespace: "kv", IsInstall: true}, nil)
	if err != nil {
		return nil, err
	}
	files, err := engine.Engine{Strict: true}.Render(chrt, top)
	if err != nil {
		return nil, err
	}
	var objs []any
	for _, name := range slices.Sorted(maps.Keys(files)) {
		if !strings.HasSuffix(name, ".yaml") {
			continue
		}
		for i, doc := range strings.Split(files[name], "\n---") {
			if strings.TrimSpace(stripComments(doc)) == "" {
				continue
			}
			js, err := yaml.YAMLToJSONStrict([]byte(doc))
			if err != nil {
				return nil, fmt.Errorf("%s #%d: %v\n%s", name, i, err, doc)
			}
			var head struct{ APIVersion, Kind string }
			if err := json.Unmarshal(js, &head); err != nil {
				return nil, fmt.Errorf("%s #%d: %v", name, i, err)
			}
			mk := types[head.APIVersion+"/"+head.Kind]
			if mk == nil {
				return nil, fmt.Errorf("%s #%d: %s %s is not a kind the test knows", name, i, head.APIVersion, head.Kind)
			}
			obj := mk()
			dec := json.NewDecoder(bytes.NewReader(js))
			dec.DisallowUnknownFields()
			if err := dec.Decode(obj); err != nil {
				return nil, fmt.Errorf("%s #%d (%s): %v\n%s", name, i, head.Kind, err, doc)
			}
			objs = append(objs, obj)
		}
	}
	return objs, nil
}

func stripComments(doc string) string {
	var b strings.Builder
	for line := range strings.Lines(doc) {
		if !strings.HasPrefix(strings.TrimSpace(line), "#") {
			b.WriteString(line)
		}
	}
	return b.String()
}

func find[T any](objs []any, name string) *T {
	for _, o := range objs {
		if v, ok := o.(*T); ok {
			if m, ok := any(v).(interface{ GetName() string }); ok && m.GetName() == name {
				return v
			}
		}
	}
	return nil
}

func count[T any](objs []any) int {
	n := 0
	for _, o := range objs {
		if _, ok := o.(*T); ok {
			n++
		}
	}
	return n
}

func flagValue(args []string, name string) []string {
	var vs []string
	for _, a := range args {
		if v, ok := strings.CutPrefix(a, "--"+name+"="); ok {
			vs = append(vs, v)
		}
	}
	return vs
}

// TestChartDefault: one master, a store and the agent on every node.
func TestChartDefault(t *testing.T) {
	objs := render(t, "")
	sts := find[appsv1.StatefulSet](objs, "tp-tidepool-master")
	if sts == nil || *sts.Spec.Replicas != 1 || sts.Spec.PodManagementPolicy != appsv1.ParallelPodManagement || sts.Spec.UpdateStrategy.Type != appsv1.OnDeleteStatefulSetStrategyType {
		t.Fatalf("master StatefulSet: %+v", sts)
	}
	args := sts.Spec.Template.Spec.Containers[0].Args
	if got := flagValue(args, "peers"); len(got) != 1 || got[0] != "tp-tidepool-master-0=tp-tidepool-master-0.tp-tidepool-master-peers.kv.svc:50052" {
		t.Errorf("--peers %q", got)
	}
	if len(sts.Spec.VolumeClaimTemplates) != 1 || sts.Spec.VolumeClaimTemplates[0].Spec.Resources.Requests.Storage().String() != "10Gi" {
		t.Errorf("master volume claims: %+v", sts.Spec.VolumeClaimTemplates)
	}
	peers := find[corev1.Service](objs, "tp-tidepool-master-peers")
	if peers == nil || peers.Spec.ClusterIP != corev1.ClusterIPNone || !peers.Spec.PublishNotReadyAddresses {
		t.Errorf("headless master service: %+v", peers)
	}
	store := find[appsv1.DaemonSet](objs, "tp-tidepool-store")
	if store == nil {
		t.Fatal("no store DaemonSet")
	}
	c := store.Spec.Template.Spec.Containers[0]
	if got := flagValue(c.Args, "tier"); !slices.Equal(got, []string{"dram:8GiB", "ssd:/data/ssd:64GiB"}) {
		t.Errorf("store tiers %q", got)
	}
	if lim := c.Resources.Limits.Memory().String(); lim != "9Gi" {
		t.Errorf("store memory limit %s, want the DRAM tier and 1Gi", lim)
	}
	if got := flagValue(c.Args, "masters"); len(got) != 1 || got[0] != "tp-tidepool-master-0.tp-tidepool-master-peers.kv.svc:50051" {
		t.Errorf("store --masters %q", got)
	}
	if agent := find[appsv1.DaemonSet](objs, "tp-tidepool-agent"); agent == nil || !agent.Spec.Template.Spec.HostPID {
		t.Errorf("agent DaemonSet: %+v", agent)
	}
	// The store shares the agent's PID namespace, so the agent maps its
	// memory instead of going over TCP.
	if !store.Spec.Template.Spec.HostPID {
		t.Error("the store is not in the host's PID namespace")
	}
	for _, c := range []corev1.Container{c, sts.Spec.Template.Spec.Containers[0]} {
		if c.StartupProbe == nil || c.StartupProbe.FailureThreshold*c.StartupProbe.PeriodSeconds < 300 {
			t.Errorf("%s: startup probe %+v, want five minutes", c.Name, c.StartupProbe)
		}
	}
	if n := count[policyv1.PodDisruptionBudget](objs); n != 0 {
		t.Errorf("%d PodDisruptionBudgets for one master, want none", n)
	}
	if n := count[monitoringv1.ServiceMonitor](objs); n != 0 {
		t.Errorf("%d ServiceMonitors by default, want none", n)
	}
	checkFlags(t, objs)
}

// TestChartValuesChecked: a release grown past its initial masters gives
// the new ones the first members' --peers (they wait to be added, and
// cannot bootstrap a second cluster); values the chart cannot honour are
// refused at render time.
func TestChartValuesChecked(t *testing.T) {
	objs, err := renderValues(map[string]any{"master": map[string]any{"replicas": 3}})
	if err != nil {
		t.Fatal(err)
	}
	sts := find[appsv1.StatefulSet](objs, "tp-tidepool-master")
	if got := flagValue(sts.Spec.Template.Spec.Containers[0].Args, "peers"); len(got) != 1 || strings.Contains(got[0], ",") {
		t.Errorf("three masters grown from one: --peers %q, want master 0 alone", got)
	}
	for _, tc := range []struct {
		vals map[string]any
		want string
	}{
		{map[string]any{"master": map[string]any{"initialReplicas": 3}}, "master.initialReplicas is 3: it must be from 1 to master.replicas (1)"},
		{map[string]any{"master": map[string]any{"initialReplicas": 0}}, "master.initialReplicas is 0"},
		{map[string]any{"store": map[string]any{"dramGiB": 1.5}}, "store.dramGiB is 1.5: whole GiB only"},
		{map[string]any{"store": map[string]any{"ssd": map[string]any{"sizeGiB": 0.5}}}, "store.ssd.sizeGiB is 0.5: whole GiB only"},
	} {
		if _, err := renderValues(tc.vals); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("values %v: %v, want an error saying %q", tc.vals, err, tc.want)
		}
	}
}

// TestChartHA: values-ha.yaml's three masters, their PDB and the
// ServiceMonitor, stores on GPU nodes.
func TestChartHA(t *testing.T) {
	objs := render(t, "values-ha.yaml")
	sts := find[appsv1.StatefulSet](objs, "tp-tidepool-master")
	if sts == nil || *sts.Spec.Replicas != 3 {
		t.Fatalf("master StatefulSet: %+v", sts)
	}
	args := sts.Spec.Template.Spec.Containers[0].Args
	peers := flagValue(args, "peers")
	if len(peers) != 1 || strings.Count(peers[0], ",") != 2 || !strings.Contains(peers[0], "tp-tidepool-master-2=tp-tidepool-master-2.tp-tidepool-master-peers.kv.svc:50052") {
		t.Errorf("--peers %q", peers)
	}
	if sts.Spec.Template.Spec.Affinity == nil || sts.Spec.Template.Spec.Affinity.PodAntiAffinity == nil {
		t.Error("three masters without anti-affinity")
	}
	pdb := find[policyv1.PodDisruptionBudget](objs, "tp-tidepool-master")
	if pdb == nil || pdb.Spec.MaxUnavailable.IntValue() != 1 {
		t.Errorf("PodDisruptionBudget: %+v", pdb)
	}
	sm := find[monitoringv1.ServiceMonitor](objs, "tp-tidepool")
	if sm == nil || sm.Labels["release"] != "prometheus" || len(sm.Spec.Endpoints) != 1 || sm.Spec.Endpoints[0].Port != "http" {
		t.Fatalf("ServiceMonitor: %+v", sm)
	}
	// It selects the three metrics services.
	n := 0
	for _, o := range objs {
		if s, ok := o.(*corev1.Service); ok && s.Labels["tidepool.io/metrics"] == "true" && s.Labels["app.kubernetes.io/instance"] == "tp" {
			n++
		}
	}
	if n != 3 {
		t.Errorf("%d services carry metrics, want master, store and agent", n)
	}
	store := find[appsv1.DaemonSet](objs, "tp-tidepool-store")
	c := store.Spec.Template.Spec.Containers[0]
	if lim := c.Resources.Limits.Memory().String(); lim != "65Gi" {
		t.Errorf("store memory limit %s", lim)
	}
	if store.Spec.Template.Spec.NodeSelector["nvidia.com/gpu.present"] != "true" || len(store.Spec.Template.Spec.Tolerations) != 1 {
		t.Errorf("stores not on GPU nodes: %+v", store.Spec.Template.Spec)
	}
	if got := flagValue(c.Args, "masters"); len(got) != 1 || strings.Count(got[0], ",") != 2 {
		t.Errorf("store --masters %q", got)
	}
	checkFlags(t, objs)
}

var (
	helpDir  string // made by TestMain
	helpOnce sync.Once
	helpErr  error
	help     = map[string]string{}
)

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "tidepool-deploy")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	helpDir = dir
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// checkFlags checks that every --flag a container passes is one its
// tidepool command has (`tidepool CMD --help`).
func checkFlags(t *testing.T, objs []any) {
	t.Helper()
	helpOnce.Do(func() {
		bin := filepath.Join(helpDir, "tidepool")
		build := exec.Command("go", "build", "-o", bin, ".")
		build.Dir = "../cmd/tidepool" // in the tidepool module
		if out, err := build.CombinedOutput(); err != nil {
			helpErr = fmt.Errorf("build tidepool: %v\n%s", err, out)
			return
		}
		for _, cmd := range []string{"master", "store", "agent"} {
			out, err := exec.Command(bin, cmd, "--help").CombinedOutput()
			if err != nil {
				helpErr = fmt.Errorf("tidepool %s --help: %v\n%s", cmd, err, out)
				return
			}
			help[cmd] = string(out)
		}
	})
	if helpErr != nil {
		t.Fatal(helpErr)
	}
	flagName := regexp.MustCompile(`^--([a-z-]+)=`)
	var specs []corev1.PodSpec
	for _, o := range objs {
		switch v := o.(type) {
		case *appsv1.StatefulSet:
			specs = append(specs, v.Spec.Template.Spec)
		case *appsv1.DaemonSet:
			specs = append(specs, v.Spec.Template.Spec)
		}
	}
	for _, spec := range specs {
		for _, c := range spec.Containers {
			h, ok := help[c.Args[0]]
			if !ok {
				t.Errorf("container %s runs tidepool %q", c.Name, c.Args[0])
				continue
			}
			for _, a := range c.Args[1:] {
				m := flagName.FindStringSubmatch(a)
				if m == nil {
					t.Errorf("container %s: argument %q is not --flag=value", c.Name, a)
				} else if !strings.Contains(h, "\n  -"+m[1]+" ") && !strings.Contains(h, "\n  -"+m[1]+"\n") {
					t.Errorf("container %s: tidepool %s has no flag --%s", c.Name, c.Args[0], m[1])
				}
			}
		}
	}
}
