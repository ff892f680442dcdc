package engine

import (
	"testing"

	"go.uber.org/goleak"
)

// Every test must leave no goroutine behind: Close waits for everything the engine started.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
