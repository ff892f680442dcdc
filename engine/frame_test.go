package engine

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"strings"
	"testing"
)

func TestRequestRoundTrip(t *testing.T) {
	tests := []struct {
		name   string
		op     byte
		seg    string
		off    uint64
		n      uint64
		ticket string
	}{
		{"read", opRead, "dram-0", 0, 1, ""},
		{"write", opWrite, "hbm", 1 << 40, MaxOpLen, strings.Repeat("t", 64)},
		{"max name and ticket", opRead, strings.Repeat("x", MaxSegmentName), 7, 0, strings.Repeat("t", MaxTicket)},
		{"describe", opDescribe, "dram-0", 0, 0, ""},
		{"empty name", opWrite, "", 0, 0, ""}, // well formed; the server answers bad request
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := appendRequest(nil, tt.op, tt.seg, tt.off, tt.n, tt.ticket)
			if want := reqFixed + len(tt.seg) + reqTrailer + len(tt.ticket); len(b) != want {
				t.Fatalf("encoded %d bytes, want %d", len(b), want)
			}
			var buf [reqMax]byte
			r := bytes.NewReader(b)
			h, err := readRequest(r, &buf)
			if err != nil {
				t.Fatal(err)
			}
			if h.op != tt.op || string(h.name) != tt.seg || h.off != tt.off || h.n != tt.n || string(h.ticket) != tt.ticket {
				t.Errorf("decoded %+v, want op %d name %q off %d n %d", h, tt.op, tt.seg, tt.off, tt.n)
			}
			if r.Len() != 0 {
				t.Errorf("%d bytes left unread", r.Len())
			}
		})
	}
}

func TestReadRequestRejects(t *testing.T) {
	valid := appendRequest(nil, opRead, "seg", 0, 10, "")
	with := func(i int, v byte) []byte { b := bytes.Clone(valid); b[i] = v; return b }
	longName := binary.BigEndian.AppendUint16(with(3, opRead)[:4], MaxSegmentName+1)
	longName = append(longName, make([]byte, 300+reqTrailer)...)
	tests := []struct {
		name string
		in   []byte
		want error
	}{
		{"empty", nil, io.EOF},
		{"truncated fixed part", valid[:3], io.ErrUnexpectedEOF},
		{"truncated name", valid[:reqFixed+1], io.ErrUnexpectedEOF},
		{"truncated trailer", valid[:len(valid)-1], io.ErrUnexpectedEOF},
		{"bad magic", with(0, 'X'), ErrProtocol},
		{"bad version", with(2, 9), ErrProtocol},
		{"op zero", with(3, 0), ErrProtocol},
		{"op unknown", with(3, 4), ErrProtocol},
		{"describe with length", appendRequest(nil, opDescribe, "seg", 0, 1, ""), ErrProtocol},
		{"describe with offset", appendRequest(nil, opDescribe, "seg", 1, 0, ""), ErrProtocol},
		{"name too long", longName, ErrProtocol},
		{"length over cap", appendRequest(nil, opWrite, "seg", 0, MaxOpLen+1, ""), ErrProtocol},
		{"length huge", appendRequest(nil, opRead, "seg", 0, 1<<63, ""), ErrProtocol},
		{"ticket too long", appendRequest(nil, opRead, "seg", 0, 1, strings.Repeat("t", MaxTicket+1)), ErrProtocol},
		{"truncated ticket", appendRequest(nil, opRead, "seg", 0, 1, "ticket")[:reqFixed+3+reqTrailer+2], io.ErrUnexpectedEOF},
		{"garbage", []byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"), ErrProtocol},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var buf [reqMax]byte
			_, err := readRequest(bytes.NewReader(tt.in), &buf)
			if !errors.Is(err, tt.want) {
				t.Fatalf("err = %v, want %v", err, tt.want)
			}
		})
	}
}

func TestResponseRoundTrip(t *testing.T) {
	for _, h := range []respHeader{{statusOK, 0}, {statusOK, MaxOpLen}, {statusNotFound, 12}, {statusInternal, maxErrMsg}} {
		var buf [respLen]byte
		got, err := readResponse(bytes.NewReader(appendResponse(nil, h)), &buf)
		if err != nil || got != h {
			t.Errorf("round trip of %+v = %+v, %v", h, got, err)
		}
	}
}

func TestReadResponseRejects(t *testing.T) {
	ok := appendResponse(nil, respHeader{statusOK, 5})
	badMagic := bytes.Clone(ok)
	badMagic[1] = 0
	tests := []struct {
		name string
		in   []byte
		want error
	}{
		{"empty", nil, io.EOF},
		{"truncated", ok[:respLen-1], io.ErrUnexpectedEOF},
		{"bad magic", badMagic, ErrProtocol},
		{"unknown status", appendResponse(nil, respHeader{statusForbidden + 1, 0}), ErrProtocol},
		{"error message too long", appendResponse(nil, respHeader{statusNotFound, maxErrMsg + 1}), ErrProtocol},
		{"payload over cap", appendResponse(nil, respHeader{statusOK, MaxOpLen + 1}), ErrProtocol},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var buf [respLen]byte
			if _, err := readResponse(bytes.NewReader(tt.in), &buf); !errors.Is(err, tt.want) {
				t.Fatalf("err = %v, want %v", err, tt.want)
			}
		})
	}
}

func TestStatusMapping(t *testing.T) {
	for _, s := range []byte{statusNotFound, statusOutOfRange, statusBadRequest, statusInternal, statusUnsupported} {
		if got := errStatus(statusErr(s)); got != s {
			t.Errorf("status %d -> %v -> %d", s, statusErr(s), got)
		}
	}
}

func TestOffsetInRange(t *testing.T) {
	tests := []struct {
		off, n uint64
		size   int64
		want   bool
	}{
		{0, 0, 0, true},
		{0, 10, 10, true},
		{10, 0, 10, true},
		{1, 10, 10, false},
		{11, 0, 10, false},
		{1 << 63, 1, 10, false},
		{1<<63 - 1, 2, 1<<63 - 1, false}, // off+n overflows int64
	}
	for _, tt := range tests {
		if got := offsetInRange(tt.off, tt.n, tt.size); got != tt.want {
			t.Errorf("offsetInRange(%d, %d, %d) = %v", tt.off, tt.n, tt.size, got)
		}
	}
}
