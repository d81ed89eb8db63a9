// Replays a lean piece's recorded native calls (backends/piecewise/replay.py): the CPU
// counterpart of a CUDA graph's launch.  A recorded call is a C function's address and its
// arguments as 64-bit words; every function recorded takes pointers and integers only, and on
// the x86-64 System V and AArch64 (Linux) calling conventions each such argument takes one
// 64-bit register or stack slot whatever its width, so one call through a pointer of N words
// reaches any of them.  (replay.py records nothing on other platforms.)
//
// No torch headers: plain C ABI called through ctypes, one g++ call.
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

namespace {

using Word = uint64_t;
constexpr int64_t kMaxWords = 32;  // the attention kernel takes 25

// One recorded call; the layout replay.py's ctypes structure mirrors.
struct Call {
  Word fn;
  int64_t kind;  // 0: returns nothing; 1: returns an int, nonzero on error
  int64_t nargs;
  Word args[kMaxWords];
};

template <class R, std::size_t... I>
R call_words(Word fn, const Word* a, std::index_sequence<I...>) {
  using Fn = R (*)(decltype((void)I, Word())...);
  return reinterpret_cast<Fn>(fn)(a[I]...);
}

// fn(a[0], ..., a[n - 1]) for n in 0 .. kMaxWords.
template <class R, int64_t N = 0>
R call_n(Word fn, const Word* a, int64_t n) {
  if constexpr (N > kMaxWords) {
    if constexpr (!std::is_void_v<R>) return R(-1);
  } else {
    if (n == N) return call_words<R>(fn, a, std::make_index_sequence<N>{});
    return call_n<R, N + 1>(fn, a, n);
  }
}

}  // namespace

extern "C" {

int64_t piecewise_replay_max_words() { return kMaxWords; }

int64_t piecewise_replay_call_bytes() { return sizeof(Call); }

// Runs calls[0 .. count) in order.  Returns 0, or i + 1 when call i (kind 1) returned nonzero,
// its value in *status; the calls after it do not run.
int64_t piecewise_replay(const Call* calls, int64_t count, int64_t* status) {
  for (int64_t i = 0; i < count; ++i) {
    const Call& c = calls[i];
    if (c.kind == 0) {
      call_n<void>(c.fn, c.args, c.nargs);
    } else {
      const int rc = call_n<int>(c.fn, c.args, c.nargs);
      if (rc != 0) {
        *status = rc;
        return i + 1;
      }
    }
  }
  return 0;
}

}  // extern "C"
