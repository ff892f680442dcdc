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
}

func listenRaft(bind, advertise string) (*raftStream, error) {
	adv, err := net.ResolveTCPAddr("tcp", advertise)
	if err != nil {
		return nil, fmt.Errorf("master: raft address %q: %w", advertise, err)
	}
	if adv.IP == nil || adv.IP.IsUnspecified() {
		return nil, fmt.Errorf("master: raft address %q is not one peers can dial", advertise)
	}
	ln, err := net.Listen("tcp", bind)
	if err != nil {
		return nil, fmt.Errorf("master: raft transport on %s: %w", bind, err)
	}
	s := &raftStream{Listener: ln, advertise: adv}
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
	return d.Dial("tcp", string(addr))
}
