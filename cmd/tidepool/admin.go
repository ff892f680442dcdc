package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/status"

	"github.com/tidepool-kv/tidepool/engine"
	"github.com/tidepool-kv/tidepool/master/leaderconn"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
	"github.com/tidepool-kv/tidepool/tiers"
)

func runAdmin(ctx context.Context, e *env, args []string) error {
	if len(args) == 0 {
		return fmt.Errorf("%w: want a subcommand: rails, evict, pin, unpin, drain, members or quota", errUsage)
	}
	switch args[0] {
	case "rails":
		return runAdminRails(ctx, e, args[1:])
	case "evict":
		return runAdminEvict(ctx, e, args[1:])
	case "pin":
		return runAdminPin(ctx, e, args[1:])
	case "unpin":
		return runAdminUnpin(ctx, e, args[1:])
	case "drain":
		return runAdminDrain(ctx, e, args[1:])
	case "members":
		return runAdminMembers(ctx, e, args[1:])
	case "quota":
		return runAdminQuota(ctx, e, args[1:])
	}
	return fmt.Errorf("%w: unknown admin subcommand %q (want rails, evict, pin, unpin, drain, members or quota)", errUsage, args[0])
}

// runAdminRails prints the rail table a daemon serves at /debug/rails.
func runAdminRails(ctx context.Context, e *env, args []string) error {
	fs := newFlags("admin rails", "[--http ADDR]", "Show the transfer engine's rails of a store (or `tidepool up`): state, bytes in flight,\nestimated bandwidth and errors per rail and peer.", e.stderr)
	addr := fs.String("http", "127.0.0.1:9090", "HTTP address of the daemon (its --http)")
	asJSON := fs.Bool("json", false, "print the rails as JSON")
	if _, err := parse(fs, args, 0, 0); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+*addr+"/debug/rails", nil)
	if err != nil {
		return err
	}
	resp, err := (&http.Client{}).Do(req) // ctx bounds it
	if err != nil {
		return fmt.Errorf("ask %s for its rails: %w", *addr, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("ask %s for its rails: %s (is it a store or `tidepool up`?)", *addr, resp.Status)
	}
	var rails []engine.RailInfo
	if err := json.NewDecoder(resp.Body).Decode(&rails); err != nil {
		return fmt.Errorf("decode rails from %s: %w", *addr, err)
	}
	if *asJSON {
		return json.NewEncoder(e.stdout).Encode(rails)
	}
	return printRails(e, rails)
}

func printRails(e *env, rails []engine.RailInfo) error {
	if len(rails) == 0 {
		fmt.Fprintln(e.stdout, "no rails yet: the engine has not sent to a peer")
		return nil
	}
	tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "PEER\tRAIL\tSTATE\tIN FLIGHT\tBANDWIDTH\tERRORS")
	for _, r := range rails {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s/s\t%d\n", r.Peer, r.Addr, r.State, human(uint64(r.InflightBytes)), human(uint64(r.Bandwidth)), r.Errors)
	}
	return tw.Flush()
}

// adminCommand parses an admin command's flags and connects to the masters;
// call runs one Admin RPC on the leader.
func adminCommand(ctx context.Context, e *env, limit time.Duration, name, argsHelp, help string, args []string, minPos, maxPos int, extra func(*flag.FlagSet)) (
	context.Context, func(func(context.Context, pb.AdminClient, ...grpc.CallOption) error) error, []string, func(), error) {
	fs := newFlags("admin "+name, argsHelp, help, e.stderr)
	m := mastersFlag(fs, e)
	timeout := fs.Duration("timeout", limit, "give up after this long")
	if extra != nil {
		extra(fs)
	}
	pos, err := parse(fs, args, minPos, maxPos)
	if err != nil {
		return nil, nil, nil, nil, err
	}
	creds, err := m.masters()
	if err != nil {
		return nil, nil, nil, nil, err
	}
	conn, err := leaderconn.Dial(m.list(), creds)
	if err != nil {
		return nil, nil, nil, nil, err
	}
	ctx, cancel := context.WithTimeout(leaderconn.WithWaiting(ctx, waitNotice(e.stderr)), *timeout)
	call := func(fn func(context.Context, pb.AdminClient, ...grpc.CallOption) error) error {
		err := conn.Do(ctx, func(ctx context.Context, cc grpc.ClientConnInterface, opts ...grpc.CallOption) error {
			return fn(ctx, pb.NewAdminClient(cc), opts...)
		})
		if st, ok := status.FromError(err); ok && err != nil {
			return errors.New(st.Message())
		}
		return err
	}
	return ctx, call, pos, func() { cancel(); conn.Close() }, nil
}

func runAdminPin(ctx context.Context, e *env, args []string) error {
	var hard bool
	var ttl time.Duration
	ctx, call, pos, done, err := adminCommand(ctx, e, time.Minute, "pin", "KEY [--hard | --ttl D]",
		"Pin KEY against eviction: softly for --ttl (default 30m, at most 24h; evicted only if nothing\nelse frees enough), or --hard (never evicted; unpin to release).", args, 1, 1, func(fs *flag.FlagSet) {
			fs.BoolVar(&hard, "hard", false, "pin until unpinned")
			fs.DurationVar(&ttl, "ttl", 30*time.Minute, "how long a soft pin lasts")
		})
	if err != nil {
		return err
	}
	defer done()
	if ttl <= 0 {
		return fmt.Errorf("%w: --ttl must be positive", errUsage)
	}
	return call(func(ctx context.Context, a pb.AdminClient, o ...grpc.CallOption) error {
		resp, err := a.Pin(ctx, &pb.PinRequest{Key: pos[0], Hard: hard, TtlMs: uint64(ttl.Milliseconds())}, o...)
		return firstItemErr(resp, err)
	})
}

func runAdminUnpin(ctx context.Context, e *env, args []string) error {
	ctx, call, pos, done, err := adminCommand(ctx, e, time.Minute, "unpin", "KEY", "Drop KEY's hard and soft pins.", args, 1, 1, nil)
	if err != nil {
		return err
	}
	defer done()
	return call(func(ctx context.Context, a pb.AdminClient, o ...grpc.CallOption) error {
		resp, err := a.Unpin(ctx, &pb.KeysRequest{Keys: pos}, o...)
		return firstItemErr(resp, err)
	})
}

func firstItemErr(resp *pb.ItemsResponse, err error) error {
	if err != nil {
		return err
	}
	if len(resp.Results) == 0 {
		return errors.New("master answered no result")
	}
	if r := resp.Results[0]; r.Code != 0 {
		return errors.New(r.Message)
	}
	return nil
}

func runAdminEvict(ctx context.Context, e *env, args []string) error {
	var req pb.EvictRequest
	var olderThan time.Duration
	var tier string
	ctx, call, _, done, err := adminCommand(ctx, e, time.Minute, "evict", "[--key K] [--prefix P] [--tenant T] [--older-than D] [--to-watermark F] [--tier T] [--dry-run]",
		`Evict objects now. --key, --prefix, --tenant and --older-than evict every match (soft pins too,
never hard pins); --to-watermark F evicts least recently used objects until every segment (of
--tier) is at most F full, as the master's own eviction does. --dry-run lists what would go.`, args, 0, 0, func(fs *flag.FlagSet) {
			fs.StringVar(&req.Key, "key", "", "evict this key")
			fs.StringVar(&req.Prefix, "prefix", "", "evict keys with this prefix")
			fs.StringVar(&req.Tenant, "tenant", "", "evict objects put with this tenant")
			fs.DurationVar(&olderThan, "older-than", 0, "evict objects not read or written for this long")
			fs.Float64Var(&req.ToWatermark, "to-watermark", 0, "evict until segments are at most this fraction full")
			fs.StringVar(&tier, "tier", "", "only objects with a replica in this tier (hbm, dram or ssd); an evicted object loses every replica")
			fs.BoolVar(&req.DryRun, "dry-run", false, "list what would be evicted; change nothing")
		})
	if err != nil {
		return err
	}
	defer done()
	if olderThan < 0 {
		return fmt.Errorf("%w: --older-than must not be negative", errUsage)
	}
	req.OlderThanMs = uint64(olderThan.Milliseconds())
	if tier != "" {
		t, ok := pb.Tier_value["TIER_"+strings.ToUpper(tier)]
		if !ok {
			return fmt.Errorf("%w: --tier %q: want hbm, dram or ssd", errUsage, tier)
		}
		req.Tier = pb.Tier(t)
	}
	var resp *pb.EvictResponse
	if err := call(func(ctx context.Context, a pb.AdminClient, o ...grpc.CallOption) (err error) {
		resp, err = a.Evict(ctx, &req, o...)
		return err
	}); err != nil {
		return err
	}
	verb := "evicted"
	if req.DryRun {
		verb = "would evict"
	}
	for _, o := range resp.Objects {
		fmt.Fprintf(e.stdout, "%s\t%d\n", o.Key, o.Size)
	}
	fmt.Fprintf(e.stdout, "%s %d objects, %s", verb, len(resp.Objects), human(resp.Bytes))
	if resp.Skipped > 0 {
		fmt.Fprintf(e.stdout, "; kept %d (hard pinned, or changed meanwhile)", resp.Skipped)
	}
	fmt.Fprintln(e.stdout)
	return nil
}

func runAdminDrain(ctx context.Context, e *env, args []string) error {
	var cancelDrain, quiet bool
	ctx, call, pos, done, err := adminCommand(ctx, e, 24*time.Hour, "drain", "NODE [--cancel] [-q]",
		`Move every object off store NODE, then take it out of the pool: replicas of objects that keep
as many replicas elsewhere as their put asked for are dropped, the rest are copied to other nodes
(same tier first). Placement
skips NODE at once. Progress prints about once a second; interrupting the command does not stop the
drain (the master finishes it; run the command again to watch). Once drained, the store process
stays out of the pool until it is restarted. --cancel stops a drain.`, args, 1, 1, func(fs *flag.FlagSet) {
			fs.BoolVar(&cancelDrain, "cancel", false, "stop draining NODE; it takes new objects again")
			fs.BoolVar(&quiet, "q", false, "print only the final summary")
		})
	if err != nil {
		return err
	}
	defer done()
	var last *pb.DrainProgress
	err = call(func(ctx context.Context, a pb.AdminClient, o ...grpc.CallOption) error {
		stream, err := a.Drain(ctx, &pb.DrainRequest{Node: pos[0], Cancel: cancelDrain}, o...)
		if err != nil {
			return err
		}
		for {
			p, err := stream.Recv()
			if errors.Is(err, io.EOF) {
				return nil
			}
			if err != nil {
				return err
			}
			last = p
			if !quiet && !p.Done && !cancelDrain {
				fmt.Fprintf(e.stderr, "draining %s: %d objects (%s) left, %d moved, %d dropped, %d waiting for room\n",
					pos[0], p.ObjectsLeft, human(p.BytesLeft), p.Moved, p.Dropped, p.Waiting)
			}
		}
	})
	if err != nil {
		return err
	}
	switch {
	case last == nil:
		return errors.New("master ended the drain without a report")
	case cancelDrain:
		fmt.Fprintf(e.stdout, "drain of %s canceled; %d objects (%s) stay on it\n", pos[0], last.ObjectsLeft, human(last.BytesLeft))
	case last.Done:
		fmt.Fprintf(e.stdout, "drained %s: %d objects moved, %d dropped (another replica kept); it is out of the pool\n", pos[0], last.Moved, last.Dropped)
	default:
		return fmt.Errorf("drain of %s did not finish: %d objects left", pos[0], last.ObjectsLeft)
	}
	return nil
}

func runAdminMembers(ctx context.Context, e *env, args []string) error {
	ctx, call, pos, done, err := adminCommand(ctx, e, time.Minute, "members", "[list | add ID RAFTADDR GRPCADDR | remove ID]",
		`List the masters (raft voters), add one, or remove one. A master to add is started first with
--join (and no --peers); add makes it a voter once it answers at GRPCADDR, and it catches up from
the leader. Both changes are refused if afterwards the masters that answer would not make a quorum
(a majority of the voters): the cluster would stop taking writes. To replace a master, add the new
one, then remove the old.`, args, 0, 4, nil)
	if err != nil {
		return err
	}
	defer done()
	verb := "list"
	if len(pos) > 0 {
		verb = pos[0]
	}
	var resp *pb.MembersResponse
	switch {
	case verb == "list" && len(pos) <= 1:
		err = call(func(ctx context.Context, a pb.AdminClient, o ...grpc.CallOption) (err error) {
			resp, err = a.Members(ctx, &pb.MembersRequest{}, o...)
			return err
		})
	case verb == "add" && len(pos) == 4:
		err = call(func(ctx context.Context, a pb.AdminClient, o ...grpc.CallOption) (err error) {
			resp, err = a.AddMember(ctx, &pb.AddMemberRequest{Id: pos[1], RaftAddress: pos[2], GrpcAddress: pos[3]}, o...)
			return err
		})
	case verb == "remove" && len(pos) == 2:
		err = call(func(ctx context.Context, a pb.AdminClient, o ...grpc.CallOption) (err error) {
			resp, err = a.RemoveMember(ctx, &pb.RemoveMemberRequest{Id: pos[1]}, o...)
			return err
		})
	default:
		return fmt.Errorf("%w: want members list, members add ID RAFTADDR GRPCADDR or members remove ID", errUsage)
	}
	if err != nil {
		return err
	}
	tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "MASTER\tGRPC\tRAFT\tROLE\tANSWERS")
	for _, m := range resp.Members {
		role, answers := "follower", "yes"
		if m.Leader {
			role = "leader"
		}
		if !m.Reachable {
			answers = "no"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", m.Id, orDash(m.Address), m.RaftAddress, role, answers)
	}
	return tw.Flush()
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// runAdminQuota is `tidepool admin quota [set TENANT --tier T [--bytes SIZE] [--objects N]]`.
func runAdminQuota(ctx context.Context, e *env, args []string) error {
	var tier, size string
	var objects uint64
	ctx, call, pos, done, err := adminCommand(ctx, e, time.Minute, "quota", "[set TENANT --tier T [--bytes SIZE] [--objects N]]",
		"Without arguments, list every tenant's use and limits per tier. With set, limit TENANT in one tier:\n"+
			"the bytes of its replicas there and its objects with a replica there (0, the default, for no limit;\n"+
			"both 0 removes the quota). A put that would pass a limit first evicts the tenant's own least recently\n"+
			"used objects in that tier, and fails only if they are not enough.", args, 0, 2, func(fs *flag.FlagSet) {
			fs.StringVar(&tier, "tier", "", "with set: the tier (hbm, dram or ssd)")
			fs.StringVar(&size, "bytes", "0", "with set: the most bytes of the tenant's replicas in the tier (e.g. 8GiB; 0: no limit)")
			fs.Uint64Var(&objects, "objects", 0, "with set: the most objects of the tenant with a replica in the tier (0: no limit)")
		})
	if err != nil {
		return err
	}
	defer done()
	var resp *pb.QuotasResponse
	switch {
	case len(pos) == 0:
		err = call(func(ctx context.Context, a pb.AdminClient, o ...grpc.CallOption) (err error) {
			resp, err = a.Quotas(ctx, &pb.QuotasRequest{}, o...)
			return err
		})
	case pos[0] == "set" && len(pos) == 2:
		t, ok := pb.Tier_value["TIER_"+strings.ToUpper(tier)]
		if !ok || tier == "" || strings.EqualFold(tier, "unspecified") {
			return fmt.Errorf("%w: --tier %q: want hbm, dram or ssd", errUsage, tier)
		}
		var bytes int64
		if size != "0" {
			if bytes, err = tiers.ParseSize(size); err != nil {
				return fmt.Errorf("%w: --bytes %q: %v", errUsage, size, err)
			}
		}
		q := &pb.TenantQuota{Tenant: pos[1], Tier: pb.Tier(t), Bytes: uint64(bytes), Objects: objects}
		err = call(func(ctx context.Context, a pb.AdminClient, o ...grpc.CallOption) (err error) {
			resp, err = a.SetQuota(ctx, q, o...)
			return err
		})
	default:
		return fmt.Errorf("%w: want no arguments, or set TENANT", errUsage)
	}
	if err != nil {
		return err
	}
	tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "TENANT\tTIER\tOBJECTS\tBYTES\tQUOTA OBJECTS\tQUOTA BYTES")
	limit := func(n uint64) string {
		if n == 0 {
			return "-"
		}
		return strconv.FormatUint(n, 10)
	}
	for _, u := range resp.Tenants {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%s\t%s\n", u.Tenant, u.Tier.Name(), u.Objects, u.Bytes, limit(u.QuotaObjects), limit(u.QuotaBytes))
	}
	return tw.Flush()
}
