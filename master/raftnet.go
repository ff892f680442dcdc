package master

import (
	"fmt"
	"net"
	"time"

	"github.com/hashicorp/raft"
)

// raftStream is raft's TCP stream layer, except that it dials from the
// host it listens on when that names one: on a host with several
// addresses, peers see a master's raft traffic come from its raft address
// (and a test can cut the traffic of one master by its source address).
type raftStream struct {
	net.Listener
	advertise net.Addr
	local     *net.TCPAddr // nil: any
	tls       *raftTLS     // nil: plaintext
}

// advertised is an address as peers name it: a DNS name stays a name, so
// a master whose IP changes (a rescheduled pod) is the same member, and
// one may start before its name resolves (a new pod, before DNS has it).
type advertised string

func (a advertised) Network() string { return "tcp" }
func (a advertised) String() string  { return string(a) }

func listenRaft(bind, advertise string, sec Security) (*raftStream, error) {
	host, port, err := net.SplitHostPort(advertise)
	if err != nil || port == "" {
		return nil, fmt.Errorf("master: raft address %q: want host:port", advertise)
	}
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		return nil, fmt.Errorf("master: raft address %q is not one peers can dial", advertise)
	}
	ln, err := net.Listen("tcp", bind)
	if err != nil {
		return nil, fmt.Errorf("master: raft transport on %s: %w", bind, err)
	}
	s := &raftStream{Listener: ln, advertise: advertised(advertise), tls: newRaftTLS(sec)}
	if a, ok := ln.Addr().(*net.TCPAddr); ok && !a.IP.IsUnspecified() {
		s.local = &net.TCPAddr{IP: a.IP}
	}
	return s, nil
}

// Addr is the address peers reach this master at.
func (s *raftStream) Addr() net.Addr { return s.advertise }

// Dial implements raft.StreamLayer.
func (s *raftStream) Dial(addr raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	d := net.Dialer{Timeout: timeout}
	if s.local != nil {
		d.LocalAddr = s.local
	}
	conn, err := d.Dial("tcp", string(addr))
	if err != nil || s.tls == nil {
		return conn, err
	}
	host, _, _ := net.SplitHostPort(string(addr))
	return s.tls.dialled(conn, host, timeout)
}

// Accept implements raft.StreamLayer.
func (s *raftStream) Accept() (net.Conn, error) {
	conn, err := s.Listener.Accept()
	if err != nil || s.tls == nil {
		return conn, err
	}
	return s.tls.accepted(conn), nil
}
