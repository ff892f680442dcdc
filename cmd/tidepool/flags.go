package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"
)

var (
	errUsage = errors.New("usage")
	errHelp  = errors.New("help shown")
)

// newFlags returns a flag set that prints its help to w and reports errors
// instead of exiting.
func newFlags(name, args, help string, w io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(w)
	fs.Usage = func() {
		fmt.Fprintf(w, "usage: tidepool %s %s\n\n%s\n\nFlags:\n", name, args, help)
		fs.PrintDefaults()
	}
	return fs
}

// parse parses flags that may come before, between or after positional
// arguments (`get KEY -o FILE`) and checks the positional count.
func parse(fs *flag.FlagSet, args []string, minPos, maxPos int) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return nil, errHelp
			}
			return nil, fmt.Errorf("%w: %v", errUsage, err)
		}
		args = fs.Args()
		if len(args) == 0 {
			break
		}
		if args[0] == "--" {
			pos = append(pos, args[1:]...)
			break
		}
		pos = append(pos, args[0])
		args = args[1:]
	}
	if len(pos) < minPos || len(pos) > maxPos {
		want := fmt.Sprintf("%d", minPos)
		if maxPos != minPos {
			want = fmt.Sprintf("%d to %d", minPos, maxPos)
		}
		return nil, fmt.Errorf("%w: want %s arguments, got %d", errUsage, want, len(pos))
	}
	return pos, nil
}

// listFlag is a repeatable flag, also accepting comma-separated values.
type listFlag []string

func (l *listFlag) String() string { return strings.Join(*l, ",") }
func (l *listFlag) Set(v string) error {
	for _, s := range strings.Split(v, ",") {
		if s = strings.TrimSpace(s); s != "" {
			*l = append(*l, s)
		}
	}
	return nil
}
