package agent

import (
	"fmt"
	"testing"
	"time"

	"github.com/tidepool-kv/tidepool/client"
)

func match(end time.Time, keys ...string) client.Match {
	m := client.Match{LeaseEnd: end}
	for _, k := range keys {
		m.Blocks = append(m.Blocks, client.Block{Key: k, Size: 1})
	}
	return m
}

func TestLeases(t *testing.T) {
	now := time.Unix(1000, 0)
	ttl := 10 * time.Second

	t.Run("expiry", func(t *testing.T) {
		l := newLeases(100)
		l.keep(match(now.Add(ttl), "a", "b"), now)
		if _, end, ok := l.get("a", now.Add(7*time.Second)); !ok || !end.Equal(now.Add(ttl)) {
			t.Fatalf("a with 3s of 10s left: %v %v", end, ok)
		}
		if _, _, ok := l.get("a", now.Add(8*time.Second)); ok {
			t.Fatal("a used with less than a quarter of its lease left")
		}
		l.keep(match(now.Add(-time.Second), "c"), now) // already over
		if _, _, ok := l.get("c", now); ok {
			t.Fatal("an expired lease was kept")
		}
		l.drop("b")
		if _, _, ok := l.get("b", now); ok {
			t.Fatal("a dropped lease is still used")
		}
	})

	t.Run("bounded", func(t *testing.T) {
		l := newLeases(4) // two generations of two
		for i := range 10 {
			l.keep(match(now.Add(ttl), fmt.Sprint(i)), now)
		}
		if n := len(l.mu.cur) + len(l.mu.old); n > 4 {
			t.Fatalf("%d blocks kept, want at most 4", n)
		}
		for _, k := range []string{"8", "9"} {
			if _, _, ok := l.get(k, now); !ok {
				t.Fatalf("recent block %s was dropped", k)
			}
		}
		if _, _, ok := l.get("0", now); ok {
			t.Fatal("the oldest block is still kept")
		}
	})

	t.Run("turns with time", func(t *testing.T) {
		l := newLeases(100)
		l.keep(match(now.Add(ttl), "old"), now)
		later := now.Add(ttl + time.Second)
		l.keep(match(later.Add(ttl), "new"), later)
		evenLater := later.Add(ttl + time.Second)
		l.keep(match(evenLater.Add(ttl), "newer"), evenLater)
		if _, ok := l.mu.cur["old"]; ok {
			t.Fatal("a block outlived two turns")
		}
		if _, ok := l.mu.old["old"]; ok {
			t.Fatal("a block outlived two turns")
		}
	})

	t.Run("nil", func(t *testing.T) {
		var l *leases
		l.keep(match(now.Add(ttl), "a"), now)
		l.drop("a")
		if _, _, ok := l.get("a", now); ok {
			t.Fatal("leases off, yet a lease")
		}
	})
}
