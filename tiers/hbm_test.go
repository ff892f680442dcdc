package tiers

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/tidepool-kv/tidepool/engine"
)

const hbmTestCapacity = 8 << 20

func TestHBMEmulated(t *testing.T) {
	tier, err := NewHBMEmulated("hbm0", hbmTestCapacity)
	if err != nil {
		t.Fatal(err)
	}
	if tier.Name() != "hbm0-emulated" || !tier.Emulated() || tier.Device() != -1 {
		t.Errorf("name %q emulated %v device %d, want hbm0-emulated true -1", tier.Name(), tier.Emulated(), tier.Device())
	}
	if s := tier.String(); !strings.Contains(s, "hbm-emulated") {
		t.Errorf("String() = %q, want it to say hbm-emulated", s)
	}
	testNotMapped(t, tier)
	testTier(t, tier, HBM, hbmTestCapacity)
}

func TestHBMEmulatedNameSaysSoOnce(t *testing.T) {
	tier, err := NewHBMEmulated("hbm1-emulated", 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer tier.Close()
	if tier.Name() != "hbm1-emulated" {
		t.Errorf("name %q, want hbm1-emulated", tier.Name())
	}
}

// TestHBM runs the tier suite on a real GPU when this host has one.
func TestHBM(t *testing.T) {
	tier, err := NewHBM("hbm0", 0, hbmTestCapacity)
	if errors.Is(err, ErrNoGPU) {
		t.Skipf("no GPU on this host (%v); the emulated tier and the fake CUDA runtime cover the code; run TIDEPOOL_GPU=1 go test -run HBM ./tiers/ on a GPU host", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	testRealHBM(t, tier)
}

// TestHBMOnGPU is TestHBM for a GPU host: with TIDEPOOL_GPU=1 a missing GPU
// fails the test instead of skipping it.
func TestHBMOnGPU(t *testing.T) {
	if os.Getenv("TIDEPOOL_GPU") != "1" {
		t.Skip("set TIDEPOOL_GPU=1 on a host with an NVIDIA GPU to run")
	}
	cuda, err := loadCUDA()
	if err != nil {
		t.Fatalf("TIDEPOOL_GPU=1 but no CUDA runtime: %v", err)
	}
	n, err := cuda.deviceCount()
	if err != nil {
		t.Fatalf("TIDEPOOL_GPU=1 but no CUDA device: %v", err)
	}
	t.Logf("%d CUDA device(s)", n)

	tier, err := NewHBM("hbm0", 0, hbmTestCapacity)
	if err != nil {
		t.Fatalf("TIDEPOOL_GPU=1 but NewHBM failed: %v", err)
	}
	testRealHBM(t, tier)

	t.Run("concurrent", func(t *testing.T) {
		tier, err := NewHBM("hbm0", 0, hbmTestCapacity)
		if err != nil {
			t.Fatal(err)
		}
		defer tier.Close()
		testConcurrent(t, tier)
	})
	t.Run("large", func(t *testing.T) {
		const size = 256 << 20
		tier, err := NewHBM("hbm0", 0, size)
		if err != nil {
			t.Fatal(err)
		}
		defer tier.Close()
		data := make([]byte, size)
		for i := range data {
			data[i] = byte(i*7 + i>>12)
		}
		if _, err := tier.WriteAt(data, 0); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, size)
		if _, err := tier.ReadAt(got, 0); err != nil || !bytes.Equal(got, data) {
			t.Fatalf("read back %d bytes: %v, equal %v", size, err, bytes.Equal(got, data))
		}
	})
	t.Run("every device", func(t *testing.T) {
		var ts []*HBMTier
		for d := range n {
			tier, err := NewHBM(fmt.Sprintf("hbm%d", d), d, 1<<20)
			if err != nil {
				t.Fatal(err)
			}
			ts = append(ts, tier)
		}
		var wg sync.WaitGroup
		for _, tier := range ts {
			wg.Go(func() { testConcurrent(t, tier) })
		}
		wg.Wait()
		for _, tier := range ts {
			if err := tier.Close(); err != nil {
				t.Error(err)
			}
		}
	})
	t.Run("errors", func(t *testing.T) {
		if _, err := NewHBM("hbm9", n, 1<<20); err == nil || !strings.Contains(err.Error(), "no CUDA device") {
			t.Errorf("NewHBM on device %d of %d: %v, want no CUDA device", n, n, err)
		}
		_, err := NewHBM("huge", 0, 1<<50)
		if err == nil || !strings.Contains(err.Error(), "cuda: cudaMalloc: out of memory (2)") {
			t.Errorf("NewHBM of 1 PiB: %v, want cuda: cudaMalloc: out of memory (2)", err)
		}
	})
}

func testRealHBM(t *testing.T, tier *HBMTier) {
	t.Helper()
	if tier.Emulated() || tier.Name() != "hbm0" || tier.Device() != 0 || !strings.Contains(tier.String(), "CUDA device 0") {
		t.Errorf("emulated %v name %q device %d string %q", tier.Emulated(), tier.Name(), tier.Device(), tier.String())
	}
	testNotMapped(t, tier)
	testTier(t, tier, HBM, hbmTestCapacity)
}

// testNotMapped checks that the engine can reach the tier only through
// ReadAt and WriteAt, as it can device memory.
func testNotMapped(t *testing.T, tier Tier) {
	t.Helper()
	seg := tier.Segment()
	if _, ok := seg.(engine.Mapped); ok {
		t.Error("an HBM segment must not be Mapped")
	}
	if _, ok := seg.(engine.Shareable); ok {
		t.Error("an HBM segment must not be Shareable")
	}
}

func TestHBMInvalid(t *testing.T) {
	for _, c := range []int64{0, -1} {
		if _, err := NewHBMEmulated("bad", c); err == nil {
			t.Errorf("NewHBMEmulated(%d) succeeded", c)
		}
		_, err := NewHBM("bad", 0, c)
		if err == nil || errors.Is(err, ErrNoGPU) {
			t.Errorf("NewHBM(capacity %d) = %v, want a capacity error before any CUDA call", c, err)
		}
	}
	if _, err := NewHBM("bad", -1, 1<<20); err == nil || errors.Is(err, ErrNoGPU) {
		t.Errorf("NewHBM(device -1) = %v, want a device error before any CUDA call", err)
	}
	if _, err := NewHBMEmulated("", 1<<20); err != nil {
		t.Errorf("NewHBMEmulated(\"\") = %v; the name is then -emulated", err)
	}
	if _, err := NewHBMEmulated(strings.Repeat("x", engine.MaxSegmentName), 1<<20); err == nil {
		t.Error("NewHBMEmulated with a name too long for the engine succeeded")
	}
}

func TestHBMClose(t *testing.T) {
	tier, err := NewHBMEmulated("hbm0", 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		if err := tier.Close(); err != nil {
			t.Fatalf("Close #%d: %v", i+1, err)
		}
	}
	buf := make([]byte, 16)
	if _, err := tier.ReadAt(buf, 0); !errors.Is(err, engine.ErrClosed) {
		t.Errorf("ReadAt after Close: %v, want engine.ErrClosed", err)
	}
	if _, err := tier.WriteAt(buf, 0); !errors.Is(err, engine.ErrClosed) {
		t.Errorf("WriteAt after Close: %v, want engine.ErrClosed", err)
	}
}

func TestHBMZeroLength(t *testing.T) {
	for _, tier := range hbmVariants(t, 1<<20) {
		for _, off := range []int64{0, 1 << 20} {
			if n, err := tier.WriteAt(nil, off); n != 0 || err != nil {
				t.Errorf("%s: WriteAt(nil, %d) = %d, %v", tier, off, n, err)
			}
			if n, err := tier.ReadAt([]byte{}, off); n != 0 || err != nil {
				t.Errorf("%s: ReadAt(empty, %d) = %d, %v", tier, off, n, err)
			}
		}
		tier.Close()
	}
}

// TestHBMConcurrent reads and writes disjoint ranges from many goroutines;
// run it with -race.
func TestHBMConcurrent(t *testing.T) {
	for _, tier := range hbmVariants(t, hbmTestCapacity) {
		t.Run(tier.Name(), func(t *testing.T) {
			testConcurrent(t, tier)
			if err := tier.Close(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// hbmVariants are the HBM tiers this host can build: emulated, over the fake
// CUDA runtime, and on a real GPU if there is one.
func hbmVariants(t *testing.T, capacity int64) []*HBMTier {
	t.Helper()
	emu, err := NewHBMEmulated("hbm0", capacity)
	if err != nil {
		t.Fatal(err)
	}
	fake, err := newHBM("hbm1", 0, capacity, newFakeCUDA(1, capacity).runtime())
	if err != nil {
		t.Fatal(err)
	}
	out := []*HBMTier{emu, fake}
	if gpu, err := NewHBM("hbm2", 0, capacity); err == nil {
		out = append(out, gpu)
	}
	return out
}

func testConcurrent(t *testing.T, tier Tier) {
	seg := tier.Segment()
	const workers, rounds = 8, 16
	chunk := seg.Size() / workers
	n := int(min(chunk/4, 64<<10))
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			got := make([]byte, n)
			for r := range rounds {
				data := bytes.Repeat([]byte{byte(w*rounds + r + 1)}, n)
				off := int64(w)*chunk + int64(r)*(chunk-int64(n))/rounds
				if _, err := seg.WriteAt(data, off); err != nil {
					t.Errorf("worker %d: WriteAt(%d): %v", w, off, err)
					return
				}
				if _, err := seg.ReadAt(got, off); err != nil || !bytes.Equal(got, data) {
					t.Errorf("worker %d: ReadAt(%d): %v, bytes equal %v", w, off, err, bytes.Equal(got, data))
					return
				}
			}
		})
	}
	wg.Wait()
}

func TestLoadCUDAMissing(t *testing.T) {
	_, err := loadCUDA("libcudart-tidepool-test-missing.so", "libcudart-tidepool-test-missing.so.1")
	if !errors.Is(err, ErrNoGPU) || !strings.Contains(err.Error(), "libcudart-tidepool-test-missing.so.1") {
		t.Errorf("loadCUDA of missing libraries: %v, want ErrNoGPU naming every library tried", err)
	}
}

// TestHBMFakeCUDA runs the suite through the device code path, over a fake
// CUDA runtime that keeps device memory in Go slices and checks that every
// call acts on the device of the memory it touches.
func TestHBMFakeCUDA(t *testing.T) {
	fake := newFakeCUDA(2, hbmTestCapacity)
	cuda := fake.runtime()
	tier, err := newHBM("hbm0", 1, hbmTestCapacity, cuda)
	if err != nil {
		t.Fatal(err)
	}
	if tier.Emulated() || tier.Device() != 1 || !strings.Contains(tier.String(), "CUDA device 1") {
		t.Errorf("emulated %v device %d string %q", tier.Emulated(), tier.Device(), tier.String())
	}
	fake.mu.Lock()
	for _, a := range fake.allocs {
		if a.device != 1 || len(a.mem) != hbmTestCapacity {
			t.Errorf("allocated %d bytes on device %d, want %d on device 1", len(a.mem), a.device, hbmTestCapacity)
		}
	}
	fake.mu.Unlock()
	testNotMapped(t, tier)
	testTier(t, tier, HBM, hbmTestCapacity)

	// Two devices at once: a copy that ran on a thread set to the other
	// device would be counted as misrouted.
	t0, err := newHBM("hbm0", 0, hbmTestCapacity, cuda)
	if err != nil {
		t.Fatal(err)
	}
	t1, err := newHBM("hbm1", 1, hbmTestCapacity, cuda)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Go(func() { testConcurrent(t, t0) })
	wg.Go(func() { testConcurrent(t, t1) })
	wg.Wait()
	for _, tier := range []*HBMTier{t0, t1} {
		if err := tier.Close(); err != nil {
			t.Fatal(err)
		}
	}

	fake.mu.Lock()
	defer fake.mu.Unlock()
	if fake.misrouted != 0 {
		t.Errorf("%d CUDA calls ran on a thread set to another device", fake.misrouted)
	}
	if len(fake.allocs) != 0 {
		t.Errorf("%d allocations left after Close", len(fake.allocs))
	}
}

func TestHBMFakeCUDAErrors(t *testing.T) {
	noDevice := newFakeCUDA(0, 1<<20)
	noDevice.countErr = 100
	if _, err := newHBM("hbm0", 0, 1<<20, noDevice.runtime()); !errors.Is(err, ErrNoGPU) ||
		!strings.Contains(err.Error(), "cuda: cudaGetDeviceCount: no CUDA-capable device is detected (100)") {
		t.Errorf("no device: %v, want ErrNoGPU with the CUDA error", err)
	}
	if _, err := newHBM("hbm0", 0, 1<<20, newFakeCUDA(0, 1<<20).runtime()); !errors.Is(err, ErrNoGPU) {
		t.Errorf("zero devices: %v, want ErrNoGPU", err)
	}
	cuda := newFakeCUDA(1, 1<<20).runtime()
	if _, err := newHBM("hbm0", 1, 1<<20, cuda); err == nil || errors.Is(err, ErrNoGPU) || !strings.Contains(err.Error(), "no CUDA device 1") {
		t.Errorf("device 1 of 1: %v, want no CUDA device 1", err)
	}
	_, err := newHBM("hbm0", 0, 2<<20, cuda)
	if err == nil || errors.Is(err, ErrNoGPU) || !strings.Contains(err.Error(), "cuda: cudaMalloc: out of memory (2)") {
		t.Errorf("over device memory: %v, want cuda: cudaMalloc: out of memory (2)", err)
	}
}

// fakeCUDA is a CUDA runtime in Go: device memory is Go slices at made-up
// device addresses, the current device is tracked per OS thread.
type fakeCUDA struct {
	devices  int
	limit    int64 // the largest allocation that succeeds
	countErr int32 // what cudaGetDeviceCount returns

	mu        sync.Mutex
	current   map[int]int // OS thread id -> device set on it
	allocs    map[uintptr]*fakeAlloc
	next      uintptr
	misrouted int
}

type fakeAlloc struct {
	device int
	mem    []byte
}

func newFakeCUDA(devices int, limit int64) *fakeCUDA {
	return &fakeCUDA{devices: devices, limit: limit, current: map[int]int{}, allocs: map[uintptr]*fakeAlloc{}, next: 1 << 40}
}

var fakeCUDAErrors = map[int32]string{
	1:   "invalid argument",
	2:   "out of memory",
	100: "no CUDA-capable device is detected",
	101: "invalid device ordinal",
}

func (f *fakeCUDA) runtime() *cudaRuntime {
	return &cudaRuntime{
		getDeviceCount: func(count *int32) int32 {
			*count = int32(f.devices)
			return f.countErr
		},
		setDevice: func(device int32) int32 {
			if device < 0 || int(device) >= f.devices {
				return 101
			}
			f.mu.Lock()
			defer f.mu.Unlock()
			f.current[unix.Gettid()] = int(device)
			return 0
		},
		malloc: func(devPtr *uintptr, size uintptr) int32 {
			if int64(size) > f.limit {
				return 2
			}
			f.mu.Lock()
			defer f.mu.Unlock()
			ptr := f.next
			f.next += size + 1<<20
			f.allocs[ptr] = &fakeAlloc{device: f.currentDevice(), mem: make([]byte, size)}
			*devPtr = ptr
			return 0
		},
		free: func(devPtr uintptr) int32 {
			f.mu.Lock()
			defer f.mu.Unlock()
			a, ok := f.allocs[devPtr]
			if !ok {
				return 1
			}
			f.checkDevice(a)
			delete(f.allocs, devPtr)
			return 0
		},
		memcpyHtoD: func(dst uintptr, src *byte, count uintptr, kind int32) int32 {
			mem := f.deviceBytes(dst, count)
			if mem == nil || kind != cudaMemcpyHostToDevice {
				return 1
			}
			copy(mem, unsafe.Slice(src, count))
			return 0
		},
		memcpyDtoH: func(dst *byte, src uintptr, count uintptr, kind int32) int32 {
			mem := f.deviceBytes(src, count)
			if mem == nil || kind != cudaMemcpyDeviceToHost {
				return 1
			}
			copy(unsafe.Slice(dst, count), mem)
			return 0
		},
		getErrorString: func(code int32) string {
			if s, ok := fakeCUDAErrors[code]; ok {
				return s
			}
			return "unknown error"
		},
	}
}

// deviceBytes is the device memory [ptr, ptr+n), nil if no one allocation
// holds it. Copies of disjoint ranges run in parallel, as on a GPU.
func (f *fakeCUDA) deviceBytes(ptr, n uintptr) []byte {
	f.mu.Lock()
	defer f.mu.Unlock()
	for base, a := range f.allocs {
		if ptr >= base && ptr+n <= base+uintptr(len(a.mem)) {
			f.checkDevice(a)
			return a.mem[ptr-base : ptr-base+n]
		}
	}
	return nil
}

// currentDevice is the device set on the calling thread, 0 by default as in
// CUDA. f.mu must be held.
func (f *fakeCUDA) currentDevice() int { return f.current[unix.Gettid()] }

// checkDevice counts a call on memory of another device than the calling
// thread's. f.mu must be held.
func (f *fakeCUDA) checkDevice(a *fakeAlloc) {
	if f.currentDevice() != a.device {
		f.misrouted++
	}
}
