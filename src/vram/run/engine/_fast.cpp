// The compiled parts of vram's simulation engine's per-op path, each the C++ form of a Python
// reference that stays the readable rule and the fallback where this file cannot be built
// (tests/test_engine_fast.py compares each with its reference):
//  - new_storage: vram/run/engine/dlpack.py `new_storage`;
//  - place: where vram/run/engine/privateuse1.py `_block_reference` looks a tensor's block up;
//  - key: vram/run/engine/meta_cache.py `key_reference` (less the settings, passed in);
//  - view_of: vram/run/engine/views.py `view_of_reference` for a view that keeps the dtype (the
//    CPU kernel of as_strided, which `_op_dk(CPU, ...)` calls: at::cpu::as_strided).
// Only tensors whose Python type is exactly torch.Tensor or nn.Parameter over a plain TensorImpl
// (torch/csrc/autograd/python_variable.h THPVariable_CheckExact: a subclass may answer `device`
// or `layout` in Python) are read here; for any other `place` and `key` return NotImplemented
// and the caller asks the reference.
//
// new_storage makes what at::fromDLPack makes of the DLPack path's capsule
// (aten/src/ATen/DLConvertor.cpp: at::from_blob with the DLTensor's sizes and strides, device
// PrivateUse1 and the dtype): a non-resizable storage with no allocator over the simulated
// address (never read), on the PrivateUse1 device. A view that spans its storage from its start is
// made with its sizes and strides; any other gets a storage of `nbytes` (as the DLPack path's
// one-dimensional base) and its sizes, strides and offset set on it, as the CPU kernel of
// as_strided sets them on an alias of that base (aten/src/ATen/native/TensorShape.cpp
// as_strided_tensorimpl). The storage's DataPtr context calls `died(device, address)` when
// PyTorch frees it, under the GIL, with any pending Python error set aside and an error of its
// own reported as unraisable, as CPython runs a finaliser (the DLPack path's `_Block.__del__`).
//
// Only ATen's and Python's headers are included (torch/csrc's Python headers take four times as
// long to compile); the two libtorch_python functions used are declared as it exports them, so a
// torch whose exports differ fails to load this library (the engine keeps the Python path) rather
// than misbehaving. A tensor is read through its TensorImpl (``Tensor._cdata``), which its Python
// object keeps alive for the call.
#include <Python.h>

#include <ATen/ops/from_blob.h>  // ATen/core/Tensor.h first: the dispatch header below needs it
#include <ATen/ops/as_strided_cpu_dispatch.h>
#include <c10/core/ScalarType.h>

#include <typeinfo>

// torch/csrc/autograd/python_variable.h
PyObject* THPVariable_Wrap(const at::TensorBase& var);
namespace torch::utils {
// torch/csrc/utils/device_lazy_init.h (what maybe_initialize_device calls for PrivateUse1)
void device_lazy_init(c10::DeviceType device_type);
}  // namespace torch::utils

namespace {

PyObject* tensor_type = nullptr;     // torch.Tensor
PyObject* parameter_type = nullptr;  // torch.nn.Parameter
PyObject* cdata_name = nullptr;      // "_cdata"
PyObject* dtype_name = nullptr;      // "dtype"
PyObject* hex_name = nullptr;        // "hex"
// meta_cache.py _PLAIN: the types whose values are a key's part as they are
PyObject* plain_types[4] = {nullptr, nullptr, nullptr, nullptr};  // torch.dtype, device, layout, memory_format
// each ScalarType's torch.dtype (singletons), filled as tensors of each are seen
PyObject* dtypes[static_cast<int>(c10::ScalarType::NumOptions)] = {};

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
    case c10::ScalarType::Bool: case c10::ScalarType::ComplexHalf: case c10::ScalarType::ComplexFloat:
    case c10::ScalarType::ComplexDouble:
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

// The plain TensorImpl of an exact torch.Tensor / nn.Parameter; nullptr (no error set) for
// anything else, nullptr with an error set when `_cdata` cannot be read.
c10::TensorImpl* exact_impl(PyObject* obj) {
  PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(obj));
  if (type != tensor_type && type != parameter_type) {
    return nullptr;
  }
  PyObject* cdata = PyObject_GetAttr(obj, cdata_name);
  if (cdata == nullptr) {
    return nullptr;
  }
  auto* impl = static_cast<c10::TensorImpl*>(PyLong_AsVoidPtr(cdata));
  Py_DECREF(cdata);
  if (impl == nullptr || typeid(*impl) != typeid(c10::TensorImpl) || impl->has_symbolic_sizes_strides()) {
    return nullptr;  // nested, sparse, batched, opaque or symbolic: the reference reads it
  }
  return impl;
}

PyObject* not_implemented() { Py_RETURN_NOTIMPLEMENTED; }

// place(t): (device index, storage data address) of a PrivateUse1 tensor with a storage
// (torch._C._has_storage: has_storage(); torch._C._data_address: storage().data()), None for
// another tensor, NotImplemented where the reference must decide.
PyObject* place(PyObject* /*self*/, PyObject* t) {
  c10::TensorImpl* impl = exact_impl(t);
  if (impl == nullptr) {
    return PyErr_Occurred() ? nullptr : not_implemented();
  }
  try {
    const c10::Device d = impl->device();
    if (d.type() != c10::DeviceType::PrivateUse1 || !impl->has_storage()) {
      Py_RETURN_NONE;
    }
    const void* data = impl->storage().data();
    return Py_BuildValue("(iL)", d.has_index() ? static_cast<int>(d.index()) : 0,
                         static_cast<long long>(reinterpret_cast<intptr_t>(data)));
  } catch (const std::exception&) {
    return not_implemented();  // as the reference raises it
  }
}

PyObject* int_tuple(c10::IntArrayRef values) {
  PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(values.size()));
  if (out == nullptr) {
    return nullptr;
  }
  for (size_t i = 0; i < values.size(); ++i) {
    PyObject* v = PyLong_FromLongLong(values[i]);
    if (v == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(i), v);
  }
  return out;
}

// A tensor's share of the key: (dtype, sizes, strides, storage offset); None when it is not a
// strided PrivateUse1 tensor; NotImplemented for one the reference must read.
PyObject* tensor_part(PyObject* a) {
  c10::TensorImpl* impl = exact_impl(a);
  if (impl == nullptr) {
    return PyErr_Occurred() ? nullptr : not_implemented();
  }
  if (impl->layout() != c10::kStrided || impl->device_type() != c10::DeviceType::PrivateUse1) {
    Py_RETURN_NONE;
  }
  const auto st = static_cast<int>(impl->dtype().toScalarType());
  if (dtypes[st] == nullptr) {
    dtypes[st] = PyObject_GetAttr(a, dtype_name);  // kept: a dtype is a singleton
    if (dtypes[st] == nullptr) {
      return nullptr;
    }
  }
  PyObject* sizes = int_tuple(impl->sizes());
  PyObject* strides = sizes == nullptr ? nullptr : int_tuple(impl->strides());
  if (strides == nullptr) {
    Py_XDECREF(sizes);
    return nullptr;
  }
  return Py_BuildValue("(ONNL)", dtypes[st], sizes, strides, static_cast<long long>(impl->storage_offset()));
}

// meta_cache.py `_part`: `a`'s share of the key; None when the call cannot be remembered;
// NotImplemented when the reference must make the key.
PyObject* part(PyObject* a) {
  PyTypeObject* kind = Py_TYPE(a);
  PyObject* k = reinterpret_cast<PyObject*>(kind);
  if (k == tensor_type || k == parameter_type || PyObject_TypeCheck(a, reinterpret_cast<PyTypeObject*>(tensor_type))) {
    return tensor_part(a);
  }
  if (PyFloat_CheckExact(a)) {
    PyObject* hex = PyObject_CallMethodNoArgs(a, hex_name);  // -0.0 and 0.0 apart
    return hex == nullptr ? nullptr : Py_BuildValue("(ON)", k, hex);
  }
  bool plain = PyLong_CheckExact(a) || PyBool_Check(a) || PyUnicode_CheckExact(a) || PyComplex_CheckExact(a) ||
               a == Py_None;
  for (PyObject* t : plain_types) {
    plain = plain || k == t;
  }
  if (plain) {
    return Py_BuildValue("(OO)", k, a);
  }
  if (PyList_CheckExact(a) || PyTuple_CheckExact(a)) {
    PyObject* seq = PySequence_Fast(a, "");
    if (seq == nullptr) {
      return nullptr;
    }
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject* out = PyTuple_New(n + 1);
    if (out == nullptr) {
      Py_DECREF(seq);
      return nullptr;
    }
    Py_INCREF(k);
    PyTuple_SET_ITEM(out, 0, k);
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* p = part(PySequence_Fast_GET_ITEM(seq, i));
      if (p == nullptr || p == Py_None || p == Py_NotImplemented) {
        Py_DECREF(out);
        Py_DECREF(seq);
        return p;
      }
      PyTuple_SET_ITEM(out, i + 1, p);
    }
    Py_DECREF(seq);
    return out;
  }
  Py_RETURN_NONE;
}

// key(op, settings, args, kwargs): meta_cache.py `key_reference` for a call whose op may be
// remembered (the caller checks): (op, settings, parts of args..., (name, part) of kwargs...),
// None when it cannot be remembered, NotImplemented when the reference must make it.
PyObject* key(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4 || !PyTuple_Check(args[2]) || !PyDict_Check(args[3])) {
    PyErr_SetString(PyExc_TypeError, "key(op, settings, args: tuple, kwargs: dict)");
    return nullptr;
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(args[2]);
  PyObject* out = PyTuple_New(2 + n + PyDict_Size(args[3]));
  if (out == nullptr) {
    return nullptr;
  }
  Py_INCREF(args[0]);
  PyTuple_SET_ITEM(out, 0, args[0]);
  Py_INCREF(args[1]);
  PyTuple_SET_ITEM(out, 1, args[1]);
  Py_ssize_t at = 2;
  // each part in turn; false (and `out` dropped) at the first that is not a part
  auto put = [&](PyObject* p) {
    if (p == nullptr || p == Py_None || p == Py_NotImplemented) {
      Py_DECREF(out);
      out = p;
      return false;
    }
    PyTuple_SET_ITEM(out, at++, p);
    return true;
  };
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!put(part(PyTuple_GET_ITEM(args[2], i)))) {
      return out;
    }
  }
  Py_ssize_t pos = 0;
  PyObject *name, *value;
  while (PyDict_Next(args[3], &pos, &name, &value)) {
    PyObject* p = part(value);
    if (p != nullptr && p != Py_None && p != Py_NotImplemented) {
      p = Py_BuildValue("(ON)", name, p);
    }
    if (!put(p)) {
      return out;
    }
  }
  return out;
}

// view_of(src, meta): a view of `src`'s storage with `meta`'s sizes, strides and offset, by the
// CPU kernel of as_strided; NotImplemented where the dtypes differ or either tensor is one the
// reference must read.
PyObject* view_of(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "view_of(src: Tensor, meta: Tensor)");
    return nullptr;
  }
  c10::TensorImpl* src = exact_impl(args[0]);
  c10::TensorImpl* meta = src == nullptr ? nullptr : exact_impl(args[1]);
  if (meta == nullptr) {
    return PyErr_Occurred() ? nullptr : not_implemented();
  }
  if (src->dtype() != meta->dtype()) {
    return not_implemented();
  }
  try {
    at::Tensor base(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::reclaim_copy(src));
    return THPVariable_Wrap(at::cpu::as_strided(base, meta->sizes(), meta->strides(), meta->storage_offset()));
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

PyMethodDef methods[] = {
    {"new_storage", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&new_storage)), METH_FASTCALL,
     "A PrivateUse1 tensor viewed as `meta` over a new storage of `nbytes` at `address` on `device`; "
     "died(device, address) when PyTorch frees it."},
    {"place", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&place)), METH_O,
     "(device index, data address) of a PrivateUse1 tensor's storage; None for another tensor; "
     "NotImplemented where the reference must decide."},
    {"key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&key)), METH_FASTCALL,
     "The meta cache's key of op(*args, **kwargs) under settings; None: not remembered; "
     "NotImplemented: the reference must make it."},
    {"view_of", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&view_of)), METH_FASTCALL,
     "A view of src's storage with meta's geometry (same dtype); NotImplemented: the reference must make it."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "vram_engine_fast", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_vram_engine_fast() {
  PyObject* torch = PyImport_ImportModule("torch");
  if (torch == nullptr) {
    return nullptr;
  }
  tensor_type = PyObject_GetAttrString(torch, "Tensor");
  const char* plain[4] = {"dtype", "device", "layout", "memory_format"};
  for (int i = 0; i < 4; ++i) {
    plain_types[i] = PyObject_GetAttrString(torch, plain[i]);
  }
  Py_DECREF(torch);
  PyObject* nn = PyImport_ImportModule("torch.nn");
  if (nn == nullptr) {
    return nullptr;
  }
  parameter_type = PyObject_GetAttrString(nn, "Parameter");
  Py_DECREF(nn);
  cdata_name = PyUnicode_InternFromString("_cdata");
  dtype_name = PyUnicode_InternFromString("dtype");
  hex_name = PyUnicode_InternFromString("hex");
  if (tensor_type == nullptr || parameter_type == nullptr || cdata_name == nullptr || dtype_name == nullptr ||
      hex_name == nullptr || !plain_types[0] || !plain_types[1] || !plain_types[2] || !plain_types[3]) {
    return nullptr;
  }
  return PyModule_Create(&module);
}
