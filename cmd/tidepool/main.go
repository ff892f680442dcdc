// Command tidepool is the one Tidepool binary: the master and store
// daemons, an all-in-one local cluster, client commands and benchmarks.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

// errAbsent makes `tidepool exists` exit 1 without an error line.
var errAbsent = errors.New("absent")

type command struct {
	name, args, help string
	run              func(ctx context.Context, env *env, args []string) error
}

// env carries the process's outside world, so commands stay testable.
type env struct {
	stdin          io.Reader
	stdout, stderr io.Writer
	getenv         func(string) string
}

func commands() []command {
	return []command{
		{"up", "[flags]", "run an all-in-one local cluster: one master and one store", runUp},
		{"master", "[flags]", "run a master (raft-replicated metadata service)", runMaster},
		{"store", "[flags]", "run a store node that serves its tiers to the pool", runStore},
		{"agent", "[flags]", "serve the pool to this host's processes over a unix socket and shared memory", runAgent},
		{"put", "KEY FILE", "store FILE (- for stdin) under KEY", runPut},
		{"get", "KEY [-o FILE]", "write the value of KEY to stdout or FILE", runGet},
		{"exists", "KEY", "exit 0 if KEY is present, 1 if not", runExists},
		{"rm", "KEY", "remove KEY", runRm},
		{"ls", "[PREFIX]", "list objects whose key starts with PREFIX", runLs},
		{"status", "", "show the cluster's masters and segments", runStatus},
		{"hash", "--scheme S ...", "print the block hashes of a token list, as an engine computes them", runHash},
		{"lookup", "--scheme S --model M ...", "how many leading blocks of a prompt the pool holds (leases them, as an engine's lookup)", runLookup},
		{"score", "--scheme S --model M ...", "a router's score of a prompt: leading blocks cached, per tier, leasing nothing", runScore},
		{"admin", "SUBCOMMAND", "operator commands: evict, pin, unpin, rails", runAdmin},
		{"certs", "init DIR", "write a development CA, per-role certificates and tokens", runCerts},
		{"bench", "[engine|lookup|meta|fill|replay] [flags]", "measure put, get and exists; or the transfer engine, prefix lookups, the master alone; fill the master with objects; or replay a request trace", runBench},
	}
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "Tidepool is a pooled KV cache store for LLM inference.\n\nUsage: tidepool COMMAND [flags] [args]\n\nCommands:")
	for _, c := range commands() {
		fmt.Fprintf(w, "  %-8s %-16s %s\n", c.name, c.args, c.help)
	}
	fmt.Fprintln(w, "\nRun `tidepool COMMAND -h` for the flags of a command.")
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, &env{stdin: os.Stdin, stdout: os.Stdout, stderr: os.Stderr, getenv: os.Getenv}, os.Args[1:])
	stop()
	os.Exit(code)
}

func run(ctx context.Context, e *env, args []string) int {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		usage(e.stdout)
		return 0
	}
	for _, c := range commands() {
		if c.name != args[0] {
			continue
		}
		err := c.run(ctx, e, args[1:])
		switch {
		case err == nil:
			return 0
		case errors.Is(err, errAbsent):
			return 1
		case errors.Is(err, errHelp):
			return 0
		case errors.Is(err, errUsage):
			fmt.Fprintf(e.stderr, "tidepool %s: %v\nusage: tidepool %s %s\n", c.name, err, c.name, c.args)
			return 2
		}
		fmt.Fprintf(e.stderr, "tidepool %s: %v\n", c.name, err)
		return 1
	}
	fmt.Fprintf(e.stderr, "tidepool: unknown command %q\n\n", args[0])
	usage(e.stderr)
	return 2
}
