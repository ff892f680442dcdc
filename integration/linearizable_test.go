package integration

import (
	"bytes"
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/tidepool-kv/tidepool/client"
)

// The history of a key-value workload, checked for linearizability with
// porcupine. A key holds a version (0: absent). Objects are immutable: a
// put of a key that exists changes nothing and succeeds. A call that
// failed may or may not have taken effect (a leader lost while committing
// answers so), so the model lets it do either; a failed get says nothing
// and is left out.

type linOp uint8

const (
	linPut linOp = iota
	linGet
	linRemove
)

type linInput struct {
	op      linOp
	key     string
	version uint64 // of a put
}

type linOutput struct {
	unknown bool   // the call failed: its effect is unknown
	found   bool   // get: found; remove: removed
	version uint64 // get: the version read
}

func linModel() porcupine.Model {
	m := porcupine.NondeterministicModel{
		Partition: func(h []porcupine.Operation) [][]porcupine.Operation {
			by := map[string][]porcupine.Operation{}
			for _, op := range h {
				k := op.Input.(linInput).key
				by[k] = append(by[k], op)
			}
			out := make([][]porcupine.Operation, 0, len(by))
			for _, ops := range by {
				out = append(out, ops)
			}
			return out
		},
		Init: func() []any { return []any{uint64(0)} },
		Step: func(state, input, output any) []any {
			st, in, out := state.(uint64), input.(linInput), output.(linOutput)
			switch in.op {
			case linPut:
				switch {
				case st != 0:
					return []any{st}
				case out.unknown:
					return []any{st, in.version}
				}
				return []any{in.version}
			case linGet:
				if (out.found && out.version == st) || (!out.found && st == 0) {
					return []any{st}
				}
				return nil
			}
			switch {
			case out.unknown:
				return []any{st, uint64(0)}
			case out.found == (st != 0):
				return []any{uint64(0)}
			}
			return nil
		},
		DescribeOperation: func(input, output any) string {
			in, out := input.(linInput), output.(linOutput)
			res := "ok"
			switch {
			case out.unknown:
				res = "unknown"
			case in.op == linGet && out.found:
				res = fmt.Sprint(out.version)
			case !out.found && in.op != linPut:
				res = "not found"
			}
			return fmt.Sprintf("%s(%s, %d) -> %s", [...]string{"put", "get", "remove"}[in.op], in.key, in.version, res)
		},
	}
	return m.ToModel()
}

// linValue is version v's value: the version, then bytes derived from it.
func linValue(v uint64) []byte {
	b := binary.LittleEndian.AppendUint64(nil, v)
	return append(b, faultValue(fmt.Sprint("v", v), 4<<10)...)
}

// TestLinearizableThroughLeaderKills: put, get and remove at concurrency 6
// over a few keys, from six clients, while the leader of three masters is
// SIGKILLed and restarted 20 times. The history is linearizable, so no
// acknowledged put is lost and no removal undone; no get returns bytes
// other than a put's.
func TestLinearizableThroughLeaderKills(t *testing.T) {
	if testing.Short() {
		t.Skip("kills masters for a minute or two")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	h := startMasters(t, ctx, 3, "--put-timeout", "3s", "--lease-ttl", "1s")
	startStore(t, ctx, "s1", strings.Join(h.grpc, ","), "dram:512MiB")

	var (
		mu      sync.Mutex
		history []porcupine.Operation
		wrong   []string
		okOps   atomic.Int64
		version atomic.Uint64
		stop    = make(chan struct{})
		wg      sync.WaitGroup
	)
	record := func(id int, in linInput, call time.Time, out linOutput) {
		ret := time.Now().UnixNano()
		if out.unknown {
			ret = 1 << 62 // it may take effect at any time after its call
		}
		mu.Lock()
		history = append(history, porcupine.Operation{ClientId: id, Input: in, Call: call.UnixNano(), Output: out, Return: ret})
		mu.Unlock()
	}
	do := func(id int, c *client.Client, in linInput) {
		call := time.Now()
		octx, ocancel := context.WithTimeout(ctx, 10*time.Second)
		defer ocancel()
		var out linOutput
		var err error
		switch in.op {
		case linPut:
			err = c.Put(octx, in.key, linValue(in.version))
		case linGet:
			var v []byte
			v, err = c.Get(octx, in.key)
			switch {
			case errors.Is(err, client.ErrNotFound):
				err = nil
			case err != nil:
				return // says nothing
			case len(v) < 8 || !bytes.Equal(v, linValue(binary.LittleEndian.Uint64(v))):
				mu.Lock()
				wrong = append(wrong, fmt.Sprintf("get %s returned %d bytes no put wrote", in.key, len(v)))
				mu.Unlock()
				return
			default:
				out.found, out.version = true, binary.LittleEndian.Uint64(v)
			}
		case linRemove:
			err = c.Remove(octx, in.key)
			out.found = err == nil
			if errors.Is(err, client.ErrNotFound) {
				err = nil
			}
		}
		if err != nil {
			out.unknown = true
		} else {
			okOps.Add(1)
		}
		record(id, in, call, out)
	}
	const keys = 24
	for w := range 6 {
		c := newClient(t, h.grpc...)
		rng := rand.New(rand.NewPCG(uint64(w), 7))
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				in := linInput{key: fmt.Sprintf("lin/%02d", rng.IntN(keys))}
				switch r := rng.IntN(100); {
				case r < 45:
					in.op, in.version = linPut, version.Add(1)
				case r < 85:
					in.op = linGet
				default:
					in.op = linRemove
				}
				do(w, c, in)
			}
		})
	}

	admin := newClient(t, h.grpc...)
	progress := func(what string) {
		t.Helper()
		from := okOps.Load()
		waitFor(t, 60*time.Second, func() error {
			if n := okOps.Load() - from; n < 40 {
				return fmt.Errorf("%s: %d operations succeeded since", what, n)
			}
			return nil
		})
	}
	progress("before the first kill")
	for kill := range 20 {
		var leader int
		waitFor(t, 30*time.Second, func() error {
			st, err := admin.Status(ctx)
			if err != nil {
				return err
			}
			if _, err := fmt.Sscanf(st.LeaderId, "m%d", &leader); err != nil || leader < 1 || leader > 3 {
				return fmt.Errorf("leader %q", st.LeaderId)
			}
			return nil
		})
		h.procs[leader-1].kill(t)
		h.restart(t, ctx, leader-1)
		progress(fmt.Sprintf("after kill %d (m%d)", kill+1, leader))
	}
	close(stop)
	wg.Wait()
	// Every key read once more, after everything else.
	for k := range keys {
		do(6, admin, linInput{op: linGet, key: fmt.Sprintf("lin/%02d", k)})
	}

	if len(wrong) > 0 {
		t.Fatalf("%d gets returned wrong bytes: %v", len(wrong), wrong[:min(len(wrong), 5)])
	}
	unknown := 0
	for _, op := range history {
		if op.Output.(linOutput).unknown {
			unknown++
		}
	}
	model := linModel()
	res, info := porcupine.CheckOperationsVerbose(model, history, 2*time.Minute)
	t.Logf("%d operations, %d with an unknown outcome: %s", len(history), unknown, res)
	if res != porcupine.Ok {
		for _, part := range model.Partition(history) {
			if porcupine.CheckOperations(model, part) {
				continue
			}
			slices.SortFunc(part, func(a, b porcupine.Operation) int { return cmp.Compare(a.Call, b.Call) })
			var lines []string
			for _, op := range part {
				ret := "-"
				if op.Return < 1<<62 {
					ret = fmt.Sprint(op.Return - part[0].Call)
				}
				lines = append(lines, fmt.Sprintf("c%d %d..%s %s", op.ClientId, op.Call-part[0].Call, ret, model.DescribeOperation(op.Input, op.Output)))
			}
			t.Logf("not linearizable:\n%s", strings.Join(lines, "\n"))
			break
		}
		path := filepath.Join(os.TempDir(), "tidepool-linearizability.html")
		if err := porcupine.VisualizePath(model, info, path); err != nil {
			t.Logf("visualize: %v", err)
		}
		t.Fatalf("the history is %s (see %s)", res, path)
	}
}
