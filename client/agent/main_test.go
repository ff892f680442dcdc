package agent_test

import (
	"testing"

	"go.uber.org/goleak"
)

// Every test closes its agent, client and cluster; nothing may be left
// running: Close must wait for the reaper and every handler.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
