// The public entries of the norms: the common case whole, everything else declined.
// Part of kbuild_native.cpp's one translation unit (included there, in order).
#pragma once

namespace kbuild {

// ------------------------------------------------------------------------- public entries
// kbuild.rmsnorm & co. hand their arguments here first. The common case (exact torch.Tensor or
// Parameter CUDA tensors of a kernel dtype, parameters of the right shape, dtype and device, a
// finite float eps >= 0, bool flags) runs whole: the forward op through the dispatcher, with
// statistics stored when a gradient will be needed. Anything else returns None and the
// caller's Python path takes it: CPU tensors, tensor subclasses, and every bad argument, so the
// error messages are written once, in Python (kbuild/op/tensors.py).

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
  // Contiguous, or a strided view read in place (a copy otherwise): what autograd saves.
  uint64_t unused[NUM_SLOTS];
  Tensor rows;
  readable_rows(*x, rows, unused);
  static auto fwd = op<RmsFwd>("kbuild::rmsnorm_fwd");
  return wrap(std::get<0>(fwd.call(rows, w, eps, needs_grad(*x, {&w}), offset)));
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

}  // namespace kbuild
