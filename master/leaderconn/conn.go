// Package leaderconn sends calls to the raft leader of a master cluster.
//
// Any master may be dialled; a follower refuses a call with
// codes.Unavailable and names the leader in the "tidepool-leader" trailer,
// and Conn retries there. When a master is down or no leader is known yet
// (an election is running), Conn tries the next one with backoff until the
// call's context ends. A Conn in use learns the masters added since it was
// dialled: every refreshEvery it asks the leader for the members, so a
// daemon keeps reaching the cluster after the masters it was given are
// replaced.
package leaderconn

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/tidepool-kv/tidepool/auth"
	"github.com/tidepool-kv/tidepool/master/framed"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

const (
	// refreshEvery is how often a Conn in use asks for the members.
	refreshEvery = 10 * time.Second
	// maxAddrs bounds the addresses a Conn rotates through.
	maxAddrs = 16
)

// Trailer names the trailer in which followers return the leader's address.
const Trailer = "tidepool-leader"

// DefaultRetryFor bounds retries of a call whose context has no deadline.
const DefaultRetryFor = 20 * time.Second

// Conn is a set of connections to the masters of one cluster.
type Conn struct {
	creds Credentials
	mu    struct {
		sync.Mutex
		addrs      []string
		dialled    []string // the addresses Dial was given: always in addrs
		next       int
		leader     string
		conns      map[string]*master
		refreshed  time.Time // when a refresh last started
		refreshing bool
		closed     bool
	}
	wg     sync.WaitGroup // the refresh running
	ctx    context.Context
	cancel context.CancelFunc // ends a refresh at Close
}

// master is the connections to one master: its unary calls framed, its
// streams (and all calls, if it does not speak framed) over gRPC.
type master struct {
	grpc   *grpc.ClientConn
	framed *framed.Client
}

// Credentials are what a Conn shows the masters.
type Credentials struct {
	// TLS, if set, is the client side of every connection; nil: plaintext.
	TLS *tls.Config
	// Token, if set, is the bearer token of every call.
	Token string
}

// Dial prepares connections to the masters; it does not block.
func Dial(addrs []string, creds Credentials) (*Conn, error) {
	if len(addrs) == 0 {
		return nil, errors.New("no master addresses given")
	}
	c := &Conn{creds: creds}
	c.ctx, c.cancel = context.WithCancel(context.Background())
	c.mu.addrs = append([]string(nil), addrs...)
	c.mu.dialled = slices.Clone(addrs)
	c.mu.conns = map[string]*master{}
	c.mu.leader = addrs[0]
	c.mu.refreshed = time.Now()
	return c, nil
}

// Call is one RPC against the connection cc; it must pass opts to the stub.
type Call func(ctx context.Context, cc grpc.ClientConnInterface, opts ...grpc.CallOption) error

// Do runs call against the leader, following redirects and retrying while
// masters are unreachable or leaderless.
func (c *Conn) Do(ctx context.Context, call Call) error { return c.do(ctx, call, false) }

// DoOnce is Do for a call that must not take effect twice, as a removal
// (a key removed, put again, then removed again by a retry, loses the new
// put). It tries another master only where the call cannot have taken
// effect: a master refused it (its answer carries the leader trailer), or
// its request was never sent. A connection lost with the call in flight
// returns that error: the outcome is unknown.
func (c *Conn) DoOnce(ctx context.Context, call Call) error { return c.do(ctx, call, true) }

func (c *Conn) do(ctx context.Context, call Call, once bool) error {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, DefaultRetryFor)
		defer cancel()
	}
	backoff := 20 * time.Millisecond
	redirects := 0
	w := newWaiting(ctx)
	defer w.end()
	var unavailable error // the last Unavailable answer, if any
	for {
		addr, cc, err := c.current()
		if err != nil {
			return err
		}
		w.trying(addr)
		var trailer metadata.MD
		err = call(ctx, cc, grpc.Trailer(&trailer))
		if status.Code(err) != codes.Unavailable {
			if err == nil {
				c.maybeRefresh(cc)
			}
			if err != nil && !once && ctx.Err() != nil && (unavailable != nil || neverConnected(err)) {
				// Ended while still looking for a leader: say so, not
				// how the last attempt was cut (for DoOnce, the cut
				// attempt's outcome is the caller's to know).
				if unavailable == nil {
					unavailable = status.Error(codes.Unavailable, status.Convert(err).Message())
				}
				return fmt.Errorf("no master leader reachable at %v: %w", c.addrs(), unavailable)
			}
			return err
		}
		unavailable = err
		if _, refused := trailer[Trailer]; once && !refused && !framed.NotSent(err) {
			c.rotate(addr) // the outcome is the caller's; the next call tries another master
			return err
		}
		if l := trailer.Get(Trailer); len(l) > 0 && l[0] != "" && l[0] != addr {
			c.setLeader(l[0])
			// Masters disagreeing during an election can bounce a call
			// between them; back off once that happens.
			if redirects++; redirects <= 3 {
				continue
			}
		} else {
			c.rotate(addr)
		}
		w.failed(addr, err)
		select {
		case <-ctx.Done():
			return fmt.Errorf("no master leader reachable at %v: %w", c.addrs(), err)
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, time.Second)
	}
}

// neverConnected reports whether err ended a gRPC call that was still
// waiting for its connection (a master that is down, reached through the
// fallback connection), as grpc-go words it: the call reached no master.
func neverConnected(err error) bool {
	return strings.Contains(status.Convert(err).Message(), "while waiting for connections to become ready")
}

func (c *Conn) current() (string, grpc.ClientConnInterface, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	addr := c.mu.leader
	if m := c.mu.conns[addr]; m != nil {
		return addr, m.framed, nil
	}
	tc := insecure.NewCredentials()
	if c.creds.TLS != nil {
		tc = credentials.NewTLS(c.creds.TLS)
	}
	opts := append(DialOptions(), grpc.WithTransportCredentials(tc),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20), grpc.MaxCallSendMsgSize(64<<20)))
	fc := framed.Credentials{TLS: c.creds.TLS}
	if c.creds.Token != "" {
		// Over plaintext too: a pool with tokens and without TLS is a
		// test's, or one whose network is trusted.
		opts = append(opts, grpc.WithPerRPCCredentials(auth.Token(c.creds.Token, true)))
		fc.Metadata = auth.BearerMetadata(c.creds.Token)
	}
	cc, err := grpc.NewClient(addr, opts...)
	if err != nil {
		return "", nil, fmt.Errorf("master address %q: %w", addr, err)
	}
	m := &master{grpc: cc, framed: framed.NewClient(addr, cc, fc)}
	c.mu.conns[addr] = m
	return addr, m.framed, nil
}

func (c *Conn) setLeader(addr string) {
	c.mu.Lock()
	c.mu.leader = addr
	c.addLocked([]string{addr})
	c.mu.Unlock()
}

// addLocked adds addresses to the rotation, up to maxAddrs; c.mu is held.
func (c *Conn) addLocked(addrs []string) {
	for _, a := range addrs {
		if a != "" && len(c.mu.addrs) < maxAddrs && !slices.Contains(c.mu.addrs, a) {
			c.mu.addrs = append(c.mu.addrs, a)
		}
	}
}

// maybeRefresh asks the master at cc, which just answered, for the
// members, in the background, at most every refreshEvery.
func (c *Conn) maybeRefresh(cc grpc.ClientConnInterface) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.mu.closed || c.mu.refreshing || time.Since(c.mu.refreshed) < refreshEvery {
		return
	}
	c.mu.refreshing, c.mu.refreshed = true, time.Now()
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		ctx, cancel := context.WithTimeout(c.ctx, 2*time.Second)
		defer cancel()
		st, err := pb.NewMasterClient(cc).Status(ctx, &pb.StatusRequest{})
		c.mu.Lock()
		defer c.mu.Unlock()
		c.mu.refreshing = false
		if err != nil || len(st.Members) == 0 {
			return
		}
		// The members now, then what Dial was given (a name for them, or
		// a master to ask when all else fails): a removed master drops out.
		var addrs []string
		for _, m := range st.Members {
			if m.Address != "" && !slices.Contains(addrs, m.Address) {
				addrs = append(addrs, m.Address)
			}
		}
		for _, a := range c.mu.dialled {
			if !slices.Contains(addrs, a) {
				addrs = append(addrs, a)
			}
		}
		c.mu.addrs = addrs[:min(len(addrs), maxAddrs)]
		c.mu.next = 0
	}()
}

// rotate moves on from a master that failed, unless another call already did.
func (c *Conn) rotate(failed string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.mu.leader != failed {
		return
	}
	c.mu.next = (c.mu.next + 1) % len(c.mu.addrs)
	c.mu.leader = c.mu.addrs[c.mu.next]
}

func (c *Conn) addrs() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.mu.addrs
}

// Close closes every connection.
func (c *Conn) Close() error {
	c.mu.Lock()
	c.mu.closed = true
	c.mu.Unlock()
	c.cancel()
	c.wg.Wait() // a refresh uses a connection
	c.mu.Lock()
	defer c.mu.Unlock()
	var errs []error
	for _, m := range c.mu.conns {
		errs = append(errs, m.framed.Close(), m.grpc.Close())
	}
	c.mu.conns = map[string]*master{}
	return errors.Join(errs...)
}
