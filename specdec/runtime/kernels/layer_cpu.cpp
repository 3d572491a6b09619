// A Llama-family model's decoder layers on GGUF blocks, a whole pass of them in one call:
// Llama, Mistral and Phi-3 as they are (Phi-3's checkpoint holds q|k|v and gate|up as one
// product each, as this stack takes them), Qwen2's q, k and v biases, Qwen3's norms of each
// q and k head; Gemma 2's and 3's four norms a layer (the attention's and the MLP's outputs normed
// before they are added), GELU-tanh, and local layers that attend within a window through
// a rotary table of their own; Gemma 2's soft-capped attention scores.
//
// Why one call: the engine's pass of the default target ran some 25 small torch operations
// a layer from Python (views, rotary embedding, cache writes, residual adds, the
// activation), which cost about as much as the layer's products; a call a layer then
// still cost each layer its arguments' conversion from Python, its checks of the pass's
// table and its allocations. Here the pass's arguments are checked once, the layers run
// between the kernels' own loops on buffers of the pass, and the interpreter's lock is
// let go for the whole of it (the service's event loop runs meanwhile).
//
// The same operations on each element, in the same order, as the engine's Python pass
// of the same model (specdec/engine/model_runner.py, _llama_forward): the same bits, which
// the tests check. The rotary embedding is x * cos + rotate_half(x) * sin, each product
// rounded before the sum (the build turns off contraction); the activation is our own
// silu or gelu_tanh (activation_cpu.cpp), as the Python pass's act_fn (specdec.ggml.SiLU,
// specdec.ggml.GELUTanh).
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

void matmul_rows(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t groups, int64_t stride,
                 int64_t type, int64_t N, float* y, int64_t ldy);
void check_packed(const torch::Tensor& w, int64_t type, int64_t K, int64_t N);
void attend(const float* q, int64_t T, int64_t H, int64_t d, const float* k_pool, const float* v_pool, int64_t KVH,
            const int64_t* slots, int64_t L, const int64_t* rows, const int64_t* lengths, double scale, double softcap,
            float* out);
void check_table(const torch::Tensor& slots, const torch::Tensor& rows, const torch::Tensor& lengths, int64_t T,
                 int64_t S);
void rms_norm_rows(const float* x, const float* w, int64_t n, int64_t rows, double eps, float* y);
void activate_rows(int64_t activation, const float* x, int64_t rows, int64_t n, int64_t stride, float* y);

namespace {

// x: d values of one head -> out: x * cos + rotate_half(x) * sin.
inline void rotate(const float* x, const float* cos, const float* sin, int64_t d, float* out) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) {
    const float turned = i < half ? -x[i + half] : x[i - half];
    const float a = x[i] * cos[i], b = turned * sin[i];
    out[i] = a + b;
  }
}

inline void add_into(float* h, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) h[i] += y[i];
}

}  // namespace

// A model's decoder layers, held for its passes (the engine builds one at load).
class LlamaStack {
 public:
  LlamaStack(std::vector<torch::Tensor> norms, std::vector<torch::Tensor> weights, std::vector<int64_t> types,
             std::vector<int64_t> sizes, double eps, double scale, std::vector<torch::Tensor> biases,
             std::vector<torch::Tensor> head_norms, int64_t activation, std::vector<int64_t> local, double softcap,
             std::vector<int64_t> parts);
  std::optional<torch::Tensor> forward(torch::Tensor h, torch::Tensor cos, torch::Tensor sin,
                                       std::vector<torch::Tensor> k_pools, std::vector<torch::Tensor> v_pools,
                                       torch::Tensor write_slots, torch::Tensor slots, torch::Tensor rows,
                                       torch::Tensor lengths, torch::Tensor stop,
                                       std::vector<torch::Tensor> local) const;

 private:
  // One block type's rows of a product: its packed blocks, and the product's columns it
  // writes from `column` on.
  struct Part {
    torch::Tensor w;
    int64_t type, rows, column;
  };
  std::vector<std::vector<Part>> products_;  // 4 a layer: q|k|v, o, gate|up, down
  std::vector<torch::Tensor> norms_, biases_, head_norms_;
  std::vector<int64_t> local_;
  double eps_, scale_, softcap_;
  int64_t layers_, hidden_, heads_, kv_heads_, d_, inter_, activation_, norms_per_layer_;
};

// norms: 2 a layer {input, post-attention} weights (Llama's: the attention's input and the
// MLP's), or 4 {input, post-attention, pre-MLP, post-MLP} (Gemma's: the attention's input,
// its output, the MLP's input, its output); weights: the packed blocks of each layer's
// {q|k|v, o, gate|up, down}, with their types; parts: none (4 weights a layer), or 2 a
// layer: how many weights its q|k|v product takes (1, or 3: q, k and v, each in its own
// block type, as llama.cpp's mixes give v more bits than q and k) and its gate|up product
// (1, or 2); sizes: {hidden, heads, kv_heads, head_dim, intermediate}; biases: none, or
// the q|k|v product's bias of each layer; head_norms:
// none, or 2 a layer {q, k}, each [head_dim], taken by every head; activation: 0 silu, 1
// gelu_tanh; local: none, or a flag a layer, set where it attends through the pass's local
// table and rotary embedding (`forward`'s local) instead of its own; softcap: 0, or Gemma
// 2's cap of each attention score (attention_cpu.cpp).
LlamaStack::LlamaStack(std::vector<torch::Tensor> norms, std::vector<torch::Tensor> weights,
                       std::vector<int64_t> types, std::vector<int64_t> sizes, double eps, double scale,
                       std::vector<torch::Tensor> biases, std::vector<torch::Tensor> head_norms,
                       int64_t activation, std::vector<int64_t> local, double softcap,
                       std::vector<int64_t> parts)
    : norms_(std::move(norms)), biases_(std::move(biases)), head_norms_(std::move(head_norms)),
      local_(std::move(local)), eps_(eps), scale_(scale), softcap_(softcap), activation_(activation) {
  TORCH_CHECK(sizes.size() == 5, "sizes: hidden, heads, kv_heads, head_dim, intermediate");
  hidden_ = sizes[0], heads_ = sizes[1], kv_heads_ = sizes[2], d_ = sizes[3], inter_ = sizes[4];
  TORCH_CHECK(types.size() == weights.size(), "a type for each weight");
  if (parts.empty()) parts.assign(weights.size() / 4 * 2, 1);
  layers_ = static_cast<int64_t>(parts.size()) / 2;
  norms_per_layer_ = static_cast<int64_t>(norms_.size()) / std::max<int64_t>(layers_, 1);
  TORCH_CHECK(layers_ > 0 && parts.size() == 2 * layers_ && (norms_per_layer_ == 2 || norms_per_layer_ == 4) &&
                  norms_.size() == norms_per_layer_ * layers_,
              "a layer takes 2 or 4 norms and the parts of its 4 products");
  TORCH_CHECK(activation_ == 0 || activation_ == 1, "activation: 0 silu, 1 gelu_tanh");
  TORCH_CHECK(softcap_ >= 0.0, "softcap must be 0 (none) or positive");
  TORCH_CHECK(local_.empty() || static_cast<int64_t>(local_.size()) == layers_, "no local flags, or one a layer");
  TORCH_CHECK(heads_ % kv_heads_ == 0 && d_ % 2 == 0, "heads must be a multiple of kv_heads, head_dim even");
  const int64_t qkv = (heads_ + 2 * kv_heads_) * d_;
  const int64_t in[4] = {hidden_, heads_ * d_, hidden_, inter_}, out[4] = {qkv, hidden_, 2 * inter_, hidden_};
  // Each part's rows: the whole product's, or q's, k's and v's; gate's and up's.
  const std::vector<int64_t> q_k_v = {heads_ * d_, kv_heads_ * d_, kv_heads_ * d_}, gate_up = {inter_, inter_};
  size_t next = 0;
  for (int64_t l = 0; l < layers_; ++l) {
    TORCH_CHECK((parts[2 * l] == 1 || parts[2 * l] == 3) && (parts[2 * l + 1] == 1 || parts[2 * l + 1] == 2),
                "q|k|v takes 1 or 3 weights, gate|up 1 or 2");
    const int64_t counts[4] = {parts[2 * l], 1, parts[2 * l + 1], 1};
    for (int i = 0; i < 4; ++i) {
      TORCH_CHECK(next + counts[i] <= weights.size(), "fewer weights than the parts name");
      std::vector<Part> product;
      for (int64_t j = 0, column = 0; j < counts[i]; ++j) {
        const int64_t rows = counts[i] == 1 ? out[i] : (i == 0 ? q_k_v : gate_up)[j];
        check_packed(weights[next], types[next], in[i], rows);
        product.push_back({weights[next], types[next], rows, column});
        column += rows, ++next;
      }
      products_.push_back(std::move(product));
    }
    for (int64_t i = 0; i < norms_per_layer_; ++i) {
      torch::Tensor& n = norms_[norms_per_layer_ * l + i];
      TORCH_CHECK(n.scalar_type() == torch::kFloat32 && n.numel() == hidden_, "a norm's weight is [hidden] float32");
      n = n.contiguous();
    }
  }
  TORCH_CHECK(next == weights.size(), "more weights than the parts name");
  TORCH_CHECK(biases_.empty() || static_cast<int64_t>(biases_.size()) == layers_, "no biases, or one a layer");
  for (torch::Tensor& b : biases_) {
    TORCH_CHECK(b.scalar_type() == torch::kFloat32 && b.numel() == qkv, "a bias is [q|k|v columns] float32");
    b = b.contiguous();
  }
  TORCH_CHECK(head_norms_.empty() || static_cast<int64_t>(head_norms_.size()) == 2 * layers_,
              "no head norms, or 2 a layer");
  for (torch::Tensor& n : head_norms_) {
    TORCH_CHECK(n.scalar_type() == torch::kFloat32 && n.numel() == d_, "a head norm's weight is [head_dim] float32");
    n = n.contiguous();
  }
}

// h: [T, hidden] float32, the pass's packed tokens; cos, sin: [T, head_dim]; k_pools,
// v_pools: a layer's [slots, kv_heads, head_dim] float32 each, written at write_slots
// [T]; slots [B, L], rows [T], lengths [T]: what each token attends (attention_cpu.cpp);
// stop: [1] uint8, set (by another thread) when nobody reads the pass any more; local:
// none, or {cos, sin, slots, rows, lengths} for the layers flagged local, as those.
// -> the last layer's h, or None where stop was found set before a layer (the layers
// after it have written nothing).
std::optional<torch::Tensor> LlamaStack::forward(torch::Tensor h, torch::Tensor cos, torch::Tensor sin,
                                                 std::vector<torch::Tensor> k_pools,
                                                 std::vector<torch::Tensor> v_pools, torch::Tensor write_slots,
                                                 torch::Tensor slots, torch::Tensor rows, torch::Tensor lengths,
                                                 torch::Tensor stop, std::vector<torch::Tensor> local) const {
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == torch::kFloat32 && h.size(1) == hidden_,
              "h must be [T, hidden] float32");
  const int64_t T = h.size(0), d = d_, q_cols = heads_ * d, kv_cols = kv_heads_ * d, qkv_cols = q_cols + 2 * kv_cols;
  TORCH_CHECK(static_cast<int64_t>(k_pools.size()) == layers_ && v_pools.size() == k_pools.size(),
              "one k and one v pool a layer");
  const int64_t pool_slots = k_pools[0].size(0);
  for (int64_t l = 0; l < layers_; ++l)
    for (const torch::Tensor* pool : {&k_pools[l], &v_pools[l]})
      TORCH_CHECK(pool->scalar_type() == torch::kFloat32 && pool->is_contiguous() && pool->dim() == 3 &&
                      pool->size(0) == pool_slots && pool->size(1) == kv_heads_ && pool->size(2) == d,
                  "the pools must be contiguous [slots, kv_heads, head_dim] float32");
  TORCH_CHECK(stop.scalar_type() == torch::kUInt8 && stop.numel() == 1, "stop must be [1] uint8");
  write_slots = write_slots.to(torch::kLong).contiguous();
  TORCH_CHECK(write_slots.numel() == T, "one write slot per token");
  const int64_t* wp = write_slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(wp[t] >= 0 && wp[t] < pool_slots, "write slot ", wp[t], " out of the pool");

  // What a layer's tokens turn by and attend: the pass's own, and its local layers'.
  struct Attending {
    torch::Tensor cos, sin, slots, rows, lengths;
  };
  auto attending = [&](torch::Tensor c, torch::Tensor s, torch::Tensor sl, torch::Tensor r, torch::Tensor len) {
    TORCH_CHECK(c.sizes() == s.sizes() && c.dim() == 2 && c.size(0) == T && c.size(1) == d &&
                    c.scalar_type() == torch::kFloat32 && s.scalar_type() == torch::kFloat32,
                "cos and sin must be [T, head_dim] float32");
    Attending a{c.contiguous(), s.contiguous(), sl.to(torch::kLong).contiguous(), r.to(torch::kLong).contiguous(),
                len.to(torch::kLong).contiguous()};
    check_table(a.slots, a.rows, a.lengths, T, pool_slots);
    return a;
  };
  const Attending own = attending(cos, sin, slots, rows, lengths);
  TORCH_CHECK(local.empty() || local.size() == 5, "local: none, or cos, sin, slots, rows, lengths");
  TORCH_CHECK(local.empty() || !local_.empty(), "local tables for a stack without local layers");
  const Attending windowed = local.empty() ? own : attending(local[0], local[1], local[2], local[3], local[4]);

  h = h.contiguous().clone();  // the residual stream, added to in place
  const auto options = h.options();
  torch::Tensor x = torch::empty({T, hidden_}, options), y = torch::empty({T, hidden_}, options);
  torch::Tensor qkv = torch::empty({T, qkv_cols}, options), q = torch::empty({T, q_cols}, options);
  torch::Tensor o = torch::empty({T, q_cols}, options), gate_up = torch::empty({T, 2 * inter_}, options);
  torch::Tensor act = torch::empty({T, inter_}, options);
  float *hp = h.data_ptr<float>(), *xp = x.data_ptr<float>(), *yp = y.data_ptr<float>();
  float *qkvp = qkv.data_ptr<float>(), *qp = q.data_ptr<float>(), *op = o.data_ptr<float>();
  float *gup = gate_up.data_ptr<float>(), *actp = act.data_ptr<float>();
  const uint8_t* stopped = stop.data_ptr<uint8_t>();
  const bool sandwich = norms_per_layer_ == 4;
  // Each part writes its own columns of the product's N.
  auto product = [&](int64_t l, int i, const float* in, int64_t M, int64_t K, int64_t N, float* out) {
    for (const Part& p : products_[4 * l + i])
      matmul_rows(in, M, K, p.w.data_ptr<uint8_t>(), p.w.size(0), p.w.size(1), p.type, p.rows, out + p.column, N);
  };
  auto norm = [&](int64_t l, int i, const float* in, float* out) {
    rms_norm_rows(in, norms_[norms_per_layer_ * l + i].data_ptr<float>(), hidden_, T, eps_, out);
  };
  // A sublayer's output y into the residual stream: normed first where the layer norms it.
  auto add_output = [&](int64_t l, int i) {
    if (sandwich) norm(l, i, yp, xp);
    add_into(hp, sandwich ? xp : yp, T * hidden_);
  };

  for (int64_t l = 0; l < layers_; ++l) {
    if (__atomic_load_n(stopped, __ATOMIC_ACQUIRE)) return std::nullopt;  // before this layer writes
    float* kp = k_pools[l].data_ptr<float>();
    float* vp = v_pools[l].data_ptr<float>();
    const Attending& a = !local_.empty() && local_[l] ? windowed : own;
    const float *cp = a.cos.data_ptr<float>(), *sp = a.sin.data_ptr<float>();

    // Attention: q, k and v in one product (of one or three block types); q and k turned;
    // k and v into the pool.
    norm(l, 0, hp, xp);
    product(l, 0, xp, T, hidden_, qkv_cols, qkvp);
    if (!biases_.empty()) {
      const float* b = biases_[l].data_ptr<float>();
      for (int64_t t = 0; t < T; ++t) add_into(qkvp + t * qkv_cols, b, qkv_cols);
    }
    if (!head_norms_.empty()) {  // in place: the norm reads each value before it writes it
      const float *qn = head_norms_[2 * l].data_ptr<float>(), *kn = head_norms_[2 * l + 1].data_ptr<float>();
      for (int64_t t = 0; t < T; ++t) {
        float* row = qkvp + t * qkv_cols;
        rms_norm_rows(row, qn, d, heads_, eps_, row);
        rms_norm_rows(row + q_cols, kn, d, kv_heads_, eps_, row + q_cols);
      }
    }
    for (int64_t t = 0; t < T; ++t) {
      const float* row = qkvp + t * qkv_cols;
      const float *c = cp + t * d, *s = sp + t * d;
      for (int64_t i = 0; i < heads_; ++i) rotate(row + i * d, c, s, d, qp + (t * heads_ + i) * d);
      for (int64_t i = 0; i < kv_heads_; ++i) rotate(row + q_cols + i * d, c, s, d, kp + (wp[t] * kv_heads_ + i) * d);
      std::memcpy(vp + wp[t] * kv_cols, row + q_cols + kv_cols, kv_cols * sizeof(float));
    }
    attend(qp, T, heads_, d, kp, vp, kv_heads_, a.slots.data_ptr<int64_t>(), a.slots.size(1),
           a.rows.data_ptr<int64_t>(), a.lengths.data_ptr<int64_t>(), scale_, softcap_, op);
    product(l, 1, op, T, q_cols, hidden_, yp);
    add_output(l, 1);

    // The MLP: gate and up in one product (of one or two block types).
    norm(l, sandwich ? 2 : 1, hp, xp);
    product(l, 2, xp, T, hidden_, 2 * inter_, gup);
    activate_rows(activation_, gup, T, inter_, 2 * inter_, actp);  // the gate's half of each row
    for (int64_t t = 0; t < T; ++t) {
      float* act_row = actp + t * inter_;
      const float* up = gup + t * 2 * inter_ + inter_;
      for (int64_t i = 0; i < inter_; ++i) act_row[i] *= up[i];
    }
    product(l, 3, actp, T, inter_, hidden_, yp);
    add_output(l, 3);
  }
  return h;
}

void define_llama_stack(pybind11::module_& m) {
  pybind11::class_<LlamaStack>(m, "LlamaStack", "a Llama-family model's decoder layers on GGUF blocks (layer_cpu.cpp)")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<int64_t>,
                          std::vector<int64_t>, double, double, std::vector<torch::Tensor>,
                          std::vector<torch::Tensor>, int64_t, std::vector<int64_t>, double,
                          std::vector<int64_t>>(),
           pybind11::arg("norms"), pybind11::arg("weights"), pybind11::arg("types"), pybind11::arg("sizes"),
           pybind11::arg("eps"), pybind11::arg("scale"), pybind11::arg("biases") = std::vector<torch::Tensor>(),
           pybind11::arg("head_norms") = std::vector<torch::Tensor>(), pybind11::arg("activation") = 0,
           pybind11::arg("local") = std::vector<int64_t>(), pybind11::arg("softcap") = 0.0,
           pybind11::arg("parts") = std::vector<int64_t>())
      .def("forward", &LlamaStack::forward, "a pass through every layer; None where stop was set",
           pybind11::arg("h"), pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("k_pools"),
           pybind11::arg("v_pools"), pybind11::arg("write_slots"), pybind11::arg("slots"), pybind11::arg("rows"),
           pybind11::arg("lengths"), pybind11::arg("stop"), pybind11::arg("local") = std::vector<torch::Tensor>(),
           pybind11::call_guard<pybind11::gil_scoped_release>());
}
