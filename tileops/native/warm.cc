// The warm path of a call, in native code: calls whose arguments match, exactly, a call that
// the Python dispatcher already validated and launched run its kernel from here, skipping
// `prepare`, the launcher lookup and the Python-side allocation (tileops/native/__init__.py
// builds and drives this module; benchmarks/NOTES.md has what each part costs).
//
// An entry's key is everything the Python path read from the call: per tensor its dtype,
// device, shape, strides, byte offset and whether its data is 16-byte aligned; per other
// argument its type and value. Its recipe says how the kernel's arguments come from the call:
// an input as it is, an input with its two dimensions swapped (a `w.t()` view passed as the
// (N, K) weight it views), a byte input read as 32-bit words, or an output or scratch buffer
// allocated here, through the caller's allocator (torch's, with its CUDA-graph pools) on the
// caller's current stream, both of which tvm-ffi sets up for the duration of the call.

#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ffi = tvm::ffi;

namespace {

// How a kernel argument is made (the recipe's `kind`, mirrored in tileops/native/__init__.py).
enum Kind : int64_t { kInput = 0, kInputSwapped = 1, kOutput = 2, kScratch = 3, kInputWords = 4 };

struct Buffer {
  DLDataType dtype;
  std::vector<int64_t> shape;
  bool returned;
};

struct Entry {
  ffi::Function kernel;
  std::vector<std::pair<int64_t, int64_t>> args;  // (kind, index)
  std::vector<Buffer> buffers;                    // outputs and scratch, by index
  int64_t n_returned;
  DLDevice device;  // where the buffers go: the call's tensors' (the key holds it)
};

struct KeyHash {
  size_t operator()(const std::vector<int64_t>& key) const noexcept {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the words
    for (int64_t v : key) {
      h ^= static_cast<uint64_t>(v);
      h *= 1099511628211ull;
    }
    return static_cast<size_t>(h);
  }
};

// Calls of new shapes keep adding entries (every M of a prefill, say); past this many, new
// shapes stay on the Python path rather than growing the table without bound.
constexpr size_t kMaxEntries = 4096;

std::mutex table_lock;
std::unordered_map<std::vector<int64_t>, std::shared_ptr<const Entry>, KeyHash> table;

int64_t PackDtype(DLDataType t) {
  return static_cast<int64_t>(t.code) | (static_cast<int64_t>(t.bits) << 8) |
         (static_cast<int64_t>(t.lanes) << 16);
}

// The key of `op` called with args[first:]; false where an argument is of a kind the key cannot
// hold (the Python path then takes the call).
bool MakeKey(int64_t op, const ffi::PackedArgs& args, int first, std::vector<int64_t>* key) {
  key->clear();
  key->push_back(op);
  key->push_back(args.size() - first);
  for (int i = first; i < args.size(); ++i) {
    ffi::AnyView arg = args[i];
    int32_t type = arg.type_index();
    key->push_back(type);
    if (type == ffi::TypeIndex::kTVMFFITensor || type == ffi::TypeIndex::kTVMFFIDLTensorPtr) {
      ffi::TensorView t = arg.cast<ffi::TensorView>();
      key->push_back(PackDtype(t.dtype()));
      key->push_back((static_cast<int64_t>(t.device().device_type) << 32) | t.device().device_id);
      key->push_back(t.ndim());
      for (int d = 0; d < t.ndim(); ++d) key->push_back(t.size(d));
      for (int d = 0; d < t.ndim(); ++d) key->push_back(t.stride(d));
      key->push_back(t.byte_offset());
      key->push_back(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0);
    } else if (type == ffi::TypeIndex::kTVMFFINone) {
    } else if (type == ffi::TypeIndex::kTVMFFIBool || type == ffi::TypeIndex::kTVMFFIInt) {
      key->push_back(arg.cast<int64_t>());
    } else if (type == ffi::TypeIndex::kTVMFFIFloat) {
      double v = arg.cast<double>();
      int64_t bits;
      std::memcpy(&bits, &v, sizeof(bits));
      key->push_back(bits);
    } else if (type == ffi::TypeIndex::kTVMFFIDataType) {
      key->push_back(PackDtype(arg.cast<DLDataType>()));
    } else {
      return false;
    }
  }
  return true;
}

// call(op, *args): the outputs of the matching entry's kernel, or None when nothing matches.
void Call(ffi::PackedArgs args, ffi::Any* rv) {
  thread_local std::vector<int64_t> key;
  if (!MakeKey(args[0].cast<int64_t>(), args, 1, &key)) return;
  std::shared_ptr<const Entry> entry;
  {
    std::lock_guard<std::mutex> guard(table_lock);
    auto it = table.find(key);
    if (it == table.end()) return;
    entry = it->second;
  }
  const int n = static_cast<int>(entry->args.size());
  std::vector<ffi::Tensor> buffers;
  buffers.reserve(entry->buffers.size());
  for (const Buffer& b : entry->buffers) {
    buffers.push_back(ffi::Tensor::FromEnvAlloc(TVMFFIEnvTensorAlloc,
                                                ffi::ShapeView(b.shape.data(), b.shape.size()),
                                                b.dtype, entry->device));
  }
  // Inputs seen another way are described here, pointing at the input's data: 2-D, with
  // their dimensions swapped, or (row-major bytes) as rows of 32-bit words.
  std::vector<DLTensor> views(n);
  std::vector<int64_t> view_dims(4 * n);
  std::vector<ffi::AnyView> call_args(n);
  for (int i = 0; i < n; ++i) {
    auto [kind, index] = entry->args[i];
    if (kind == kInput) {
      call_args[i] = args[1 + index];
    } else if (kind == kInputSwapped || kind == kInputWords) {
      ffi::TensorView t = args[1 + index].cast<ffi::TensorView>();
      int64_t* dims = &view_dims[4 * i];
      DLTensor& d = views[i];
      d.data = t.data_ptr();
      d.device = t.device();
      d.ndim = 2;
      d.dtype = t.dtype();
      d.shape = dims;
      d.strides = dims + 2;
      d.byte_offset = t.byte_offset();
      if (kind == kInputSwapped) {
        dims[0] = t.size(1), dims[1] = t.size(0), dims[2] = t.stride(1), dims[3] = t.stride(0);
      } else {  // registered only for contiguous rows of whole words
        dims[0] = t.size(0), dims[1] = t.size(1) / 4, dims[2] = t.stride(0) / 4, dims[3] = 1;
        d.dtype = DLDataType{kDLInt, 32, 1};
      }
      call_args[i] = &d;
    } else {
      call_args[i] = buffers[index];
    }
  }
  ffi::Any ignored;
  entry->kernel.CallPacked(ffi::PackedArgs(call_args.data(), n), &ignored);
  if (entry->n_returned == 1) {
    for (size_t j = 0; j < buffers.size(); ++j) {
      if (entry->buffers[j].returned) {
        *rv = buffers[j];
        return;
      }
    }
  }
  ffi::Array<ffi::Tensor> out;
  for (size_t j = 0; j < buffers.size(); ++j) {
    if (entry->buffers[j].returned) out.push_back(buffers[j]);
  }
  *rv = out;
}

// register(op, kernel, n_header, *header, *call_args): remember how `kernel` runs calls like
// `call_args`. The header: the kernel's argument count, then (kind, index) per argument; the
// buffer count, then per buffer its dtype, whether it is returned, its rank and its sizes.
void Register(ffi::PackedArgs args, ffi::Any* rv) {
  int64_t op = args[0].cast<int64_t>();
  auto entry = std::make_shared<Entry>();
  entry->kernel = args[1].cast<ffi::Function>();
  int64_t n_header = args[2].cast<int64_t>();
  int pos = 3;
  auto next = [&]() { return args[pos++].cast<int64_t>(); };
  int64_t n_args = next();
  for (int64_t i = 0; i < n_args; ++i) {
    int64_t kind = next();
    entry->args.emplace_back(kind, next());
  }
  int64_t n_buffers = next();
  entry->n_returned = 0;
  for (int64_t j = 0; j < n_buffers; ++j) {
    Buffer b;
    b.dtype = args[pos++].cast<DLDataType>();
    b.returned = next() != 0;
    int64_t rank = next();
    for (int64_t d = 0; d < rank; ++d) b.shape.push_back(next());
    entry->n_returned += b.returned;
    entry->buffers.push_back(std::move(b));
  }
  TVM_FFI_ICHECK_EQ(pos, 3 + n_header) << "malformed warm-path header";
  entry->device = DLDevice{kDLCPU, 0};
  for (int i = pos; i < args.size(); ++i) {
    if (auto t = args[i].try_cast<ffi::TensorView>()) {
      entry->device = t->device();
      break;
    }
  }
  std::vector<int64_t> key;
  if (!MakeKey(op, args, pos, &key)) {
    *rv = false;
    return;
  }
  std::lock_guard<std::mutex> guard(table_lock);
  if (table.size() >= kMaxEntries && table.find(key) == table.end()) {
    *rv = false;
    return;
  }
  table[std::move(key)] = std::move(entry);
  *rv = true;
}

void Clear() {
  std::lock_guard<std::mutex> guard(table_lock);
  table.clear();
}

int64_t Size() {
  std::lock_guard<std::mutex> guard(table_lock);
  return static_cast<int64_t>(table.size());
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(clear, Clear);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(size, Size);

// The two variadic functions, exported in tvm-ffi's C calling convention as the typed ones are.
#define TILEOPS_EXPORT_PACKED(ExportName, Function)                                             \
  extern "C" TVM_FFI_DLL_EXPORT int __tvm_ffi_##ExportName(void*, const TVMFFIAny* args,       \
                                                           int32_t num_args, TVMFFIAny* rv) {  \
    TVM_FFI_SAFE_CALL_BEGIN();                                                                 \
    Function(ffi::PackedArgs(reinterpret_cast<const ffi::AnyView*>(args), num_args),           \
             reinterpret_cast<ffi::Any*>(rv));                                                 \
    TVM_FFI_SAFE_CALL_END();                                                                   \
  }

TILEOPS_EXPORT_PACKED(call, Call)
TILEOPS_EXPORT_PACKED(register_call, Register)
