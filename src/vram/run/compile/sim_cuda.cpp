// A CPU build of torch told that CUDA is built, for a compile-only process (vram.run.compile).
//
// at::accelerator::getAccelerator() asks getCUDAHooks().isBuilt(); a CPU build registers no
// "CUDAHooks", so the autograd engine has no accelerator for CUDA tensors and refuses their
// backward (InputBuffer::add -> at::accelerator::getCurrentStream). Registering hooks that say
// "built" (and nothing else: no device, no allocator, no generator) plus c10's FakeGuardImpl as
// CUDA's device guard lets fake CUDA tensors be made, indexed and differentiated. Load this
// library before torch's first getCUDAHooks() call (that is, before `import torch`): the hooks
// are created once per process.
//
// The hooks also say what a CUDA build with cuDNN answers (CUDAHooks.cpp), so that the choices
// ATen makes from them while Inductor traces (Convolution.cpp select_conv_backend: cuDNN, whose
// output follows cudnn_conv_suggest_memory_format; batch norm's _batch_norm_impl_index) are the
// GPU's: the card's major version and the cuDNN version come from vram_sim_cuda_set, called
// before the hooks are first used.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace {
int card_major = 9;
long cudnn_version = 92000;
}  // namespace

extern "C" void vram_sim_cuda_set(int major, long cudnn) {
  card_major = major;
  cudnn_version = cudnn;
}

namespace at {
namespace {
struct CUDAHooks final : CUDAHooksInterface {
  explicit CUDAHooks(CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  bool hasCuDNN() const override { return true; }
  bool compiledWithCuDNN() const override { return true; }
  long versionCuDNN() const override { return cudnn_version; }
  long versionRuntimeCuDNN() const override { return cudnn_version; }
  // CUDAHooks.cpp: dilated always; depthwise from Volta (major 7); bf16 convolutions from major 8
  bool supportsDilatedConvolutionWithCuDNN() const override { return true; }
  bool supportsDepthwiseConvolutionWithCuDNN() const override { return card_major >= 7; }
  bool supportsBFloat16ConvolutionWithCuDNNv8() const override { return card_major >= 8; }
  double batchnormMinEpsilonCuDNN() const override { return 0.0; }  // cudnn.h CUDNN_BN_MIN_EPSILON
};
}  // namespace
// the registry key is the class name: getCUDAHooks() creates "CUDAHooks"
REGISTER_CUDA_HOOKS(CUDAHooks)
}  // namespace at

C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>)
