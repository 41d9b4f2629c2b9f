// The norms: CUDA kernels of the kbuild::* norm operators and their autograd.
// Part of kbuild_native.cpp's one translation unit (included there, in order).
#pragma once

namespace kbuild {

// ------------------------------------------------------------------------ the CUDA kernels
// The stride of a strided x's row groups, in bytes, for the alignment of its vector loads.
uint64_t group_bytes(const Tensor& x, const uint64_t* s) {
  return s[X_STRIDE] * static_cast<uint64_t>(x.element_size());
}

std::tuple<Tensor, Tensor> rmsnorm_fwd_cuda(const Tensor& x_, const optional<Tensor>& w_,
                                            double eps, bool store_rstd, double offset) {
  uint64_t s[NUM_SLOTS] = {};
  Tensor x;
  bool strided = readable_rows(x_, x, s);  // a (B, T, H, D) view of a fused qkv: no copy
  auto [M, N] = rows_of(x);
  check_param("weight", w_, x, N);
  Tensor w = optional_param(w_);
  c10::OptionalDeviceGuard guard(cuda_device(x));
  Tensor y = at::empty(x.sizes(), x.options());  // dense (and cheaper than empty_like)
  Tensor rstd = stats(M, x, store_rstd);
  if (M == 0 || N == 0) return {y, rstd.fill_(NAN)};
  s[X] = ptr(x), s[Y] = ptr(y), s[WEIGHT] = w.defined() ? ptr(w) : 0;
  s[RSTD] = store_rstd ? ptr(rstd) : 0;
  Key key(RMSNORM_FWD, x);
  key.set<Value::N>(N).set<Value::DTYPE>(dtype_code(x.scalar_type()));
  key.set<Value::WEIGHT_DTYPE>(dtype_of(w)).set<Value::STORE_RSTD>(store_rstd);
  key.set<Value::EPS>(eps).set<Value::OFFSET>(weight_offset(w, offset));
  key.set<Value::VECTORIZE>(aligned(s[X] | s[Y] | s[WEIGHT] | group_bytes(x, s)));
  if (strided) key.set<Value::STRIDED>(true);  // else unset (False), as the Python path has it
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
  Key key(FUSED_ADD_RMSNORM_FWD, x);
  key.set<Value::N>(N).set<Value::DTYPE>(dtype_code(x.scalar_type()));
  key.set<Value::WEIGHT_DTYPE>(dtype_of(w));
  key.set<Value::RESIDUAL_DTYPE>(dtype_code(residual_dtype));
  key.set<Value::STORE_RSTD>(store_rstd).set<Value::EPS>(eps);
  key.set<Value::VECTORIZE>(aligned(s[X] | s[RESIDUAL] | s[WEIGHT] | s[Y] | s[RESIDUAL_OUT]));
  key.set<Value::OFFSET>(weight_offset(w, offset));
  key.set<Value::RESIDUAL_IN_DTYPE>(res32 ? dtype_code(residual.scalar_type()) : Dtype::NONE);
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
  Key key(LAYERNORM_FWD, x);
  key.set<Value::N>(N).set<Value::DTYPE>(dtype_code(x.scalar_type()));
  key.set<Value::WEIGHT_DTYPE>(dtype_of(w)).set<Value::BIAS_DTYPE>(dtype_of(b));
  key.set<Value::STORE_STATS>(store_stats).set<Value::EPS>(eps);
  key.set<Value::VECTORIZE>(aligned(s[X] | s[WEIGHT] | s[BIAS] | s[Y]));
  launch_rows(key, x, M, s);
  return {y, mean, rstd};
}

void check_rows(const char* op, const Tensor& stats_, int64_t M, const char* flag) {
  TORCH_CHECK_VALUE(stats_.numel() == M, "kbuild::", op, ": the saved statistics hold ",
                    stats_.numel(), " rows, not ", M,
                    "; the forward must run with ", flag, "=True for a backward");
}

std::tuple<Tensor, Tensor> rmsnorm_bwd_cuda(const Tensor& dy_, const Tensor& x_,
                                            const optional<Tensor>& w_, const Tensor& rstd,
                                            bool need_dx, bool need_dw, double offset) {
  Tensor dy = dy_.contiguous();
  auto [M, N] = rows_of(dy);
  check_rows("rmsnorm_bwd", rstd, M, "store_rstd");
  uint64_t s[NUM_SLOTS] = {};
  Tensor x;
  bool strided = readable_rows(x_, x, s);  // as the forward read it (and saved it)
  Tensor w = optional_param(w_);
  bool compute_dw = need_dw && w.defined();
  c10::OptionalDeviceGuard guard(cuda_device(dy));
  Tensor dx = at::empty(dy.sizes(), dy.options());
  s[X] = ptr(x), s[WEIGHT] = w.defined() ? ptr(w) : 0, s[DY] = ptr(dy), s[RSTD] = ptr(rstd);
  s[DX] = ptr(dx);
  Key key(RMSNORM_BWD, dy);
  key.set<Value::N>(N).set<Value::DTYPE>(dtype_code(x.scalar_type()));
  key.set<Value::WEIGHT_DTYPE>(dtype_of(w)).set<Value::COMPUTE_DW>(compute_dw);
  key.set<Value::VECTORIZE>(
      aligned(s[X] | s[WEIGHT] | s[DY] | s[RSTD] | s[DX] | group_bytes(x, s)));
  key.set<Value::OFFSET>(weight_offset(w, offset));
  if (strided) key.set<Value::STRIDED>(true);  // as in the forward
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
  Key key(FUSED_ADD_RMSNORM_BWD, dy);
  key.set<Value::N>(N).set<Value::DTYPE>(dtype_code(dy.scalar_type()));
  key.set<Value::WEIGHT_DTYPE>(dtype_of(w));
  key.set<Value::RESIDUAL_DTYPE>(dtype_code(residual_out.scalar_type()));
  key.set<Value::HAS_DRESIDUAL_OUT>(dres.defined()).set<Value::COMPUTE_DW>(compute_dw);
  key.set<Value::VECTORIZE>(
      aligned(s[X] | s[WEIGHT] | s[DY] | s[RSTD] | s[DRESIDUAL_OUT] | s[DX] | s[DRESIDUAL]));
  key.set<Value::OFFSET>(weight_offset(w, offset));
  key.set<Value::DRESIDUAL_DTYPE>(res32 ? dtype_code(*residual_dtype) : Dtype::NONE);
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
  Key key(LAYERNORM_BWD, dy);
  key.set<Value::N>(N).set<Value::DTYPE>(dtype_code(x.scalar_type()));
  key.set<Value::WEIGHT_DTYPE>(dtype_of(w)).set<Value::COMPUTE_DW>(compute_dw);
  key.set<Value::COMPUTE_DB>(compute_db);
  key.set<Value::VECTORIZE>(aligned(s[X] | s[WEIGHT] | s[DY] | s[MEAN] | s[RSTD] | s[DX]));
  auto grads = launch_persistent(key, dy, N ? M : 0, N, s,
                                 {compute_dw ? w : Tensor(), compute_db ? b : Tensor()});
  auto none = [&] { return at::empty({0}, x.options()); };
  return {need_dx ? dx : none(), grads[0].defined() ? grads[0] : none(),
          grads[1].defined() ? grads[1] : none()};
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

// The statistics (rstd, mean) a forward op returns are not outputs of its autograd Function:
// a saved output is rebuilt as a new Variable at each unpack in the backward, and each output
// carries autograd metadata, together a few microseconds per call that torch's own norms do
// not pay (H200: LayerNorm forward + backward 1.03-1.09x torch's with them). The autograd
// kernel passes the Function's forward a place for them (`Stats*`, a non-tensor argument:
// its gradient slot in the backward is undefined), filled before apply returns.
using Stats = std::array<Tensor, 2>;

struct RMSNormFunction : torch::autograd::Function<RMSNormFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const optional<Tensor>& w,
                               double eps, bool store_rstd, double offset, Stats* stats) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fwd = op<RmsFwd>("kbuild::rmsnorm_fwd");
    auto [y, rstd] = fwd.call(x, w, eps, store_rstd, offset);
    ctx->save_for_backward({x, w.value_or(Tensor()), rstd});
    ctx->saved_data["offset"] = offset;
    // No zeros made for an unused y's gradient (an allocation and a fill kernel).
    ctx->set_materialize_grads(false);
    (*stats)[0] = rstd;
    return {y};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return variable_list(6);  // y unused: no gradient flows
    auto saved = ctx->get_saved_variables();
    bool need_dx = ctx->needs_input_grad(0);
    bool need_dw = saved[1].defined() && ctx->needs_input_grad(1);  // edges: x, [weight]
    double offset = ctx->saved_data["offset"].toDouble();
    BelowAutograd below;
    static auto bwd = op<RmsBwd>("kbuild::rmsnorm_bwd");
    auto [dx, dw] =
        bwd.call(grads[0], saved[0], maybe(saved[1]), saved[2], need_dx, need_dw, offset);
    return {need_dx ? dx : Tensor(), need_dw ? dw : Tensor(), Tensor(), Tensor(), Tensor(),
            Tensor()};
  }
};

std::tuple<Tensor, Tensor> rmsnorm_fwd_autograd(const Tensor& x, const optional<Tensor>& w,
                                                double eps, bool store_rstd, double offset) {
  if (!wants_grad({&x, w.has_value() ? &*w : &x})) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fwd = op<RmsFwd>("kbuild::rmsnorm_fwd");
    return fwd.call(x, w, eps, store_rstd, offset);
  }
  Stats stats;
  auto out = RMSNormFunction::apply(x, w, eps, store_rstd, offset, &stats);
  return {out[0], stats[0]};
}

struct FusedAddRMSNormFunction : torch::autograd::Function<FusedAddRMSNormFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& residual,
                               const optional<Tensor>& w, double eps,
                               at::ScalarType residual_dtype, bool store_rstd, double offset,
                               Stats* stats) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fwd = op<FusedFwd>("kbuild::fused_add_rmsnorm_fwd");
    auto [y, residual_out, rstd] =
        fwd.call(x, residual, w, eps, residual_dtype, store_rstd, offset);
    ctx->save_for_backward({residual_out, w.value_or(Tensor()), rstd});
    ctx->saved_data["offset"] = offset;
    ctx->set_materialize_grads(false);  // an unused residual_out has no gradient to add
    ctx->saved_data["out_dtype"] = static_cast<int64_t>(y.scalar_type());
    // An fp32 residual stream: its gradient is written in fp32 (not rounded to x's dtype).
    ctx->saved_data["res32"] = residual.scalar_type() != x.scalar_type();
    (*stats)[0] = rstd;
    return {y, residual_out};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined() && !grads[1].defined()) return variable_list(8);
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
            Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
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
  Stats stats;
  auto out = FusedAddRMSNormFunction::apply(x, residual, w, eps, residual_dtype, store_rstd,
                                            offset, &stats);
  return {out[0], out[1], stats[0]};
}

struct LayerNormFunction : torch::autograd::Function<LayerNormFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const optional<Tensor>& w,
                               const optional<Tensor>& b, double eps, bool store_stats,
                               Stats* stats) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto fwd = op<LnFwd>("kbuild::layernorm_fwd");
    auto [y, mean, rstd] = fwd.call(x, w, b, eps, store_stats);
    ctx->save_for_backward({x, w.value_or(Tensor()), b.value_or(Tensor()), mean, rstd});
    ctx->set_materialize_grads(false);  // as in RMSNormFunction
    *stats = {mean, rstd};
    return {y};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return variable_list(6);
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
            Tensor(), Tensor(), Tensor()};
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
  Stats stats;
  auto out = LayerNormFunction::apply(x, w, b, eps, store_stats, &stats);
  return {out[0], stats[0], stats[1]};
}

}  // namespace kbuild
