package engine

import (
	"bytes"
	"strings"
	"testing"
)

// TestReview12FrameTicketDoesNotAliasName: the longest name with the
// longest ticket decode intact, and a second request read into the same
// buffer leaves nothing of the first's ticket.
func TestReview12FrameTicketDoesNotAliasName(t *testing.T) {
	name := strings.Repeat("n", MaxSegmentName)
	tk := strings.Repeat("\xee", MaxTicket)
	var buf [reqMax]byte
	in := appendRequest(nil, opWrite, name, 1<<40, 77, tk)
	in = appendRequest(in, opRead, "x", 3, 4, "")
	in = appendRequest(in, opRead, name, 5, 6, "ab")
	r := bytes.NewReader(in)
	h, err := readRequest(r, &buf)
	if err != nil || string(h.name) != name || string(h.ticket) != tk || h.off != 1<<40 || h.n != 77 {
		t.Fatalf("first: %v %q %d %d %v", err, h.ticket, h.off, h.n, len(h.name))
	}
	h, err = readRequest(r, &buf)
	if err != nil || string(h.name) != "x" || len(h.ticket) != 0 || h.off != 3 || h.n != 4 {
		t.Fatalf("second: %v %+v", err, h)
	}
	h, err = readRequest(r, &buf)
	if err != nil || string(h.name) != name || string(h.ticket) != "ab" {
		t.Fatalf("third: %v %q", err, h.ticket)
	}
}
