package master

import (
	"testing"

	"github.com/hashicorp/raft"
)

// TestListenRaftAdvertise: the advertised raft address is kept as given,
// a name that does not resolve yet included (a new pod before DNS has its
// record), and one peers cannot dial is refused.
func TestListenRaftAdvertise(t *testing.T) {
	for _, tc := range []struct {
		advertise string
		ok        bool
	}{
		{"127.0.0.1:7000", true},
		{"master-0.peers.kv.svc:7000", true},
		{"not-yet-in-dns.invalid:7000", true},
		{"[::1]:7000", true},
		{"0.0.0.0:7000", false},
		{"[::]:7000", false},
		{":7000", false},
		{"master-0", false},
	} {
		s, err := listenRaft("127.0.0.1:0", tc.advertise, Security{})
		if (err == nil) != tc.ok {
			t.Errorf("listenRaft(%q): %v, want ok %v", tc.advertise, err, tc.ok)
		}
		if err == nil {
			if got := s.Addr().String(); got != tc.advertise {
				t.Errorf("listenRaft(%q) advertises %q", tc.advertise, got)
			}
			s.Close()
		}
	}
}

// TestNotAmongPeersWaits: a master whose id is not among Peers bootstraps
// nothing (a StatefulSet's new ordinal, given the first members' list,
// must not start a cluster of its own); it waits to be added.
func TestNotAmongPeersWaits(t *testing.T) {
	addr, tr := raft.NewInmemTransport("")
	cfg := Config{ID: "m3", Dir: t.TempDir(), Transport: tr,
		Peers: []raft.Server{{ID: "m0", Address: "m0.peers:7000"}, {ID: "m1", Address: "m1.peers:7000"}}}
	fastTimings(&cfg)
	m := start(t, cfg)
	f := m.srv.raft.GetConfiguration()
	if err := f.Error(); err != nil {
		t.Fatal(err)
	}
	if servers := f.Configuration().Servers; len(servers) != 0 {
		t.Fatalf("a master outside --peers bootstrapped %v (its address %s)", servers, addr)
	}
}
