// The CPU kernels of the piecewise linear ops, registered with the torch dispatcher
// (TORCH_LIBRARY_IMPL), so a graph's call of the op reaches C++ directly: no Python op body,
// no ctypes marshalling.  Built by passes/native_ops.py (framework/core/native_build.py's
// TorchOpLibrary) and loaded with torch.ops.load_library.
//
// The ops' schemas, fakes and Python implementations are defined in Python (framework/core/
// ops.py define_op; passes/ops_prepack.py, passes/ops_int8.py): each op's Python body is its
// CompositeExplicitAutograd kernel (any device, and CPU when this library is not loaded); this
// file adds the CPU kernel, which takes the small-M calls (rows <= the call's max_rows, dtypes
// and layouts the kernels read) and hands every other call to the op's twin
// `piecewise::<op>_python`, the same Python body registered under its own name.
//
//   packed_linear(x, w, md, bias, N, K, max_rows)                  bf16 small-M kernel
//   int8_packed_linear(x, w, w_scale, w_comp, bias, N, K, max_rows)  W8A8, quantised in-kernel
//   int8_wo_packed_linear(x, w, w_scale, bias, N, K, max_rows)      int8 weight-only
//   fused_moe_packed(x, weights, ids, w13, w2, ...)  a MoE layer's experts (fused_moe_packed.cpp)
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <string>
#include <vector>

#include "../../framework/core/csrc/dtype_name.h"
#include "int8_linear.cpp"
#include "small_m_linear.cpp"
#include "fused_moe_packed.cpp"  // the MoE layer op: its own namespace and registration

namespace {

using OptTensor = std::optional<at::Tensor>;

using pw_names::dtype_name;

// Rows of x as a [rows, K] matrix, or -1 when x is not [..., K].
int64_t rows_of(const at::Tensor& x, int64_t k) {
  if (x.dim() == 0 || x.size(-1) != k || k <= 0) return -1;
  return x.numel() / k;
}

at::Tensor as_rows(const at::Tensor& x, int64_t rows, int64_t k) {
  at::Tensor x2 = x.dim() == 2 ? x : x.reshape({rows, k});
  return x2.stride(1) == 1 ? x2 : x2.contiguous();
}

int64_t row_stride(const at::Tensor& x2, int64_t k) {
  return x2.size(0) > 1 ? x2.stride(0) : k;  // a size-1 dim's stride can be anything
}

at::Tensor with_rows(const at::Tensor& out, const at::Tensor& x, int64_t n) {
  if (x.dim() == 2) return out;
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n;
  return out.view(sizes);
}

// bias [n] in `dtype`, unit stride (or none); false: not a bias the kernels read.
bool bias_ok(const OptTensor& bias, int64_t n, c10::ScalarType dtype) {
  return !bias.has_value() ||
         (bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == dtype &&
          bias->device().is_cpu());
}

const void* bias_ptr(const OptTensor& bias, at::Tensor& keep) {
  if (!bias.has_value()) return nullptr;
  keep = bias->stride(0) == 1 ? *bias : bias->contiguous();
  return keep.data_ptr();
}

template <class T>
int64_t as_word(T* p) {
  return static_cast<int64_t>(reinterpret_cast<intptr_t>(p));
}
inline int64_t as_word(int64_t v) { return v; }

// x and the bias as the kernels read them are the caller's own tensors (no copy was made).
bool reads_in_place(const at::Tensor& x, const at::Tensor& x2, const OptTensor& bias,
                    const void* bp) {
  return x2.data_ptr() == x.data_ptr() && (!bias.has_value() || bp == bias->data_ptr());
}

int64_t kernel_dtype(c10::ScalarType t) {
  return t == c10::ScalarType::BFloat16 ? pw_int8::kBFloat16 : pw_int8::kFloat32;
}

bool panel_shape(const at::Tensor& w, int64_t n, int64_t k, int64_t lanes, int64_t per_lane) {
  return w.dim() == 4 && w.size(0) == (n + lanes - 1) / lanes &&
         w.size(1) == (k + per_lane - 1) / per_lane && w.size(2) == lanes &&
         w.size(3) == per_lane && w.is_contiguous() && w.device().is_cpu();
}

// The native call a small-M op call made, for a lean piece's replay
// (backends/piecewise/replay.py): {the C function's address, 1 (it returns an int, nonzero on
// error), its arguments as 64-bit integers}.  Left empty where the call cannot be replayed from
// its arguments alone: it took the op's Python twin, or copied x or the bias first (the copy
// is a fresh tensor each call).  Every kernel entry point takes pointers and integers only.
using NativeCall = std::vector<int64_t>;

template <class... Params, class... Args>
void note_call(NativeCall* call, int (*fn)(Params...), Args... args) {
  static_assert(sizeof...(Params) == sizeof...(Args), "one word per parameter");
  if (call == nullptr) return;
  *call = {static_cast<int64_t>(reinterpret_cast<intptr_t>(fn)), 1};
  (call->push_back(as_word(args)), ...);
}

// --- bf16: packed_linear ----------------------------------------------------------------------

at::Tensor packed_linear_call(const at::Tensor& x, const at::Tensor& w, const OptTensor& md,
                              const OptTensor& bias, int64_t n, int64_t k, int64_t max_rows,
                              NativeCall* call) {
  TORCH_CHECK_TYPE(x.scalar_type() == w.scalar_type(), "piecewise::packed_linear: x (",
                   dtype_name(x.scalar_type()), ") and w (", dtype_name(w.scalar_type()),
                   ") differ");
  const int64_t rows = rows_of(x, k);
  if (rows >= 0 && rows <= max_rows && x.scalar_type() == c10::ScalarType::BFloat16 &&
      panel_shape(w, n, k, pw_small_m::kLanes, 2)) {
    TORCH_CHECK_VALUE(bias_ok(bias, n, w.scalar_type()), "piecewise::packed_linear: bias ",
                      bias->sizes(), " ", dtype_name(bias->scalar_type()), " for w (", n, ", ",
                      k, ") ", dtype_name(w.scalar_type()));
    const at::Tensor x2 = as_rows(x, rows, k);
    at::Tensor b;
    const void* bp = bias_ptr(bias, b);
    at::Tensor out = at::empty({rows, n}, x.options());
    const void* xp = x2.data_ptr();
    const void* wp = w.data_ptr();
    void* op = out.data_ptr();
    const int64_t xs = row_stride(x2, k), one = 1;
    const int rc = piecewise_small_m_linear(xp, xs, rows, wp, bp, op, n, n, k, one);
    TORCH_CHECK(rc == 0, "piecewise::packed_linear: kernel error ", rc, " for x ", x.sizes(),
                ", w (", n, ", ", k, ")");
    if (reads_in_place(x, x2, bias, bp))
      note_call(call, &piecewise_small_m_linear, xp, xs, rows, wp, bp, op, n, n, k, one);
    return with_rows(out, x, n);
  }
  static const auto fallback =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("piecewise::packed_linear_python", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&,
                            const OptTensor&, int64_t, int64_t, int64_t)>();
  return fallback.call(x, w, md, bias, n, k, max_rows);
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& w, const OptTensor& md,
                         const OptTensor& bias, int64_t n, int64_t k, int64_t max_rows) {
  return packed_linear_call(x, w, md, bias, n, k, max_rows, nullptr);
}

// --- bf16 LM head with the greedy epilogue: packed_linear_greedy -------------------------------

// (logits [rows, n], index [rows] int64, maximum [rows] float32): the small-M kernel's greedy
// entry where it applies (each thread scans the outputs it stored), else packed_linear and one
// pass over each stored row (pw_argmax::row_argmax: the same rules).
std::tuple<at::Tensor, at::Tensor, at::Tensor> packed_linear_greedy_call(
    const at::Tensor& x, const at::Tensor& w, const OptTensor& md, const OptTensor& bias,
    int64_t n, int64_t k, int64_t max_rows, NativeCall* call) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == k, "piecewise::packed_linear_greedy: x must be ",
                    "[rows, ", k, "], got ", x.sizes());
  const int64_t rows = x.size(0);
  at::Tensor idx = at::empty({rows}, x.options().dtype(c10::ScalarType::Long));
  at::Tensor val = at::empty({rows}, x.options().dtype(c10::ScalarType::Float));
  if (rows > 0 && rows <= max_rows && x.scalar_type() == c10::ScalarType::BFloat16 &&
      w.scalar_type() == c10::ScalarType::BFloat16 &&
      panel_shape(w, n, k, pw_small_m::kLanes, 2) && bias_ok(bias, n, w.scalar_type())) {
    const at::Tensor x2 = as_rows(x, rows, k);
    at::Tensor b;
    const void* bp = bias_ptr(bias, b);
    at::Tensor out = at::empty({rows, n}, x.options());
    const void* xp = x2.data_ptr();
    const void* wp = w.data_ptr();
    void* op = out.data_ptr();
    int64_t* ip = idx.data_ptr<int64_t>();
    float* vp = val.data_ptr<float>();
    const int64_t xs = row_stride(x2, k), one = 1;
    const int rc = piecewise_small_m_linear_greedy(xp, xs, rows, wp, bp, op, n, n, k, one, ip, vp);
    TORCH_CHECK(rc == 0, "piecewise::packed_linear_greedy: kernel error ", rc, " for x ",
                x.sizes(), ", w (", n, ", ", k, ")");
    if (reads_in_place(x, x2, bias, bp))
      note_call(call, &piecewise_small_m_linear_greedy, xp, xs, rows, wp, bp, op, n, n, k, one, ip,
                vp);
    return {out, idx, val};
  }
  const at::Tensor out = packed_linear(x, w, md, bias, n, k, max_rows).contiguous();
  const bool bf16 = out.scalar_type() == c10::ScalarType::BFloat16;
  TORCH_CHECK_TYPE(bf16 || out.scalar_type() == c10::ScalarType::Float,
                   "piecewise::packed_linear_greedy: logits of ",
                   dtype_name(out.scalar_type()), " (bfloat16 or float32 only)");
  int64_t* ip = idx.data_ptr<int64_t>();
  float* vp = val.data_ptr<float>();
#pragma omp parallel for schedule(static) if (rows > 1 && rows * n >= (1 << 16))
  for (int64_t r = 0; r < rows; ++r) {
    if (bf16) {
      const auto* row = static_cast<const uint16_t*>(out.data_ptr()) + r * n;
      pw_argmax::row_argmax(row, n, ip + r, vp + r);
    } else {
      pw_argmax::row_argmax(out.data_ptr<float>() + r * n, n, ip + r, vp + r);
    }
  }
  return {out, idx, val};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> packed_linear_greedy(
    const at::Tensor& x, const at::Tensor& w, const OptTensor& md, const OptTensor& bias,
    int64_t n, int64_t k, int64_t max_rows) {
  return packed_linear_greedy_call(x, w, md, bias, n, k, max_rows, nullptr);
}

// --- int8: W8A8 and weight-only -----------------------------------------------------------------

bool float_rows(const at::Tensor& x) {
  return x.scalar_type() == c10::ScalarType::BFloat16 || x.scalar_type() == c10::ScalarType::Float;
}

bool per_channel(const at::Tensor& t, int64_t n, c10::ScalarType dtype) {
  return t.numel() == n && t.scalar_type() == dtype && t.is_contiguous() && t.device().is_cpu();
}

at::Tensor int8_packed_linear_call(const at::Tensor& x, const at::Tensor& w,
                                   const at::Tensor& w_scale, const at::Tensor& w_comp,
                                   const OptTensor& bias, int64_t n, int64_t k, int64_t max_rows,
                                   NativeCall* call) {
  const int64_t rows = rows_of(x, k);
  if (rows >= 0 && rows <= max_rows && float_rows(x) && x.device().is_cpu() &&
      w.scalar_type() == c10::ScalarType::Char && panel_shape(w, n, k, pw_int8::kLanes, 4) &&
      per_channel(w_scale, n, c10::ScalarType::Float) &&
      per_channel(w_comp, n, c10::ScalarType::Int) && bias_ok(bias, n, x.scalar_type())) {
    const at::Tensor x2 = as_rows(x, rows, k);
    at::Tensor b;
    const void* bp = bias_ptr(bias, b);
    at::Tensor out = at::empty({rows, n}, x.options());
    const void* xp = x2.data_ptr();
    const void* wp = w.data_ptr();
    const int32_t* cp = w_comp.data_ptr<int32_t>();
    const float* sp = w_scale.data_ptr<float>();
    void* op = out.data_ptr();
    const int64_t xs = row_stride(x2, k), dt = kernel_dtype(x.scalar_type());
    const int rc = piecewise_int8_linear(xp, xs, rows, wp, cp, sp, bp, op, n, n, k, dt);
    TORCH_CHECK(rc == 0, "piecewise::int8_packed_linear: kernel error ", rc, " for x ",
                x.sizes(), ", w (", n, ", ", k, ")");
    if (reads_in_place(x, x2, bias, bp))
      note_call(call, &piecewise_int8_linear, xp, xs, rows, wp, cp, sp, bp, op, n, n, k, dt);
    return with_rows(out, x, n);
  }
  static const auto fallback =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("piecewise::int8_packed_linear_python", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const OptTensor&, int64_t, int64_t, int64_t)>();
  return fallback.call(x, w, w_scale, w_comp, bias, n, k, max_rows);
}

at::Tensor int8_packed_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                              const at::Tensor& w_comp, const OptTensor& bias, int64_t n,
                              int64_t k, int64_t max_rows) {
  return int8_packed_linear_call(x, w, w_scale, w_comp, bias, n, k, max_rows, nullptr);
}

at::Tensor int8_wo_packed_linear_call(const at::Tensor& x, const at::Tensor& w,
                                      const at::Tensor& w_scale, const OptTensor& bias,
                                      int64_t n, int64_t k, int64_t max_rows, NativeCall* call) {
  const int64_t rows = rows_of(x, k);
  if (rows >= 0 && rows <= max_rows && float_rows(x) && x.device().is_cpu() &&
      w.scalar_type() == c10::ScalarType::Char && panel_shape(w, n, k, pw_int8::kLanes, 4) &&
      per_channel(w_scale, n, c10::ScalarType::Float) && bias_ok(bias, n, x.scalar_type())) {
    const at::Tensor x2 = as_rows(x, rows, k);
    at::Tensor b;
    const void* bp = bias_ptr(bias, b);
    at::Tensor out = at::empty({rows, n}, x.options());
    const void* xp = x2.data_ptr();
    const void* wp = w.data_ptr();
    const float* sp = w_scale.data_ptr<float>();
    void* op = out.data_ptr();
    const int64_t xs = row_stride(x2, k), dt = kernel_dtype(x.scalar_type());
    const int rc = piecewise_int8_wo_linear(xp, xs, rows, wp, sp, bp, op, n, n, k, dt);
    TORCH_CHECK(rc == 0, "piecewise::int8_wo_packed_linear: kernel error ", rc, " for x ",
                x.sizes(), ", w (", n, ", ", k, ")");
    if (reads_in_place(x, x2, bias, bp))
      note_call(call, &piecewise_int8_wo_linear, xp, xs, rows, wp, sp, bp, op, n, n, k, dt);
    return with_rows(out, x, n);
  }
  static const auto fallback =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("piecewise::int8_wo_packed_linear_python", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const OptTensor&, int64_t, int64_t, int64_t)>();
  return fallback.call(x, w, w_scale, bias, n, k, max_rows);
}

at::Tensor int8_wo_packed_linear(const at::Tensor& x, const at::Tensor& w,
                                 const at::Tensor& w_scale, const OptTensor& bias, int64_t n,
                                 int64_t k, int64_t max_rows) {
  return int8_wo_packed_linear_call(x, w, w_scale, bias, n, k, max_rows, nullptr);
}

// Each op's call together with the native call it made (NativeCall; empty: not replayable):
// what a lean piece records for its replay.
template <class Op, class... A>
std::tuple<at::Tensor, NativeCall> recorded(Op op, const A&... args) {
  NativeCall call;
  at::Tensor out = op(args..., &call);
  return {out, call};
}

}  // namespace

TORCH_LIBRARY_IMPL(piecewise, CPU, m) {
  m.impl("packed_linear", TORCH_FN(packed_linear));
  m.impl("packed_linear_greedy", TORCH_FN(packed_linear_greedy));
  m.impl("int8_packed_linear", TORCH_FN(int8_packed_linear));
  m.impl("int8_wo_packed_linear", TORCH_FN(int8_wo_packed_linear));
}

// The same kernels as a Python module (built where this Python's headers are installed:
// framework/core/native_build.py's TorchOpLibrary, python_module): a lean piece calls them
// directly, without the dispatcher's boxing of every argument (framework/core/ops.py,
// direct calls).  Each is the function the CPU dispatch key runs.
#ifdef PW_PYTHON_MODULE
#include <torch/extension.h>

PYBIND11_MODULE(PW_PYTHON_MODULE, m) {
  m.def("packed_linear", &packed_linear);
  m.def("packed_linear_greedy", &packed_linear_greedy);
  m.def("int8_packed_linear", &int8_packed_linear);
  m.def("int8_wo_packed_linear", &int8_wo_packed_linear);
  m.def("fused_moe_packed", &pw_moe::fused_moe_packed);
  m.def("packed_linear_record", [](const at::Tensor& x, const at::Tensor& w, const OptTensor& md,
                                   const OptTensor& bias, int64_t n, int64_t k, int64_t rows) {
    return recorded(packed_linear_call, x, w, md, bias, n, k, rows);
  });
  m.def("packed_linear_greedy_record",
        [](const at::Tensor& x, const at::Tensor& w, const OptTensor& md, const OptTensor& bias,
           int64_t n, int64_t k, int64_t rows) {
          NativeCall call;
          auto got = packed_linear_greedy_call(x, w, md, bias, n, k, rows, &call);
          return std::make_tuple(got, call);
        });
  m.def("int8_packed_linear_record",
        [](const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, const at::Tensor& c,
           const OptTensor& bias, int64_t n, int64_t k, int64_t rows) {
          return recorded(int8_packed_linear_call, x, w, s, c, bias, n, k, rows);
        });
  m.def("int8_wo_packed_linear_record",
        [](const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, const OptTensor& bias,
           int64_t n, int64_t k, int64_t rows) {
          return recorded(int8_wo_packed_linear_call, x, w, s, bias, n, k, rows);
        });
}
#endif

extern "C" {
// Which instruction sets the kernels of this build use (for logs and benchmarks).
const char* piecewise_torch_ops_isa() {
  static const std::string isa = std::string(piecewise_small_m_linear_isa()) + "," +
                                 piecewise_int8_linear_isa();
  return isa.c_str();
}
}
