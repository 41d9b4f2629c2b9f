// The generic CUDA kernel of ops declared with kbuild.Op: no C++ of their own.
// Part of kbuild_native.cpp's one translation unit (included there, in order).
//
// An Op whose launches bind by name (kbuild/op/opdef.py `Launch`, nothing computed by a
// Python function) is compiled there into a Program: which arguments are tensors to read
// dense, how each output is allocated, and per launch which call values pick the kernel (N,
// a tensor's dtype, a scalar argument, the alignment bit). `define_generic` registers one
// boxed kernel for the op's CUDA dispatch key that runs any Program: it allocates the
// outputs, keys each launch by (launch, device, its values) and launches by handle, so a
// call never enters Python after the first per key. On a miss the launch's resolver
// (Python, built by opdef from the kernel table) turns the values into the table's
// parameters, loads the kernel and says which argument each of its slots takes.
//
// The op's Python entry (`Op.__call__`) calls the op through here too where every argument's
// check is a declaration (`call` below, the program's "checks"): the checks of `Op.check`
// run on the call's Python objects, then the dispatcher, with no Python in between.
#pragma once

#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/Dtype.h>

namespace kbuild::generic {

// Where a launch's varying values come from (opdef.py `_Binding.native_sources`).
enum Source : int8_t {
  ROWS_N,       // the first Rows tensor's last dimension
  DTYPE_OF,     // a tensor's dtype (an argument or an output), None where absent
  SCALAR_FLOAT, // a float argument
  SCALAR_BOOL,
  SCALAR_INT,
  SCALAR_DTYPE, // a ScalarType argument (None allowed)
  ALIGNED,      // every tensor of the call 16-byte aligned (`vectorize`)
};
constexpr int kMaxValues = 16, kMaxSlots = 64;

struct ValueSource {
  Source source;
  int position;  // the argument (or nargs + output index) it reads
};

struct OutputRule {
  bool rows = false;     // one fp32 value per row of `source`, else `source`'s shape
  int source = 0;        // argument position
  int dtype = -1;        // -1: the source's dtype, -2: float32, k >= 0: the dtype argument k
                         // (the source's where it is None)
  std::vector<int> when; // arguments that must all hold (a tensor given, true, not None)
};

struct Launch {
  std::vector<ValueSource> values;
  py::object resolve;  // (device, values tuple) -> record (opdef.py `_native_record`)
};

// Op.__call__'s checks of one argument (kbuild/op/args.py `native_check`).
enum CheckKind : int8_t {
  ROWS,     // a float tensor of at least one dimension
  LIKE,     // a float tensor of `of`'s shape and dtype (or float32, with or_fp32)
  FEATURE,  // a dense (N,) tensor of `of`'s dtype or float32, N `of`'s last dimension
  TENSORS,  // any tensor
  IDS,      // int32 / int64 ids, with `of` one per row of it (its shape without the last)
  FLOAT,    // a float or an int (not a bool), finite, within bounds
  BOOL,
  INT,      // an int (not a bool) within bounds
  DTYPE,    // torch.float32, float16 or bfloat16
};

struct ArgCheck {
  CheckKind kind = ROWS;
  bool optional = false;  // None accepted
  bool or_fp32 = false;   // LIKE
  int of = -1;            // LIKE, FEATURE, IDS: the tensor argument it is checked against
  double low = -INFINITY, high = INFINITY;  // FLOAT's bounds, ends included
  int64_t ilow = std::numeric_limits<int64_t>::min();  // INT's
  int64_t ihigh = std::numeric_limits<int64_t>::max();
  py::object fallback;    // what a call leaving it out passes (null: it is required)
};

struct Program {
  std::string name;
  int nargs = 0;
  std::vector<int> tensors;     // argument positions of tensors, in order (the first given
                                // one is where empty outputs live)
  std::vector<int> dense;       // tensor arguments the kernels read dense
  int rows = 0;                 // the first Rows argument: N, M and the device
  std::vector<OutputRule> outputs;
  std::vector<Launch> launches;
  int id = 0;                   // of the first launch; launch i keys as id + i
  std::vector<ArgCheck> checks; // Op.__call__'s, one per argument (empty: Python's alone)
  std::optional<c10::OperatorHandle> handle;  // the operator, for `call`
};

// What a launch needs of a loaded kernel, plus which call slot each argument reads.
struct Record {
  kbuild::Record launch;
  std::vector<int8_t> pointers;  // slot indices that must hold a tensor's address
  std::vector<std::string> arg_names;
};

struct Key {
  uint64_t values[kMaxValues] = {};
  int32_t launch = 0;
  int8_t device = 0, count = 0;
  bool operator==(const Key& o) const {
    return launch == o.launch && device == o.device && count == o.count &&
           std::memcmp(values, o.values, sizeof(uint64_t) * count) == 0;
  }
};

struct KeyHash {
  size_t operator()(const Key& k) const {
    uint64_t h = (static_cast<uint64_t>(k.launch) << 8 | static_cast<uint8_t>(k.device)) *
                 kMixers[NUM_VALUES];
    for (int i = 0; i < k.count; ++i) h += k.values[i] * kMixers[i];
    return h ^ h >> 32;
  }
};

std::mutex g_programs_mutex;  // guards g_programs (written at declaration, read per call)
// Leaked, as the resolver is: their Python objects must not be freed after the interpreter.
auto& g_programs = *new std::unordered_map<std::string, std::unique_ptr<Program>>();
std::unordered_map<Key, Record, KeyHash> g_generic_records;  // under kbuild::g_mutex
int g_next_launch = 0;

bool holds(const c10::IValue& v) {
  if (v.isNone()) return false;
  if (v.isBool()) return v.toBool();
  return true;  // a tensor given, a dtype given
}

// A dtype as a key holds it (Dtype): a float's, or an index dtype's (ids).
uint64_t dtype_bits(at::ScalarType t) {
  if (t == at::kInt) return static_cast<uint64_t>(Dtype::I32);
  if (t == at::kLong) return static_cast<uint64_t>(Dtype::I64);
  return static_cast<uint64_t>(dtype_code(t));
}

uint64_t dtype_bits(const c10::IValue& v) {
  if (v.isNone()) return static_cast<uint64_t>(Dtype::NONE);
  if (v.isTensor()) return dtype_bits(v.toTensor().scalar_type());
  return dtype_bits(v.toScalarType());
}

py::object value_object(Source source, uint64_t bits) {
  switch (source) {
    case ROWS_N:
    case SCALAR_INT: return py::int_(static_cast<int64_t>(bits));
    case SCALAR_FLOAT: return py::float_(std::bit_cast<double>(bits));
    case SCALAR_BOOL:
    case ALIGNED: return py::bool_(bits != 0);
    default: return dtype_object(bits);
  }
}

const Record& record(const Program& p, int index, const Key& key) {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_generic_records.find(key);
    if (it != g_generic_records.end()) return it->second;
  }
  Record rec;
  {
    py::gil_scoped_acquire gil;
    try {
      py::tuple values(key.count);
      const auto& sources = p.launches[index].values;
      for (int i = 0; i < key.count; ++i)
        values[i] = value_object(sources[i].source, key.values[i]);
      py::object out = p.launches[index].resolve(key.device, values);
      auto& k = rec.launch;
      read_launch_fields(out, k);
      k.name = out.attr("name").cast<std::string>();
      for (auto s : out.attr("slots").cast<std::vector<int>>()) {
        TORCH_CHECK(0 <= s && s < kMaxSlots, "kbuild native: bad argument slot ", s);
        k.slots.push_back(static_cast<int8_t>(s));
      }
      TORCH_CHECK(k.slots.size() <= NUM_SLOTS, "kbuild native: ", k.name, " takes ",
                  k.slots.size(), " arguments, more than ", NUM_SLOTS);
      for (auto s : out.attr("pointers").cast<std::vector<int>>())
        rec.pointers.push_back(static_cast<int8_t>(s));
      rec.arg_names = out.attr("arg_names").cast<std::vector<std::string>>();
    } catch (py::error_already_set& e) {
      rethrow_python(e);
    }
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_generic_records.emplace(key, std::move(rec)).first->second;
}

at::ScalarType output_dtype(const OutputRule& o, const c10::IValue* args) {
  if (o.rows || o.dtype == -2) return at::kFloat;
  // A dtype argument of None (an optional one): the source's dtype, as opdef.py's Out has it.
  if (o.dtype >= 0 && !args[o.dtype].isNone()) return args[o.dtype].toScalarType();
  return args[o.source].toTensor().scalar_type();
}

// The op's CUDA kernel: arguments from the stack, outputs onto it.
void run(const Program& p, torch::jit::Stack* stack) {
  c10::IValue* args = stack->data() + (stack->size() - p.nargs);  // read in place
  for (int i : p.dense)
    if (args[i].isTensor() && !args[i].toTensor().is_contiguous())
      args[i] = args[i].toTensor().contiguous();
  const Tensor* first = nullptr;
  for (int i : p.tensors)
    if (args[i].isTensor()) {
      first = &args[i].toTensor();
      break;
    }
  const Tensor& rows = args[p.rows].toTensor();
  auto [M, N] = rows_of(rows);
  c10::OptionalDeviceGuard guard(cuda_device(rows));
  uint64_t slots[kMaxSlots] = {};
  c10::SmallVector<Tensor, 8> outs;
  for (size_t k = 0; k < p.outputs.size(); ++k) {
    const OutputRule& o = p.outputs[k];
    bool wanted = true;
    for (int w : o.when) wanted = wanted && holds(args[w]);
    Tensor t;
    if (!wanted) {
      t = at::empty({0}, first->options().dtype(o.rows ? at::kFloat : first->scalar_type()));
    } else if (o.rows) {
      t = at::empty({rows_of(args[o.source].toTensor()).first}, first->options().dtype(at::kFloat));
    } else {
      const Tensor& like = args[o.source].toTensor();
      t = at::empty(like.sizes(), like.options().dtype(output_dtype(o, args)));
    }
    outs.push_back(std::move(t));
  }
  if (M > 0 && N > 0) {
    uint64_t addresses = 0;
    for (int i : p.tensors)
      if (args[i].isTensor() && args[i].toTensor().numel()) {
        slots[i] = ptr(args[i].toTensor());
        addresses |= slots[i];
      }
    for (size_t k = 0; k < outs.size(); ++k)
      if (outs[k].numel()) {
        slots[p.nargs + k] = ptr(outs[k]);
        addresses |= slots[p.nargs + k];
      }
    int m_slot = p.nargs + static_cast<int>(outs.size());
    slots[m_slot] = static_cast<uint64_t>(M);
    int8_t device = static_cast<int8_t>(rows.is_cuda() ? rows.get_device() : -1);
    void* stream = current_stream(rows);
    for (size_t l = 0; l < p.launches.size(); ++l) {
      Key key;
      key.launch = p.id + static_cast<int>(l), key.device = device;
      for (const ValueSource& v : p.launches[l].values) {
        const c10::IValue& a = v.position < p.nargs ? args[v.position] : c10::IValue();
        uint64_t bits = 0;
        switch (v.source) {
          case ROWS_N: bits = static_cast<uint64_t>(N); break;
          case DTYPE_OF:
            bits = v.position < p.nargs
                       ? dtype_bits(a)
                       : dtype_bits(outs[v.position - p.nargs].scalar_type());
            break;
          case SCALAR_FLOAT: bits = std::bit_cast<uint64_t>(a.toDouble()); break;
          case SCALAR_BOOL: bits = a.toBool(); break;
          case SCALAR_INT: bits = static_cast<uint64_t>(a.toInt()); break;
          case SCALAR_DTYPE: bits = dtype_bits(a); break;
          case ALIGNED: bits = (addresses & 15) == 0; break;
        }
        key.values[key.count++] = bits;
      }
      const Record& r = record(p, static_cast<int>(l), key);
      for (size_t i = 0; i < r.pointers.size(); ++i)
        TORCH_CHECK_VALUE(slots[r.pointers[i]] != 0, p.name, ": kernel ", r.launch.name,
                          "'s argument ", r.arg_names[i], " has no tensor");
      const auto& k = r.launch;
      int64_t groups = ceil_div(M, k.rows_per_block);
      int64_t grid = (k.persistent ? std::min(groups, k.resident_clusters) : groups) * k.cluster;
      launch(k, grid, slots, stream, device);
    }
  }
  for (size_t k = 0; k < outs.size(); ++k) {
    if (!outs[k].numel()) continue;
    if (p.outputs[k].rows && args[p.outputs[k].source].toTensor().size(-1) == 0)
      outs[k].fill_(NAN);  // statistics of rows with no elements: undefined
    else if (M == 0)
      outs[k].zero_();  // nothing launched: a (N,) output (a dw) is a sum over no rows
  }
  torch::jit::drop(*stack, p.nargs);
  for (auto& t : outs) stack->emplace_back(std::move(t));
}

const Program& program_of(const c10::OperatorHandle& op) {
  const auto& name = op.schema().name();
  std::lock_guard<std::mutex> lock(g_programs_mutex);
  auto it = g_programs.find(name);
  TORCH_CHECK(it != g_programs.end(), "kbuild native: no program for ", name);
  return *it->second;  // never erased: the reference outlives the lock
}

// The kernel registered for an op's CUDA key: it holds its program (no lookup per call).
struct Boxed final : c10::OperatorKernel {
  explicit Boxed(const Program* program) : program(program) {}
  void operator()(const c10::OperatorHandle&, c10::DispatchKeySet, torch::jit::Stack* stack) {
    run(*program, stack);
  }
  const Program* program;  // never freed (g_programs)
};

// --------------------------------------------------------------- Op.__call__'s fast path
// `Op.__call__(*args)` hands its positional arguments here first. A call whose every
// argument passes its check runs the operator through the dispatcher (autograd, dispatch
// modes, the profiler as a torch.ops call) and returns its outputs; anything else returns
// None, and Op.__call__ runs its Python check (whose errors name the argument) and call. So
// this accepts only what the Python check accepts, and of that only the common case: exact
// torch.Tensor / nn.Parameter strided tensors, all on one CUDA device (CPU in tests, with the
// launch hook set; without it CPU tensors run the reference from Python), exact floats, ints
// and bools, no torch function mode (which sees torch.ops calls). Left to Python: tensor
// subclasses, a Feature that is not dense (the Python check copies it), SymInts, an int or
// a float beyond int64 / double. Nothing is allocated but the stack the call passes.

bool float_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// A number as Op.check takes it: FLOAT a finite float or int (as float(value)) within bounds,
// INT an int64 within bounds; false for anything else (no Python error left set).
bool number(const ArgCheck& c, PyObject* o, torch::jit::Stack& stack) {
  if (c.kind == INT) {
    if (!PyLong_CheckExact(o)) return false;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow != 0 || v < c.ilow || v > c.ihigh) return false;
    stack.emplace_back(static_cast<int64_t>(v));
    return true;
  }
  double v;
  if (PyFloat_CheckExact(o)) {
    v = PyFloat_AS_DOUBLE(o);
  } else if (PyLong_CheckExact(o)) {
    v = PyLong_AsDouble(o);
    if (v == -1.0 && PyErr_Occurred()) {  // past a double: the Python check says so
      PyErr_Clear();
      return false;
    }
  } else {
    return false;
  }
  if (!std::isfinite(v) || !(c.low <= v && v <= c.high)) return false;
  stack.emplace_back(v);
  return true;
}

// A tensor as Op.check takes it (`of` is on the stack already: an earlier argument), on the
// call's device: the first tensor's, CUDA (or CPU under the launch hook).
bool tensor(const ArgCheck& c, PyObject* o, torch::jit::Stack& stack,
            optional<c10::Device>& device) {
  if (!THPVariable_CheckExact(o)) return false;
  const Tensor& t = THPVariable_Unpack(o);
  if (t.layout() != at::kStrided) return false;
  if (!device.has_value()) {
    if (!t.is_cuda() && !(g_hooked && t.is_cpu())) return false;
    device = t.device();
  } else if (t.device() != *device) {
    return false;
  }
  auto dtype = t.scalar_type();
  switch (c.kind) {
    case ROWS:
      if (!float_dtype(dtype) || t.dim() < 1) return false;
      break;
    case LIKE: {
      const Tensor& of = stack[c.of].toTensor();
      if (!float_dtype(dtype) || t.dim() < 1 || !t.sizes().equals(of.sizes())) return false;
      if (dtype != of.scalar_type() && !(c.or_fp32 && dtype == at::kFloat)) return false;
      break;
    }
    case FEATURE: {
      const Tensor& of = stack[c.of].toTensor();
      if (t.dim() != 1 || t.size(0) != of.size(-1) || !t.is_contiguous()) return false;
      if (dtype != of.scalar_type() && dtype != at::kFloat) return false;
      break;
    }
    case IDS: {
      if (dtype != at::kInt && dtype != at::kLong) return false;
      if (c.of >= 0) {
        auto rows = stack[c.of].toTensor().sizes();
        if (!t.sizes().equals(rows.slice(0, rows.size() - 1))) return false;
      }
      break;
    }
    default:  // TENSORS
      break;
  }
  stack.emplace_back(t);
  return true;
}

bool accept(const ArgCheck& c, PyObject* o, torch::jit::Stack& stack,
            optional<c10::Device>& device) {
  if (o == Py_None) {
    if (!c.optional) return false;
    stack.emplace_back();
    return true;
  }
  switch (c.kind) {
    case FLOAT:
    case INT: return number(c, o, stack);
    case BOOL:
      if (!PyBool_Check(o)) return false;
      stack.emplace_back(o == Py_True);
      return true;
    case DTYPE: {
      if (!THPDtype_Check(o)) return false;
      auto t = reinterpret_cast<THPDtype*>(o)->scalar_type;
      if (!float_dtype(t)) return false;
      stack.emplace_back(t);
      return true;
    }
    default: return tensor(c, o, stack, device);
  }
}

// The op called with a positional call's arguments, or None where a check does not take them.
py::object call(const Program& p, const py::tuple& args) {
  Py_ssize_t given = PyTuple_GET_SIZE(args.ptr());
  if (given > p.nargs || at::impl::torch_function_mode_enabled()) return py::none();
  torch::jit::Stack stack;
  stack.reserve(std::max(p.nargs, static_cast<int>(p.outputs.size())));
  optional<c10::Device> device;
  for (int i = 0; i < p.nargs; ++i) {
    const ArgCheck& c = p.checks[i];
    PyObject* o = i < given ? PyTuple_GET_ITEM(args.ptr(), i) : c.fallback.ptr();
    if (o == nullptr || !accept(c, o, stack, device)) return py::none();
  }
  if (!device.has_value()) return py::none();  // no tensor given: the Python path says
  p.handle->callBoxed(&stack);
  if (stack.size() == 1) return wrap(std::move(stack[0]).toTensor());
  py::tuple outs(stack.size());
  for (size_t k = 0; k < stack.size(); ++k) outs[k] = wrap(std::move(stack[k]).toTensor());
  return outs;
}

ArgCheck read_check(py::handle check, py::handle fallback) {
  auto t = check.cast<py::tuple>();  // (kind, optional, of, or_fp32, low, high): op_args.py
  ArgCheck c;
  c.kind = static_cast<CheckKind>(t[0].cast<int>());
  c.optional = t[1].cast<bool>();
  c.of = t[2].cast<int>();
  c.or_fp32 = t[3].cast<bool>();
  if (c.kind == INT) {
    if (!t[4].is_none()) c.ilow = t[4].cast<int64_t>();
    if (!t[5].is_none()) c.ihigh = t[5].cast<int64_t>();
  } else {
    if (!t[4].is_none()) c.low = t[4].cast<double>();
    if (!t[5].is_none()) c.high = t[5].cast<double>();
  }
  auto f = fallback.cast<py::tuple>();  // (given when left out, the value)
  if (f[0].cast<bool>()) c.fallback = py::reinterpret_borrow<py::object>(f[1]);
  return c;
}

// A warning handler that drops them: the bench's CPU key replaces the reference's kernel.
struct Quiet final : c10::WarningHandler {
  void process(const c10::Warning&) override {}
};

// Registered from Python (opdef.py) as each eligible Op is declared: the Program, and the
// boxed kernel for its CUDA key. Where the spec has "checks", its "entry" function is handed
// the op's fast path (Op.__call__'s `_fast`). A spec's "dispatch_keys" (a CPU benchmark's:
// ["CUDA", "CPU"]) puts the kernel on those keys instead (CPU: over the reference).
void define(const std::string& ns, const std::string& name, py::dict spec) {
  auto p = std::make_unique<Program>();
  p->name = ns + "::" + name;
  p->nargs = spec["nargs"].cast<int>();
  p->tensors = spec["tensors"].cast<std::vector<int>>();
  p->dense = spec["dense"].cast<std::vector<int>>();
  p->rows = spec["rows"].cast<int>();
  for (auto o : spec["outputs"]) {
    auto t = o.cast<py::tuple>();
    p->outputs.push_back({t[0].cast<bool>(), t[1].cast<int>(), t[2].cast<int>(),
                          t[3].cast<std::vector<int>>()});
  }
  for (auto l : spec["launches"]) {
    auto t = l.cast<py::tuple>();
    Launch launch;
    for (auto v : t[0]) {
      auto pair = v.cast<std::pair<int, int>>();
      launch.values.push_back({static_cast<Source>(pair.first), pair.second});
    }
    TORCH_CHECK(launch.values.size() <= kMaxValues, "kbuild native: ", p->name, " keys ",
                launch.values.size(), " values, more than ", kMaxValues);
    launch.resolve = t[1];
    p->launches.push_back(std::move(launch));
  }
  TORCH_CHECK(p->nargs + static_cast<int>(p->outputs.size()) + 1 <= kMaxSlots, "kbuild native: ",
              p->name, " has too many arguments and outputs");
  if (spec.contains("checks") && !spec["checks"].is_none()) {
    py::list checks = spec["checks"], defaults = spec["defaults"];
    TORCH_CHECK(static_cast<int>(checks.size()) == p->nargs &&
                    static_cast<int>(defaults.size()) == p->nargs,
                "kbuild native: ", p->name, " has ", p->nargs, " arguments, and ", checks.size(),
                " checks and ", defaults.size(), " defaults");
    for (int i = 0; i < p->nargs; ++i) p->checks.push_back(read_check(checks[i], defaults[i]));
  }
  p->handle = c10::Dispatcher::singleton().findSchemaOrThrow(p->name.c_str(), "");
  std::vector<std::string> keys{"CUDA"};
  if (spec.contains("dispatch_keys"))
    keys = spec["dispatch_keys"].cast<std::vector<std::string>>();
  const Program* program = p.get();
  {
    std::lock_guard<std::mutex> lock(g_programs_mutex);
    p->id = g_next_launch;
    g_next_launch += static_cast<int>(p->launches.size());
    TORCH_CHECK(!g_programs.count(p->name), "kbuild native: ", p->name, " is defined already");
    g_programs.emplace(p->name, std::move(p));
  }
  for (const auto& key : keys) {
    TORCH_CHECK(key == "CUDA" || key == "CPU", "kbuild native: no generic kernel for ", key);
    Quiet quiet;  // (the CPU key's reference is replaced: torch warns of it)
    c10::WarningUtils::WarningHandlerGuard guard(&quiet);
    // Never freed: a Library unregisters its kernels when destroyed.
    auto* lib = new torch::Library(torch::Library::IMPL, ns,
                                   key == "CPU" ? c10::DispatchKey::CPU : c10::DispatchKey::CUDA,
                                   __FILE__, __LINE__);
    lib->impl(name.c_str(),
              torch::CppFunction::makeFromBoxedFunctor(std::make_unique<Boxed>(program)));
  }
  if (!program->checks.empty() && spec.contains("entry"))
    spec["entry"](py::cpp_function(
        [program](const py::tuple& args) { return call(*program, args); }));
}

// ------------------------------------------------------------------------------- autograd
// The autograd of an op declared with a backward op (opdef.py: by the backward's argument
// names), for every device: one boxed kernel on the Autograd key runs the forward below
// autograd, saves what the backward takes and hands the gradients to the backward op; no
// Python per call. Its spec is derived from the declaration (`Op.autograd_program`).
enum BackwardSource : int8_t {
  SAVED_INPUT,   // a forward argument (a tensor, saved)
  SAVED_OUTPUT,  // a forward output (saved)
  GRAD,          // the gradient of a forward output (zeros where it has none)
  NEED,          // whether a forward tensor argument wants a gradient
  SCALAR,        // a forward scalar argument
};

struct AutogradSpec {
  std::string name;            // the forward op's
  std::optional<c10::OperatorHandle> backward;
  int nargs = 0, nouts = 0;
  std::vector<int> inputs;     // forward tensor arguments, in edge order
  std::vector<int> grad_outputs;  // forward outputs whose gradient the backward takes
  std::vector<std::pair<BackwardSource, int>> args;  // the backward op's, in order
  std::vector<int> targets;    // per backward output: the forward argument it is the grad of
};

int edge_of(const AutogradSpec& s, int position) {
  for (size_t e = 0; e < s.inputs.size(); ++e)
    if (s.inputs[e] == position) return static_cast<int>(e);
  return -1;
}

struct GenericBackward final : torch::autograd::Node {
  explicit GenericBackward(const AutogradSpec* spec) : spec(spec) {}
  std::string name() const override { return spec->name + "Backward"; }

  variable_list apply(variable_list&& grads) override {
    torch::jit::Stack stack;
    stack.reserve(spec->args.size());
    for (size_t i = 0; i < spec->args.size(); ++i) {
      auto [source, index] = spec->args[i];
      switch (source) {
        case SAVED_INPUT:
        case SAVED_OUTPUT: {
          Tensor t = saved[i].unpack(getptr());
          if (t.defined()) stack.emplace_back(std::move(t));
          else stack.emplace_back();
          break;
        }
        case GRAD: {
          int j = input_nr[index];
          Tensor g = j >= 0 ? grads[j] : Tensor();
          if (!g.defined()) g = at::zeros_symint(sizes[index], options[index]);
          stack.emplace_back(std::move(g));
          break;
        }
        case NEED: {
          int e = edge_of(*spec, index);
          stack.emplace_back(e >= 0 && task_should_compute_output(static_cast<size_t>(e)));
          break;
        }
        case SCALAR: stack.push_back(scalars[i]); break;
      }
    }
    spec->backward->callBoxed(&stack);
    variable_list out(num_outputs());
    for (size_t k = 0; k < spec->targets.size(); ++k) {
      int e = edge_of(*spec, spec->targets[k]);
      const Tensor& g = stack[k].toTensor();
      // an empty gradient is one not computed (or of an empty input): none, read as zeros
      if (e >= 0 && task_should_compute_output(static_cast<size_t>(e)) && g.sym_numel() != 0)
        out[e] = g;
    }
    return out;
  }

  void release_variables() override {
    for (auto& s : saved) s.reset_data();
  }

  const AutogradSpec* spec;
  std::vector<torch::autograd::SavedVariable> saved;  // by backward argument (SAVED_*)
  std::vector<c10::IValue> scalars;                   // by backward argument (SCALAR)
  std::vector<int> input_nr;                          // by forward output: -1 or its grad's
  // by forward output, for zeros: symbolic under tracing (sizes() would specialise them,
  // a recompile per shape under torch.compile(dynamic=True))
  std::vector<std::vector<c10::SymInt>> sizes;
  std::vector<at::TensorOptions> options;
};

// Nodes are held by std::shared_ptr in older torch, by c10::intrusive_ptr in newer: made as
// this torch holds them.
using NodePtr = decltype(std::declval<torch::autograd::Node&>().getptr());
template <typename T, typename... A>
auto make_node(A&&... a) {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>)
    return std::make_shared<T>(std::forward<A>(a)...);
  else
    return c10::make_intrusive<T>(std::forward<A>(a)...);
}

struct BoxedAutograd final : c10::OperatorKernel {
  explicit BoxedAutograd(const AutogradSpec* spec) : spec(spec) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                  torch::jit::Stack* stack) {
    const AutogradSpec& s = *spec;
    c10::IValue* args = stack->data() + (stack->size() - s.nargs);
    bool wanted = false;
    for (int i : s.inputs)
      if (args[i].isTensor()) {
        const Tensor& t = args[i].toTensor();
        wanted = wanted || t.requires_grad();
        // forward-mode AD (dual tensors, torch.func.jvp): no formula here; its tangents
        // would be dropped silently (zeros), as the generated kernels refuse
        TORCH_CHECK_NOT_IMPLEMENTED(!t._fw_grad(/*level=*/0).defined(),
                                    "Trying to use forward AD with ", s.name,
                                    " that does not support it (kbuild ops have reverse-mode "
                                    "autograd only)");
      }
    wanted = wanted && at::GradMode::is_enabled();
    decltype(make_node<GenericBackward>(spec)) node;
    std::vector<Tensor> inputs;  // the edges' tensors (only for a call that records a node)
    if (wanted) {  // what the backward takes of the arguments, before the call consumes them
      inputs.resize(s.inputs.size());
      for (size_t e = 0; e < s.inputs.size(); ++e)
        if (args[s.inputs[e]].isTensor()) inputs[e] = args[s.inputs[e]].toTensor();
      node = make_node<GenericBackward>(spec);
      node->saved.resize(s.args.size());
      node->scalars.resize(s.args.size());
      for (size_t i = 0; i < s.args.size(); ++i) {
        auto [source, index] = s.args[i];
        if (source == SAVED_INPUT && args[index].isTensor())
          node->saved[i] = torch::autograd::SavedVariable(args[index].toTensor(), false);
        else if (source == SCALAR)
          node->scalars[i] = args[index];
      }
    }
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
    }
    if (!wanted) return;
    c10::IValue* outs = stack->data() + (stack->size() - s.nouts);
    node->set_next_edges(torch::autograd::collect_next_edges(inputs));
    node->input_nr.assign(s.nouts, -1);
    node->sizes.resize(s.nouts);
    node->options.resize(s.nouts);
    int next = 0;
    for (int k : s.grad_outputs) {  // the outputs whose gradient the backward takes
      Tensor& t = outs[k].toTensor();
      node->sizes[k] = t.sym_sizes().vec();
      node->options[k] = t.options();
      if (!at::isFloatingType(t.scalar_type())) continue;
      torch::autograd::set_history(t, node);  // the node's input `next`
      node->input_nr[k] = next++;
    }
    for (size_t i = 0; i < s.args.size(); ++i) {
      auto [source, index] = s.args[i];
      if (source == SAVED_OUTPUT)
        node->saved[i] =
            torch::autograd::SavedVariable(outs[index].toTensor(), node->input_nr[index] >= 0);
    }
  }

  const AutogradSpec* spec;  // never freed
};

void define_autograd(const std::string& ns, const std::string& name, py::dict spec) {
  auto* s = new AutogradSpec();  // never freed: the kernel below points at it
  s->name = ns + "::" + name;
  s->backward = c10::Dispatcher::singleton().findSchemaOrThrow(
      spec["backward"].cast<std::string>().c_str(), "");
  s->nargs = spec["nargs"].cast<int>();
  s->nouts = spec["nouts"].cast<int>();
  s->inputs = spec["inputs"].cast<std::vector<int>>();
  s->grad_outputs = spec["grad_outputs"].cast<std::vector<int>>();
  for (auto a : spec["args"]) {
    auto pair = a.cast<std::pair<int, int>>();
    s->args.emplace_back(static_cast<BackwardSource>(pair.first), pair.second);
  }
  s->targets = spec["targets"].cast<std::vector<int>>();
  auto* lib = new torch::Library(torch::Library::IMPL, ns, c10::DispatchKey::Autograd,
                                 __FILE__, __LINE__);  // never freed: it would unregister
  lib->impl(name.c_str(),
            torch::CppFunction::makeFromBoxedFunctor(std::make_unique<BoxedAutograd>(s)));
}

// Tests: the kernel run on CPU tensors (with the launch hook set), arguments from Python.
py::object run_on(const std::string& name, py::list args) {
  const auto& op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "");
  torch::jit::Stack stack;
  for (auto a : args) {  // the kinds an Op's arguments take
    if (a.is_none()) stack.emplace_back();
    else if (THPVariable_Check(a.ptr())) stack.emplace_back(THPVariable_Unpack(a.ptr()));
    else if (PyBool_Check(a.ptr())) stack.emplace_back(a.cast<bool>());
    else if (PyLong_Check(a.ptr())) stack.emplace_back(a.cast<int64_t>());
    else if (PyFloat_Check(a.ptr())) stack.emplace_back(a.cast<double>());
    else stack.emplace_back(a.cast<at::ScalarType>());
  }
  {
    py::gil_scoped_release release;
    run(program_of(op), &stack);
  }
  py::list outs;
  for (auto& v : stack) outs.append(py::reinterpret_steal<py::object>(THPVariable_Wrap(v.toTensor())));
  return py::tuple(outs);
}

}  // namespace kbuild::generic
