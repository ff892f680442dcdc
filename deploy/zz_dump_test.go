package deploy

import (
	"fmt"
	"os"
	"testing"

	"helm.sh/helm/v4/pkg/chart/common"
	"helm.sh/helm/v4/pkg/chart/common/util"
	"helm.sh/helm/v4/pkg/chart/v2/loader"
	"helm.sh/helm/v4/pkg/engine"
)

func TestZZDump(t *testing.T) {
	chrt, _ := loader.Load("helm/tidepool")
	v, err := common.ReadValuesFile(os.Getenv("VF"))
	if err != nil {
		t.Fatal(err)
	}
	top, err := util.ToRenderValues(chrt, v.AsMap(), common.ReleaseOptions{Name: "tp", Namespace: "kv", IsInstall: true}, nil)
	if err != nil {
		t.Fatal(err)
	}
	files, err := engine.Engine{Strict: true}.Render(chrt, top)
	if err != nil {
		t.Fatal(err)
	}
	for k, f := range files {
		fmt.Printf("=== %s\n%s\n", k, f)
	}
}
