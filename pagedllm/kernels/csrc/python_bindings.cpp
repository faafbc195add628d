// ops.h's entry points as a Python module (cpu_ops.py calls them), each releasing the GIL while it
// runs, as torch.ops does: the server's HTTP thread goes on while a step computes.
// (torch's pybind11 casters alone: torch/extension.h, the whole C++ frontend, took ~26 s to compile)
#include <torch/csrc/utils/pybind.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using Release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("paged_attention", &pagedllm_ops::paged_attention, Release());
  m.def("add_rms_norm", &pagedllm_ops::add_rms_norm, Release());
  m.def("rms_norm_heads_", &pagedllm_ops::rms_norm_heads_, Release());
  m.def("rotary_write_kv", &pagedllm_ops::rotary_write_kv, Release());
  m.def("silu_and_mul", &pagedllm_ops::silu_and_mul, Release());
  m.def("gelu_tanh_and_mul", &pagedllm_ops::gelu_tanh_and_mul, Release());
  m.def("few_rows_linear", &pagedllm_ops::few_rows_linear, Release());
  m.def("quant_linear", &pagedllm_ops::quant_linear, Release());
  m.def("moe_quant_linear", &pagedllm_ops::moe_quant_linear, Release());
  m.def("argmax_rows", &pagedllm_ops::argmax_rows, Release());
  m.def("moe_align", &pagedllm_ops::moe_align, Release());
  m.def("gguf_rows", &pagedllm_ops::gguf_rows, Release());
  m.def("lora_add_", &pagedllm_ops::lora_add_, Release());
}
