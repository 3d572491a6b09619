// The CPU kernels as one Python module (specdec.kernels.cpu).
#include <torch/extension.h>

torch::Tensor pack(torch::Tensor w, int64_t type);
torch::Tensor matmul(torch::Tensor x, torch::Tensor w, int64_t type, int64_t n);
std::vector<std::string> isas();
std::string set_isa(const std::string& name);
torch::Tensor dequantize(torch::Tensor w, int64_t type, int64_t n, torch::Tensor ids);
torch::Tensor attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor slots,
                        torch::Tensor rows, torch::Tensor lengths, double scale, double softcap);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor silu(torch::Tensor x);
torch::Tensor gelu_tanh(torch::Tensor x);
void define_llama_stack(pybind11::module_& m);

// ATen takes a thread's count of threads from torch's process-wide setting at the thread's
// first parallel call, once per shared library: this module's own first call in a thread
// can undo what torch.set_num_threads set for that thread, if another thread has changed
// the setting since. Make that first call now.
int64_t take_threads() {
  at::internal::lazy_init_num_threads();
  return at::get_num_threads();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "GGUF blocks [N, bytes] -> the kernels' layout, rows in groups of 8 (gguf_cpu.cpp)");
  // The products and attention let go of the interpreter's lock, as torch's own operations do.
  m.def("matmul", &matmul, "x [M, K] float32 @ packed GGUF blocks of N rows ^T -> [M, N] (gguf_cpu.cpp)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("isas", &isas, "the GGUF products' paths in this build, narrowest first (gguf_cpu.cpp)");
  m.def("set_isa", &set_isa, "makes the GGUF products take the path named; -> the one before (gguf_cpu.cpp)");
  m.def("dequantize", &dequantize, "rows of packed GGUF blocks of N rows -> float32 (gguf_cpu.cpp)");
  m.def("attention", &attention, "each new token attending its row's pool slots, in float64 (attention_cpu.cpp)",
        pybind11::arg("q"), pybind11::arg("k_pool"), pybind11::arg("v_pool"), pybind11::arg("slots"),
        pybind11::arg("rows"), pybind11::arg("lengths"), pybind11::arg("scale"), pybind11::arg("softcap") = 0.0,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("take_threads", &take_threads, "fixes this thread's torch.set_num_threads for these kernels; -> the count");
  m.def("rms_norm", &rms_norm, "Llama's RMSNorm, the sum of squares in float64 (norm_cpu.cpp)");
  m.def("silu", &silu, "x / (1 + e^-x), each value's bits wherever it lies (activation_cpu.cpp)");
  m.def("gelu_tanh", &gelu_tanh, "GELU's tanh approximation, each value's bits wherever it lies (activation_cpu.cpp)");
  define_llama_stack(m);
}
