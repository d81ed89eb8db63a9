// The C++ CPU kernel of piecewise::fused_moe_packed (passes/ops_prepack_moe.py): the routed
// experts of one MoE layer on their small-M panels, the whole layer in one dispatcher call.
//
//   fused_moe_packed(x [T, H] bf16, topk_weights [T, K] fp32|bf16, topk_ids [T, K] int64|int32,
//                    w13 [E, *panel_shape(2I, H)], w2 [E, *panel_shape(H, I)],
//                    w13_md, w2_md, I, max_rows) -> [T, H] bf16
//
// What the Python body (passes.ops_prepack_moe.fused_moe_packed_cpu over passes.ops.moe.
// combine_by_expert) does for groups of at most max_rows rows, with the same arithmetic, bit
// for bit: the (token, k) slots grouped by expert (stable: ascending expert, then slot order);
// per expert hit, the gate-up linear on its rows (the small-M kernel, piecewise_small_m_linear,
// on that expert's panels), SiLU(gate) * up (ATen's own CPU kernels on the same [n, 2I] views
// the Python body uses, so the rounding is torch's), the down linear (the small-M kernel);
// each contribution rounded as torch rounds `y * w` (fp32 product, bf16 once), added into a
// bf16 accumulator in ascending expert order (fp32 add, bf16 once).  At batch 1 only the top-k
// experts' panels are touched.  OpenMP: inside each small-M call, over its N panels.
//
// A call with a group above max_rows (prefill: those groups go to oneDNN), or dtypes/layouts
// other than these, is handed whole to the Python twin piecewise::fused_moe_packed_python.
//
// Included by torch_ops.cpp (after small_m_linear.cpp, whose C entry point it calls); its own
// namespace and its own TORCH_LIBRARY_IMPL block.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mul_cpu_dispatch.h>
#include <ATen/ops/silu_cpu_dispatch.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "../../framework/core/csrc/bf16.h"

namespace pw_moe {

using OptTensor = std::optional<at::Tensor>;
constexpr int64_t kPanelLanes = 64;  // output features per small-M panel
constexpr int64_t kPanelPairs = 2;   // k values per lane of a panel row

using pw_bf16::bf16_to_f32;
using pw_bf16::f32_to_bf16;

// w is the [E, ceil(n/64), ceil(k/2), 64, 2] stack of panels of E weights [n, k].
bool panel_stack(const at::Tensor& w, int64_t e, int64_t n, int64_t k) {
  return w.dim() == 5 && w.size(0) == e && w.size(1) == (n + kPanelLanes - 1) / kPanelLanes &&
         w.size(2) == (k + kPanelPairs - 1) / kPanelPairs && w.size(3) == kPanelLanes &&
         w.size(4) == kPanelPairs && w.scalar_type() == c10::ScalarType::BFloat16 &&
         w.is_contiguous() && w.device().is_cpu();
}

// y [m, n] = x [m, k] (row stride x_st) @ W^T on the panels w of W [n, k].
void small_m(const uint16_t* x, int64_t x_st, int64_t m, const uint16_t* w, uint16_t* y,
             int64_t n, int64_t k) {
  const int rc = piecewise_small_m_linear(x, x_st, m, w, nullptr, y, n, n, k, 1);
  TORCH_CHECK(rc == 0, "piecewise::fused_moe_packed: small-M kernel error ", rc, " for ", m,
              " rows, w (", n, ", ", k, ")");
}

at::Tensor python_twin(const at::Tensor& x, const at::Tensor& topk_weights,
                       const at::Tensor& topk_ids, const at::Tensor& w13, const at::Tensor& w2,
                       const OptTensor& w13_md, const OptTensor& w2_md, int64_t inter,
                       int64_t max_rows) {
  static const auto twin =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("piecewise::fused_moe_packed_python", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, const OptTensor&,
                            const OptTensor&, int64_t, int64_t)>();
  return twin.call(x, topk_weights, topk_ids, w13, w2, w13_md, w2_md, inter, max_rows);
}

at::Tensor fused_moe_packed(const at::Tensor& x, const at::Tensor& topk_weights,
                            const at::Tensor& topk_ids, const at::Tensor& w13,
                            const at::Tensor& w2, const OptTensor& w13_md,
                            const OptTensor& w2_md, int64_t inter, int64_t max_rows) {
  const bool takes =
      x.dim() == 2 && x.scalar_type() == c10::ScalarType::BFloat16 && x.device().is_cpu() &&
      topk_ids.dim() == 2 && topk_weights.sizes() == topk_ids.sizes() &&
      topk_ids.size(0) == x.size(0) && topk_ids.device().is_cpu() &&
      topk_weights.device().is_cpu() &&
      (topk_ids.scalar_type() == c10::ScalarType::Long ||
       topk_ids.scalar_type() == c10::ScalarType::Int) &&
      (topk_weights.scalar_type() == c10::ScalarType::Float ||
       topk_weights.scalar_type() == c10::ScalarType::BFloat16) &&
      inter > 0 && x.size(1) > 0 && w13.dim() == 5 &&
      panel_stack(w13, w13.size(0), 2 * inter, x.size(1)) &&
      panel_stack(w2, w13.size(0), x.size(1), inter);
  if (!takes)
    return python_twin(x, topk_weights, topk_ids, w13, w2, w13_md, w2_md, inter, max_rows);

  const int64_t T = x.size(0), H = x.size(1), K = topk_ids.size(1), E = w13.size(0);
  const int64_t I = inter, S = T * K;
  if (T == 0 || K == 0) return at::zeros_like(x);

  // the slots' experts and weights, read once
  const at::Tensor ids_c = topk_ids.contiguous();
  const at::Tensor ws_c = topk_weights.contiguous();
  std::vector<int64_t> ids(S);
  std::vector<float> ws(S);
  if (ids_c.scalar_type() == c10::ScalarType::Long) {
    const int64_t* p = ids_c.data_ptr<int64_t>();
    for (int64_t s = 0; s < S; ++s) ids[s] = p[s];
  } else {
    const int32_t* p = ids_c.data_ptr<int32_t>();
    for (int64_t s = 0; s < S; ++s) ids[s] = p[s];
  }
  if (ws_c.scalar_type() == c10::ScalarType::Float) {
    std::memcpy(ws.data(), ws_c.data_ptr<float>(), S * sizeof(float));
  } else {
    const auto* p = static_cast<const uint16_t*>(ws_c.data_ptr());
    for (int64_t s = 0; s < S; ++s) ws[s] = bf16_to_f32(p[s]);
  }

  // counting sort of the slots by expert (stable)
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK_INDEX(ids[s] >= 0 && ids[s] < E, "piecewise::fused_moe_packed: expert id ",
                      ids[s], " of token ", s / K, " is out of range for ", E, " experts");
    ++start[ids[s] + 1];
  }
  for (int64_t e = 0; e < E; ++e) {
    if (start[e + 1] > max_rows)  // a prefill-sized group: oneDNN, in the Python body
      return python_twin(x, topk_weights, topk_ids, w13, w2, w13_md, w2_md, inter, max_rows);
    start[e + 1] += start[e];
  }
  std::vector<int64_t> order(S);
  {
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t s = 0; s < S; ++s) order[next[ids[s]]++] = s;
  }

  const at::Tensor xr = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t x_st = T > 1 ? xr.stride(0) : H;
  const auto* xp = static_cast<const uint16_t*>(xr.data_ptr());
  const auto* w13p = static_cast<const uint16_t*>(w13.data_ptr());
  const auto* w2p = static_cast<const uint16_t*>(w2.data_ptr());
  const int64_t w13_per = w13.numel() / E, w2_per = w2.numel() / E;

  // one token, K distinct experts: the K contributions added, the first one as the
  // accumulator (the Python body's batch-1 path; 0 + c == c, except for the sign of zero)
  bool direct = T == 1;
  for (int64_t e = 0; direct && e < E; ++e) direct = start[e + 1] - start[e] <= 1;

  at::Tensor out = direct ? at::empty({T, H}, x.options()) : at::zeros({T, H}, x.options());
  auto* op = static_cast<uint16_t*>(out.data_ptr());
  const int64_t rows_max = [&] {
    int64_t m = 0;
    for (int64_t e = 0; e < E; ++e) m = std::max(m, start[e + 1] - start[e]);
    return m;
  }();
  std::vector<uint16_t> xg(direct ? 0 : rows_max * H), y(rows_max * H);
  bool first = true;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = start[e + 1] - start[e];
    if (n == 0) continue;
    const int64_t* slots = order.data() + start[e];
    const uint16_t* rows = xp;
    int64_t rows_st = x_st;
    if (!direct) {  // gather the group's rows (a token listed twice comes twice)
      for (int64_t r = 0; r < n; ++r)
        std::memcpy(xg.data() + r * H, xp + (slots[r] / K) * x_st, H * sizeof(uint16_t));
      rows = xg.data();
      rows_st = H;
    }
    at::Tensor h = at::empty({n, 2 * I}, x.options());  // gate, then up
    small_m(rows, rows_st, n, w13p + e * w13_per, static_cast<uint16_t*>(h.data_ptr()), 2 * I,
            H);
    at::Tensor a = at::cpu::silu(h.narrow(1, 0, I));  // [n, I], as F.silu(h[:, :I])
    at::cpu::mul_(a, h.narrow(1, I, I));
    if (!a.is_contiguous()) a = a.contiguous();
    small_m(static_cast<const uint16_t*>(a.data_ptr()), I, n, w2p + e * w2_per, y.data(), H,
            I);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t t = slots[r] / K;
      const float w = ws[slots[r]];
      const uint16_t* yr = y.data() + r * H;
      uint16_t* o = op + t * H;
      if (direct && first) {
        for (int64_t j = 0; j < H; ++j) o[j] = f32_to_bf16(bf16_to_f32(yr[j]) * w);
      } else {
        for (int64_t j = 0; j < H; ++j)
          o[j] = f32_to_bf16(bf16_to_f32(o[j]) + bf16_to_f32(f32_to_bf16(bf16_to_f32(yr[j]) * w)));
      }
    }
    first = false;
  }
  return out;
}

}  // namespace pw_moe

TORCH_LIBRARY_IMPL(piecewise, CPU, m) {
  m.impl("fused_moe_packed", TORCH_FN(pw_moe::fused_moe_packed));
}
