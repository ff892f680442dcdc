// Package tiers holds the storage media of a store node. A Tier is one
// medium (HBM, DRAM or SSD) of a fixed capacity that exposes its bytes as an
// engine.Segment, so peers read and write it through the transfer engine.
//
// A tier does not allocate: the master owns the placement and the offset
// allocator of every segment, and the tier only holds the bytes.
package tiers
