package client_test

import (
	"bytes"
	"errors"
	"fmt"
	"testing"

	"github.com/tidepool-kv/tidepool/client"
	"github.com/tidepool-kv/tidepool/engine"
)

// TestReview10BatchPutChecksumsAroundInline: batches whose values total
// just under, at and just over the inline checksum bound (256 KiB), with a
// refused item among them, store every value's CRC-32C, and read back,
// over TCP and over shared memory (whose writes read a word of each
// fault-around span first, at odd offsets here).
func TestReview10BatchPutChecksumsAroundInline(t *testing.T) {
	c := newCluster(t, clusterOpts{})
	ctx := testCtx(t)
	for _, via := range []struct {
		name string
		cfg  engine.Config
	}{{"tcp", engine.Config{NoShm: true}}, {"shm", engine.Config{}}} {
		cl := c.newClientWith(via.cfg)
		for _, total := range []int{256<<10 - 1, 256 << 10, 256<<10 + 1, 3 << 20} {
			// Three values of odd sizes making total, and an empty one.
			sizes := []int{total / 3, total / 3, total - 2*(total/3)}
			var keys []string
			var vals [][]byte
			for i, n := range sizes {
				keys = append(keys, fmt.Sprintf("r10/%s/%d/%d", via.name, total, i))
				vals = append(vals, value(uint64(total+i), n))
			}
			keys = append(keys, fmt.Sprintf("r10/%s/%d/empty", via.name, total))
			vals = append(vals, nil)
			errs := cl.BatchPut(ctx, keys, vals)
			for i := range sizes {
				if errs[i] != nil {
					t.Fatalf("%s, total %d: put %s: %v", via.name, total, keys[i], errs[i])
				}
			}
			if !errors.Is(errs[len(sizes)], client.ErrInvalidArgument) {
				t.Fatalf("%s, total %d: the empty value: %v, want ErrInvalidArgument", via.name, total, errs[len(sizes)])
			}
			for i := range sizes {
				info, err := cl.List(ctx, keys[i])
				if err != nil || len(info) != 1 {
					t.Fatalf("%s: List %s: %v, %v", via.name, keys[i], info, err)
				}
				if got, want := info[0].Checksum, client.Checksum(vals[i]); got != want {
					t.Fatalf("%s, total %d: %s stored checksum %#x, want %#x", via.name, total, keys[i], got, want)
				}
			}
			got, gerrs := cl.BatchGet(ctx, keys[:len(sizes)])
			for i := range sizes {
				if gerrs[i] != nil || !bytes.Equal(got[i], vals[i]) {
					t.Fatalf("%s, total %d: get %s: %d bytes, %v", via.name, total, keys[i], len(got[i]), gerrs[i])
				}
			}
		}
	}
}
