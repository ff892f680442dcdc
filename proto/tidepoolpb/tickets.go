package tidepoolpb

// NoTicket in LookupResponse.replica_tickets marks a replica whose store
// checks no tickets.
const NoTicket = ^uint32(0)

// ticketSize is ticket.Size; this package knows no other.
const ticketSize = 64

// ReplicaTicket returns the read ticket of the i-th replica of the answer
// (counted as replica_segments), or nil if it has none or the answer is
// malformed.
func (r *LookupResponse) ReplicaTicket(i int) []byte {
	if i < 0 || i >= len(r.GetReplicaTickets()) {
		return nil
	}
	k := r.ReplicaTickets[i]
	if k == NoTicket || uint64(k+1)*ticketSize > uint64(len(r.Tickets)) {
		return nil
	}
	return r.Tickets[k*ticketSize : (k+1)*ticketSize : (k+1)*ticketSize]
}
