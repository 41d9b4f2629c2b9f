// Kernel records, the driver and launch shapes: slots, keys, the resolver, launches.
// Part of kbuild_native.cpp's one translation unit (included there, in order).
#pragma once

namespace kbuild {

// ------------------------------------------------------------------------------------ slots
// A kernel's arguments are 8-byte values (pointers and i64) taken from these slots in the
// order its launch record lists them. The names are the kernel table's argument names
// (kbuild/kernels/table.py); kbuild/ops/resolve.py maps names to these indices by `slot_names`.
enum Slot : int {
  X, WEIGHT, BIAS, RESIDUAL, Y, RESIDUAL_OUT, MEAN, RSTD, DY, DRESIDUAL_OUT, DX,
  DW_PARTIAL, DB_PARTIAL, ROWS, PARTIAL, OUT, OUT1, PARTIAL_ROWS, DOUT, ROWS_PER_CHUNK,
  DRESIDUAL, X_GROUP, X_STRIDE, X_GROUP_MAGIC, NUM_SLOTS
};
const char* const kSlotNames[NUM_SLOTS] = {
    "x", "weight", "bias", "residual", "y", "residual_out", "mean", "rstd", "dy",
    "dresidual_out", "dx", "dw_partial", "db_partial", "M", "partial", "out", "out1", "R",
    "dout", "rows_per_chunk", "dresidual", "x_group", "x_stride", "x_group_magic"};

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
// backward writes d(residual) in fp32 beside dx). STRIDED: RMSNorm's x is read in place at a
// two-level stride (slots X_GROUP, X_STRIDE, X_GROUP_MAGIC: see grouped_rows).
constexpr uint8_t STATS = 1, DW = 2, DB = 4, DRES = 8, RES32 = 16, STRIDED = 32;

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

// Where the rows of a non-contiguous (..., N) tensor lie, as kbuild/ops/common.py's
// grouped_rows (the two are held equal by a CPU test): true with group = rows when they are
// dense after all, true with (group, stride) when row r starts at
// (r / group) * stride + (r % group) * N, false when they cannot be read so (or there are
// more than kMaxGroupedRows rows: the kernels divide by group_magic).
constexpr int64_t kMaxGroupedRows = int64_t{1} << 31;  // kernels/table.py MAX_GROUPED_ROWS

// x_group_magic: r / group == (r * m) >> p for 0 <= r < 2^31 (kernels/table.py group_magic).
uint64_t group_magic(int64_t group) {
  int p = 31, bits = 0;
  for (uint64_t g = static_cast<uint64_t>(group - 1); g != 0; g >>= 1) ++bits;
  p += bits;
  uint64_t m = ((uint64_t{1} << p) + static_cast<uint64_t>(group) - 1) / static_cast<uint64_t>(group);
  return m | static_cast<uint64_t>(p) << 32;
}

bool grouped_rows(const Tensor& t, int64_t& group, int64_t& stride) {
  int64_t N = t.size(-1);
  if (t.stride(-1) != 1 && N > 1) return false;
  std::vector<std::pair<int64_t, int64_t>> dims;
  for (int64_t i = 0; i + 1 < t.dim(); ++i)
    if (t.size(i) != 1) dims.emplace_back(t.size(i), t.stride(i));
  group = 1;
  int64_t expected = N;
  while (!dims.empty() && dims.back().second == expected) {
    group *= dims.back().first, expected *= dims.back().first;
    dims.pop_back();
  }
  stride = 0;
  if (dims.empty()) return true;
  if (rows_of(t).first > kMaxGroupedRows) return false;
  int64_t count = dims.back().first, step = dims.back().second;
  stride = step;
  dims.pop_back();
  while (!dims.empty()) {
    if (dims.back().second != step * count) return false;
    step = dims.back().second, count = dims.back().first;
    dims.pop_back();
  }
  return true;
}

// RMSNorm's x as its kernels read it: itself when contiguous or of grouped rows (then
// slots[X_GROUP], slots[X_STRIDE], slots[X_GROUP_MAGIC] are set and the result is true: the
// STRIDED kernels), else
// a contiguous copy. `x` receives the tensor to read (and to save for the backward).
bool readable_rows(const Tensor& t, Tensor& x, uint64_t* slots) {
  x = t;
  if (t.is_contiguous()) return false;
  int64_t group, stride;
  if (!grouped_rows(t, group, stride)) {
    x = t.contiguous();
    return false;
  }
  if (group == rows_of(t).first) return false;  // dense after all
  slots[X_GROUP] = static_cast<uint64_t>(group), slots[X_STRIDE] = static_cast<uint64_t>(stride);
  slots[X_GROUP_MAGIC] = group_magic(group);
  return true;
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

// A backward kernel on a persistent grid: one fp32 partial row per cluster (block) for each
// wanted parameter gradient, summed by the column-sum kernel in a fixed order. The grid is what
// the device holds at once (fixed per device and kernel), so every bit of dw / db is the same
// on every run. Returns the gradients of `params` (undefined where not wanted).
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
  int64_t rows = clusters;  // one workspace row per cluster (a block's rows are added first)
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

}  // namespace kbuild
