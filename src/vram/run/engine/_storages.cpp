// New storages of vram's simulation engine, made in C++: the compiled form of
// vram/run/engine/dlpack.py's `new_storage` (the reference, and the fallback where this file
// cannot be built; tests/test_engine_native.py compares the two).
//
// A storage is what at::fromDLPack makes of the DLPack path's capsule (aten/src/ATen/DLConvertor.cpp:
// at::from_blob with the DLTensor's sizes and strides, device PrivateUse1 and the dtype): a
// non-resizable storage with no allocator over the simulated address (never read), on the
// PrivateUse1 device. A view that spans its storage from its start is made with its sizes and
// strides; any other gets a storage of `nbytes` (as the DLPack path's one-dimensional base) and
// its sizes, strides and offset set on it, as the CPU kernel of as_strided sets them on an alias
// of that base (aten/src/ATen/native/TensorShape.cpp as_strided_tensorimpl). The storage's
// DataPtr context calls `died(device, address)` when PyTorch frees it, under the GIL, with any
// pending Python error set aside and an error of its own reported as unraisable, as CPython
// runs a finaliser (the DLPack path's `_Block.__del__`).
//
// Only ATen's from_blob and Python's headers are included (torch/csrc's Python headers take four
// times as long to compile); the two functions of libtorch_python used are declared here as that
// library exports them, so a torch whose exports differ fails to load this library (and the engine
// keeps the DLPack path) rather than misbehaving. A tensor is read through its TensorImpl
// (``Tensor._cdata``), which its Python object keeps alive for the call.
#include <Python.h>

#include <ATen/ops/from_blob.h>
#include <c10/core/ScalarType.h>

// torch/csrc/autograd/python_variable.h
PyObject* THPVariable_Wrap(const at::TensorBase& var);
namespace torch::utils {
// torch/csrc/utils/device_lazy_init.h (what maybe_initialize_device calls for PrivateUse1)
void device_lazy_init(c10::DeviceType device_type);
}  // namespace torch::utils

namespace {

PyObject* tensor_type = nullptr;  // torch.Tensor
PyObject* cdata_name = nullptr;   // "_cdata"

// The empty storage's address (dlpack.py EMPTY: never read, never charged).
constexpr uintptr_t kEmpty = uintptr_t(1) << 40;

struct Death {
  PyObject* died;  // a strong reference
  long long device;
  long long address;
};

bool finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

void on_death(void* context) {
  auto* death = static_cast<Death*>(context);
  if (!Py_IsInitialized() || finalizing()) {  // no interpreter left to tell (nor to free `died`)
    delete death;
    return;
  }
  PyGILState_STATE gil = PyGILState_Ensure();
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  PyObject* result = PyObject_CallFunction(death->died, "LL", death->device, death->address);
  if (result == nullptr) {
    PyErr_WriteUnraisable(death->died);
  } else {
    Py_DECREF(result);
  }
  Py_DECREF(death->died);
  PyErr_Restore(type, value, traceback);
  PyGILState_Release(gil);
  delete death;
}

// The dtypes the DLPack path has a code for (dlpack.py CODES); others are refused as it refuses them.
bool has_dlpack_code(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: case c10::ScalarType::Half: case c10::ScalarType::Double:
    case c10::ScalarType::BFloat16: case c10::ScalarType::Long: case c10::ScalarType::Int:
    case c10::ScalarType::Short: case c10::ScalarType::Char: case c10::ScalarType::Byte:
    case c10::ScalarType::UInt16: case c10::ScalarType::UInt32: case c10::ScalarType::UInt64:
    case c10::ScalarType::Bool: case c10::ScalarType::ComplexFloat: case c10::ScalarType::ComplexDouble:
      return true;
    default:
      return false;
  }
}

// Elements from a view's first to one past its last (0 for an empty view): dlpack.py `_extent`.
int64_t extent(c10::IntArrayRef sizes, c10::IntArrayRef strides) {
  int64_t n = 1;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] == 0) {
      return 0;
    }
    n += (sizes[i] - 1) * strides[i];
  }
  return n;
}

// The TensorImpl behind a torch.Tensor (nullptr with a Python error set when `obj` is none).
c10::TensorImpl* impl_of(PyObject* obj) {
  int is_tensor = Py_TYPE(obj) == reinterpret_cast<PyTypeObject*>(tensor_type) ? 1 : PyObject_IsInstance(obj, tensor_type);
  if (is_tensor != 1) {
    if (is_tensor == 0) {
      PyErr_SetString(PyExc_TypeError, "new_storage: meta must be a Tensor");
    }
    return nullptr;
  }
  PyObject* cdata = PyObject_GetAttr(obj, cdata_name);
  if (cdata == nullptr) {
    return nullptr;
  }
  void* impl = PyLong_AsVoidPtr(cdata);
  Py_DECREF(cdata);
  return static_cast<c10::TensorImpl*>(impl);
}

PyObject* make(PyObject* const* args) {
  c10::TensorImpl* meta = impl_of(args[0]);
  long long device = PyLong_AsLongLong(args[1]);
  long long address = PyLong_AsLongLong(args[2]);
  long long nbytes = PyLong_AsLongLong(args[4]);
  if (meta == nullptr || PyErr_Occurred()) {
    return nullptr;
  }
  const c10::ScalarType dtype = meta->dtype().toScalarType();
  if (!has_dlpack_code(dtype)) {
    PyObject* name = PyObject_GetAttrString(args[0], "dtype");
    if (name != nullptr) {
      PyErr_Format(PyExc_NotImplementedError, "vram run --backend privateuse1: no DLPack code for %S yet", name);
      Py_DECREF(name);
    }
    return nullptr;
  }
  const int64_t words = nbytes / static_cast<int64_t>(meta->dtype().itemsize());
  c10::IntArrayRef sizes = meta->sizes(), strides = meta->strides();
  const int64_t offset = meta->storage_offset();
  const bool spans = offset == 0 && words == extent(sizes, strides);
  c10::Device where(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device));
  auto* death = new Death{args[3], device, address};
  Py_INCREF(death->died);
  void* data = reinterpret_cast<void*>(address ? static_cast<uintptr_t>(address) : kEmpty);
  int64_t flat[1] = {words};
  auto maker = at::for_blob(data, spans ? sizes : c10::IntArrayRef(flat, 1));
  if (spans) {
    maker.strides(strides);
  }
  at::Tensor t = maker.context(death, &on_death)
                     .target_device(where)
                     .options(at::TensorOptions().dtype(dtype).device(where))
                     .make_tensor();
  if (!spans) {
    t.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, offset);
  }
  torch::utils::device_lazy_init(c10::DeviceType::PrivateUse1);  // torch/csrc/utils/tensor_new.cpp tensor_fromDLPack
  return THPVariable_Wrap(t);
}

// new_storage(meta, device, address, died, nbytes): dlpack.py `new_storage` (nbytes given).
PyObject* new_storage(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5 || !PyCallable_Check(args[3])) {
    PyErr_SetString(PyExc_TypeError, "new_storage(meta: Tensor, device: int, address: int, died, nbytes: int)");
    return nullptr;
  }
  try {
    return make(args);
  } catch (const c10::Error& e) {
    if (!PyErr_Occurred()) {
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    }
  } catch (const std::exception& e) {
    if (!PyErr_Occurred()) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  }
  return nullptr;
}

PyMethodDef methods[] = {
    {"new_storage", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&new_storage)), METH_FASTCALL,
     "A PrivateUse1 tensor viewed as `meta` over a new storage of `nbytes` at `address` on `device`; "
     "died(device, address) when PyTorch frees it."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "vram_engine_storages", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_vram_engine_storages() {
  PyObject* torch = PyImport_ImportModule("torch");
  if (torch == nullptr) {
    return nullptr;
  }
  tensor_type = PyObject_GetAttrString(torch, "Tensor");
  Py_DECREF(torch);
  cdata_name = PyUnicode_InternFromString("_cdata");
  if (tensor_type == nullptr || cdata_name == nullptr) {
    return nullptr;
  }
  return PyModule_Create(&module);
}
