package master

import (
	"testing"

	"go.uber.org/goleak"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// TestMain fails the package if a test leaves a goroutine behind: every
// master, gRPC server and client the tests start must be closed.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// replicasOf describes the complete objects of keys, as GetReplicas does.
func (f *FSM) replicasOf(keys []string) []*pb.ObjectReplicas {
	return f.replicas(keys, f.complete(keys), 0, access{})
}
