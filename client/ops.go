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
// lease on it has ended.
func (c *Client) Remove(ctx context.Context, key string) error {
	return c.BatchRemove(ctx, []string{key})[0]
}

// maxBatch is the most keys one request carries (the master's limit).
const maxBatch = 16384

// BatchRemove deletes objects with one master round trip per maxBatch
// keys, and returns one error per key.
func (c *Client) BatchRemove(ctx context.Context, keys []string) []error {
	// A lookup must not answer from a descriptor this client cached for a
	// key it removes (its lease keeps the bytes, but the key is gone).
	for _, k := range keys {
		c.descs.Del(k)
	}
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
		err := c.master(ctx, func(m pb.MasterClient, o ...grpc.CallOption) (err error) {
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
		var resp *pb.ListResponse
		if err := c.master(ctx, func(m pb.MasterClient, o ...grpc.CallOption) (err error) {
			resp, err = m.List(ctx, &pb.ListRequest{Prefix: prefix, StartAfter: after}, o...)
			return err
		}); err != nil {
			return out, err
		}
		out = append(out, resp.Objects...)
		if !resp.Truncated || len(resp.Objects) == 0 {
			return out, nil
		}
		after = resp.Objects[len(resp.Objects)-1].Key
	}
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
