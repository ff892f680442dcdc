// Package ticket is the master's permission for one transfer: a ticket names
// an extent of a store's segment, what may be done to it (read or write), the
// put or copy it serves, and until when, under a MAC only the master and that
// store can make. A store moves bytes only for a request whose ticket covers
// them, so reaching its engine port is not enough to read or overwrite an
// object, and a writer frozen past its put's deadline cannot land bytes in
// space the master has since reused.
//
// # Keys
//
// A store makes a NodeKey when it starts and hands it to the master with its
// registration, so the key lives as long as one epoch of the node. Both sides
// derive a per-segment Key from it and the segment's id ("node/name@epoch"),
// so a ticket for one segment is worthless on any other.
//
// # Format
//
// A ticket is Size bytes: three 16-byte blocks of fields, then the tag.
//
//	offset  8  first byte of the extent
//	length  8  its length
//	expiry  8  unix nanoseconds (the master's clock) after which it is void
//	id      8  the put or copy it was issued for, 0 for reads
//	op      1  1 read, 2 write
//	zero   15
//	tag    16  AES-128 CBC-MAC of the three blocks under the segment's Key
//
// The message has a fixed length, for which CBC-MAC is a secure MAC; it costs
// three AES block encryptions, tens of nanoseconds, so a lookup of a thousand
// blocks can carry tickets without the master noticing.
package ticket
