// Package enginetest holds test transports with fault injection for package engine.
//
// Shaper wraps a real engine.Transport and gives every rail (peer address) its own RailShape:
// bandwidth, latency, jitter, a random error rate, or a dead link. It lets tests exercise
// heterogeneous rails (a fast one and a slow one, a flaky one, one that dies mid-run) on a single
// host over loopback, or over an in-memory transport with no network at all:
//
//	sh := enginetest.NewShaper(inner, 1)
//	sh.SetRail("127.0.0.1:7001", enginetest.RailShape{Bandwidth: 100e6, Latency: time.Millisecond})
//	sh.SetRail("127.0.0.1:7002", enginetest.RailShape{Bandwidth: 25e6, ErrorRate: 0.01})
//	eng := engine.New(engine.Config{Transport: sh})
//	...
//	sh.SetRail("127.0.0.1:7002", enginetest.RailShape{Down: true}) // kill a rail mid-run
//
// Shaping uses real time: it shapes real traffic, and its timings are meant for assertions within
// generous bands, not for performance measurement.
package enginetest
