// One translation unit for the projection kernels and their helpers: torch's headers are parsed
// once for all five files instead of once each (~8 s apiece of a ~20 s build of this group).
// Each file keeps its own anonymous namespace; their names do not collide.
#include "quant_linear_cpu.cpp"
#include "gguf_pack_cpu.cpp"
#include "lora_cpu.cpp"
#include "argmax_cpu.cpp"
#include "moe_align_cpu.cpp"
