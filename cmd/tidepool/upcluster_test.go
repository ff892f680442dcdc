package main

import (
	"errors"
	"strings"
	"testing"
	"time"
)

// The ports of a local cluster are the flags' moved up per process, so
// two flags can lead to one port; up refuses such a plan with both names
// before it starts anything.
func TestUpPortsClash(t *testing.T) {
	spec := clusterSpec{masters: 3, stores: 2, dir: t.TempDir(), dram: "64MiB", ssd: "0", leaseTTL: time.Second,
		listen: "127.0.0.1:38023", raft: "127.0.0.1:45589", engine: "127.0.0.1:33783"}
	tests := []struct {
		name, http, clash string // clash: "" for none, else what the error names
	}{
		{"apart", "127.0.0.1:50000", ""},
		{"up's own http is a store's engine", "127.0.0.1:33883", "store store-1 --listen"},
		{"a child's http is a master's raft", "127.0.0.1:45489", "master m1 --raft and master m1 --http"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, _, argvs, _, err := spec.argvs(tt.http, "info")
			if tt.clash == "" {
				if err != nil || len(argvs) != 5 {
					t.Fatalf("argvs = %d, %v", len(argvs), err)
				}
				return
			}
			if !errors.Is(err, errUsage) || !strings.Contains(err.Error(), "ports clash") || !strings.Contains(err.Error(), tt.clash) {
				t.Fatalf("argvs = %v, want a usage error naming %q", err, tt.clash)
			}
		})
	}
}
