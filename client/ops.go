package client

import (
	"context"
	"fmt"

	"google.golang.org/grpc"

	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// Exists reports whether a complete object has the key.
func (c *Client) Exists(ctx context.Context, key string) (bool, error) {
	if err := validKey(key); err != nil {
		return false, err
	}
	var resp *pb.ExistsResponse
	err := c.master(ctx, func(m pb.MasterClient, o ...grpc.CallOption) (err error) {
		resp, err = m.Exists(ctx, &pb.KeysRequest{Keys: []string{key}}, o...)
		return err
	})
	if err != nil {
		return false, err
	}
	if len(resp.Exists) != 1 {
		return false, fmt.Errorf("%w: %d answers to one exists", ErrProtocol, len(resp.Exists))
	}
	return resp.Exists[0], nil
}

// Remove deletes the object. Its space is reused only after every read
// lease on it has ended. A removal that fails with ErrUnavailable because
// the leader went away with it in flight may or may not have happened: it
// is not retried, as a retry could remove a put made meanwhile.
func (c *Client) Remove(ctx context.Context, key string) error {
	return c.BatchRemove(ctx, []string{key})[0]
}

const (
	// maxBatch is the most keys one request carries (the master's limit).
	maxBatch = 16384
	// maxReplicas caps the copies one put asks for; placement gives at most
	// one per store node anyway.
	maxReplicas = 16
)

// Present reports, per key, whether a complete object has it, with one
// master round trip per maxBatch keys. A key the master would refuse (empty,
// too long) is absent.
func (c *Client) Present(ctx context.Context, keys []string) ([]bool, error) {
	out := make([]bool, len(keys))
	var query []string
	var idx []int
	for i, k := range keys {
		if validKey(k) == nil {
			query, idx = append(query, k), append(idx, i)
		}
	}
	for start := 0; start < len(query); start += maxBatch {
		part := query[start:min(start+maxBatch, len(query))]
		var resp *pb.ExistsResponse
		if err := c.master(ctx, func(m pb.MasterClient, o ...grpc.CallOption) (err error) {
			resp, err = m.Exists(ctx, &pb.KeysRequest{Keys: part}, o...)
			return err
		}); err != nil {
			return nil, err
		}
		if len(resp.Exists) != len(part) {
			return nil, fmt.Errorf("%w: %d answers to %d exists", ErrProtocol, len(resp.Exists), len(part))
		}
		for j, ok := range resp.Exists {
			out[idx[start+j]] = ok
		}
	}
	return out, nil
}

// Describe returns each key's size, checksum and replicas (fastest tier
// first), or its error (ErrNotFound when absent). The master leases what it
// describes for its lease TTL.
func (c *Client) Describe(ctx context.Context, keys []string) ([]Block, []error) {
	blocks := make([]Block, len(keys))
	errs := make([]error, len(keys))
	var query []string
	var idx []int
	for i, k := range keys {
		blocks[i].Key = k
		if errs[i] = validKey(k); errs[i] == nil {
			query, idx = append(query, k), append(idx, i)
		}
	}
	for start := 0; start < len(query); start += maxBatch {
		part := query[start:min(start+maxBatch, len(query))]
		var resp *pb.GetReplicasResponse
		err := c.master(ctx, func(m pb.MasterClient, o ...grpc.CallOption) (err error) {
			resp, err = m.GetReplicas(ctx, &pb.KeysRequest{Keys: part}, o...)
			return err
		})
		if err == nil && len(resp.Results) != len(part) {
			err = fmt.Errorf("%w: %d answers to %d describes", ErrProtocol, len(resp.Results), len(part))
		}
		for j := range part {
			i := idx[start+j]
			if err != nil {
				errs[i] = err
				continue
			}
			r := resp.Results[j]
			if errs[i] = itemError(r.Status); errs[i] == nil {
				blocks[i].Size, blocks[i].Checksum = r.Size, r.Checksum
				blocks[i].setReplicas(r.Replicas)
			}
		}
	}
	return blocks, errs
}

// BatchRemove deletes objects with one master round trip per maxBatch
// keys, and returns one error per key.
func (c *Client) BatchRemove(ctx context.Context, keys []string) []error {
	// A lookup must not answer from a descriptor this client cached for a
	// key it removes (its lease keeps the bytes, but the key is gone).
	// Outdated now, the keys miss in lookups from here on; outdated again
	// once the master has answered, so do the descriptors of lookups it
	// answered before the removal, which may reach the cache at any time.
	c.removing(keys)
	defer func() {
		c.removing(keys)
		for _, k := range keys {
			c.descs.Del(k) // outdated already: only frees the entries
		}
	}()
	errs := make([]error, len(keys))
	var query []string
	var idx []int
	for i, k := range keys {
		if errs[i] = validKey(k); errs[i] == nil {
			query = append(query, k)
			idx = append(idx, i)
		}
	}
	for start := 0; start < len(query); start += maxBatch {
		part := query[start:min(start+maxBatch, len(query))]
		var resp *pb.ItemsResponse
		// Not retried once it may have reached the leader: a retry after
		// another client put the key again would remove that put.
		err := c.masterOnce(ctx, func(m pb.MasterClient, o ...grpc.CallOption) (err error) {
			resp, err = m.Remove(ctx, &pb.KeysRequest{Keys: part}, o...)
			return err
		})
		if err == nil && len(resp.Results) != len(part) {
			err = fmt.Errorf("%w: %d answers to %d removes", ErrProtocol, len(resp.Results), len(part))
		}
		for j := range part {
			i := idx[start+j]
			if err != nil {
				errs[i] = err
			} else {
				errs[i] = itemError(resp.Results[j])
			}
		}
	}
	return errs
}

// List returns the objects whose key starts with prefix, in key order,
// fetching page after page.
func (c *Client) List(ctx context.Context, prefix string) ([]*pb.ObjectInfo, error) {
	var out []*pb.ObjectInfo
	after := ""
	for {
		page, more, err := c.ListPage(ctx, prefix, after, 0)
		out = append(out, page...)
		if err != nil || !more {
			return out, err
		}
		after = page[len(page)-1].Key
	}
}

// ListPage returns up to limit objects (0: the master's default page)
// whose key starts with prefix and sorts after startAfter, in key order,
// and whether more follow.
func (c *Client) ListPage(ctx context.Context, prefix, startAfter string, limit int) ([]*pb.ObjectInfo, bool, error) {
	var resp *pb.ListResponse
	if err := c.master(ctx, func(m pb.MasterClient, o ...grpc.CallOption) (err error) {
		resp, err = m.List(ctx, &pb.ListRequest{Prefix: prefix, StartAfter: startAfter, Limit: uint32(max(limit, 0))}, o...)
		return err
	}); err != nil {
		return nil, false, err
	}
	return resp.Objects, resp.Truncated && len(resp.Objects) > 0, nil
}

// Status describes the cluster as the leader sees it.
func (c *Client) Status(ctx context.Context) (*pb.StatusResponse, error) {
	var resp *pb.StatusResponse
	err := c.master(ctx, func(m pb.MasterClient, o ...grpc.CallOption) (err error) {
		resp, err = m.Status(ctx, &pb.StatusRequest{}, o...)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("status: %w", err)
	}
	return resp, nil
}
