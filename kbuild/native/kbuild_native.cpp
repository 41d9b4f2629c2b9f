// kbuild's hot path in C++: the CUDA and Autograd kernels of the kbuild::* operators.
//
// The operators' schemas, CPU kernels (the torch reference) and fake kernels are defined in
// Python (kbuild/ops/custom_ops.py). This library adds, for CUDA tensors, the launches of the
// cached kernels by handle, and for every device the autograd formulas, so an eager training
// step calls the kernels without entering Python after the first call per shape:
//
//   kbuild.rmsnorm (Python: argument checks) -> native.rmsnorm_fwd (pybind) -> dispatcher
//     -> Autograd kernel (RMSNormFunction below) -> CUDA kernel (rmsnorm_fwd_cuda) -> driver
//   loss.backward() -> engine -> RMSNormFunction::backward -> kbuild::rmsnorm_bwd -> driver
//
// Also here: kbuild::bias_grad's CUDA kernel (llm.c's bias gradient, two launches) and an
// eager LinearFunction for kbuild.linear (torch's matmuls, kbuild's bias gradient), applied
// by the `linear` entry; their schemas, CPU kernels and fakes are in kbuild/ops/llmc.py.
//
// Kernels are found by a key of what picks them (kernel, N, dtypes, flags, eps, weight
// offset, aligned, device). On a miss the Python resolver (kbuild/ops/resolve.py) asks the kernel table for the
// spec, loads the binary through kbuild's memory and disk tiers and returns the kernel's
// launch record: driver function handle, block, shared memory, grid shape and argument slots
// in the table's order. Only the launch record lives here; which spec a call needs is decided
// in Python, once per key.
//
// No CUDA headers or libraries at build time: the driver entry points come from libcuda.so.1
// at first launch and the current stream from c10's device-guard interface, so the same
// source builds against any torch (CPU or CUDA build) and CPU CI builds and tests it.

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <dlfcn.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;
using at::Tensor;
using std::optional;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace kbuild {

// ------------------------------------------------------------------------------------ slots
// A kernel's arguments are 8-byte values (pointers and i64) taken from these slots in the
// order its launch record lists them. The names are the kernel table's argument names
// (kbuild/kernels/table.py); kbuild/ops/resolve.py maps names to these indices by `slot_names`.
enum Slot : int {
  X, WEIGHT, BIAS, RESIDUAL, Y, RESIDUAL_OUT, MEAN, RSTD, DY, DRESIDUAL_OUT, DX,
  DW_PARTIAL, DB_PARTIAL, ROWS, PARTIAL, OUT, OUT1, PARTIAL_ROWS, DOUT, ROWS_PER_CHUNK,
  DRESIDUAL, NUM_SLOTS
};
const char* const kSlotNames[NUM_SLOTS] = {
    "x", "weight", "bias", "residual", "y", "residual_out", "mean", "rstd", "dy",
    "dresidual_out", "dx", "dw_partial", "db_partial", "M", "partial", "out", "out1", "R",
    "dout", "rows_per_chunk", "dresidual"};

// The kernels, in the order of kbuild/ops/resolve.py KERNELS.
enum Kind : int8_t {
  RMSNORM_FWD, FUSED_ADD_RMSNORM_FWD, LAYERNORM_FWD, RMSNORM_BWD, FUSED_ADD_RMSNORM_BWD,
  LAYERNORM_BWD, COLUMN_SUM, BIAS_GRAD, NUM_KINDS
};
const char* const kKindNames[NUM_KINDS] = {
    "rmsnorm_fwd", "fused_add_rmsnorm_fwd", "layernorm_fwd", "rmsnorm_bwd",
    "fused_add_rmsnorm_bwd", "layernorm_bwd", "column_sum", "bias_grad"};

// Flag bits of a key (what each kernel's bool parameters are made of, in resolve.py). RES32:
// the fused forms' residual is fp32 while x is not (its forward reads it as fp32, its
// backward writes d(residual) in fp32 beside dx).
constexpr uint8_t STATS = 1, DW = 2, DB = 4, DRES = 8, RES32 = 16;

// ----------------------------------------------------------------------------------- driver
using CUresult = int;
constexpr CUresult CUDA_ERROR_INVALID_CONTEXT = 201;

struct Driver {
  CUresult (*launch)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                     unsigned, void*, void**, void**) = nullptr;
  CUresult (*device_get)(int*, int) = nullptr;
  CUresult (*primary_ctx_retain)(void**, int) = nullptr;
  CUresult (*ctx_set_current)(void*) = nullptr;
  CUresult (*error_name)(CUresult, const char**) = nullptr;
};

const Driver& driver() {
  static const Driver d = [] {
    Driver d;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    TORCH_CHECK(lib != nullptr, "kbuild: cannot load the CUDA driver (libcuda.so.1): ",
                dlerror());
    auto sym = [lib](const char* name) {
      void* p = dlsym(lib, name);
      TORCH_CHECK(p != nullptr, "kbuild: the CUDA driver has no ", name);
      return p;
    };
    d.launch = reinterpret_cast<decltype(d.launch)>(sym("cuLaunchKernel"));
    d.device_get = reinterpret_cast<decltype(d.device_get)>(sym("cuDeviceGet"));
    d.primary_ctx_retain =
        reinterpret_cast<decltype(d.primary_ctx_retain)>(sym("cuDevicePrimaryCtxRetain"));
    d.ctx_set_current = reinterpret_cast<decltype(d.ctx_set_current)>(sym("cuCtxSetCurrent"));
    d.error_name = reinterpret_cast<decltype(d.error_name)>(sym("cuGetErrorName"));
    return d;
  }();
  return d;
}

std::string error_name(CUresult err) {
  const char* name = nullptr;
  if (driver().error_name(err, &name) != 0 || name == nullptr) return std::to_string(err);
  return name;
}

// ----------------------------------------------------------------------------- the records
struct Key {
  int64_t N;
  uint64_t eps_bits, offset_bits;  // RMSNorm's weight offset; 0 for the other kernels
  int8_t kind, dtype, weight, aux, device;
  uint8_t flags;
  bool aligned;
  bool operator==(const Key& o) const {
    return N == o.N && eps_bits == o.eps_bits && offset_bits == o.offset_bits && kind == o.kind && dtype == o.dtype &&
           weight == o.weight && aux == o.aux && device == o.device && flags == o.flags &&
           aligned == o.aligned;
  }
};

struct KeyHash {
  size_t operator()(const Key& k) const {
    uint64_t h = static_cast<uint64_t>(k.N) * 0x9E3779B97F4A7C15ull ^ k.eps_bits ^
                 (k.offset_bits * 0xD6E8FEB86659FD93ull);
    uint64_t small = static_cast<uint8_t>(k.kind) | static_cast<uint8_t>(k.dtype) << 8 |
                     static_cast<uint64_t>(static_cast<uint8_t>(k.weight)) << 16 |
                     static_cast<uint64_t>(static_cast<uint8_t>(k.aux)) << 24 |
                     static_cast<uint64_t>(static_cast<uint8_t>(k.device)) << 32 |
                     static_cast<uint64_t>(k.flags) << 40 |
                     static_cast<uint64_t>(k.aligned) << 48;
    return h ^ (small * 0xC2B2AE3D27D4EB4Full);
  }
};

// What a launch needs of a loaded kernel (kbuild/runtime/cuda.py Launcher, reduced).
struct Record {
  void* function = nullptr;
  unsigned block = 0, shared = 0;
  int64_t cluster = 1, rows_per_block = 1, resident_clusters = 1, columns_per_block = 1;
  int64_t units = 1;  // the device's multiprocessors (the bias gradient's chunking)
  bool persistent = false;
  std::vector<int8_t> slots;
  std::string name;
};

std::mutex g_mutex;  // guards g_records; never held while Python runs
std::unordered_map<Key, Record, KeyHash> g_records;
py::object* g_resolver = nullptr;     // kbuild.ops.resolve.resolve (leaked: outlives exit)
py::object* g_launch_hook = nullptr;  // tests: record launches instead of making them
bool g_hooked = false;

int8_t dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kHalf: return 1;
    case at::kBFloat16: return 2;
    default:
      TORCH_CHECK_TYPE(false, "kbuild kernels take float32, float16 or bfloat16; got ", t);
  }
}
const char* const kDtypeNames[3] = {"f32", "f16", "bf16"};

py::object dtype_object(int8_t code) {
  return code < 0 ? py::none() : py::object(py::str(kDtypeNames[code]));
}

// Rethrow a Python exception from the resolver as torch's python_error, which every path
// back to Python (pybind, torch.ops, the autograd engine) restores with its type and text.
[[noreturn]] void rethrow_python(py::error_already_set& e) {
  e.restore();
  python_error err;
  err.persist();
  throw err;
}

const Record& record(const Key& key) {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_records.find(key);
    if (it != g_records.end()) return it->second;
  }
  Record rec;
  {
    py::gil_scoped_acquire gil;
    TORCH_CHECK(g_resolver != nullptr, "kbuild native: no resolver set");
    py::object out;
    try {
      double eps, offset;
      std::memcpy(&eps, &key.eps_bits, sizeof eps);
      std::memcpy(&offset, &key.offset_bits, sizeof offset);
      out = (*g_resolver)(kKindNames[key.kind], key.device, key.N, dtype_object(key.dtype),
                          dtype_object(key.weight), dtype_object(key.aux), key.flags, eps,
                          key.aligned, offset);
    } catch (py::error_already_set& e) {
      rethrow_python(e);
    }
    auto t = out.cast<py::tuple>();
    TORCH_CHECK(t.size() == 11, "kbuild native: the resolver returned ", t.size(),
                " fields, expected 11");
    rec.function = reinterpret_cast<void*>(t[0].cast<uintptr_t>());
    rec.block = t[1].cast<unsigned>();
    rec.shared = t[2].cast<unsigned>();
    rec.cluster = t[3].cast<int64_t>();
    rec.rows_per_block = t[4].cast<int64_t>();
    rec.resident_clusters = t[5].cast<int64_t>();
    rec.persistent = t[6].cast<bool>();
    rec.columns_per_block = t[7].cast<int64_t>();
    for (auto s : t[8].cast<std::vector<int>>()) {
      TORCH_CHECK(0 <= s && s < NUM_SLOTS, "kbuild native: bad argument slot ", s);
      rec.slots.push_back(static_cast<int8_t>(s));
    }
    rec.name = t[9].cast<std::string>();
    rec.units = t[10].cast<int64_t>();
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_records.emplace(key, std::move(rec)).first->second;  // a racing thread's wins
}

void* primary_context(int device) {
  static std::mutex m;
  static std::unordered_map<int, void*> contexts;
  std::lock_guard<std::mutex> lock(m);
  auto it = contexts.find(device);
  if (it != contexts.end()) return it->second;
  int dev = 0;
  void* ctx = nullptr;
  CUresult err = driver().device_get(&dev, device);
  if (err == 0) err = driver().primary_ctx_retain(&ctx, dev);
  TORCH_CHECK(err == 0, "kbuild: no primary context on cuda:", device, ": ", error_name(err));
  return contexts[device] = ctx;
}

void* current_stream(const Tensor& t) {
  if (g_hooked || !t.is_cuda()) return nullptr;
  const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return impl->getStream(t.device()).native_handle();
}

void launch(const Record& k, int64_t grid, const uint64_t* slots, void* stream, int device) {
  TORCH_CHECK(grid >= 1 && grid <= std::numeric_limits<int32_t>::max(), "kbuild: ", k.name,
              " needs a grid of ", grid, " blocks, past the driver's limit");
  if (g_hooked) {  // tests (CPU): hand the launch to Python instead of the driver
    py::gil_scoped_acquire gil;
    std::vector<uint64_t> args;
    for (auto s : k.slots) args.push_back(slots[s]);
    try {
      (*g_launch_hook)(k.name, grid, args);
    } catch (py::error_already_set& e) {
      rethrow_python(e);
    }
    return;
  }
  void* params[NUM_SLOTS];
  for (size_t i = 0; i < k.slots.size(); ++i)
    params[i] = const_cast<uint64_t*>(slots + k.slots[i]);
  const Driver& d = driver();
  CUresult err = d.launch(k.function, static_cast<unsigned>(grid), 1, 1, k.block, 1, 1,
                          k.shared, stream, params, nullptr);
  if (err == CUDA_ERROR_INVALID_CONTEXT) {
    // A thread that never touched CUDA has no current context: bind the device's primary
    // context (the one torch uses) and retry once.
    TORCH_CHECK(d.ctx_set_current(primary_context(device)) == 0, "kbuild: cuCtxSetCurrent");
    err = d.launch(k.function, static_cast<unsigned>(grid), 1, 1, k.block, 1, 1, k.shared,
                   stream, params, nullptr);
  }
  TORCH_CHECK(err == 0, "kbuild: launching ", k.name, " failed: ", error_name(err));
}

// ------------------------------------------------------------------------------ launch shapes
uint64_t ptr(const Tensor& t) { return reinterpret_cast<uint64_t>(t.data_ptr()); }
uint64_t ptr(const optional<Tensor>& t) { return t.has_value() ? ptr(*t) : 0; }
int8_t dtype_of(const optional<Tensor>& t) {
  return t.has_value() ? dtype_code(t->scalar_type()) : -1;
}

uint64_t eps_bits(double eps) {
  uint64_t bits;
  std::memcpy(&bits, &eps, sizeof bits);
  return bits;
}

Key make_key(Kind kind, int64_t N, int8_t dtype, int8_t weight, int8_t aux, uint8_t flags,
             double eps, uint64_t addresses, const Tensor& like, double offset = 0.0) {
  if (weight < 0) offset = 0.0;  // an offset scales the weight: without one it is nothing
  return Key{N, eps_bits(eps), eps_bits(offset), kind, dtype, weight, aux,
             static_cast<int8_t>(like.is_cuda() ? like.get_device() : -1), flags,
             (addresses & 15) == 0};
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The device a kernel's guard makes current: t's, for CUDA tensors (CPU tests: none).
optional<c10::Device> cuda_device(const Tensor& t) {
  return t.is_cuda() ? optional<c10::Device>(t.device()) : std::nullopt;
}

// (M, N) rows of a contiguous (..., N) tensor; M also when N is 0.
std::pair<int64_t, int64_t> rows_of(const Tensor& t) {
  int64_t N = t.size(-1);
  int64_t M = 1;
  for (int64_t i = 0; i + 1 < t.dim(); ++i) M *= t.size(i);
  return {M, N};
}

Tensor stats(int64_t M, const Tensor& like, bool store) {
  return at::empty({store ? M : 0}, like.options().dtype(at::kFloat));
}

Tensor optional_param(const optional<Tensor>& p) {
  return p.has_value() ? p->contiguous() : Tensor();
}

void launch_rows(const Key& key, const Tensor& like, int64_t M, uint64_t* slots) {
  const Record& k = record(key);
  int64_t groups = ceil_div(M, k.rows_per_block);
  int64_t grid = (k.persistent ? std::min(groups, k.resident_clusters) : groups) * k.cluster;
  slots[ROWS] = static_cast<uint64_t>(M);
  launch(k, grid, slots, current_stream(like), key.device);
}

// Sum the R rows of each of `planes` (1 or 2) fp32 (R, N) planes at `partial` in a fixed
// order, in one launch of the column-sum kernel; one (N,) tensor of `dtype` per plane.
std::vector<Tensor> column_sums(uint64_t partial, int planes, int64_t R, int64_t N,
                                at::ScalarType dtype, const Tensor& like, void* stream) {
  Key key = make_key(COLUMN_SUM, N, dtype_code(dtype), -1, -1, static_cast<uint8_t>(planes),
                     0.0, 0, like);
  key.aligned = true;  // not a parameter of the column sum
  const Record& c = record(key);
  uint64_t cs[NUM_SLOTS] = {};
  cs[PARTIAL] = partial;
  // Two planes (dw and db of one dtype): one allocation, a row each (an allocation costs
  // more host time than a view).
  auto options = like.options().dtype(dtype);
  std::vector<Tensor> sums;
  if (planes == 1) {
    sums.push_back(at::empty({N}, options));
  } else {
    Tensor both = at::empty({planes, N}, options);
    for (int i = 0; i < planes; ++i) sums.push_back(both.select(0, i));
  }
  for (int i = 0; i < planes; ++i) cs[i == 0 ? OUT : OUT1] = ptr(sums[i]);
  cs[PARTIAL_ROWS] = static_cast<uint64_t>(R);
  launch(c, planes * ceil_div(N, c.columns_per_block), cs, stream, key.device);
  return sums;
}

// A backward kernel on a persistent grid: one fp32 partial row per block row for each wanted
// parameter gradient, summed by the column-sum kernel in a fixed order. The grid is what the
// device holds at once (fixed per device and kernel), so every bit of dw / db is the same on
// every run. Returns the gradients of `params` (undefined where not wanted).
std::vector<Tensor> launch_persistent(const Key& key, const Tensor& like, int64_t M, int64_t N,
                                      uint64_t* slots, std::vector<Tensor> params) {
  std::vector<Tensor> wanted;
  for (auto& p : params)
    if (p.defined()) wanted.push_back(p);
  std::vector<Tensor> grads(params.size());
  if (M == 0) {
    for (size_t i = 0; i < params.size(); ++i)
      if (params[i].defined()) grads[i] = at::zeros_like(params[i]);
    return grads;
  }
  const Record& k = record(key);
  int64_t clusters = std::min(ceil_div(M, k.rows_per_block), k.resident_clusters);
  int64_t rows = clusters * k.rows_per_block;
  auto workspace = at::empty({static_cast<int64_t>(wanted.size()), rows, N},
                             like.options().dtype(at::kFloat));
  uint64_t base = wanted.empty() ? 0 : ptr(workspace);
  uint64_t plane_bytes = static_cast<uint64_t>(rows * N) * 4;
  // Partials in the order of the table's arguments: dw_partial, then db_partial.
  int plane = 0;
  if (params.size() > 0 && params[0].defined()) slots[DW_PARTIAL] = base + plane_bytes * plane++;
  if (params.size() > 1 && params[1].defined()) slots[DB_PARTIAL] = base + plane_bytes * plane++;
  slots[ROWS] = static_cast<uint64_t>(M);
  void* stream = current_stream(like);
  launch(k, clusters * k.cluster, slots, stream, key.device);

  std::vector<Tensor> sums;
  if (wanted.size() == 2 && wanted[0].scalar_type() == wanted[1].scalar_type()) {
    sums = column_sums(base, 2, rows, N, wanted[0].scalar_type(), like, stream);
  } else {
    for (size_t i = 0; i < wanted.size(); ++i) {
      auto one = column_sums(base + plane_bytes * i, 1, rows, N, wanted[i].scalar_type(),
                             like, stream);
      sums.push_back(one[0]);
    }
  }
  size_t next = 0;
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i].defined()) grads[i] = sums[next++];
  return grads;
}

void check_cuda_like(const char* name, const Tensor& t, const Tensor& x) {
  TORCH_CHECK_VALUE(t.device() == x.device(), "kbuild: ", name, " must be on x's device ",
                    x.device(), "; got ", t.device());
}

void check_param(const char* name, const optional<Tensor>& p, const Tensor& x, int64_t N) {
  if (!p.has_value()) return;
  TORCH_CHECK_VALUE(p->dim() == 1 && p->size(0) == N, "kbuild: ", name, " must have shape (",
                    N, ",); got ", p->sizes());
  TORCH_CHECK_TYPE(p->scalar_type() == x.scalar_type() || p->scalar_type() == at::kFloat,
                   "kbuild: ", name, " must have x's dtype or float32; got ",
                   p->scalar_type());
  check_cuda_like(name, *p, x);
}

// ------------------------------------------------------------------------ the CUDA kernels
std::tuple<Tensor, Tensor> rmsnorm_fwd_cuda(const Tensor& x_, const optional<Tensor>& w_,
                                            double eps, bool store_rstd, double offset) {
  Tensor x = x_.contiguous();
  auto [M, N] = rows_of(x);
  check_param("weight", w_, x, N);
  Tensor w = optional_param(w_);
  c10::OptionalDeviceGuard guard(cuda_device(x));
  Tensor y = at::empty(x.sizes(), x.options());  // x is contiguous: cheaper than empty_like
  Tensor rstd = stats(M, x, store_rstd);
  if (M == 0 || N == 0) return {y, rstd.fill_(NAN)};
  uint64_t s[NUM_SLOTS] = {};
  s[X] = ptr(x), s[Y] = ptr(y), s[WEIGHT] = w.defined() ? ptr(w) : 0;
  s[RSTD] = store_rstd ? ptr(rstd) : 0;
  Key key = make_key(RMSNORM_FWD, N, dtype_code(x.scalar_type()),
                     w.defined() ? dtype_code(w.scalar_type()) : -1, -1,
                     store_rstd ? STATS : 0, eps, s[X] | s[Y] | s[WEIGHT], x, offset);
  launch_rows(key, x, M, s);
  return {y, rstd};
}

std::tuple<Tensor, Tensor, Tensor> fused_add_rmsnorm_fwd_cuda(
    const Tensor& x_, const Tensor& r_, const optional<Tensor>& w_, double eps,
    at::ScalarType residual_dtype, bool store_rstd, double offset) {
  Tensor x = x_.contiguous(), residual = r_.contiguous();
  auto [M, N] = rows_of(x);
  TORCH_CHECK_VALUE(residual.sizes() == x.sizes(), "kbuild: residual must have x's shape ",
                    x.sizes(), "; got ", residual.sizes());
  bool res32 = residual.scalar_type() != x.scalar_type();  // an fp32 residual stream
  TORCH_CHECK_TYPE(!res32 || (residual.scalar_type() == at::kFloat && residual_dtype == at::kFloat),
                   "kbuild: residual must have x's dtype, or be float32 with a float32 "
                   "residual_out");
  check_cuda_like("residual", residual, x);
  check_param("weight", w_, x, N);
  Tensor w = optional_param(w_);
  c10::OptionalDeviceGuard guard(cuda_device(x));
  Tensor y = at::empty(x.sizes(), x.options());  // x is contiguous: cheaper than empty_like
  Tensor residual_out = at::empty(x.sizes(), x.options().dtype(residual_dtype));
  Tensor rstd = stats(M, x, store_rstd);
  if (M == 0 || N == 0) return {y, residual_out, rstd.fill_(NAN)};
  uint64_t s[NUM_SLOTS] = {};
  s[X] = ptr(x), s[RESIDUAL] = ptr(residual), s[WEIGHT] = w.defined() ? ptr(w) : 0;
  s[Y] = ptr(y), s[RESIDUAL_OUT] = ptr(residual_out), s[RSTD] = store_rstd ? ptr(rstd) : 0;
  Key key = make_key(FUSED_ADD_RMSNORM_FWD, N, dtype_code(x.scalar_type()),
                     w.defined() ? dtype_code(w.scalar_type()) : -1,
                     dtype_code(residual_dtype), (store_rstd ? STATS : 0) | (res32 ? RES32 : 0), eps,
                     s[X] | s[RESIDUAL] | s[WEIGHT] | s[Y] | s[RESIDUAL_OUT], x, offset);
  launch_rows(key, x, M, s);
  return {y, residual_out, rstd};
}

std::tuple<Tensor, Tensor, Tensor> layernorm_fwd_cuda(const Tensor& x_,
                                                      const optional<Tensor>& w_,
                                                      const optional<Tensor>& b_, double eps,
                                                      bool store_stats) {
  Tensor x = x_.contiguous();
  auto [M, N] = rows_of(x);
  check_param("weight", w_, x, N);
  check_param("bias", b_, x, N);
  Tensor w = optional_param(w_), b = optional_param(b_);
  c10::OptionalDeviceGuard guard(cuda_device(x));
  Tensor y = at::empty(x.sizes(), x.options());  // x is contiguous: cheaper than empty_like
  Tensor mean = stats(M, x, store_stats), rstd = stats(M, x, store_stats);
  if (M == 0 || N == 0) return {y, mean.fill_(NAN), rstd.fill_(NAN)};
  uint64_t s[NUM_SLOTS] = {};
  s[X] = ptr(x), s[Y] = ptr(y);
  s[WEIGHT] = w.defined() ? ptr(w) : 0, s[BIAS] = b.defined() ? ptr(b) : 0;
  if (store_stats) s[MEAN] = ptr(mean), s[RSTD] = ptr(rstd);
  Key key = make_key(LAYERNORM_FWD, N, dtype_code(x.scalar_type()),
                     w.defined() ? dtype_code(w.scalar_type()) : -1,
                     b.defined() ? dtype_code(b.scalar_type()) : -1, store_stats ? STATS : 0,
                     eps, s[X] | s[WEIGHT] | s[BIAS] | s[Y], x);
  launch_rows(key, x, M, s);
  return {y, mean, rstd};
}

void check_rows(const char* op, const Tensor& stats_, int64_t M, const char* flag) {
  TORCH_CHECK_VALUE(stats_.numel() == M, "kbuild::", op, ": the saved statistics hold ",
                    stats_.numel(), " rows, not ", M,
                    "; the forward must run with ", flag, "=True for a backward");
}

std::tuple<Tensor, Tensor> rmsnorm_bwd_cuda(const Tensor& dy_, const Tensor& x,
                                            const optional<Tensor>& w_, const Tensor& rstd,
                                            bool need_dx, bool need_dw, double offset) {
  Tensor dy = dy_.contiguous();
  auto [M, N] = rows_of(dy);
  check_rows("rmsnorm_bwd", rstd, M, "store_rstd");
  Tensor w = optional_param(w_);
  bool compute_dw = need_dw && w.defined();
  c10::OptionalDeviceGuard guard(cuda_device(dy));
  Tensor dx = at::empty(dy.sizes(), dy.options());
  uint64_t s[NUM_SLOTS] = {};
  s[X] = ptr(x), s[WEIGHT] = w.defined() ? ptr(w) : 0, s[DY] = ptr(dy), s[RSTD] = ptr(rstd);
  s[DX] = ptr(dx);
  Key key = make_key(RMSNORM_BWD, N, dtype_code(x.scalar_type()),
                     w.defined() ? dtype_code(w.scalar_type()) : -1, -1, compute_dw ? DW : 0,
                     0.0, s[X] | s[WEIGHT] | s[DY] | s[RSTD] | s[DX], dy, offset);
  auto grads = launch_persistent(key, dy, N ? M : 0, N, s, {compute_dw ? w : Tensor()});
  Tensor dw = grads[0].defined() ? grads[0] : at::empty({0}, x.options());
  return {need_dx ? dx : at::empty({0}, x.options()), dw};
}

std::tuple<Tensor, Tensor, Tensor> fused_add_rmsnorm_bwd_cuda(const Tensor& dy_,
                                                      const optional<Tensor>& dres_,
                                                      const Tensor& residual_out,
                                                      const optional<Tensor>& w_,
                                                      const Tensor& rstd, bool need_dw,
                                                      double offset,
                                                      optional<at::ScalarType> residual_dtype) {
  Tensor dy = dy_.contiguous();
  auto [M, N] = rows_of(dy);
  check_rows("fused_add_rmsnorm_bwd", rstd, M, "store_rstd");
  Tensor dres = dres_.has_value() ? dres_->contiguous() : Tensor();
  Tensor w = optional_param(w_);
  bool compute_dw = need_dw && w.defined();
  c10::OptionalDeviceGuard guard(cuda_device(dy));
  Tensor dx = at::empty(dy.sizes(), dy.options());
  // An fp32 residual's gradient, written beside dx unrounded (else dx serves both inputs).
  bool res32 = residual_dtype.has_value();
  TORCH_CHECK_TYPE(!res32 || *residual_dtype == at::kFloat,
                   "kbuild: residual_dtype must be None or float32 (the fp32 residual stream's "
                   "gradient); got ", *residual_dtype);
  Tensor dres_in = at::empty(res32 ? dy.sizes() : at::IntArrayRef{0},
                             dy.options().dtype(res32 ? at::kFloat : dy.scalar_type()));
  uint64_t s[NUM_SLOTS] = {};
  s[X] = ptr(residual_out), s[WEIGHT] = w.defined() ? ptr(w) : 0, s[DY] = ptr(dy);
  s[RSTD] = ptr(rstd), s[DRESIDUAL_OUT] = dres.defined() ? ptr(dres) : 0, s[DX] = ptr(dx);
  s[DRESIDUAL] = res32 ? ptr(dres_in) : 0;
  uint8_t flags = (compute_dw ? DW : 0) | (dres.defined() ? DRES : 0) | (res32 ? RES32 : 0);
  Key key = make_key(FUSED_ADD_RMSNORM_BWD, N, dtype_code(dy.scalar_type()),
                     w.defined() ? dtype_code(w.scalar_type()) : -1,
                     dtype_code(residual_out.scalar_type()), flags, 0.0,
                     s[X] | s[WEIGHT] | s[DY] | s[RSTD] | s[DRESIDUAL_OUT] | s[DX] | s[DRESIDUAL],
                     dy, offset);
  auto grads = launch_persistent(key, dy, N ? M : 0, N, s, {compute_dw ? w : Tensor()});
  return {dx, dres_in, grads[0].defined() ? grads[0] : at::empty({0}, dy.options())};
}

std::tuple<Tensor, Tensor, Tensor> layernorm_bwd_cuda(
    const Tensor& dy_, const Tensor& x, const optional<Tensor>& w_, const optional<Tensor>& b_,
    const Tensor& mean, const Tensor& rstd, bool need_dx, bool need_dw, bool need_db) {
  Tensor dy = dy_.contiguous();
  auto [M, N] = rows_of(dy);
  check_rows("layernorm_bwd", rstd, M, "store_stats");
  Tensor w = optional_param(w_), b = optional_param(b_);
  bool compute_dw = need_dw && w.defined(), compute_db = need_db && b.defined();
  c10::OptionalDeviceGuard guard(cuda_device(dy));
  Tensor dx = at::empty(x.sizes(), x.options());
  uint64_t s[NUM_SLOTS] = {};
  s[X] = ptr(x), s[WEIGHT] = w.defined() ? ptr(w) : 0, s[DY] = ptr(dy), s[MEAN] = ptr(mean);
  s[RSTD] = ptr(rstd), s[DX] = ptr(dx);
  uint8_t flags = (compute_dw ? DW : 0) | (compute_db ? DB : 0);
  Key key = make_key(LAYERNORM_BWD, N, dtype_code(x.scalar_type()),
                     w.defined() ? dtype_code(w.scalar_type()) : -1, -1, flags, 0.0,
                     s[X] | s[WEIGHT] | s[DY] | s[MEAN] | s[RSTD] | s[DX], dy);
  auto grads = launch_persistent(key, dy, N ? M : 0, N, s,
                                 {compute_dw ? w : Tensor(), compute_db ? b : Tensor()});
  auto none = [&] { return at::empty({0}, x.options()); };
  return {need_dx ? dx : none(), grads[0].defined() ? grads[0] : none(),
          grads[1].defined() ? grads[1] : none()};
}

// The first pass's row chunks (kbuild/ops/encoder.py bias_chunks, the same formula): about
// four blocks per multiprocessor in all, never chunks under 64 rows. Fixed by (M, kernel,
// device), so the summation order and every bit of dbias are too.
std::pair<int64_t, int64_t> bias_chunks(int64_t M, int64_t column_blocks, int64_t units) {
  constexpr int64_t kMinChunkRows = 64;  // encoder.py MIN_CHUNK_ROWS
  int64_t wanted = std::max<int64_t>(1, ceil_div(4 * units, column_blocks));
  int64_t chunks = std::max<int64_t>(1, std::min(wanted, M / kMinChunkRows));
  int64_t per_chunk = ceil_div(M, chunks);
  return {ceil_div(M, per_chunk), per_chunk};
}

// dbias = dout summed over every row (fp32, two fixed-order passes: row chunks into fp32
// partial rows, then the column sum), in dout's dtype.
Tensor bias_grad_cuda(const Tensor& dout_) {
  Tensor dout = dout_.contiguous();
  auto [M, OC] = rows_of(dout);
  c10::OptionalDeviceGuard guard(cuda_device(dout));
  if (M == 0 || OC == 0) return at::zeros({OC}, dout.options());
  uint64_t s[NUM_SLOTS] = {};
  s[DOUT] = ptr(dout);
  Key key = make_key(BIAS_GRAD, OC, dtype_code(dout.scalar_type()), -1, -1, 0, 0.0, s[DOUT],
                     dout);
  const Record& k = record(key);
  int64_t column_blocks = ceil_div(OC, k.columns_per_block);
  auto [chunks, per_chunk] = bias_chunks(M, column_blocks, k.units);
  Tensor partial = at::empty({chunks, OC}, dout.options().dtype(at::kFloat));
  s[PARTIAL] = ptr(partial), s[ROWS] = static_cast<uint64_t>(M);
  s[ROWS_PER_CHUNK] = static_cast<uint64_t>(per_chunk);
  void* stream = current_stream(dout);
  launch(k, chunks * column_blocks, s, stream, key.device);
  return column_sums(s[PARTIAL], 1, chunks, OC, dout.scalar_type(), dout, stream)[0];
}

// ------------------------------------------------------------------------------- autograd
// The forward ops' autograd, as torch.autograd.Functions written in C++. The backward ops
// have none: their kernels have no graph of their own (no double backward).

template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// The RMSNorm ops' last double is the weight offset (y = x_hat * (offset + w)).
using RmsFwd = std::tuple<Tensor, Tensor>(const Tensor&, const optional<Tensor>&, double, bool,
                                          double);
using RmsBwd = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const optional<Tensor>&,
                                          const Tensor&, bool, bool, double);
using FusedFwd = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&,
                                                    const optional<Tensor>&, double,
                                                    at::ScalarType, bool, double);
using FusedBwd = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const optional<Tensor>&,
                                                    const Tensor&, const optional<Tensor>&,
                                                    const Tensor&, bool, double,
                                                    optional<at::ScalarType>);
using LnFwd = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const optional<Tensor>&,
                                                 const optional<Tensor>&, double, bool);
using LnBwd = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&,
                                                 const optional<Tensor>&,
                                                 const optional<Tensor>&, const Tensor&,
                                                 const Tensor&, bool, bool, bool);

optional<Tensor> maybe(const Tensor& t) { return t.defined() ? optional<Tensor>(t) : std::nullopt; }

bool wants_grad(std::initializer_list<const Tensor*> ts) {
  if (!at::GradMode::is_enabled()) return false;
  for (const Tensor* t : ts)
    if (t->defined() && t->requires_grad()) return true;
  return false;
}

// A backward op called from a backward (grad mode off: not create_graph) goes straight to
// its device kernel, past the Autograd and ADInplaceOrView keys: the backward ops have no
// autograd kernel, so those keys would only run the boxed fallbacks (argument boxing, a
// requires-grad scan) on every call. With create_graph the dispatch is left as it was.
struct BelowAutograd {
  optional<at::AutoDispatchBelowADInplaceOrView> guard;
  BelowAutograd() {
    if (!at::GradMode::is_enabled()) guard.emplace();
  }
};

struct RMSNormFunction : torch::autograd::Function<RMSNormFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const optional<Tensor>& w,
                               double eps, bool store_rstd, double offset) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fwd = op<RmsFwd>("kbuild::rmsnorm_fwd");
    auto [y, rstd] = fwd.call(x, w, eps, store_rstd, offset);
    ctx->save_for_backward({x, w.value_or(Tensor()), rstd});
    ctx->saved_data["offset"] = offset;
    ctx->mark_non_differentiable({rstd});
    // No zeros made for the statistics' (never defined) gradients: each would cost an
    // allocation and a fill kernel per backward.
    ctx->set_materialize_grads(false);
    return {y, rstd};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return variable_list(5);  // y unused: no gradient flows
    auto saved = ctx->get_saved_variables();
    bool need_dx = ctx->needs_input_grad(0);
    bool need_dw = saved[1].defined() && ctx->needs_input_grad(1);  // edges: x, [weight]
    double offset = ctx->saved_data["offset"].toDouble();
    BelowAutograd below;
    static auto bwd = op<RmsBwd>("kbuild::rmsnorm_bwd");
    auto [dx, dw] =
        bwd.call(grads[0], saved[0], maybe(saved[1]), saved[2], need_dx, need_dw, offset);
    return {need_dx ? dx : Tensor(), need_dw ? dw : Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor> rmsnorm_fwd_autograd(const Tensor& x, const optional<Tensor>& w,
                                                double eps, bool store_rstd, double offset) {
  if (!wants_grad({&x, w.has_value() ? &*w : &x})) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fwd = op<RmsFwd>("kbuild::rmsnorm_fwd");
    return fwd.call(x, w, eps, store_rstd, offset);
  }
  auto out = RMSNormFunction::apply(x, w, eps, store_rstd, offset);
  return {out[0], out[1]};
}

struct FusedAddRMSNormFunction : torch::autograd::Function<FusedAddRMSNormFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& residual,
                               const optional<Tensor>& w, double eps,
                               at::ScalarType residual_dtype, bool store_rstd, double offset) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fwd = op<FusedFwd>("kbuild::fused_add_rmsnorm_fwd");
    auto [y, residual_out, rstd] =
        fwd.call(x, residual, w, eps, residual_dtype, store_rstd, offset);
    ctx->save_for_backward({residual_out, w.value_or(Tensor()), rstd});
    ctx->saved_data["offset"] = offset;
    ctx->mark_non_differentiable({rstd});
    ctx->set_materialize_grads(false);  // an unused residual_out has no gradient to add
    ctx->saved_data["out_dtype"] = static_cast<int64_t>(y.scalar_type());
    // An fp32 residual stream: its gradient is written in fp32 (not rounded to x's dtype).
    ctx->saved_data["res32"] = residual.scalar_type() != x.scalar_type();
    return {y, residual_out, rstd};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined() && !grads[1].defined()) return variable_list(7);
    auto saved = ctx->get_saved_variables();
    Tensor dy = grads[0];
    if (!dy.defined()) {
      auto out_dtype = static_cast<at::ScalarType>(ctx->saved_data["out_dtype"].toInt());
      dy = at::zeros_like(saved[0], saved[0].options().dtype(out_dtype));
    }
    bool need_dw = saved[1].defined() && ctx->needs_input_grad(2);  // x, residual, [weight]
    BelowAutograd below;
    static auto bwd = op<FusedBwd>("kbuild::fused_add_rmsnorm_bwd");
    // An fp32 stream's gradient is written apart only when the residual wants one.
    bool res32 = ctx->saved_data["res32"].toBool() && ctx->needs_input_grad(1);
    auto [dsum, dres, dw] =
        bwd.call(dy, maybe(grads[1]), saved[0], maybe(saved[1]), saved[2], need_dw,
                 ctx->saved_data["offset"].toDouble(),
                 res32 ? optional<at::ScalarType>(at::kFloat) : std::nullopt);
    // added = x + residual: one gradient, computed once, serves both inputs (an fp32
    // residual gets its unrounded copy).
    return {ctx->needs_input_grad(0) ? dsum : Tensor(),
            ctx->needs_input_grad(1) ? (res32 ? dres : dsum) : Tensor(),
            need_dw ? dw : Tensor(),
            Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor, Tensor> fused_add_rmsnorm_fwd_autograd(
    const Tensor& x, const Tensor& residual, const optional<Tensor>& w, double eps,
    at::ScalarType residual_dtype, bool store_rstd, double offset) {
  if (!wants_grad({&x, &residual, w.has_value() ? &*w : &x})) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fwd = op<FusedFwd>("kbuild::fused_add_rmsnorm_fwd");
    return fwd.call(x, residual, w, eps, residual_dtype, store_rstd, offset);
  }
  auto out =
      FusedAddRMSNormFunction::apply(x, residual, w, eps, residual_dtype, store_rstd, offset);
  return {out[0], out[1], out[2]};
}

struct LayerNormFunction : torch::autograd::Function<LayerNormFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const optional<Tensor>& w,
                               const optional<Tensor>& b, double eps, bool store_stats) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fwd = op<LnFwd>("kbuild::layernorm_fwd");
    auto [y, mean, rstd] = fwd.call(x, w, b, eps, store_stats);
    ctx->save_for_backward({x, w.value_or(Tensor()), b.value_or(Tensor()), mean, rstd});
    ctx->mark_non_differentiable({mean, rstd});
    ctx->set_materialize_grads(false);  // as in RMSNormFunction
    return {y, mean, rstd};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return variable_list(5);
    auto s = ctx->get_saved_variables();
    bool need_dx = ctx->needs_input_grad(0);
    // Edges exist for given tensors only: x, [weight], [bias].
    bool need_dw = s[1].defined() && ctx->needs_input_grad(1);
    bool need_db = s[2].defined() && ctx->needs_input_grad(s[1].defined() ? 2 : 1);
    BelowAutograd below;
    static auto bwd = op<LnBwd>("kbuild::layernorm_bwd");
    auto [dx, dw, db] = bwd.call(grads[0], s[0], maybe(s[1]), maybe(s[2]), s[3], s[4], need_dx,
                                 need_dw, need_db);
    return {need_dx ? dx : Tensor(), need_dw ? dw : Tensor(), need_db ? db : Tensor(),
            Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor, Tensor> layernorm_fwd_autograd(const Tensor& x,
                                                          const optional<Tensor>& w,
                                                          const optional<Tensor>& b,
                                                          double eps, bool store_stats) {
  if (!wants_grad({&x, w.has_value() ? &*w : &x, b.has_value() ? &*b : &x})) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fwd = op<LnFwd>("kbuild::layernorm_fwd");
    return fwd.call(x, w, b, eps, store_stats);
  }
  auto out = LayerNormFunction::apply(x, w, b, eps, store_stats);
  return {out[0], out[1], out[2]};
}

// y = x @ weight.T + bias by torch (cuBLAS, the bias in its epilogue); the backward's dx and
// dweight are torch's matmuls, dbias kbuild's deterministic column sum. Not an operator: the
// entry applies it eagerly (torch.compile traces the Python LinearFunction instead).
struct LinearFunction : torch::autograd::Function<LinearFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& w,
                               const Tensor& b) {
    ctx->save_for_backward({x, w});
    return {at::linear(x, w, b)};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor& dy = grads[0];
    if (!dy.defined()) return variable_list(3);
    auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &w = saved[1];
    Tensor dy2 = dy.reshape({-1, dy.size(-1)});
    Tensor dx, dw, db;
    if (ctx->needs_input_grad(0)) dx = at::matmul(dy, w);
    if (ctx->needs_input_grad(1)) dw = dy2.t().mm(x.reshape({-1, x.size(-1)}));
    if (ctx->needs_input_grad(2)) {
      BelowAutograd below;
      static auto bias_grad = op<Tensor(const Tensor&)>("kbuild::bias_grad");
      db = bias_grad.call(dy2);
    }
    return {dx, dw, db};
  }
};

// ------------------------------------------------------------------------- public entries
// kbuild.rmsnorm & co. hand their arguments here first. The common case (exact torch.Tensor or
// Parameter CUDA tensors of a kernel dtype, parameters of the right shape, dtype and device, a
// finite float eps >= 0, bool flags) runs whole: the forward op through the dispatcher, with
// statistics stored when a gradient will be needed. Anything else returns None and the
// caller's Python path takes it: CPU tensors, tensor subclasses, and every bad argument, so the
// error messages are written once, in Python (kbuild/ops/common.py).

const Tensor* cuda_tensor(py::handle h) {
  if (!THPVariable_CheckExact(h.ptr())) return nullptr;
  const Tensor& t = THPVariable_Unpack(h.ptr());
  // CPU tensors only in tests (launch hook set), where they run the CPU kernels.
  if ((!t.is_cuda() && !g_hooked) || t.dim() < 1) return nullptr;
  auto dt = t.scalar_type();
  if (dt != at::kFloat && dt != at::kHalf && dt != at::kBFloat16) return nullptr;
  return &t;
}

// A parameter in the common case: None (-> nullopt) or a contiguous (N,) CUDA tensor of x's
// dtype or fp32 on x's device. false: not the common case.
bool common_param(py::handle h, const Tensor& x, optional<Tensor>& out) {
  if (h.is_none()) return true;
  if (!THPVariable_CheckExact(h.ptr())) return false;
  const Tensor& p = THPVariable_Unpack(h.ptr());
  if (p.dim() != 1 || p.size(0) != x.size(-1) || p.device() != x.device() ||
      !p.is_contiguous())
    return false;
  if (p.scalar_type() != x.scalar_type() && p.scalar_type() != at::kFloat) return false;
  out = p;
  return true;
}

bool common_eps(py::handle h, double& eps) {
  if (!PyFloat_CheckExact(h.ptr())) return false;
  eps = PyFloat_AS_DOUBLE(h.ptr());
  return eps >= 0.0 && eps < std::numeric_limits<double>::infinity();
}

// A weight offset in the common case: None (0) or a finite float, nonzero only with a weight.
bool common_offset(py::handle h, const optional<Tensor>& w, double& offset) {
  offset = 0.0;
  if (h.is_none()) return true;
  if (!PyFloat_CheckExact(h.ptr())) return false;
  offset = PyFloat_AS_DOUBLE(h.ptr());
  return std::isfinite(offset) && (offset == 0.0 || w.has_value());
}

bool needs_grad(const Tensor& x, std::initializer_list<const optional<Tensor>*> params) {
  if (!at::GradMode::is_enabled()) return false;
  if (x.requires_grad()) return true;
  for (auto* p : params)
    if (p->has_value() && (*p)->requires_grad()) return true;
  return false;
}

py::object wrap(Tensor t) { return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(t))); }

py::object rmsnorm_entry(py::handle x_, py::handle w_, py::handle eps_, py::handle offset_) {
  const Tensor* x = cuda_tensor(x_);
  optional<Tensor> w;
  double eps, offset;
  if (x == nullptr || !common_param(w_, *x, w) || !common_eps(eps_, eps) ||
      !common_offset(offset_, w, offset))
    return py::none();
  static auto fwd = op<RmsFwd>("kbuild::rmsnorm_fwd");
  return wrap(std::get<0>(fwd.call(x->contiguous(), w, eps, needs_grad(*x, {&w}), offset)));
}

py::object layernorm_entry(py::handle x_, py::handle w_, py::handle b_, py::handle eps_) {
  const Tensor* x = cuda_tensor(x_);
  optional<Tensor> w, b;
  double eps;
  if (x == nullptr || !common_param(w_, *x, w) || !common_param(b_, *x, b) ||
      !common_eps(eps_, eps))
    return py::none();
  static auto fwd = op<LnFwd>("kbuild::layernorm_fwd");
  return wrap(std::get<0>(fwd.call(x->contiguous(), w, b, eps, needs_grad(*x, {&w, &b}))));
}

py::object fused_add_rmsnorm_entry(py::handle x_, py::handle r_, py::handle w_,
                                   py::handle eps_, py::handle prenorm_, py::handle fp32_,
                                   py::handle offset_) {
  const Tensor* x = cuda_tensor(x_);
  const Tensor* r = cuda_tensor(r_);
  optional<Tensor> w;
  double eps, offset;
  if (x == nullptr || r == nullptr || !common_param(w_, *x, w) || !common_eps(eps_, eps) ||
      !common_offset(offset_, w, offset) || !PyBool_Check(prenorm_.ptr()) ||
      !PyBool_Check(fp32_.ptr()))
    return py::none();
  bool r32 = r->scalar_type() == at::kFloat;  // x's dtype, or an fp32 residual stream
  if (r->sizes() != x->sizes() || (r->scalar_type() != x->scalar_type() && !r32) ||
      r->device() != x->device())
    return py::none();
  bool grad = needs_grad(*x, {&w}) || (at::GradMode::is_enabled() && r->requires_grad());
  auto residual_dtype = fp32_.ptr() == Py_True || r32 ? at::kFloat : x->scalar_type();
  static auto fwd = op<FusedFwd>("kbuild::fused_add_rmsnorm_fwd");
  auto [out, residual_out, rstd] =
      fwd.call(x->contiguous(), r->contiguous(), w, eps, residual_dtype, grad, offset);
  if (prenorm_.ptr() != Py_True) return wrap(std::move(out));
  return py::make_tuple(wrap(std::move(out)), wrap(std::move(residual_out)));
}

// kbuild.linear's common case: exact CUDA tensors of one kernel dtype on one device, shapes
// that match, a bias that needs its gradient, no autocast. Everything else: None (Python).
py::object linear_entry(py::handle x_, py::handle w_, py::handle b_) {
  const Tensor* x = cuda_tensor(x_);
  const Tensor* w = cuda_tensor(w_);
  const Tensor* b = cuda_tensor(b_);
  if (x == nullptr || w == nullptr || b == nullptr || w->dim() != 2 || b->dim() != 1 ||
      w->size(1) != x->size(-1) || b->size(0) != w->size(0))
    return py::none();
  auto dt = x->scalar_type();
  if (w->scalar_type() != dt || b->scalar_type() != dt || w->device() != x->device() ||
      b->device() != x->device() || at::autocast::is_autocast_enabled(x->device().type()))
    return py::none();
  if (!at::GradMode::is_enabled() || !b->requires_grad()) return wrap(at::linear(*x, *w, *b));
  return wrap(LinearFunction::apply(*x, *w, *b)[0]);
}

}  // namespace kbuild

TORCH_LIBRARY_IMPL(kbuild, CUDA, m) {
  m.impl("bias_grad", &kbuild::bias_grad_cuda);
  m.impl("rmsnorm_fwd", &kbuild::rmsnorm_fwd_cuda);
  m.impl("rmsnorm_bwd", &kbuild::rmsnorm_bwd_cuda);
  m.impl("fused_add_rmsnorm_fwd", &kbuild::fused_add_rmsnorm_fwd_cuda);
  m.impl("fused_add_rmsnorm_bwd", &kbuild::fused_add_rmsnorm_bwd_cuda);
  m.impl("layernorm_fwd", &kbuild::layernorm_fwd_cuda);
  m.impl("layernorm_bwd", &kbuild::layernorm_bwd_cuda);
}

TORCH_LIBRARY_IMPL(kbuild, Autograd, m) {
  m.impl("rmsnorm_fwd", &kbuild::rmsnorm_fwd_autograd);
  m.impl("fused_add_rmsnorm_fwd", &kbuild::fused_add_rmsnorm_fwd_autograd);
  m.impl("layernorm_fwd", &kbuild::layernorm_fwd_autograd);
}

// The Python side: entry points that skip torch.ops' argument parsing (the dispatcher still
// runs, with autograd and any dispatch modes), the resolver, and a launch hook for CPU tests.
PYBIND11_MODULE(KBUILD_EXTENSION_NAME, m) {
  using namespace kbuild;
  m.def("rmsnorm", &rmsnorm_entry, py::arg("x"), py::arg("w"), py::arg("eps"),
        py::arg("offset") = py::none());
  m.def("layernorm", &layernorm_entry);
  m.def("fused_add_rmsnorm", &fused_add_rmsnorm_entry, py::arg("x"), py::arg("r"), py::arg("w"),
        py::arg("eps"), py::arg("prenorm"), py::arg("fp32"), py::arg("offset") = py::none());
  m.def("linear", &linear_entry);
  m.def("rmsnorm_fwd", [](const Tensor& x, const optional<Tensor>& w, double eps, bool store,
                          double offset) {
    static auto fwd = op<RmsFwd>("kbuild::rmsnorm_fwd");
    return fwd.call(x, w, eps, store, offset);
  }, py::arg("x"), py::arg("w"), py::arg("eps"), py::arg("store"), py::arg("offset") = 0.0);
  m.def("fused_add_rmsnorm_fwd", [](const Tensor& x, const Tensor& r, const optional<Tensor>& w,
                                    double eps, at::ScalarType residual_dtype, bool store,
                                    double offset) {
    static auto fwd = op<FusedFwd>("kbuild::fused_add_rmsnorm_fwd");
    return fwd.call(x, r, w, eps, residual_dtype, store, offset);
  }, py::arg("x"), py::arg("r"), py::arg("w"), py::arg("eps"), py::arg("residual_dtype"),
     py::arg("store"), py::arg("offset") = 0.0);
  m.def("layernorm_fwd", [](const Tensor& x, const optional<Tensor>& w,
                            const optional<Tensor>& b, double eps, bool store) {
    static auto fwd = op<LnFwd>("kbuild::layernorm_fwd");
    return fwd.call(x, w, b, eps, store);
  });
  // The CUDA kernels called directly (no dispatcher): CPU tests run them on CPU tensors with
  // the launch hook set, to check the kernels and launch shapes they ask for.
  // (The RMSNorm ones take the weight offset last, 0.0 when not given.)
  m.def("rmsnorm_fwd_cuda", &rmsnorm_fwd_cuda, py::arg("x"), py::arg("w"), py::arg("eps"),
        py::arg("store"), py::arg("offset") = 0.0);
  m.def("rmsnorm_bwd_cuda", &rmsnorm_bwd_cuda, py::arg("dy"), py::arg("x"), py::arg("w"),
        py::arg("rstd"), py::arg("need_dx"), py::arg("need_dw"), py::arg("offset") = 0.0);
  m.def("fused_add_rmsnorm_fwd_cuda", &fused_add_rmsnorm_fwd_cuda, py::arg("x"), py::arg("r"),
        py::arg("w"), py::arg("eps"), py::arg("residual_dtype"), py::arg("store"),
        py::arg("offset") = 0.0);
  m.def("fused_add_rmsnorm_bwd_cuda", &fused_add_rmsnorm_bwd_cuda, py::arg("dy"),
        py::arg("dres"), py::arg("residual_out"), py::arg("w"), py::arg("rstd"),
        py::arg("need_dw"), py::arg("offset") = 0.0, py::arg("residual_dtype") = py::none());
  m.def("layernorm_fwd_cuda", &layernorm_fwd_cuda);
  m.def("layernorm_bwd_cuda", &layernorm_bwd_cuda);
  m.def("bias_grad_cuda", &bias_grad_cuda);
  m.def("set_resolver", [](py::object fn) {
    delete g_resolver;
    g_resolver = new py::object(std::move(fn));
  });
  m.def("set_launch_hook", [](py::object fn) {
    delete g_launch_hook;
    g_launch_hook = fn.is_none() ? nullptr : new py::object(std::move(fn));
    g_hooked = g_launch_hook != nullptr;
  });
  m.def("clear_records", [] {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_records.clear();
  });
  m.def("record_count", [] {
    std::lock_guard<std::mutex> lock(g_mutex);
    return g_records.size();
  });
  m.attr("slot_names") = py::cast(std::vector<std::string>(kSlotNames, kSlotNames + NUM_SLOTS));
  m.attr("kernel_names") =
      py::cast(std::vector<std::string>(kKindNames, kKindNames + NUM_KINDS));
}
