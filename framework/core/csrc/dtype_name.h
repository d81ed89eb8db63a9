// A dtype as Python prints it ("torch.bfloat16"), for the error messages of the piecewise
// torch op kernels: the same words as the Python checks they stand in for.  Used by
// passes/csrc/torch_ops.cpp and backends/attention/csrc/cpu_paged_op.cpp (needs c10).
#pragma once

#include <c10/core/ScalarType.h>

#include <string>

namespace pw_names {

inline std::string dtype_name(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::BFloat16: return "torch.bfloat16";
    case c10::ScalarType::Float: return "torch.float32";
    case c10::ScalarType::Half: return "torch.float16";
    case c10::ScalarType::Double: return "torch.float64";
    case c10::ScalarType::Char: return "torch.int8";
    case c10::ScalarType::Int: return "torch.int32";
    case c10::ScalarType::Long: return "torch.int64";
    default: return std::string("torch.") + c10::toString(t);
  }
}

}  // namespace pw_names
