package agent_test

import (
	"os"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/tidepool-kv/tidepool/client/agent"
)

// TestRegionSealed: a process that maps a session's region cannot shrink
// or grow it: a shrunk file under the agent's mapping would fault the agent
// (SIGBUS) and end every session.
func TestRegionSealed(t *testing.T) {
	f := newFixture(t, agent.Config{})
	r := f.open("sealed", 1<<20)
	if err := os.Truncate(r.path, 0); err == nil {
		t.Fatal("a session's region could be truncated")
	}
	if err := os.Truncate(r.path, 2<<20); err == nil {
		t.Fatal("a session's region could be grown")
	}
	file, err := os.Open(r.path)
	if err != nil {
		t.Fatal(err)
	}
	defer file.Close()
	seals, err := unix.FcntlInt(file.Fd(), unix.F_GET_SEALS, 0)
	if err != nil {
		t.Fatal(err)
	}
	if want := unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_SEAL; seals&want != want {
		t.Fatalf("seals %#x, want %#x", seals, want)
	}
}
