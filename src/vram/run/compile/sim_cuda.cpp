// A CPU build of torch told that CUDA is built, for a compile-only process (vram.run.compile).
//
// at::accelerator::getAccelerator() asks getCUDAHooks().isBuilt(); a CPU build registers no
// "CUDAHooks", so the autograd engine has no accelerator for CUDA tensors and refuses their
// backward (InputBuffer::add -> at::accelerator::getCurrentStream). Registering hooks that say
// "built" (and nothing else: no device, no allocator, no generator) plus c10's FakeGuardImpl as
// CUDA's device guard lets fake CUDA tensors be made, indexed and differentiated. Load this
// library before torch's first getCUDAHooks() call (that is, before `import torch`): the hooks
// are created once per process.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace at {
namespace {
struct CUDAHooks final : CUDAHooksInterface {
  explicit CUDAHooks(CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
};
}  // namespace
// the registry key is the class name: getCUDAHooks() creates "CUDAHooks"
REGISTER_CUDA_HOOKS(CUDAHooks)
}  // namespace at

C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>)
