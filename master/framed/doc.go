// Package framed carries the unary calls of gRPC services as one frame
// each way over plain TCP, beside gRPC on the same port.
//
// A gRPC unary call between two processes here costs about three times a
// bare round trip (HTTP/2 framing and header compression, and four
// goroutine hand-offs where two do). The master's hot calls (a put's
// BatchPutEnd, a lookup) are one round trip each, so the master serves
// them framed too: the same protobuf messages through the same generated
// handlers and the same interceptor, so a handler cannot tell the two
// apart (its deadline, peer and trailer work as under gRPC). Streams stay
// on gRPC: Client hands them to its fallback connection, and so every call
// while the peer does not speak framed (an older master).
//
// The wire. A connection opens with the client's 24-byte preface, which
// the server echoes; it is as long as HTTP/2's, so Split tells the two
// apart from the first bytes and a gRPC-only server closes at once. Then
// each request is
//
//	u32 size of the rest | u64 id | u64 timeout in ns (0: none) | u16 method size | method | message
//
// and each answer
//
//	u32 size of the rest | u64 id | u32 code | u32 text size | text | u32 trailer size | trailer | message
//
// big-endian, where method is gRPC's "/package.Service/Method", code and
// text are the call's gRPC status, trailer is the trailer metadata as
// pairs (u16 key size, key, u32 value size, value; a status's details ride
// in it as under gRPC) and message is the protobuf request or reply.
// Answers come in any order; the id pairs them. A request without a
// method cancels the call of its id, as a cancelled gRPC call resets its
// stream; a call past its deadline sends none, the server's own timer ends
// it.
//
// A frame begun is finished, whatever its call does meanwhile: a call
// cancelled while its request is written returns at once, and the rest of
// the frame follows from a goroutine of the connection.
//
// Bounds, so a peer holds little: a frame carries at most MaxMessage of
// message and 1 MiB of trailer, its body must arrive within a deadline
// that grows with its size, a connection without a call for IdleTimeout is
// closed (a client replaces its own a minute before, so no call meets
// that close), each connection runs at most maxInFlight calls at once
// (then its requests wait in the socket), and a server holds at most
// maxConns connections.
package framed
