// Kernel records, the driver and launch shapes: slots, keys, the resolver, launches.
// Part of kbuild_native.cpp's one translation unit (included there, in order).
#pragma once

namespace kbuild {

// ------------------------------------------------------------------------------------ slots
// A kernel's arguments are 8-byte values (pointers and i64) taken from these slots in the
// order its launch record lists them. The names are the kernel table's argument names
// (kbuild/registry.py); kbuild/kernels/resolve.py maps names to these indices by `slot_names`.
enum Slot : int {
  X, WEIGHT, BIAS, RESIDUAL, Y, RESIDUAL_OUT, MEAN, RSTD, DY, DRESIDUAL_OUT, DX,
  DW_PARTIAL, DB_PARTIAL, ROWS, PARTIAL, OUT, OUT1, PARTIAL_ROWS, DOUT, ROWS_PER_CHUNK,
  DRESIDUAL, X_GROUP, X_STRIDE, X_GROUP_MAGIC, NUM_SLOTS
};
const char* const kSlotNames[NUM_SLOTS] = {
    "x", "weight", "bias", "residual", "y", "residual_out", "mean", "rstd", "dy",
    "dresidual_out", "dx", "dw_partial", "db_partial", "M", "partial", "out", "out1", "R",
    "dout", "rows_per_chunk", "dresidual", "x_group", "x_stride", "x_group_magic"};

// The kernels, in the order of kbuild/kernels/resolve.py NATIVE_KERNELS.
enum Kernel : int8_t {
  RMSNORM_FWD, FUSED_ADD_RMSNORM_FWD, LAYERNORM_FWD, RMSNORM_BWD, FUSED_ADD_RMSNORM_BWD,
  LAYERNORM_BWD, COLUMN_SUM, BIAS_GRAD, NUM_KERNELS
};
const char* const kKernelNames[NUM_KERNELS] = {
    "rmsnorm_fwd", "fused_add_rmsnorm_fwd", "layernorm_fwd", "rmsnorm_bwd",
    "fused_add_rmsnorm_bwd", "layernorm_bwd", "column_sum", "bias_grad"};

// ----------------------------------------------------------------------------------- values
// A key holds a kernel's compile-time parameter values, each named by its parameter in the
// kernel table (kbuild/registry.py Param) and of that parameter's kind. These are the
// parameters of the kernels above, in the order they first appear there; a CPU test holds the
// names and kinds equal to the table's (`value_names`, `value_kinds`).
enum class Value : int8_t {
  N, DTYPE, WEIGHT_DTYPE, STORE_RSTD, EPS, VECTORIZE, OFFSET, STRIDED,  // rmsnorm_fwd
  RESIDUAL_DTYPE, RESIDUAL_IN_DTYPE,                                    // fused_add_rmsnorm_fwd
  BIAS_DTYPE, STORE_STATS,                                              // layernorm_fwd
  COMPUTE_DW,                                                           // rmsnorm_bwd
  HAS_DRESIDUAL_OUT, DRESIDUAL_DTYPE,                                   // fused_add_rmsnorm_bwd
  COMPUTE_DB,                                                           // layernorm_bwd
  OUT_DTYPE, PLANES,                                                    // column_sum
  OC,                                                                   // bias_grad
  COUNT
};
constexpr int NUM_VALUES = static_cast<int>(Value::COUNT);

// The table's kinds (Param.kind); OPTIONAL_DTYPE is "dtype?", a dtype or None.
enum class ValueKind : int8_t { INT, FLOAT, BOOL, DTYPE, OPTIONAL_DTYPE };
const char* const kValueKindNames[] = {"int", "float", "bool", "dtype", "dtype?"};

struct ValueInfo {
  const char* name;
  ValueKind kind;
};
constexpr ValueInfo kValues[NUM_VALUES] = {
    {"N", ValueKind::INT},
    {"dtype", ValueKind::DTYPE},
    {"weight_dtype", ValueKind::OPTIONAL_DTYPE},
    {"store_rstd", ValueKind::BOOL},
    {"eps", ValueKind::FLOAT},
    {"vectorize", ValueKind::BOOL},
    {"offset", ValueKind::FLOAT},
    {"strided", ValueKind::BOOL},
    {"residual_dtype", ValueKind::DTYPE},
    {"residual_in_dtype", ValueKind::OPTIONAL_DTYPE},
    {"bias_dtype", ValueKind::OPTIONAL_DTYPE},
    {"store_stats", ValueKind::BOOL},
    {"compute_dw", ValueKind::BOOL},
    {"has_dresidual_out", ValueKind::BOOL},
    {"dresidual_dtype", ValueKind::OPTIONAL_DTYPE},
    {"compute_db", ValueKind::BOOL},
    {"out_dtype", ValueKind::DTYPE},
    {"planes", ValueKind::INT},
    {"OC", ValueKind::INT},
};
static_assert(NUM_VALUES <= 32, "Key::given has a bit per value");

// A dtype value's code; NONE is a "dtype?" parameter's None (no weight, no bias, ...).
// I32 / I64: ids (an "index" parameter), in the generic kernel's keys only.
enum class Dtype : uint8_t { F32, F16, BF16, NONE, I32, I64 };
const char* const kDtypeNames[6] = {"f32", "f16", "bf16", nullptr, "i32", "i64"};

// A dtype value as the resolver takes it: its table name, or None.
py::object dtype_object(uint64_t bits) {
  return bits < 6 && kDtypeNames[bits] != nullptr ? py::object(py::str(kDtypeNames[bits]))
                                                  : py::object(py::none());
}

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

// ------------------------------------------------------------------------------- the keys
// The C++ type a value of each kind is given as (checked where a key is built).
template <typename T>
constexpr bool is_of_kind(ValueKind kind) {
  if constexpr (std::is_same_v<T, int64_t>) return kind == ValueKind::INT;
  if constexpr (std::is_same_v<T, double>) return kind == ValueKind::FLOAT;
  if constexpr (std::is_same_v<T, bool>) return kind == ValueKind::BOOL;
  if constexpr (std::is_same_v<T, Dtype>)
    return kind == ValueKind::DTYPE || kind == ValueKind::OPTIONAL_DTYPE;
  return false;
}

// Each value as a u64: an int as int64, a float by its IEEE bits (1e-6 and its neighbour are
// two keys, as they are two specs; so are 0.0 and -0.0), a bool 0/1, a dtype by its code.
inline uint64_t encode(int64_t v) { return static_cast<uint64_t>(v); }
inline uint64_t encode(double v) { return std::bit_cast<uint64_t>(v); }
inline uint64_t encode(bool v) { return v; }
inline uint64_t encode(Dtype v) { return static_cast<uint64_t>(v); }

// One odd multiplier per value (splitmix64's outputs) and one for (kernel, device): a key's
// hash is the sum of its values times theirs, kept up to date as values are set.
constexpr auto kMixers = [] {
  std::array<uint64_t, NUM_VALUES + 1> m{};
  uint64_t z = 0;
  for (auto& x : m) {
    z += 0x9E3779B97F4A7C15ull;
    uint64_t y = (z ^ z >> 30) * 0xBF58476D1CE4E5B9ull;
    y = (y ^ y >> 27) * 0x94D049BB133111EBull;
    x = (y ^ y >> 31) | 1;
  }
  return m;
}();

// What picks a kernel: the kernel, the device and the table's parameter values by name, built
// as Key key(RMSNORM_FWD, x); key.set<Value::EPS>(eps)... A value not set stays 0 with its
// bit clear in `given`, and the resolver gives that parameter the table's default. Fixed size
// and hashed as it is built (a multiply-add per value set): a lookup allocates nothing.
struct Key {
  uint64_t values[NUM_VALUES] = {};
  uint64_t hash;
  uint32_t given = 0;  // bit i: values[i] was set
  Kernel kernel;
  int8_t device;  // -1: a CPU tensor (tests)

  Key(Kernel kernel, const Tensor& like)
      : kernel(kernel), device(static_cast<int8_t>(like.is_cuda() ? like.get_device() : -1)) {
    hash = (uint64_t{static_cast<uint8_t>(kernel)} << 8 | static_cast<uint8_t>(device)) *
           kMixers[NUM_VALUES];
  }

  template <Value v, typename T>
  Key& set(T value) {
    constexpr int i = static_cast<int>(v);
    static_assert(is_of_kind<T>(kValues[i].kind),
                  "a value is set as its table kind: int64_t, double, bool or Dtype");
    uint64_t bits = encode(value);
    hash += (bits - values[i]) * kMixers[i];
    values[i] = bits;
    given |= uint32_t{1} << i;
    return *this;
  }

  bool operator==(const Key& o) const {
    return given == o.given && kernel == o.kernel && device == o.device &&
           std::memcmp(values, o.values, sizeof values) == 0;
  }
};

struct KeyHash {
  size_t operator()(const Key& k) const { return k.hash ^ k.hash >> 32; }
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
py::object* g_resolver = nullptr;     // kbuild.kernels.resolve.resolve (leaked: outlives exit)
py::object* g_launch_hook = nullptr;  // tests: record launches instead of making them
bool g_hooked = false;

Dtype dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return Dtype::F32;
    case at::kHalf: return Dtype::F16;
    case at::kBFloat16: return Dtype::BF16;
    default:
      TORCH_CHECK_TYPE(false, "kbuild kernels take float32, float16 or bfloat16; got ", t);
  }
}

// A key's value as the resolver takes it: the Python value of the table's kind.
py::object value_object(int i, uint64_t bits) {
  switch (kValues[i].kind) {
    case ValueKind::INT: return py::int_(static_cast<int64_t>(bits));
    case ValueKind::FLOAT: return py::float_(std::bit_cast<double>(bits));
    case ValueKind::BOOL: return py::bool_(bits != 0);
    default: return dtype_object(bits);
  }
}

// Rethrow a Python exception from the resolver as torch's python_error, which every path
// back to Python (pybind, torch.ops, the autograd engine) restores with its type and text.
[[noreturn]] void rethrow_python(py::error_already_set& e) {
  e.restore();
  python_error err;
  err.persist();
  throw err;
}

// What both C++ launch paths read of a resolved kernel (kbuild/op/launch.py record_fields):
// the driver's function, block, shared memory and the grid's shape.
void read_launch_fields(const py::object& out, Record& rec) {
  rec.function = reinterpret_cast<void*>(out.attr("function_handle").cast<uintptr_t>());
  rec.block = out.attr("block").cast<unsigned>();
  rec.shared = out.attr("shared").cast<unsigned>();
  rec.cluster = out.attr("cluster").cast<int64_t>();
  rec.rows_per_block = out.attr("rows_per_block").cast<int64_t>();
  rec.resident_clusters = out.attr("resident_clusters").cast<int64_t>();
  rec.persistent = out.attr("persistent").cast<bool>();
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
    try {
      py::dict values;  // the values set, by name; the resolver defaults the others
      for (int i = 0; i < NUM_VALUES; ++i)
        if (key.given >> i & 1) values[kValues[i].name] = value_object(i, key.values[i]);
      py::object out = (*g_resolver)(kKernelNames[key.kernel], key.device, values);
      // The launch record's fields by name (kbuild/kernels/resolve.py Record).
      read_launch_fields(out, rec);
      rec.columns_per_block = out.attr("columns_per_block").cast<int64_t>();
      for (auto s : out.attr("slots").cast<std::vector<int>>()) {
        TORCH_CHECK(0 <= s && s < NUM_SLOTS, "kbuild native: bad argument slot ", s);
        rec.slots.push_back(static_cast<int8_t>(s));
      }
      rec.name = out.attr("name").cast<std::string>();
      rec.units = out.attr("units").cast<int64_t>();
    } catch (py::error_already_set& e) {
      rethrow_python(e);
    }
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
Dtype dtype_of(const Tensor& t) { return t.defined() ? dtype_code(t.scalar_type()) : Dtype::NONE; }

// The vector kernels (the table's `vectorize`) take 16-byte aligned addresses (or'ed here).
bool aligned(uint64_t addresses) { return (addresses & 15) == 0; }

// RMSNorm's weight offset as keyed: an offset scales the weight, so without one it is nothing
// (the table's needs="weight_dtype" drops it from the spec) and splits no key either.
double weight_offset(const Tensor& w, double offset) { return w.defined() ? offset : 0.0; }

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

// Where the rows of a non-contiguous (..., N) tensor lie, as kbuild/op/tensors.py's
// grouped_rows (the two are held equal by a CPU test): true with group = rows when they are
// dense after all, true with (group, stride) when row r starts at
// (r / group) * stride + (r % group) * N, false when they cannot be read so (or there are
// more than kMaxGroupedRows rows: the kernels divide by group_magic).
constexpr int64_t kMaxGroupedRows = int64_t{1} << 31;  // registry.py MAX_GROUPED_ROWS

// x_group_magic: r / group == (r * m) >> p for 0 <= r < 2^31 (registry.py group_magic).
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
// kernels of the table's `strided`), else a contiguous copy. `x` receives the tensor to read
// (and to save for the backward).
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
  Key key(COLUMN_SUM, like);
  key.set<Value::N>(N).set<Value::OUT_DTYPE>(dtype_code(dtype));
  key.set<Value::PLANES>(static_cast<int64_t>(planes));
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
