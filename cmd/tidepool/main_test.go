package main

import (
	"bytes"
	"context"
	"flag"
	"io"
	"net"
	"reflect"
	"strings"
	"testing"
	"time"
)

func TestParseInterleavedFlags(t *testing.T) {
	tests := []struct {
		args    []string
		pos     []string
		out     string
		wantErr bool
	}{
		{[]string{"k"}, []string{"k"}, "", false},
		{[]string{"k", "-o", "f"}, []string{"k"}, "f", false},
		{[]string{"-o", "f", "k"}, []string{"k"}, "f", false},
		{[]string{"--", "-k"}, []string{"-k"}, "", false},
		{[]string{}, nil, "", true},
		{[]string{"a", "b"}, nil, "", true},
		{[]string{"k", "-x"}, nil, "", true},
	}
	for _, tc := range tests {
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		out := fs.String("o", "", "")
		pos, err := parse(fs, tc.args, 1, 1)
		if (err != nil) != tc.wantErr {
			t.Errorf("parse(%q) error %v, want error %v", tc.args, err, tc.wantErr)
			continue
		}
		if err == nil && (!reflect.DeepEqual(pos, tc.pos) || *out != tc.out) {
			t.Errorf("parse(%q) = %q, -o %q; want %q, %q", tc.args, pos, *out, tc.pos, tc.out)
		}
	}
}

func TestRunUsage(t *testing.T) {
	tests := []struct {
		args   []string
		code   int
		stderr string
	}{
		{nil, 0, ""},
		{[]string{"nope"}, 2, `unknown command "nope"`},
		{[]string{"get"}, 2, "want 1 arguments, got 0"},
		{[]string{"put", "k"}, 2, "usage: tidepool put KEY FILE"},
		{[]string{"store", "--tier", "tape:1GiB", "--http", ""}, 2, `unknown tier kind "tape"`},
		{[]string{"store", "--tier", "dram:lots", "--http", ""}, 2, "invalid size"},
		{[]string{"master", "--peers", "m1", "--http", ""}, 2, "want id=host:port"},
		{[]string{"bench", "--concurrency", "0"}, 2, "want 1 to 1024"},
		{[]string{"get", "-h"}, 0, ""},
	}
	for _, tc := range tests {
		var stdout, stderr bytes.Buffer
		e := &env{stdin: strings.NewReader(""), stdout: &stdout, stderr: &stderr, getenv: func(string) string { return "" }}
		if code := run(context.Background(), e, tc.args); code != tc.code {
			t.Errorf("run(%q) = %d, want %d; stderr: %s", tc.args, code, tc.code, stderr.String())
		}
		if !strings.Contains(stderr.String(), tc.stderr) {
			t.Errorf("run(%q) stderr %q, want it to contain %q", tc.args, stderr.String(), tc.stderr)
		}
	}
}

func TestMastersFlag(t *testing.T) {
	tests := []struct {
		args []string
		env  string
		want []string
	}{
		{nil, "", []string{defaultMaster}},
		{nil, "a:1, b:2", []string{"a:1", "b:2"}},
		{[]string{"--masters", "c:3"}, "a:1", []string{"c:3"}},
	}
	for _, tc := range tests {
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		m := mastersFlag(fs, &env{getenv: func(string) string { return tc.env }})
		if err := fs.Parse(tc.args); err != nil {
			t.Fatal(err)
		}
		if got := m.list(); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("masters(%q, env %q) = %q, want %q", tc.args, tc.env, got, tc.want)
		}
	}
}

// TestWaitingForMastersSaysSo: a command that finds no master says on
// stderr, after a second, what it waits for and where, with a hint to
// start a cluster when nothing listens there; status gives up after 10 s.
func TestWaitingForMastersSaysSo(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // nothing listens there now
	for _, args := range [][]string{
		{"get", "k", "--masters", addr, "--timeout", "2s"},
		{"admin", "unpin", "k", "--masters", addr, "--timeout", "2s"},
		{"status", "--masters", addr},
	} {
		var stdout, stderr bytes.Buffer
		e := &env{stdin: strings.NewReader(""), stdout: &stdout, stderr: &stderr, getenv: func(string) string { return "" }}
		start := time.Now()
		if code := run(context.Background(), e, args); code != 1 {
			t.Errorf("run(%q) = %d, want 1; stderr: %s", args, code, stderr.String())
		}
		took := time.Since(start)
		for _, want := range []string{"still waiting for a master leader after 1s (" + addr + ": connection refused)", "`tidepool up` starts one"} {
			if !strings.Contains(stderr.String(), want) {
				t.Errorf("run(%q) stderr %q, want it to contain %q", args, stderr.String(), want)
			}
		}
		if args[0] == "status" && (took < 9*time.Second || took > 15*time.Second) {
			t.Errorf("status gave up after %v, want 10 s", took)
		}
	}
}
