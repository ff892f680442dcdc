package master

import (
	"context"
	"fmt"
	"strings"

	"google.golang.org/grpc/status"

	"github.com/tidepool-kv/tidepool/auth"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// A tenant's keys live under its name and a '/': a client of tenant "a"
// that puts "k" makes the object "a/k", and sees it as "k" in every answer.
// The master derives the namespace from the caller's credential, never
// from the request, so no request can name another tenant's key: its
// gets, lookups, lists, removals and puts reach its own namespace alone,
// and how fast they answer says nothing of another tenant's keys. Tenant
// names hold no '/', so namespaces never overlap. Admins, stores and the
// callers of a pool without security see the whole key space, other
// tenants' keys with their prefix.
const tenantSeparator = "/"

// callerTenant is the tenant whose namespace the call's keys live in, or
// "" for the whole key space.
func callerTenant(ctx context.Context) string {
	if id, ok := auth.FromContext(ctx); ok && id.Role == auth.Client {
		return id.Tenant
	}
	return ""
}

// ownedBy reports whether the caller may act on a put of tenant: its own
// tenant's, or any if it sees the whole key space.
func ownedBy(ctx context.Context, tenant string) bool {
	t := callerTenant(ctx)
	return t == "" || t == tenant
}

// namespace rewrites keys into and out of one tenant's namespace.
type namespace struct{ tenant, prefix string }

func newNamespace(tenant string) namespace {
	return namespace{tenant: tenant, prefix: tenant + tenantSeparator}
}

// in is key in the namespace; empty stays empty (a grant's key, a list's
// cursor), and so does a field that was not set.
func (n namespace) in(key string) string {
	if key == "" {
		return ""
	}
	return n.prefix + key
}

func (n namespace) out(key string) string { return strings.TrimPrefix(key, n.prefix) }

func (n namespace) keys(keys []string) {
	for i, k := range keys {
		keys[i] = n.in(k)
	}
}

// owner checks a request's tenant field, which may be empty or the
// caller's own, and sets it to the caller's.
func (n namespace) owner(tenant *string) error {
	if *tenant != "" && *tenant != n.tenant {
		return fmt.Errorf("%w: the request names tenant %q, the credential tenant %q", auth.ErrPermissionDenied, *tenant, n.tenant)
	}
	*tenant = n.tenant
	return nil
}

func (n namespace) putStart(it *pb.PutStartRequest) error {
	it.Key, it.Parent = n.in(it.Key), n.in(it.Parent)
	return n.owner(&it.Tenant)
}

// request rewrites req, a Master service request, in place.
func (n namespace) request(req any) error {
	switch r := req.(type) {
	case *pb.PutStartRequest:
		return n.putStart(r)
	case *pb.BatchPutStartRequest:
		for _, it := range r.Items {
			if err := n.putStart(it); err != nil {
				return err
			}
		}
	case *pb.BatchPutEndRequest:
		for _, it := range r.Items {
			it.Key, it.Parent = n.in(it.Key), n.in(it.Parent)
			if err := n.owner(&it.Tenant); err != nil {
				return err
			}
		}
		for _, it := range r.Grants {
			if err := n.putStart(it); err != nil {
				return err
			}
		}
		for _, a := range r.GrantAsks {
			if err := n.owner(&a.Tenant); err != nil {
				return err
			}
		}
	case *pb.KeysRequest:
		n.keys(r.Keys)
	case *pb.ListRequest:
		r.Prefix, r.StartAfter = n.prefix+r.Prefix, n.in(r.StartAfter)
	case *pb.CorruptReplica:
		r.Key = n.in(r.Key)
	case *pb.ChildrenRequest:
		r.Key = n.in(r.Key)
	case *pb.ScoreRequest:
		if r.Chain != nil {
			return n.request(r.Chain)
		}
	case *pb.LookupRequest:
		n.keys(r.Keys)
		if len(r.KeyLengths) > MaxBatchKeys {
			// Refused before the prefixed copy is made: its size is
			// the count times the prefix.
			return fmt.Errorf("%w: %d keys exceed the batch limit of %d", ErrInvalidRequest, len(r.KeyLengths), MaxBatchKeys)
		}
		if len(r.KeyLengths) > 0 {
			packed := make([]byte, 0, len(r.PackedKeys)+len(r.KeyLengths)*len(n.prefix))
			at := 0
			for i, l := range r.KeyLengths {
				if at+int(l) > len(r.PackedKeys) {
					return fmt.Errorf("%w: key lengths past the packed keys", ErrInvalidRequest)
				}
				packed = append(append(packed, n.prefix...), r.PackedKeys[at:at+int(l)]...)
				r.KeyLengths[i] = l + uint32(len(n.prefix))
				at += int(l)
			}
			if at != len(r.PackedKeys) {
				return fmt.Errorf("%w: packed keys beyond their lengths", ErrInvalidRequest)
			}
			r.PackedKeys = packed
		}
	}
	return nil
}

// reply rewrites resp, a Master service reply, in place: keys, and the
// keys quoted in its items' errors.
func (n namespace) reply(resp any) {
	items := func(sts ...*pb.ItemStatus) {
		for _, st := range sts {
			if st != nil && st.Message != "" {
				st.Message = n.message(st.Message)
			}
		}
	}
	switch r := resp.(type) {
	case *pb.ListResponse:
		for _, o := range r.Objects {
			o.Key, o.Parent = n.out(o.Key), n.out(o.Parent)
		}
	case *pb.ItemsResponse:
		items(r.Results...)
	case *pb.BatchPutEndResponse:
		items(r.Results...)
	case *pb.PutStartResult:
		items(r.Status)
	case *pb.BatchPutStartResponse:
		for _, it := range r.Results {
			items(it.Status)
		}
	case *pb.GetReplicasResponse:
		for _, o := range r.Results {
			items(o.Status)
		}
	}
}

// message is an error's text as the tenant put its keys: errors quote
// keys (%q), so a quoted key loses the namespace's prefix.
func (n namespace) message(s string) string {
	return strings.ReplaceAll(s, `"`+n.prefix, `"`)
}

// status is err with its message as message makes it.
func (n namespace) status(err error) error {
	st, ok := status.FromError(err)
	if !ok {
		return err
	}
	p := st.Proto()
	p.Message = n.message(p.Message)
	return status.FromProto(p).Err()
}
