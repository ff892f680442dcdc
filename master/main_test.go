package master

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package if a test leaves a goroutine behind: every
// master, gRPC server and client the tests start must be closed.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
