package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"maps"
	"os"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"google.golang.org/grpc/status"

	"github.com/tidepool-kv/tidepool/client"
	"github.com/tidepool-kv/tidepool/engine"
	"github.com/tidepool-kv/tidepool/master/leaderconn"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// masters is the --masters flag: explicit, else TIDEPOOL_MASTERS, else the
// local default.
// Its credentials are the flags of TLS and tokens.
type masters struct {
	flag listFlag
	env  string
	credentials
}

func mastersFlag(fs *flag.FlagSet, e *env) *masters {
	m := &masters{env: e.getenv("TIDEPOOL_MASTERS")}
	fs.Var(&m.flag, "masters", "master gRPC addresses host:port[,host:port...] (default $TIDEPOOL_MASTERS or "+defaultMaster+")")
	m.credentials.register(fs)
	return m
}

func (m *masters) list() []string {
	if len(m.flag) > 0 {
		return m.flag
	}
	if m.env != "" {
		var l listFlag
		_ = l.Set(m.env)
		return l
	}
	return []string{defaultMaster}
}

// clientCommand parses a client command's flags and opens a client. The
// returned context ends after --timeout, so a dead cluster gives an error
// instead of a hang.
func clientCommand(ctx context.Context, e *env, limit time.Duration, name, argsHelp, help string, args []string, minPos, maxPos int, extra func(*flag.FlagSet, *client.Config)) (context.Context, *client.Client, []string, func(), error) {
	fs := newFlags(name, argsHelp, help, e.stderr)
	m := mastersFlag(fs, e)
	noShm := fs.Bool("no-shm", false, "move bytes over TCP even when the store is on this host")
	timeout := fs.Duration("timeout", limit, "give up after this long (the client retries while no master leader is reachable)")
	var cfg client.Config
	if extra != nil {
		extra(fs, &cfg)
	}
	pos, err := parse(fs, args, minPos, maxPos)
	if err != nil {
		return nil, nil, nil, nil, err
	}
	cfg.Masters, cfg.EngineConfig = m.list(), engine.Config{NoShm: *noShm}
	if cfg.Credentials, err = m.masters(); err != nil {
		return nil, nil, nil, nil, err
	}
	if cfg.EngineConfig.PeerTLS, err = m.stores(); err != nil {
		return nil, nil, nil, nil, err
	}
	c, err := client.New(cfg)
	if err != nil {
		return nil, nil, nil, nil, err
	}
	ctx, cancel := context.WithTimeout(leaderconn.WithWaiting(ctx, waitNotice(e.stderr)), *timeout)
	return ctx, c, pos, func() { cancel(); c.Close() }, nil
}

// waitNotice tells the person at the terminal what a command still waiting
// for a master leader waits for, and where; if every master refuses
// connections, that no cluster seems to run.
func waitNotice(w io.Writer) func(leaderconn.Wait) {
	return func(wt leaderconn.Wait) {
		var parts []string
		refused := 0
		for _, addr := range slices.Sorted(maps.Keys(wt.Errs)) {
			why := status.Convert(wt.Errs[addr]).Message()
			if strings.Contains(why, "connection refused") {
				why = "connection refused"
				refused++
			}
			parts = append(parts, addr+": "+why)
		}
		fmt.Fprintf(w, "tidepool: still waiting for a master leader after %v (%s)\n", wt.For.Round(time.Second), strings.Join(parts, "; "))
		if refused == len(wt.Errs) {
			fmt.Fprintln(w, "tidepool: no master listens there; is a cluster running? `tidepool up` starts one on this host, --masters names another")
		}
	}
}

func runPut(ctx context.Context, e *env, args []string) error {
	ctx, c, pos, done, err := clientCommand(ctx, e, time.Minute, "put", "KEY FILE", "Store FILE (- for stdin) under KEY.", args, 2, 2, putFlags)
	if err != nil {
		return err
	}
	defer done()
	var value []byte
	if pos[1] == "-" {
		value, err = io.ReadAll(e.stdin)
	} else {
		value, err = os.ReadFile(pos[1])
	}
	if err != nil {
		return fmt.Errorf("read value: %w", err)
	}
	return c.Put(ctx, pos[0], value)
}

func runGet(ctx context.Context, e *env, args []string) error {
	var out string
	ctx, c, pos, done, err := clientCommand(ctx, e, time.Minute, "get", "KEY [-o FILE]", "Write the value of KEY to stdout or FILE.", args, 1, 1, func(fs *flag.FlagSet, _ *client.Config) {
		fs.StringVar(&out, "o", "", "write the value to this file instead of stdout")
	})
	if err != nil {
		return err
	}
	defer done()
	value, err := c.Get(ctx, pos[0])
	if err != nil {
		return err
	}
	if out == "" {
		_, err = e.stdout.Write(value)
		return err
	}
	// Write beside the target and rename, so a failed get never leaves a
	// truncated file under the requested name.
	tmp := out + ".tidepool-tmp"
	if err := os.WriteFile(tmp, value, 0o644); err != nil {
		return fmt.Errorf("write %s: %w", out, err)
	}
	return os.Rename(tmp, out)
}

func runExists(ctx context.Context, e *env, args []string) error {
	ctx, c, pos, done, err := clientCommand(ctx, e, time.Minute, "exists", "KEY", "Exit 0 if KEY is present, 1 if not.", args, 1, 1, nil)
	if err != nil {
		return err
	}
	defer done()
	ok, err := c.Exists(ctx, pos[0])
	if err != nil {
		return err
	}
	if !ok {
		fmt.Fprintln(e.stdout, "absent")
		return errAbsent
	}
	fmt.Fprintln(e.stdout, "present")
	return nil
}

func runRm(ctx context.Context, e *env, args []string) error {
	ctx, c, pos, done, err := clientCommand(ctx, e, time.Minute, "rm", "KEY", "Remove KEY.", args, 1, 1, nil)
	if err != nil {
		return err
	}
	defer done()
	return c.Remove(ctx, pos[0])
}

func runLs(ctx context.Context, e *env, args []string) error {
	var long bool
	ctx, c, pos, done, err := clientCommand(ctx, e, time.Minute, "ls", "[PREFIX]", "List objects whose key starts with PREFIX, one per line.", args, 0, 1, func(fs *flag.FlagSet, _ *client.Config) {
		fs.BoolVar(&long, "l", false, "long listing: size, state, creation time and replicas")
	})
	if err != nil {
		return err
	}
	defer done()
	prefix := ""
	if len(pos) == 1 {
		prefix = pos[0]
	}
	objs, err := c.List(ctx, prefix)
	if err != nil {
		return err
	}
	if !long {
		for _, o := range objs {
			fmt.Fprintln(e.stdout, o.Key)
		}
		return nil
	}
	tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "KEY\tSIZE\tSTATE\tCREATED\tREPLICAS")
	for _, o := range objs {
		var reps []string
		for _, r := range o.Replicas {
			reps = append(reps, r.Segment)
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%v\n", o.Key, o.Size, stateName(o.State),
			time.UnixMilli(o.CreatedUnixMs).UTC().Format(time.RFC3339), reps)
	}
	return tw.Flush()
}

func stateName(s pb.ObjectState) string {
	if s == pb.ObjectState_OBJECT_STATE_COMPLETE {
		return "complete"
	}
	return "processing"
}

func runStatus(ctx context.Context, e *env, args []string) error {
	ctx, c, _, done, err := clientCommand(ctx, e, 10*time.Second, "status", "", "Show the cluster's masters and segments.", args, 0, 0, nil)
	if err != nil {
		return err
	}
	defer done()
	st, err := c.Status(ctx)
	if err != nil {
		return err
	}
	fmt.Fprintf(e.stdout, "leader %s at %s, raft term %d, commit index %d\n", st.LeaderId, st.LeaderAddress, st.RaftTerm, st.RaftCommitIndex)
	fmt.Fprintf(e.stdout, "%d objects, %s\n", st.Objects, human(st.CompleteBytes))
	if st.RaftLogError != "" {
		fmt.Fprintf(e.stdout, "refusing writes: %s\n", st.RaftLogError)
	}
	if st.UnderReplicated > 0 {
		fmt.Fprintf(e.stdout, "re-replicating: %d objects on fewer nodes than their put asked for, %d copies running\n", st.UnderReplicated, st.Repairing)
	}
	fmt.Fprintln(e.stdout)
	tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "MASTER\tADDRESS\tROLE")
	for _, m := range st.Members {
		role := "follower"
		if m.Leader {
			role = "leader"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\n", m.Id, m.Address, role)
	}
	fmt.Fprintln(tw, "\nSEGMENT\tNODE\tTIER\tENDPOINT\tUSED\tRESERVED\tCAPACITY\tOBJECTS\tSTATE")
	for _, s := range st.Segments {
		state := "alive"
		switch {
		case !s.Alive:
			state = "silent"
		case s.Draining:
			state = "draining"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%d\t%s\n", s.Name, s.Node, s.TierName(), s.Endpoint, human(s.Used), human(s.Reserved), human(s.Capacity), s.Objects, state)
	}
	return tw.Flush()
}

func human(n uint64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := uint64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

// putFlags are the placement flags of commands that put.
func putFlags(fs *flag.FlagSet, cfg *client.Config) {
	fs.IntVar(&cfg.Replicas, "replicas", 1, "copies on distinct store nodes (best effort)")
	fs.StringVar(&cfg.Tier, "tier", "dram", "preferred tier: dram, hbm or ssd (others are used when it is full)")
	fs.StringVar(&cfg.Tenant, "tenant", "", "record this tenant with the objects (see admin evict --tenant)")
}
