// One Llama decoder layer of a model on GGUF blocks, in one call: the engine's pass of the
// default target ran some 25 small torch operations a layer from Python (views, rotary
// embedding, cache writes, residual adds, the activation), and they cost about as much
// as the layer's products. Here they are plain loops between the kernels' own calls.
//
// The same operations on each element, in the same order, as the engine's Python pass
// of the same model (specdec/engine/model_runner.py, _llama_forward): the same bits, which
// the tests check. The rotary embedding is x * cos + rotate_half(x) * sin, each product
// rounded before the sum (the build turns off contraction); the activation is torch's
// own silu.
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <vector>

torch::Tensor matmul(torch::Tensor x, torch::Tensor w, int64_t type, int64_t n);
torch::Tensor attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor slots,
                        torch::Tensor rows, torch::Tensor lengths, double scale);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);

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

}  // namespace

// h: [T, hidden] float32, the pass's packed tokens; cos, sin: [T, head_dim];
// norms: {input, post-attention} weights; weights: the packed blocks of {q|k|v, o,
// gate|up, down}, with their types; sizes: {heads, kv_heads, head_dim, intermediate};
// k_pool, v_pool: [slots, kv_heads, head_dim] float32, written at write_slots [T];
// slots, rows, lengths, scale: as `attention` takes them. -> the layer's output h.
torch::Tensor llama_layer(torch::Tensor h, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> norms,
                          double eps, std::vector<torch::Tensor> weights, std::vector<int64_t> types,
                          std::vector<int64_t> sizes, torch::Tensor k_pool, torch::Tensor v_pool,
                          torch::Tensor write_slots, torch::Tensor slots, torch::Tensor rows, torch::Tensor lengths,
                          double scale) {
  TORCH_CHECK(norms.size() == 2 && weights.size() == 4 && types.size() == 4 && sizes.size() == 4,
              "a layer takes 2 norms, 4 weights and their types, and 4 sizes");
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == torch::kFloat32, "h must be [T, hidden] float32");
  const int64_t T = h.size(0), hidden = h.size(1);
  const int64_t heads = sizes[0], kv_heads = sizes[1], d = sizes[2], inter = sizes[3];
  const int64_t q_cols = heads * d, kv_cols = kv_heads * d, qkv_cols = q_cols + 2 * kv_cols;
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == T && cos.size(1) == d,
              "cos and sin must be [T, head_dim]");
  TORCH_CHECK(k_pool.scalar_type() == torch::kFloat32 && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  k_pool.dim() == 3 && k_pool.size(1) == kv_heads && k_pool.size(2) == d &&
                  k_pool.sizes() == v_pool.sizes(),
              "the pools must be contiguous [slots, kv_heads, head_dim] float32");
  write_slots = write_slots.to(torch::kLong).contiguous();
  TORCH_CHECK(write_slots.numel() == T, "one write slot per token");
  cos = cos.contiguous();
  sin = sin.contiguous();

  // Attention: q, k and v in one product; q and k turned; k and v into the pool.
  const torch::Tensor qkv = matmul(rms_norm(h, norms[0], eps), weights[0], types[0], qkv_cols);
  torch::Tensor q = torch::empty({T, heads, d}, h.options());
  const float* src = qkv.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kp = k_pool.data_ptr<float>();
  float* vp = v_pool.data_ptr<float>();
  const int64_t* wp = write_slots.data_ptr<int64_t>();
  const int64_t pool_slots = k_pool.size(0);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(wp[t] >= 0 && wp[t] < pool_slots, "write slot ", wp[t], " out of the pool");
    const float* row = src + t * qkv_cols;
    const float* c = cos.data_ptr<float>() + t * d;
    const float* s = sin.data_ptr<float>() + t * d;
    for (int64_t i = 0; i < heads; ++i) rotate(row + i * d, c, s, d, qp + (t * heads + i) * d);
    for (int64_t i = 0; i < kv_heads; ++i) rotate(row + q_cols + i * d, c, s, d, kp + (wp[t] * kv_heads + i) * d);
    std::memcpy(vp + wp[t] * kv_cols, row + q_cols + kv_cols, kv_cols * sizeof(float));
  }
  const torch::Tensor o = attention(q, k_pool, v_pool, slots, rows, lengths, scale).reshape({T, q_cols});
  h = h + matmul(o, weights[1], types[1], hidden);

  // The MLP: gate and up in one product.
  const torch::Tensor gate_up = matmul(rms_norm(h, norms[1], eps), weights[2], types[2], 2 * inter);
  const torch::Tensor act = torch::silu(gate_up.narrow(1, 0, inter)) * gate_up.narrow(1, inter, inter);
  return h + matmul(act, weights[3], types[3], hidden);
}
