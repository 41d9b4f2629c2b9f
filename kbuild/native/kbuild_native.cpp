// kbuild's hot path in C++: the CUDA and Autograd kernels of the kbuild::* operators.
//
// The operators' schemas, CPU kernels (the torch reference) and fake kernels are defined in
// Python, each operator declared once (kbuild.Op: kbuild/op/opdef.py, custom_ops.py). This library adds, for CUDA tensors, the launches of the
// cached kernels by handle, and for every device the autograd formulas, so an eager training
// step calls the kernels without entering Python after the first call per shape:
//
//   kbuild.rmsnorm (Python: argument checks) -> native.rmsnorm_fwd (pybind) -> dispatcher
//     -> Autograd kernel (RMSNormFunction below) -> CUDA kernel (rmsnorm_fwd_cuda) -> driver
//   loss.backward() -> engine -> RMSNormFunction::backward -> kbuild::rmsnorm_bwd -> driver
//
// Also here: kbuild::bias_grad's CUDA kernel (llm.c's bias gradient, two launches) and an
// eager LinearFunction for kbuild.linear (torch's matmuls, kbuild's bias gradient), applied
// by the `linear` entry; their schemas, CPU kernels and fakes are in kbuild/kernels/llmc/op.py.
//
// Kernels are found by a key: the kernel, the device and the kernel table's parameter values
// (kbuild/registry.py), each set by its parameter's name (launch.h Value). On a miss the
// Python resolver (kbuild/kernels/resolve.py) is given the values set, by name; it makes the spec
// (the table's defaults for the rest), loads the binary through kbuild's memory and disk tiers
// and returns the kernel's launch record, read here by field name: driver function handle,
// block, shared memory, grid shape and argument slots in the table's order. A call's values
// are decided here, as the Python launch functions decide theirs (a CPU test holds the two
// paths to identical specs); the spec they make and its launch shape in Python, once per key.
//
// One translation unit in parts, included below in order: launch.h (slots, keys, the driver,
// records and launch shapes), norms.h (the norms' CUDA kernels and autograd), entries.h (the
// norms' public entries), llmc.h (kbuild::bias_grad and kbuild.linear), generic.h (the one
// CUDA kernel of every op declared with kbuild.Op whose launches bind by name: a program per
// op, registered at its declaration; no C++ per op).
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
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace py = pybind11;
using at::Tensor;
using std::optional;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The parts, in dependency order (one translation unit: one build, one library).
#include "launch.h"
#include "norms.h"
#include "entries.h"
#include "llmc.h"
#include "generic.h"


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
  // Forget every record (the memory tier forgot its kernels). A thread may be launching from
  // a record it looked up just before: the records are moved aside, never freed (the nodes
  // keep their addresses), so its reference stays good. Clears are rare (jit.forget).
  m.def("clear_records", [] {
    static auto& retired = *new std::vector<decltype(g_records)>();
    static auto& retired_generic = *new std::vector<decltype(generic::g_generic_records)>();
    std::lock_guard<std::mutex> lock(g_mutex);
    retired.push_back(std::move(g_records));
    retired_generic.push_back(std::move(generic::g_generic_records));
    g_records.clear();  // moved-from: valid, emptied to be sure
    generic::g_generic_records.clear();
  });
  // Ops declared with kbuild.Op (generic.h): their programs and CUDA kernel; a test entry.
  m.def("define_generic", &generic::define);
  m.def("define_generic_autograd", &generic::define_autograd);
  m.def("run_generic", &generic::run_on);
  m.def("generic_record_count", [] {
    std::lock_guard<std::mutex> lock(g_mutex);
    return generic::g_generic_records.size();
  });
  m.def("record_count", [] {
    std::lock_guard<std::mutex> lock(g_mutex);
    return g_records.size();
  });
  m.attr("slot_names") = py::cast(std::vector<std::string>(kSlotNames, kSlotNames + NUM_SLOTS));
  m.attr("kernel_names") =
      py::cast(std::vector<std::string>(kKernelNames, kKernelNames + NUM_KERNELS));
  // The parameters a key's values are named by, and their kinds (the kernel table's).
  std::vector<std::string> value_names, value_kinds;
  for (const ValueInfo& v : kValues) {
    value_names.push_back(v.name);
    value_kinds.push_back(kValueKindNames[static_cast<int>(v.kind)]);
  }
  m.attr("value_names") = py::cast(value_names);
  m.attr("value_kinds") = py::cast(value_kinds);
}
