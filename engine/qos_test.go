package engine

import (
	"slices"
	"testing"
	"time"
)

var qosT0 = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

type qosPush struct {
	name  string
	class Priority
	at    time.Duration // enqueue time since qosT0
}

// drain pops everything at now, in order.
func drain(q *qosQueue[string], now time.Time, canStart func(string, int64) bool) []string {
	var out []string
	for {
		var admit func(Priority, string, int64) bool
		if canStart != nil {
			admit = func(_ Priority, tenant string, n int64) bool { return canStart(tenant, n) }
		}
		item, ok := q.pop(now, admit)
		if !ok {
			return out
		}
		out = append(out, item)
	}
}

func TestQoSOrder(t *testing.T) {
	ms := time.Millisecond
	tests := []struct {
		name   string
		pushes []qosPush
		popAt  time.Duration
		want   []string
	}{
		{"strict priority", []qosPush{{"low", Low, 0}, {"med", Medium, 0}, {"high", High, 0}}, 0,
			[]string{"high", "med", "low"}},
		{"FIFO within a class", []qosPush{{"m1", Medium, 0}, {"m2", Medium, ms}, {"m3", Medium, ms}, {"m4", Medium, 2 * ms}}, 2 * ms,
			[]string{"m1", "m2", "m3", "m4"}},
		{"zero class is Medium", []qosPush{{"m1", Medium, 0}, {"z", 0, 0}, {"m2", Medium, 0}, {"l", Low, 0}}, 0,
			[]string{"m1", "z", "m2", "l"}},
		{"out-of-range classes clamp", []qosPush{{"l9", 9, 0}, {"m", Medium, 0}, {"h-1", -1, 0}}, 0,
			[]string{"h-1", "m", "l9"}},
		// Aging moves a class up once: a Low that has waited an hour is Medium, never High.
		{"aged Low never beats High", []qosPush{{"low", Low, 0}, {"high", High, 25 * ms}}, time.Hour,
			[]string{"high", "low"}},
		// A Medium that has waited competes as High and is older than a fresh High.
		{"aged Medium beats a younger High", []qosPush{{"med", Medium, 0}, {"high", High, 15 * ms}}, 15 * ms,
			[]string{"med", "high"}},
		// After 5ms Low has not risen at all, so a Medium (even a younger one) wins.
		{"Low at 5ms still loses to Medium", []qosPush{{"low", Low, 0}, {"med", Medium, 5 * ms}}, 5 * ms,
			[]string{"med", "low"}},
		// After 10ms Low competes as Medium and is older.
		{"Low at 10ms beats a younger Medium", []qosPush{{"low", Low, 0}, {"med", Medium, ms}}, 10 * ms,
			[]string{"low", "med"}},
		// Aging stops at High: a Medium waiting an hour does not jump an older High.
		{"aging stops at High", []qosPush{{"high", High, 0}, {"med", Medium, time.Millisecond}}, time.Hour,
			[]string{"high", "med"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var q qosQueue[string]
			for _, p := range tt.pushes {
				q.push(p.name, p.class, 1, "", time.Time{}, qosT0.Add(p.at))
			}
			if q.len() != len(tt.pushes) {
				t.Fatalf("len %d after %d pushes", q.len(), len(tt.pushes))
			}
			if got := drain(&q, qosT0.Add(tt.popAt), nil); !slices.Equal(got, tt.want) {
				t.Fatalf("popped %v, want %v", got, tt.want)
			}
			if q.len() != 0 {
				t.Fatalf("len %d after draining", q.len())
			}
		})
	}
}

func TestQoSTenantCapSkips(t *testing.T) {
	caps := newTenantCaps(100)
	var q qosQueue[string]
	q.push("a1", High, 50, "a", time.Time{}, qosT0)
	q.push("a2", High, 10, "a", time.Time{}, qosT0)
	q.push("b1", Low, 60, "b", time.Time{}, qosT0)

	// a has 80 in flight: a1 (50) does not fit under the cap of 100, a2 (10) does. Skipping is per
	// request, so a2, a's first startable High, goes first, and a1 waits without being dropped.
	caps.start("a", 80)
	pop := func(want string) {
		t.Helper()
		got, ok := q.pop(qosT0, func(_ Priority, tenant string, n int64) bool { return caps.canStart(tenant, n) })
		if want == "" {
			if ok {
				t.Fatalf("popped %q, want nothing", got)
			}
			return
		}
		if !ok || got != want {
			t.Fatalf("popped %q (%v), want %q", got, ok, want)
		}
	}
	pop("a2")
	caps.start("a", 10)
	pop("b1") // a1 skipped, not dropped
	caps.start("b", 60)
	pop("")
	if q.len() != 1 {
		t.Fatalf("len %d, want a1 still queued", q.len())
	}
	caps.done("a", 90) // a's transfers finish
	pop("a1")
	caps.start("a", 50)
	if got := caps.inflight("a"); got != 50 {
		t.Fatalf("a in flight %d, want 50", got)
	}
	caps.done("a", 50)
	caps.done("b", 60)
	if caps.inflight("a") != 0 || caps.inflight("b") != 0 || len(caps.mu.inflight) != 0 {
		t.Fatalf("caps not released: %v", caps.mu.inflight)
	}
}

func TestTenantCaps(t *testing.T) {
	tests := []struct {
		name     string
		limit    int64
		inflight int64 // tenant t's bytes in flight before the check
		bytes    int64
		want     bool
	}{
		{"fits", 100, 40, 60, true},
		{"over", 100, 40, 61, false},
		{"idle tenant may start one larger than the cap", 100, 0, 500, true},
		{"but only one", 100, 500, 1, false},
		{"unlimited", 0, 1 << 40, 1 << 40, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := newTenantCaps(tt.limit)
			if tt.inflight > 0 {
				c.start("t", tt.inflight)
			}
			if got := c.canStart("t", tt.bytes); got != tt.want {
				t.Fatalf("canStart(t, %d) = %v, want %v", tt.bytes, got, tt.want)
			}
			if !c.canStart("other", tt.bytes) {
				t.Fatalf("another tenant was limited by t's bytes")
			}
		})
	}
}

func TestQoSExpired(t *testing.T) {
	ms := time.Millisecond
	var q qosQueue[string]
	// estimate: 1 byte per microsecond.
	estimate := func(bytes int64) time.Duration { return time.Duration(bytes) * time.Microsecond }
	q.push("no-deadline", Low, 1e9, "", time.Time{}, qosT0)
	q.push("tight", High, 5000, "", qosT0.Add(4*ms), qosT0)        // needs 5ms, has 4ms
	q.push("exact", Medium, 4000, "", qosT0.Add(4*ms), qosT0)      // needs 4ms, has 4ms: can make it
	q.push("loose", Medium, 1000, "", qosT0.Add(10*ms), qosT0)     // plenty
	q.push("passed", Low, 0, "", qosT0.Add(-ms), qosT0.Add(-2*ms)) // deadline already gone
	q.push("tight2", Low, 11000, "", qosT0.Add(10*ms), qosT0)      // needs 11ms

	if got, want := q.expired(qosT0, estimate), []string{"tight", "passed", "tight2"}; !slices.Equal(got, want) {
		t.Fatalf("expired %v, want %v (enqueue order)", got, want)
	}
	if q.len() != 3 {
		t.Fatalf("len %d after expiry, want 3", q.len())
	}
	// 1ms later "exact" cannot make it either; a nil estimate only catches passed deadlines.
	if got := q.expired(qosT0.Add(ms), nil); len(got) != 0 {
		t.Fatalf("nil estimate expired %v", got)
	}
	if got, want := q.expired(qosT0.Add(ms), estimate), []string{"exact"}; !slices.Equal(got, want) {
		t.Fatalf("expired %v, want %v", got, want)
	}
	if got, want := drain(&q, qosT0.Add(ms), nil), []string{"loose", "no-deadline"}; !slices.Equal(got, want) {
		t.Fatalf("left %v, want %v", got, want)
	}
}

func TestQoSPopEmpty(t *testing.T) {
	var q qosQueue[int]
	if v, ok := q.pop(qosT0, nil); ok {
		t.Fatalf("pop on empty queue = %d, true", v)
	}
	q.push(7, Low, 1, "t", time.Time{}, qosT0)
	if _, ok := q.pop(qosT0, func(Priority, string, int64) bool { return false }); ok {
		t.Fatalf("popped although no tenant may start")
	}
	if v, ok := q.pop(qosT0, nil); !ok || v != 7 {
		t.Fatalf("pop = %d, %v; want 7", v, ok)
	}
}

func TestQoSRemove(t *testing.T) {
	var q qosQueue[int]
	now := time.Unix(0, 0)
	for i := range 6 {
		q.push(i, Priority(1+i%3), 1, "", time.Time{}, now)
	}
	got := q.remove(func(i int) bool { return i%2 == 0 })
	if len(got) != 3 || q.len() != 3 {
		t.Fatalf("removed %v, %d left; want 3 removed and 3 left", got, q.len())
	}
	for q.len() > 0 {
		if i, _ := q.pop(now, nil); i%2 == 0 {
			t.Fatalf("popped removed item %d", i)
		}
	}
}

func TestQoSPushFrontKeepsTurn(t *testing.T) {
	var q qosQueue[string]
	now := time.Unix(0, 0)
	q.push("a", Medium, 1, "", time.Time{}, now)
	q.push("b", Medium, 1, "", time.Time{}, now)
	got, _ := q.pop(now, nil)
	q.pushFront(got, Medium, 1, "", now)
	if first, _ := q.pop(now, nil); first != "a" {
		t.Fatalf("after pushFront the next pop is %q, want a", first)
	}
}
