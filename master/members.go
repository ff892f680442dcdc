package master

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc"

	"github.com/tidepool-kv/tidepool/master/leaderconn"
	pb "github.com/tidepool-kv/tidepool/proto/tidepoolpb"
)

// Membership: the masters are the raft voters. Raft knows each one's raft
// address; the FSM keeps each one's gRPC address (MemberCmd), which a
// leader records for itself on election and a follower sends the leader
// (announce), so every master can tell clients where every other one is.
// An operator grows or shrinks the cluster with AddMember and RemoveMember,
// which refuse a change after which the voters that answer would not make
// a quorum: the cluster would stop taking writes.

const (
	// probeTimeout bounds a Status call to one master.
	probeTimeout = 2 * time.Second
	// changeTimeout bounds a raft configuration change.
	changeTimeout = 30 * time.Second
	// announceEvery is how often a follower whose gRPC address the FSM
	// lacks sends it to the leader.
	announceEvery = 500 * time.Millisecond
	// maxMemberID bounds a master's id.
	maxMemberID = 64
)

// Members lists the voters; any master answers, probing the others.
func (a *adminService) Members(ctx context.Context, _ *pb.MembersRequest) (*pb.MembersResponse, error) {
	return a.s.members(ctx)
}

func (s *Server) members(ctx context.Context) (*pb.MembersResponse, error) {
	servers, err := s.voters()
	if err != nil {
		return nil, err
	}
	_, leader := s.raft.LeaderWithID()
	resp := &pb.MembersResponse{}
	up := s.probeAll(ctx, servers)
	for _, srv := range servers {
		id := string(srv.ID)
		resp.Members = append(resp.Members, &pb.MemberInfo{
			Id: id, Address: s.fsm.member(id), RaftAddress: string(srv.Address), Leader: srv.ID == leader, Reachable: up[id],
		})
	}
	return resp, nil
}

// voters is the raft configuration's voters, by id.
func (s *Server) voters() ([]raft.Server, error) {
	v, _, err := s.configuration()
	return v, err
}

// configuration is the raft configuration's voters, by id, and its index.
func (s *Server) configuration() ([]raft.Server, uint64, error) {
	f := s.raft.GetConfiguration()
	if err := f.Error(); err != nil {
		return nil, 0, fmt.Errorf("%w: raft configuration: %v", ErrNotLeader, err)
	}
	var out []raft.Server
	for _, srv := range f.Configuration().Servers {
		if srv.Suffrage == raft.Voter {
			out = append(out, srv)
		}
	}
	slices.SortFunc(out, func(a, b raft.Server) int { return cmp.Compare(a.ID, b.ID) })
	return out, f.Index(), nil
}

// probeAll reports which of servers answer now: this one does; the others
// if a Status call to their recorded gRPC address succeeds.
func (s *Server) probeAll(ctx context.Context, servers []raft.Server) map[string]bool {
	up := make(map[string]bool, len(servers))
	type answer struct {
		id string
		ok bool
	}
	ch := make(chan answer, len(servers))
	for _, srv := range servers {
		id := string(srv.ID)
		if id == s.cfg.ID {
			ch <- answer{id, true}
			continue
		}
		go func() { // each ends within probeTimeout
			_, err := s.probe(ctx, s.fsm.member(id))
			ch <- answer{id, err == nil}
		}()
	}
	for range servers {
		a := <-ch
		up[a.id] = a.ok
	}
	return up
}

// probe asks the master at addr for its status.
func (s *Server) probe(ctx context.Context, addr string) (*pb.StatusResponse, error) {
	if addr == "" {
		return nil, errors.New("no gRPC address known")
	}
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	conn, err := leaderconn.Dial([]string{addr}, s.peerCreds()) // framed, as clients call
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	var st *pb.StatusResponse
	err = conn.Do(ctx, func(ctx context.Context, cc grpc.ClientConnInterface, o ...grpc.CallOption) (err error) {
		st, err = pb.NewMasterClient(cc).Status(ctx, &pb.StatusRequest{}, o...)
		return err
	})
	return st, err
}

// quorum is the voters a cluster of n needs to commit.
func quorum(n int) int { return n/2 + 1 }

func validMember(id, raftAddr, grpcAddr string) error {
	if err := validName("master id", id); err != nil || len(id) > maxMemberID {
		return fmt.Errorf("%w: master id %q: want up to %d printable bytes without space, '/', '@'", ErrInvalidRequest, id, maxMemberID)
	}
	for _, a := range []string{raftAddr, grpcAddr} {
		if _, port, err := net.SplitHostPort(a); err != nil || port == "" || len(a) > maxEndpoint {
			return fmt.Errorf("%w: address %q: want host:port", ErrInvalidRequest, a)
		}
	}
	return nil
}

// sameAddr reports whether two host:port addresses name one endpoint
// (a name and the address it resolves to do).
func sameAddr(a, b string) bool {
	if a == b {
		return true
	}
	ta, errA := net.ResolveTCPAddr("tcp", a)
	tb, errB := net.ResolveTCPAddr("tcp", b)
	return errA == nil && errB == nil && ta.IP.Equal(tb.IP) && ta.Port == tb.Port
}

// AddMember adds a voter, or records a voter's gRPC address.
func (a *adminService) AddMember(ctx context.Context, req *pb.AddMemberRequest) (*pb.MembersResponse, error) {
	s := a.s
	if err := validMember(req.Id, req.RaftAddress, req.GrpcAddress); err != nil {
		return nil, err
	}
	if err := s.leaderOnly(); err != nil {
		return nil, err
	}
	// One change at a time, each against the configuration it checked:
	// two removals that each keep a quorum may not together.
	s.memberMu.Lock()
	defer s.memberMu.Unlock()
	servers, index, err := s.configuration()
	if err != nil {
		return nil, err
	}
	for _, srv := range servers {
		switch {
		case string(srv.ID) == req.Id && sameAddr(string(srv.Address), req.RaftAddress):
			if err := s.recordMember(ctx, req.Id, req.GrpcAddress); err != nil {
				return nil, err
			}
			return s.members(ctx)
		case string(srv.ID) == req.Id:
			return nil, fmt.Errorf("%w: master %s is a member at raft address %s; remove it first", ErrInvalidRequest, req.Id, srv.Address)
		case string(srv.Address) == req.RaftAddress:
			return nil, fmt.Errorf("%w: raft address %s is master %s's", ErrInvalidRequest, req.RaftAddress, srv.ID)
		}
	}
	st, err := s.probe(ctx, req.GrpcAddress)
	if err != nil {
		return nil, fmt.Errorf("%w: master %s does not answer at %s (start it with --join first): %v", ErrQuorum, req.Id, req.GrpcAddress, err)
	}
	// A voter the cluster cannot reach at its raft address would count
	// against the quorum from the start.
	switch {
	case st.SelfId != req.Id:
		return nil, fmt.Errorf("%w: the master at %s is %q, not %q", ErrInvalidRequest, req.GrpcAddress, st.SelfId, req.Id)
	case !sameAddr(st.SelfRaftAddress, req.RaftAddress):
		return nil, fmt.Errorf("%w: master %s advertises raft address %s, not %s", ErrInvalidRequest, req.Id, st.SelfRaftAddress, req.RaftAddress)
	case st.LeaderId != "" || st.RaftTerm > 0:
		return nil, fmt.Errorf("%w: the master at %s is in a cluster already (term %d, leader %q); start it with --join on an empty --dir", ErrInvalidRequest, req.GrpcAddress, st.RaftTerm, st.LeaderId)
	}
	up := s.probeAll(ctx, servers)
	if live := countTrue(up) + 1; live < quorum(len(servers)+1) {
		return nil, fmt.Errorf("%w: %d of %d masters would answer, %d needed", ErrQuorum, live, len(servers)+1, quorum(len(servers)+1))
	}
	s.log.Info("adding a master", "id", req.Id, "raft", req.RaftAddress, "grpc", req.GrpcAddress)
	if err := s.raft.AddVoter(raft.ServerID(req.Id), raft.ServerAddress(req.RaftAddress), index, changeTimeout).Error(); err != nil {
		return nil, raftErr(err)
	}
	if err := s.recordMember(ctx, req.Id, req.GrpcAddress); err != nil {
		return nil, err
	}
	return s.members(ctx)
}

// RemoveMember takes a voter out of the cluster.
func (a *adminService) RemoveMember(ctx context.Context, req *pb.RemoveMemberRequest) (*pb.MembersResponse, error) {
	s := a.s
	if req.Id == "" {
		return nil, fmt.Errorf("%w: remove needs a master id", ErrInvalidRequest)
	}
	if err := s.leaderOnly(); err != nil {
		return nil, err
	}
	s.memberMu.Lock()
	defer s.memberMu.Unlock()
	servers, index, err := s.configuration()
	if err != nil {
		return nil, err
	}
	i := slices.IndexFunc(servers, func(srv raft.Server) bool { return string(srv.ID) == req.Id })
	if i < 0 {
		return nil, fmt.Errorf("%w: no master %q", ErrNotFound, req.Id)
	}
	rest := slices.Delete(slices.Clone(servers), i, i+1)
	if len(rest) == 0 {
		return nil, fmt.Errorf("%w: %s is the last master", ErrQuorum, req.Id)
	}
	up := s.probeAll(ctx, rest)
	if live := countTrue(up); live < quorum(len(rest)) {
		return nil, fmt.Errorf("%w: %d of the %d remaining masters answer, %d needed", ErrQuorum, live, len(rest), quorum(len(rest)))
	}
	s.log.Info("removing a master", "id", req.Id)
	if err := s.raft.RemoveServer(raft.ServerID(req.Id), index, changeTimeout).Error(); err != nil {
		return nil, raftErr(err)
	}
	// A leader that removed itself steps down: the next one keeps the
	// stale address, which no voter names.
	if req.Id != s.cfg.ID {
		if err := s.recordMember(ctx, req.Id, ""); err != nil {
			s.log.Warn("forget a removed master's address", "id", req.Id, "err", err)
		}
	}
	return s.members(ctx)
}

func countTrue(m map[string]bool) int {
	n := 0
	for _, ok := range m {
		if ok {
			n++
		}
	}
	return n
}

// raftErr maps raft's refusals of a configuration change.
func raftErr(err error) error {
	if errors.Is(err, raft.ErrNotLeader) || errors.Is(err, raft.ErrLeadershipLost) {
		return ErrNotLeader
	}
	return fmt.Errorf("raft configuration change: %w", err)
}

// recordMember stores a master's gRPC address ("": forgets it).
func (s *Server) recordMember(ctx context.Context, id, addr string) error {
	if s.fsm.member(id) == addr {
		return nil
	}
	_, err := s.apply(ctx, &pb.Command{Op: &pb.Command_Member{Member: &pb.MemberCmd{Id: id, Address: addr}}})
	return err
}

// announceLoop sends this master's gRPC address to the leader while the
// FSM lacks it, until Close.
func (s *Server) announceLoop() {
	defer s.wg.Done()
	tick := time.NewTicker(announceEvery)
	defer tick.Stop()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { // a call to a hung leader must not hold up Close
		select {
		case <-s.stop:
			cancel()
		case <-ctx.Done():
		}
	}()
	for {
		select {
		case <-s.stop:
			return
		case <-tick.C:
		}
		if s.IsLeader() || s.fsm.member(s.cfg.ID) == s.cfg.Advertise {
			continue
		}
		_, lid := s.raft.LeaderWithID()
		addr := s.fsm.member(string(lid))
		if lid == "" || addr == "" {
			continue
		}
		if err := s.announce(ctx, addr); err != nil {
			s.log.Debug("send the leader this master's address", "leader", addr, "err", err)
		}
	}
}

func (s *Server) announce(ctx context.Context, leader string) error {
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	// The raft address as the configuration names this master (--peers
	// may use a name where the transport reports an IP).
	servers, err := s.voters()
	if err != nil {
		return err
	}
	raftAddr := string(s.trans.LocalAddr())
	for _, srv := range servers {
		if string(srv.ID) == s.cfg.ID {
			raftAddr = string(srv.Address)
		}
	}
	conn, err := leaderconn.Dial([]string{leader}, s.peerCreds())
	if err != nil {
		return err
	}
	defer conn.Close()
	return conn.Do(ctx, func(ctx context.Context, cc grpc.ClientConnInterface, o ...grpc.CallOption) error {
		_, err := pb.NewAdminClient(cc).AddMember(ctx, &pb.AddMemberRequest{Id: s.cfg.ID, RaftAddress: raftAddr, GrpcAddress: s.cfg.Advertise}, o...)
		return err
	})
}
