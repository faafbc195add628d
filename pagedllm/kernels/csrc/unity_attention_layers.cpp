// One translation unit for attention, the few-rows projections and the layers' small ops (the
// other half of the kernels, compiled beside unity_projections.cpp on a second core): torch's
// headers parsed once for the three files.
#include "paged_attention_cpu.cpp"
#include "few_rows_linear_cpu.cpp"
#include "layer_ops_cpu.cpp"
