// llm.c's layers: kbuild::bias_grad's CUDA kernel and kbuild.linear's autograd and entry.
// Part of kbuild_native.cpp's one translation unit (included there, in order).
#pragma once

namespace kbuild {

// The first pass's row chunks (kbuild/kernels/llmc/launch.py bias_chunks, the same formula): about
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
  Key key(BIAS_GRAD, dout);
  key.set<Value::OC>(OC).set<Value::DTYPE>(dtype_code(dout.scalar_type()));
  key.set<Value::VECTORIZE>(aligned(s[DOUT]));
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
