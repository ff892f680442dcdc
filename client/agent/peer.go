package agent

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
)

// peerCreds is the server side of the agent's unix socket for gRPC: it
// moves no bytes (clients dial without security, as before) and gives each
// connection the pid of the process at its other end (SO_PEERCRED), so a
// session knows which process it belongs to and ends when that process
// exits.
type peerCreds struct{}

// peerInfo is a connection's AuthInfo: its process, if the socket told.
type peerInfo struct {
	credentials.CommonAuthInfo
	owner process
}

func (peerInfo) AuthType() string { return "peercred" }

func (peerCreds) ServerHandshake(c net.Conn) (net.Conn, credentials.AuthInfo, error) {
	info := peerInfo{CommonAuthInfo: credentials.CommonAuthInfo{SecurityLevel: credentials.NoSecurity}}
	if uc, ok := c.(*net.UnixConn); ok {
		if raw, err := uc.SyscallConn(); err == nil {
			_ = raw.Control(func(fd uintptr) {
				if u, err := unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED); err == nil && u.Pid > 0 {
					info.owner = processOf(int(u.Pid))
				}
			})
		}
	}
	return c, info, nil
}

func (peerCreds) ClientHandshake(_ context.Context, _ string, c net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return c, peerInfo{CommonAuthInfo: credentials.CommonAuthInfo{SecurityLevel: credentials.NoSecurity}}, nil
}

func (peerCreds) Info() credentials.ProtocolInfo {
	return credentials.ProtocolInfo{SecurityProtocol: "insecure"}
}
func (peerCreds) Clone() credentials.TransportCredentials { return peerCreds{} }
func (peerCreds) OverrideServerName(string) error         { return nil }

// process names a process across pid reuse: its pid and its start time
// (clock ticks after boot, /proc/PID/stat). The zero process is unknown.
type process struct {
	pid   int
	start uint64
}

func (p process) known() bool { return p.pid > 0 }

func (p process) String() string { return strconv.Itoa(p.pid) }

// processOf is pid's process now; unknown if it is gone or unreadable.
func processOf(pid int) process {
	p, _ := readProcess(pid)
	return p
}

// readProcess reads pid's process from /proc/PID/stat. A process that has
// exited but is not yet waited for (a zombie) is gone too: err is then
// errGone, as it is when there is no such pid.
func readProcess(pid int) (process, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ESRCH) {
		return process{}, errGone
	}
	if err != nil {
		return process{}, err
	}
	// Field 2 is the command in parentheses, and may hold both; then come
	// the state (field 3) and, 20th after the command, the start time.
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return process{}, fmt.Errorf("agent: /proc/%d/stat: no command field", pid)
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 20 {
		return process{}, fmt.Errorf("agent: /proc/%d/stat: %d fields", pid, len(f))
	}
	if f[0] == "Z" || f[0] == "X" {
		return process{}, errGone
	}
	start, err := strconv.ParseUint(f[19], 10, 64)
	if err != nil {
		return process{}, fmt.Errorf("agent: /proc/%d/stat: start time %q", pid, f[19])
	}
	return process{pid, start}, nil
}

var errGone = errors.New("process gone")

// alive reports whether p still runs (and is p, not a later process that
// got its pid). What cannot be told (no descriptor free to read /proc)
// counts as alive: a session must not end for the agent's own trouble.
func (p process) alive() bool {
	q, err := readProcess(p.pid)
	if err != nil {
		return !errors.Is(err, errGone)
	}
	return q == p
}

// ownerOf is the process at the other end of ctx's connection, if known.
func ownerOf(ctx context.Context) process {
	if pr, ok := peer.FromContext(ctx); ok {
		if info, ok := pr.AuthInfo.(peerInfo); ok {
			return info.owner
		}
	}
	return process{}
}
