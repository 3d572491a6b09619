// The CPU kernels as one Python module (specdec.kernels.cpu).
#include <torch/extension.h>

torch::Tensor matmul(torch::Tensor x, torch::Tensor w, int64_t type);
torch::Tensor dequantize(torch::Tensor w, int64_t type, torch::Tensor ids);
torch::Tensor attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor slots,
                        torch::Tensor rows, torch::Tensor lengths, double scale);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("matmul", &matmul, "x [M, K] float32 @ GGUF blocks [N, K]^T -> [M, N] (gguf_cpu.cpp)");
  m.def("dequantize", &dequantize, "rows of GGUF blocks -> float32 (gguf_cpu.cpp)");
  m.def("attention", &attention, "each new token attending its row's pool slots, in float64 (attention_cpu.cpp)");
  m.def("rms_norm", &rms_norm, "Llama's RMSNorm, the sum of squares in float64 (norm_cpu.cpp)");
}
