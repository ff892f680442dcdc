package tiers

import (
	"errors"
	"fmt"
	"runtime"
	"strings"

	"github.com/ebitengine/purego"
)

// ErrNoGPU reports that this host cannot serve an HBM tier: no CUDA runtime
// library could be loaded, or it sees no device. Declare the tier as
// hbm-emulated (NewHBMEmulated) on such hosts.
var ErrNoGPU = errors.New("no usable CUDA runtime or device")

// cudaMemcpyKind values of the CUDA runtime API.
const (
	cudaMemcpyHostToDevice int32 = 1
	cudaMemcpyDeviceToHost int32 = 2
)

// cudaRuntime is the part of the CUDA runtime API the HBM tier uses, called
// through purego: no cgo, so one binary runs on hosts with and without GPUs.
// Each function returns a cudaError_t, 0 on success.
//
// The device a call acts on is per OS thread in CUDA, so a caller that sets
// the device must hold its goroutine on its thread (runtime.LockOSThread)
// until the calls that depend on it are done; withDevice does that.
type cudaRuntime struct {
	getDeviceCount func(count *int32) int32
	setDevice      func(device int32) int32
	malloc         func(devPtr *uintptr, size uintptr) int32
	free           func(devPtr uintptr) int32
	// memcpyHtoD and memcpyDtoH are both cudaMemcpy, typed per direction so
	// the host side is a Go pointer and the device side an address.
	memcpyHtoD     func(dst uintptr, src *byte, count uintptr, kind int32) int32
	memcpyDtoH     func(dst *byte, src uintptr, count uintptr, kind int32) int32
	getErrorString func(code int32) string
}

// loadCUDA loads the CUDA runtime from the first of names that dlopen finds;
// with no names it tries the usual sonames (libcudart.so, libcudart.so.12,
// libcudart.so.11.0). A failure wraps ErrNoGPU.
//
// The library is never closed: the CUDA runtime keeps per-process state (the
// devices' primary contexts) and is not made to be unloaded. dlopen counts
// references, so loading it once per tier costs one lookup.
func loadCUDA(names ...string) (*cudaRuntime, error) {
	if len(names) == 0 {
		names = []string{"libcudart.so", "libcudart.so.12", "libcudart.so.11.0"}
	}
	var lib uintptr
	var tried []string
	// dlerror is per OS thread: keep dlopen and its error on one.
	runtime.LockOSThread()
	for _, name := range names {
		h, err := purego.Dlopen(name, purego.RTLD_NOW|purego.RTLD_LOCAL)
		if err == nil {
			lib = h
			break
		}
		tried = append(tried, fmt.Sprintf("%s (%v)", name, err))
	}
	runtime.UnlockOSThread()
	if lib == 0 {
		return nil, fmt.Errorf("%w: dlopen: %s", ErrNoGPU, strings.Join(tried, "; "))
	}
	r := &cudaRuntime{}
	for _, f := range []struct {
		fptr any
		name string
	}{
		{&r.getDeviceCount, "cudaGetDeviceCount"},
		{&r.setDevice, "cudaSetDevice"},
		{&r.malloc, "cudaMalloc"},
		{&r.free, "cudaFree"},
		{&r.memcpyHtoD, "cudaMemcpy"},
		{&r.memcpyDtoH, "cudaMemcpy"},
		{&r.getErrorString, "cudaGetErrorString"},
	} {
		// Look the symbol up first: RegisterLibFunc panics on a missing one.
		sym, err := purego.Dlsym(lib, f.name)
		if err != nil {
			return nil, fmt.Errorf("%w: the CUDA runtime lacks %s: %w", ErrNoGPU, f.name, err)
		}
		purego.RegisterFunc(f.fptr, sym)
	}
	return r, nil
}

// check turns a cudaError_t into a Go error: "cuda: cudaMalloc: out of memory (2)".
func (r *cudaRuntime) check(fn string, code int32) error {
	if code == 0 {
		return nil
	}
	return fmt.Errorf("cuda: %s: %s (%d)", fn, r.getErrorString(code), code)
}

// deviceCount is the number of CUDA devices this process can use. No device,
// or a driver the runtime cannot use, wraps ErrNoGPU.
func (r *cudaRuntime) deviceCount() (int, error) {
	var n int32
	if err := r.check("cudaGetDeviceCount", r.getDeviceCount(&n)); err != nil {
		return 0, fmt.Errorf("%w: %w", ErrNoGPU, err)
	}
	if n <= 0 {
		return 0, fmt.Errorf("%w: the CUDA runtime sees no device", ErrNoGPU)
	}
	return int(n), nil
}

// withDevice runs fn on one OS thread whose current device is device, so the
// CUDA calls in fn act on it whichever thread the goroutine ran on before.
func (r *cudaRuntime) withDevice(device int, fn func() error) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := r.check("cudaSetDevice", r.setDevice(int32(device))); err != nil {
		return err
	}
	return fn()
}

// alloc allocates size bytes of device memory on device.
func (r *cudaRuntime) alloc(device int, size int64) (uintptr, error) {
	var ptr uintptr
	err := r.withDevice(device, func() error {
		return r.check("cudaMalloc", r.malloc(&ptr, uintptr(size)))
	})
	return ptr, err
}

// release frees device memory allocated on device.
func (r *cudaRuntime) release(device int, ptr uintptr) error {
	return r.withDevice(device, func() error {
		return r.check("cudaFree", r.free(ptr))
	})
}

// toDevice copies p to device memory at dst; p is the host staging buffer.
func (r *cudaRuntime) toDevice(device int, dst uintptr, p []byte) error {
	if len(p) == 0 {
		return nil
	}
	return r.withDevice(device, func() error {
		return r.check("cudaMemcpy", r.memcpyHtoD(dst, &p[0], uintptr(len(p)), cudaMemcpyHostToDevice))
	})
}

// fromDevice copies device memory at src into p.
func (r *cudaRuntime) fromDevice(device int, p []byte, src uintptr) error {
	if len(p) == 0 {
		return nil
	}
	return r.withDevice(device, func() error {
		return r.check("cudaMemcpy", r.memcpyDtoH(&p[0], src, uintptr(len(p)), cudaMemcpyDeviceToHost))
	})
}
