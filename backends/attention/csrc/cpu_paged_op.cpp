// The fused CPU paged-attention kernel (cpu_paged_attention.cpp) as the CPU kernel of the torch
// op piecewise::cpu_paged_attention, registered with the dispatcher (TORCH_LIBRARY_IMPL), so
// the attention backend's call reaches C++ directly: the checks of the tensors and of the
// step's metadata, and the kernel's 25 arguments, without a Python body or ctypes marshalling.
// Built by backends/attention/cpu_paged_build.py (framework/core/native_build.py's
// TorchOpLibrary) and loaded with torch.ops.load_library.
//
// The op's schema, fake and Python body are defined in Python (backends/attention/cpu_paged.py,
// framework/core/ops.py define_op): the Python body checks the same things and calls the
// same kernel through ctypes; it serves the calls where this library is not loaded.
//
//   cpu_paged_attention(q, k, v, out!, kv_cache!, slot_mapping, block_table, query_start_loc,
//                       seq_lens, num_reqs, num_actual_tokens, scale, sliding_window)
//
// Every refusal is a ValueError naming the argument, as the Python body's.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "../../../framework/core/csrc/dtype_name.h"
#include "cpu_paged_attention.cpp"

namespace {

constexpr const char* kWho = "cpu_paged attention: ";

using pw_names::dtype_name;

// (rows, token stride) of a [T, heads, d] tensor whose heads are contiguous.
std::pair<int64_t, int64_t> rows_of(const char* name, const at::Tensor& t, int64_t heads,
                                    int64_t d) {
  TORCH_CHECK_VALUE(t.dim() == 3 && t.size(1) == heads && t.size(2) == d && t.stride(2) == 1 &&
                        t.stride(1) == d,
                    kWho, name, " must be [T, ", heads, ", ", d,
                    "] with contiguous heads, got shape ", t.sizes(), " strides ", t.strides());
  return {t.size(0), t.stride(0)};
}

void check_metadata(const char* name, const at::Tensor& t, c10::ScalarType dtype, int64_t dim) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == dtype && t.dim() == dim &&
                        t.stride(-1) == 1,
                    kWho, "metadata ", name, " must be a ", dim, "-D CPU ", dtype_name(dtype),
                    " tensor with unit inner stride, got ", t.dim(), "-D ",
                    dtype_name(t.scalar_type()), " on ", t.device(), " with strides ",
                    t.strides());
}

const char* error_text(int rc) {
  switch (rc) {
    case 1: return "unsupported dtype";
    case 2: return "head_dim > 256 or Hq not a multiple of Hkv";
    case 3: return "a request has more query tokens than context (seq_lens < query length)";
    case 4: return "the block table names a block outside the KV cache";
    default: return "kernel error";
  }
}

// The kernel's 25 arguments for one call, after the op's checks; the scale as its float's
// bits (piecewise_cpu_paged_attention_words).
using KernelWords = std::array<int64_t, 25>;

KernelWords kernel_words(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& out, const at::Tensor& kv_cache,
                         const at::Tensor& slot_mapping, const at::Tensor& block_table,
                         const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                         int64_t num_reqs, int64_t num_actual_tokens, double scale,
                         int64_t sliding_window) {
  const auto dt = q.scalar_type();
  const bool bf16 = dt == c10::ScalarType::BFloat16;
  TORCH_CHECK_VALUE((bf16 || dt == c10::ScalarType::Float) && k.scalar_type() == dt &&
                        v.scalar_type() == dt && out.scalar_type() == dt &&
                        kv_cache.scalar_type() == dt,
                    kWho, "q/k/v/out/kv_cache must share one dtype of ['torch.bfloat16', ",
                    "'torch.float32'], got q ", dtype_name(q.scalar_type()), ", k ",
                    dtype_name(k.scalar_type()), ", v ", dtype_name(v.scalar_type()), ", out ",
                    dtype_name(out.scalar_type()), ", kv_cache ",
                    dtype_name(kv_cache.scalar_type()));
  TORCH_CHECK_VALUE(kv_cache.device().is_cpu() && q.device().is_cpu() && k.device().is_cpu() &&
                        v.device().is_cpu() && out.device().is_cpu(),
                    kWho, "runs on CPU tensors, got q on ", q.device(), ", kv_cache on ",
                    kv_cache.device());
  TORCH_CHECK_VALUE(kv_cache.dim() == 5 && kv_cache.size(0) == 2, kWho,
                    "kv_cache must be [2, num_blocks, block_size, Hkv, D], got ",
                    kv_cache.sizes());
  TORCH_CHECK_VALUE(kv_cache.is_contiguous(), kWho, "kv_cache must be contiguous");
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2);
  const int64_t hkv = kv_cache.size(3), d = kv_cache.size(4);
  TORCH_CHECK_VALUE(q.dim() == 3, kWho, "q must be [T, Hq, ", d, "], got shape ", q.sizes());
  const int64_t hq = q.size(1);
  const auto [q_rows, q_st] = rows_of("q", q, hq, d);
  const auto [k_rows, k_st] = rows_of("k", k, hkv, d);
  const auto [v_rows, v_st] = rows_of("v", v, hkv, d);
  const auto [out_rows, out_st] = rows_of("out", out, hq, d);

  check_metadata("slot_mapping", slot_mapping, c10::ScalarType::Long, 1);
  check_metadata("block_table", block_table, c10::ScalarType::Int, 2);
  check_metadata("query_start_loc", query_start_loc, c10::ScalarType::Int, 1);
  check_metadata("seq_lens", seq_lens, c10::ScalarType::Int, 1);
  const int64_t n = num_actual_tokens;
  TORCH_CHECK_VALUE(num_reqs >= 0 && query_start_loc.size(0) >= num_reqs + 1 &&
                        seq_lens.size(0) >= num_reqs,
                    kWho, "query_start_loc/seq_lens shorter than num_reqs=", num_reqs);
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  TORCH_CHECK_VALUE(qsl[num_reqs] <= n, kWho, "query_start_loc ends at ", qsl[num_reqs],
                    " > num_actual_tokens=", n);
  int64_t max_seq_len = 0;
  for (int64_t i = 0; i < num_reqs; ++i) max_seq_len = std::max<int64_t>(max_seq_len, lens[i]);
  TORCH_CHECK_VALUE(max_seq_len <= block_table.size(1) * block_size, kWho, "max_seq_len=",
                    max_seq_len, " exceeds the block table (", block_table.size(1),
                    " blocks of ", block_size, ")");
  TORCH_CHECK_VALUE(slot_mapping.size(0) >= n, kWho, "slot_mapping has ", slot_mapping.size(0),
                    " entries for num_actual_tokens=", n);
  TORCH_CHECK_VALUE(n <= std::min({q_rows, k_rows, v_rows, out_rows}), kWho,
                    "num_actual_tokens=", n, " exceeds the rows of q/k/v/out (", q_rows, ", ",
                    k_rows, ", ", v_rows, ", ", out_rows, ")");
  const float scale_f = static_cast<float>(scale);
  uint32_t scale_bits;
  std::memcpy(&scale_bits, &scale_f, 4);
  auto word = [](const void* p) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(p)); };
  return {word(q.data_ptr()), q_st, word(k.data_ptr()), k_st, word(v.data_ptr()), v_st,
          word(out.data_ptr()), out_st, word(kv_cache.data_ptr()), num_blocks, block_size,
          word(slot_mapping.data_ptr<int64_t>()), word(block_table.data_ptr<int32_t>()),
          block_table.stride(0), word(qsl), word(lens), num_reqs, n, out_rows, hq, hkv, d,
          static_cast<int64_t>(scale_bits), sliding_window, bf16 ? 1 : 0};
}

// Runs the kernel on checked words (kernel_words); a kernel error is a ValueError.
void run_words(const KernelWords& w) {
  auto ptr = [](int64_t x) { return reinterpret_cast<void*>(static_cast<uintptr_t>(x)); };
  const int rc = piecewise_cpu_paged_attention_words(
      ptr(w[0]), w[1], ptr(w[2]), w[3], ptr(w[4]), w[5], ptr(w[6]), w[7], ptr(w[8]), w[9],
      w[10], static_cast<const int64_t*>(ptr(w[11])), static_cast<const int32_t*>(ptr(w[12])),
      w[13], static_cast<const int32_t*>(ptr(w[14])), static_cast<const int32_t*>(ptr(w[15])),
      w[16], w[17], w[18], w[19], w[20], w[21], w[22], w[23], w[24]);
  TORCH_CHECK_VALUE(rc == 0, kWho, error_text(rc), " (Hq=", w[19], ", Hkv=", w[20], ", D=", w[21],
                    ")");
}

void cpu_paged_attention_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& out, const at::Tensor& kv_cache,
                            const at::Tensor& slot_mapping, const at::Tensor& block_table,
                            const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                            int64_t num_reqs, int64_t num_actual_tokens, double scale,
                            int64_t sliding_window) {
  run_words(kernel_words(q, k, v, out, kv_cache, slot_mapping, block_table, query_start_loc,
                         seq_lens, num_reqs, num_actual_tokens, scale, sliding_window));
}

// The op's call and the native call it made, [address, 1, word...] (the function returns an
// int, nonzero on error): what a recorded forward replays (framework.core.ops
// set_direct_recorder; backends/piecewise/forward_replay.py).
std::vector<int64_t> cpu_paged_attention_recorded(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& kv_cache, const at::Tensor& slot_mapping, const at::Tensor& block_table,
    const at::Tensor& query_start_loc, const at::Tensor& seq_lens, int64_t num_reqs,
    int64_t num_actual_tokens, double scale, int64_t sliding_window) {
  const KernelWords w = kernel_words(q, k, v, out, kv_cache, slot_mapping, block_table,
                                     query_start_loc, seq_lens, num_reqs, num_actual_tokens,
                                     scale, sliding_window);
  run_words(w);
  std::vector<int64_t> call = {
      static_cast<int64_t>(reinterpret_cast<uintptr_t>(&piecewise_cpu_paged_attention_words)),
      1};
  call.insert(call.end(), w.begin(), w.end());
  return call;
}

}  // namespace

TORCH_LIBRARY_IMPL(piecewise, CPU, m) {
  m.impl("cpu_paged_attention", &cpu_paged_attention_op);
}

// Built with PW_PYTHON_MODULE (TorchOpLibrary's python_module): the same kernel as a Python
// module function, which the attention backend calls without the dispatcher
// (framework/core/ops.py set_direct_call / direct_call).
#ifdef PW_PYTHON_MODULE
#include <torch/extension.h>

PYBIND11_MODULE(PW_PYTHON_MODULE, m) {
  m.def("cpu_paged_attention", &cpu_paged_attention_op);
  m.def("cpu_paged_attention_record",
        [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
           const at::Tensor& kv_cache, const at::Tensor& slot_mapping,
           const at::Tensor& block_table, const at::Tensor& query_start_loc,
           const at::Tensor& seq_lens, int64_t num_reqs, int64_t num_actual_tokens, double scale,
           int64_t sliding_window) {
          return std::make_tuple(
              pybind11::none(),
              cpu_paged_attention_recorded(q, k, v, out, kv_cache, slot_mapping, block_table,
                                           query_start_loc, seq_lens, num_reqs,
                                           num_actual_tokens, scale, sliding_window));
        });
}
#endif
