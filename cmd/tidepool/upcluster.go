package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/tidepool-kv/tidepool/auth"
	"github.com/tidepool-kv/tidepool/client"
	"github.com/tidepool-kv/tidepool/master/kvevents"
	"github.com/tidepool-kv/tidepool/statuspage"
)

// `tidepool up --masters N --stores M` runs a local HA cluster: each
// master and store is a child process of this one (the same binary), so a
// user can kill one and watch the rest carry on. Ports are the flags'
// ones, moved up by portStep per process: master 1 keeps --listen and
// --raft, so the client commands' default master address works; store j
// uses --engine moved up j-1 steps. Child k's HTTP port is --http moved up
// k+1 steps, --http itself serving /readyz for the whole cluster.

// portStep separates the ports of the cluster's processes.
const portStep = 100

// clusterSpec is what `up` asks of a local cluster.
type clusterSpec struct {
	masters, stores                      int
	dir, listen, raft, engine, dram, ssd string
	leaseTTL                             time.Duration
	promoteAfter                         int
	prefault                             bool
	certs                                devCerts // empty: not secure
	plainRails                           bool     // with certs: stores serve plaintext rails too
	kvEvents                             kvevents.Config
}

// child is one process of the cluster.
type child struct {
	name string
	http string
	cmd  *exec.Cmd
	done chan struct{}
	err  error
}

// shiftPort moves addr's port up by n steps.
func shiftPort(addr string, n int) (string, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return "", fmt.Errorf("%w: address %q: %v", errUsage, addr, err)
	}
	p, err := strconv.Atoi(port)
	if err != nil || p <= 0 || p+n*portStep > 65535 {
		return "", fmt.Errorf("%w: address %q: want a port below %d for %d processes", errUsage, addr, 65535-n*portStep, n+1)
	}
	return net.JoinHostPort(host, strconv.Itoa(p+n*portStep)), nil
}

// argvs builds each child's command line: masters first, then stores.
func (c clusterSpec) argvs(httpAddr, level string) (names, https []string, argvs [][]string, masters []string, err error) {
	if c.masters < 1 || c.stores < 1 || c.masters > 9 || c.stores > 32 {
		return nil, nil, nil, nil, fmt.Errorf("%w: --masters must be 1 to 9 and --stores 1 to 32", errUsage)
	}
	if c.masters%2 == 0 {
		return nil, nil, nil, nil, fmt.Errorf("%w: --masters %d: an even number of masters tolerates no more failures than one fewer; use an odd number", errUsage, c.masters)
	}
	if httpAddr == "" {
		return nil, nil, nil, nil, fmt.Errorf("%w: a local cluster needs --http (each process's port is moved up from it)", errUsage)
	}
	shift := func(addr string, n int) string {
		a, e := shiftPort(addr, n)
		if e != nil && err == nil {
			err = e
		}
		return a
	}
	var grpcs, rafts, peers []string
	for i := range c.masters {
		grpcs, rafts = append(grpcs, shift(c.listen, i)), append(rafts, shift(c.raft, i))
		peers = append(peers, fmt.Sprintf("m%d=%s", i+1, rafts[i]))
	}
	for i := range c.masters {
		id := fmt.Sprintf("m%d", i+1)
		h := shift(httpAddr, len(names)+1)
		names, https = append(names, id), append(https, h)
		argvs = append(argvs, []string{"master", "--id", id, "--dir", filepath.Join(c.dir, id), "--listen", grpcs[i], "--raft", rafts[i],
			"--http", h, "--peers", strings.Join(peers, ","), "--lease-ttl", c.leaseTTL.String(),
			"--promote-after", strconv.Itoa(c.promoteAfter), "--log-level", level})
		if c.certs != "" {
			argvs[i] = append(argvs[i], append(c.certs.flags(auth.Master), "--tokens", c.certs.path("tokens.json"))...)
		}
		// Every master publishes what it applies: each on its own ports.
		if ev := c.kvEvents; ev.Endpoint != "" {
			argvs[i] = append(argvs[i], "--kv-events", "tcp://"+shift(strings.TrimPrefix(ev.Endpoint, "tcp://"), i),
				"--kv-events-encoding", string(ev.Encoding))
			if ev.ReplayEndpoint != "" {
				argvs[i] = append(argvs[i], "--kv-events-replay", "tcp://"+shift(strings.TrimPrefix(ev.ReplayEndpoint, "tcp://"), i))
			}
		}
	}
	for j := range c.stores {
		id := fmt.Sprintf("store-%d", j)
		h := shift(httpAddr, len(names)+1)
		names, https = append(names, id), append(https, h)
		argv := []string{"store", "--id", id, "--masters", strings.Join(grpcs, ","), "--listen", shift(c.engine, j), "--http", h,
			"--tier", "dram:" + c.dram, "--prefault=" + strconv.FormatBool(c.prefault), "--log-level", level}
		if c.ssd != "0" {
			argv = append(argv, "--tier", "ssd:"+filepath.Join(c.dir, id)+":"+c.ssd)
		}
		if c.certs != "" {
			argv = append(argv, c.certs.flags(auth.Store)...)
			if c.plainRails {
				argv = append(argv, "--plain-rails")
			}
		}
		argvs = append(argvs, argv)
	}
	if err == nil {
		err = distinctPorts(argvs, httpAddr)
	}
	return names, https, argvs, grpcs, err
}

// distinctPorts checks that no two of the cluster's listening addresses
// (each child's --listen, --raft, --http and event ports, and this
// process's httpAddr) are the same: ports moved up from different flags
// can meet, and the second process would then fail to bind.
func distinctPorts(argvs [][]string, httpAddr string) error {
	owner := map[string]string{httpAddr: "up --http"}
	for _, argv := range argvs {
		for i := 1; i+1 < len(argv); i++ {
			switch argv[i] {
			case "--listen", "--raft", "--http", "--kv-events", "--kv-events-replay":
			default:
				continue
			}
			addr := strings.TrimPrefix(argv[i+1], "tcp://")
			who := argv[0] + " " + argv[2] + " " + argv[i] // e.g. "store store-1 --listen"
			if other, ok := owner[addr]; ok {
				return fmt.Errorf("%w: ports clash: %s and %s are both %s (each process's ports are the flags' moved up %d per process): choose ports further apart", errUsage, other, who, addr, portStep)
			}
			owner[addr] = who
		}
	}
	return nil
}

// runCluster starts the cluster's processes and stops them all when ctx
// ends. A process that dies meanwhile is reported; the others keep
// running, as a real cluster's would.
func runCluster(ctx context.Context, e *env, d *daemon, spec clusterSpec) error {
	log := d.log
	names, https, argvs, masters, err := spec.argvs(d.http, d.level)
	if err != nil {
		return err
	}
	self, err := os.Executable()
	if err != nil {
		return fmt.Errorf("find this binary to start the cluster's processes: %w", err)
	}
	for _, n := range names {
		if err := os.MkdirAll(filepath.Join(spec.dir, n), 0o755); err != nil {
			return err
		}
	}
	out := &lockedWriter{w: e.stderr}
	var children []*child
	// Stores first, while the masters are there to let them leave the
	// pool; then the masters.
	stop := func(group []*child) {
		for _, c := range group {
			_ = c.cmd.Process.Signal(syscall.SIGTERM)
		}
		for _, c := range group {
			select {
			case <-c.done:
			case <-time.After(15 * time.Second):
				log.Warn("process did not stop within 15 s of SIGTERM; killing it", "process", c.name)
				_ = c.cmd.Process.Kill()
				<-c.done
			}
		}
	}
	stopAll := func() {
		stop(children[min(len(children), spec.masters):])
		stop(children[:min(len(children), spec.masters)])
	}
	for i, argv := range argvs {
		c, err := startChild(self, names[i], https[i], argv, out)
		if err != nil {
			stopAll()
			return err
		}
		children = append(children, c)
		log.Info("started", "process", c.name, "pid", c.cmd.Process.Pid, "args", strings.Join(argv, " "))
	}
	hc := &http.Client{Timeout: time.Second}
	ready := func() error {
		var errs []error
		for _, c := range children {
			if err := childReady(hc, c); err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", c.name, err))
			}
		}
		return errors.Join(errs...)
	}
	// The cluster's page, as its masters answer; each child serves its own.
	cc := client.Config{Masters: masters, Logger: log}
	if spec.certs != "" {
		// The page shows what an admin sees.
		admin := credentials{files: auth.Files{CA: spec.certs.path("ca.crt")}, tokenFile: spec.certs.path("admin.token")}
		if cc.Credentials, err = admin.masters(); err != nil {
			return err
		}
		if cc.EngineConfig.PeerTLS, err = admin.stores(); err != nil {
			return err
		}
	}
	mc, err := client.New(cc)
	if err != nil {
		stopAll()
		return err
	}
	defer mc.Close()
	page := &statuspage.Page{Title: fmt.Sprintf("tidepool up (%d masters, %d stores)", spec.masters, spec.stores), Status: mc.Status}
	stopHTTP, err := serveHTTP(d.http, d.reg, ready, nil, page, log)
	if err != nil {
		stopAll()
		return err
	}
	defer stopHTTP()
	exited := make(chan *child, len(children))
	for _, c := range children {
		go func() { <-c.done; exited <- c }()
	}
	up := time.NewTicker(200 * time.Millisecond)
	defer up.Stop()
	announced := false
	for {
		select {
		case <-ctx.Done():
			log.Info("shutting down the cluster")
			stopAll()
			return nil
		case c := <-exited:
			if !announced {
				stopAll()
				return fmt.Errorf("%s exited while the cluster started (%v); its output is above", c.name, c.err)
			}
			log.Error("process exited; the rest of the cluster keeps running", "process", c.name, "pid", c.cmd.Process.Pid, "err", c.err)
		case <-up.C:
			if !announced && ready() == nil {
				announced = true
				hint := "tidepool status; tidepool admin members; kill a master's pid to watch a failover"
				if spec.certs != "" {
					hint = spec.certs.hint()
				}
				log.Info("tidepool is up", "masters", strings.Join(masters, ","), "secure", spec.certs != "", "hint", hint)
			}
		}
	}
}

func startChild(bin, name, httpAddr string, argv []string, out io.Writer) (*child, error) {
	c := &child{name: name, http: httpAddr, cmd: exec.Command(bin, argv...), done: make(chan struct{})}
	pr, pw := io.Pipe()
	c.cmd.Stdout, c.cmd.Stderr = pw, pw
	// Should this process die, take the cluster with it. A process group
	// of its own, so a terminal's Ctrl-C reaches `up` alone, which stops
	// the processes in order.
	c.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	if err := c.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	go func() {
		c.err = c.cmd.Wait()
		pw.Close()
	}()
	go func() {
		defer close(c.done) // after the last line is out
		sc := bufio.NewScanner(pr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			fmt.Fprintf(out, "[%s] %s\n", name, sc.Bytes())
		}
		_, _ = io.Copy(io.Discard, pr) // a line too long: drain, so the child never blocks
	}()
	return c, nil
}

func childReady(hc *http.Client, c *child) error {
	select {
	case <-c.done:
		return fmt.Errorf("exited: %v", c.err)
	default:
	}
	resp, err := hc.Get("http://" + c.http + "/readyz")
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return fmt.Errorf("%s", strings.TrimSpace(string(b)))
	}
	return nil
}

// lockedWriter serializes the children's lines onto one writer.
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
