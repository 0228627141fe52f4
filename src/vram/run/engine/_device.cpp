// The PrivateUse1 device of vram's simulation engine, as a C++ backend registers it
// (see vram/run/engine/native.py, which compiles this file on first use and loads it).
//
// torch._C._acc's Python device guard counts one device and keeps no current device
// (torch/csrc/acc/Module.cpp PythonDeviceGuard), so the autograd engine makes one ready queue
// (engine.cpp Engine::start_device_threads sizes device_ready_queues_ by deviceCount()) and a
// backward on any other index fails. Its Python hooks cannot supply a pinned-memory allocator
// (PrivateUse1HooksInterface::getPinnedMemoryAllocator), which DDP's Reducer needs for its
// used-parameter map (reducer.cpp all_reduce_local_used_map). This file registers both the
// way a C++ backend does (c10::impl::registerDeviceGuard, at::RegisterPrivateUse1HooksInterface):
//  - a device guard with a settable device count and a current device per thread (as CUDA's
//    cudaSetDevice is per thread); streams and events are the default stream's no-ops, as in
//    the Python guard (vram models streams in Python);
//  - hooks whose pinned-memory allocator is host memory from c10's CPU allocator, remembered so
//    that isPinnedPtr answers for it (a pinned host buffer is host memory: it costs no GPU bytes).
// Operators stay with the Python boxed fallback (torch.library fallback at PrivateUse1).
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>

#include <atomic>
#include <mutex>
#include <unordered_set>

namespace {

std::atomic<int> device_count{1};
thread_local c10::DeviceIndex current_device = 0;

struct Guard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override {
    return c10::DeviceType::PrivateUse1;
  }
  c10::Device exchangeDevice(c10::Device device) const override {
    c10::Device old = getDevice();
    setDevice(device);
    return old;
  }
  c10::Device getDevice() const override {
    return c10::Device(type(), current_device);
  }
  void setDevice(c10::Device device) const override {
    uncheckedSetDevice(device);
  }
  void uncheckedSetDevice(c10::Device device) const noexcept override {
    if (device.index() >= 0) {
      current_device = device.index();
    }
  }
  c10::Stream getStream(c10::Device device) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, device);
  }
  c10::Stream getNewStream(c10::Device device, int /*priority*/) const override {
    return c10::Stream(c10::Stream::DEFAULT, device);
  }
  c10::Stream exchangeStream(c10::Stream stream) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, stream.device());
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return static_cast<c10::DeviceIndex>(device_count.load());
  }
  void record(void** /*event*/, const c10::Stream& /*stream*/, const c10::DeviceIndex /*device_index*/,
              const c10::EventFlag /*flag*/) const override {}
  void block(void* /*event*/, const c10::Stream& /*stream*/) const override {}
  bool queryEvent(void* /*event*/) const override {
    return true;
  }
  void destroyEvent(void* /*event*/, const c10::DeviceIndex /*device_index*/) const noexcept override {}
  bool queryStream(const c10::Stream& /*stream*/) const override {
    return true;
  }
  void synchronizeStream(const c10::Stream& /*stream*/) const override {}
};

std::mutex pinned_mutex;
std::unordered_set<const void*> pinned;

void free_pinned(void* data) {
  {
    std::lock_guard<std::mutex> lock(pinned_mutex);
    pinned.erase(data);
  }
  c10::free_cpu(data);
}

struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* data = c10::alloc_cpu(nbytes ? nbytes : 1);
    {
      std::lock_guard<std::mutex> lock(pinned_mutex);
      pinned.insert(data);
    }
    return {data, data, &free_pinned, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &free_pinned;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

PinnedAllocator pinned_allocator;

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override {
    return true;
  }
  bool isAvailable() const override {
    return true;
  }
  bool hasPrimaryContext(c10::DeviceIndex /*device_index*/) const override {
    return true;
  }
  c10::DeviceIndex deviceCount() const override {
    return static_cast<c10::DeviceIndex>(device_count.load());
  }
  bool isPinnedPtr(const void* data) const override {
    std::lock_guard<std::mutex> lock(pinned_mutex);
    return pinned.count(data) > 0;
  }
  c10::Allocator* getPinnedMemoryAllocator() const override {
    return &pinned_allocator;
  }
};

Guard guard;
Hooks hooks;

}  // namespace

// At least `devices` devices from now on (the count never shrinks: the autograd engine sizes its
// queues once, at the process's first backward).
extern "C" int vram_engine_devices(int devices) {
  int now = device_count.load();
  while (devices > now && !device_count.compare_exchange_weak(now, devices)) {
  }
  return device_count.load();
}

// Register the guard and hooks for PrivateUse1; 0 when another guard or hooks came first.
extern "C" int vram_engine_register(int devices) {
  if (c10::impl::hasDeviceGuardImpl(c10::DeviceType::PrivateUse1) || at::isPrivateUse1HooksRegistered()) {
    return 0;
  }
  vram_engine_devices(devices);
  c10::impl::registerDeviceGuard(c10::DeviceType::PrivateUse1, &guard);
  at::RegisterPrivateUse1HooksInterface(&hooks);
  return 1;
}
