// Memory read-bandwidth probe (see experiments/bench/bandwidth.py for the contract): how fast
// can this machine stream a buffer much larger than the last-level cache, at a given thread
// count?
//
// The buffer is mmap'ed here (anonymous, private), advised MADV_HUGEPAGE (transparent 2 MB
// pages) or MADV_NOHUGEPAGE (4 KB pages) as asked, and first touched by the same threads, in the
// same static split, that later read it.  Each repetition: every thread reads its contiguous
// share of the buffer once, as `kStreams` independent streams (the share cut into kStreams
// equal parts read side by side, so the hardware prefetchers track several streams per core),
// each stream with its own two accumulators, 64 bytes per load.  The methods:
//   0 plain     512-bit loads (vmovdqu64), 64-bit adds into the accumulators
//   1 prefetch  the same plus a software prefetch (prefetcht0) kPrefetchBytes ahead per stream
//   2 stream    non-temporal loads (vmovntdqa) instead of plain ones
// (without AVX-512 every method is a portable 64-bit-word loop the compiler vectorises).
// Threads: OpenMP (libgomp by soname: torch's pool when loaded in a torch process), each thread
// pinned to one CPU of the process's affinity mask for the call (thread t -> the t-th allowed
// CPU, modulo their count) and restored afterwards.  The sum of all 64-bit words comes back so
// the caller can check that every byte was read (and the compiler cannot drop the loads).
//
// No torch headers: a C ABI called through ctypes (framework/core/native_build.py).
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__)
#define PW_AVX512 1
#include <immintrin.h>
#endif

namespace {

constexpr int kStreams = 4;
constexpr int64_t kPrefetchBytes = 1024;
constexpr int64_t kChunk = 128;  // bytes per stream per iteration: two 64-byte loads

#if defined(PW_AVX512)
template <int Method>
uint64_t read_share(const char* base, int64_t bytes) {
  // bytes is a multiple of kStreams * kChunk
  const int64_t per = bytes / kStreams;
  __m512i acc[kStreams][2];
  for (int s = 0; s < kStreams; ++s) acc[s][0] = acc[s][1] = _mm512_setzero_si512();
  for (int64_t off = 0; off < per; off += kChunk) {
    for (int s = 0; s < kStreams; ++s) {
      const char* p = base + s * per + off;
      if (Method == 1) _mm_prefetch(p + kPrefetchBytes, _MM_HINT_T0);
      __m512i a, b;
      if (Method == 2) {
        a = _mm512_stream_load_si512((void*)p);
        b = _mm512_stream_load_si512((void*)(p + 64));
      } else {
        a = _mm512_loadu_si512((const void*)p);
        b = _mm512_loadu_si512((const void*)(p + 64));
      }
      acc[s][0] = _mm512_add_epi64(acc[s][0], a);
      acc[s][1] = _mm512_add_epi64(acc[s][1], b);
    }
  }
  __m512i t = _mm512_setzero_si512();
  for (int s = 0; s < kStreams; ++s)
    t = _mm512_add_epi64(t, _mm512_add_epi64(acc[s][0], acc[s][1]));
  return static_cast<uint64_t>(_mm512_reduce_add_epi64(t));
}
#else
template <int Method>
uint64_t read_share(const char* base, int64_t bytes) {
  const int64_t per = bytes / kStreams;
  uint64_t acc[kStreams][16] = {};
  for (int64_t off = 0; off < per; off += kChunk) {
    for (int s = 0; s < kStreams; ++s) {
      const uint64_t* p = reinterpret_cast<const uint64_t*>(base + s * per + off);
      if (Method == 1) __builtin_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes);
      for (int j = 0; j < 16; ++j) acc[s][j] += p[j];
    }
  }
  uint64_t t = 0;
  for (int s = 0; s < kStreams; ++s)
    for (int j = 0; j < 16; ++j) t += acc[s][j];
  return t;
}
#endif

using ReadFn = uint64_t (*)(const char*, int64_t);
constexpr ReadFn kMethods[3] = {read_share<0>, read_share<1>, read_share<2>};

// Share of thread t of n over `units` units of kStreams * kChunk bytes: [begin, end) in bytes.
inline void share(int64_t units, int t, int n, int64_t* begin, int64_t* end) {
  const int64_t unit = kStreams * kChunk;
  *begin = units * t / n * unit;
  *end = units * (t + 1) / n * unit;
}

}  // namespace

extern "C" {

const char* piecewise_read_bandwidth_isa() {
#if defined(PW_AVX512)
  return "avx512";
#else
  return "portable";
#endif
}

// Reads a `bytes` buffer `repeats` times with `threads` threads by `method` (0 plain, 1
// prefetch, 2 stream); `huge`: 1 MADV_HUGEPAGE, 0 MADV_NOHUGEPAGE.  seconds[r]: wall time of
// repetition r; *sum: the sum (mod 2^64) of the buffer's 64-bit words over one repetition
// (word i holds i).  *used_bytes: the bytes each repetition read (bytes rounded down to whole
// units).  Returns 0, or -1 bad arguments, -2 mmap failed.
int piecewise_read_bandwidth(int64_t bytes, int threads, int repeats, int method, int huge,
                             double* seconds, uint64_t* sum, int64_t* used_bytes) {
  if (bytes <= 0 || threads <= 0 || repeats <= 0 || method < 0 || method > 2) return -1;
  const int64_t unit = kStreams * kChunk;
  const int64_t units = bytes / unit;
  if (units < threads) return -1;
  const int64_t total = units * unit;
  void* mem = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return -2;
  madvise(mem, total, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  char* buf = static_cast<char*>(mem);

  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  sched_getaffinity(0, sizeof(allowed), &allowed);
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
  if (cpus.empty()) cpus.push_back(0);

  const ReadFn fn = kMethods[method];
  std::vector<uint64_t> partial(threads, 0);
#pragma omp parallel num_threads(threads)
  {
#ifdef _OPENMP
    const int t = omp_get_thread_num(), n = omp_get_num_threads();
#else
    const int t = 0, n = 1;
#endif
    cpu_set_t saved, mine;
    CPU_ZERO(&saved);
    sched_getaffinity(0, sizeof(saved), &saved);
    CPU_ZERO(&mine);
    CPU_SET(cpus[t % cpus.size()], &mine);
    sched_setaffinity(0, sizeof(mine), &mine);  // 0: the calling thread
    int64_t b, e;
    share(units, t, n, &b, &e);
    uint64_t* words = reinterpret_cast<uint64_t*>(buf + b);
    for (int64_t i = 0, w = (e - b) / 8; i < w; ++i) words[i] = static_cast<uint64_t>(b / 8 + i);
    for (int r = 0; r < repeats; ++r) {
#pragma omp barrier
#pragma omp master
      seconds[r] = std::chrono::duration<double>(
                       std::chrono::steady_clock::now().time_since_epoch())
                       .count();
#pragma omp barrier
      const uint64_t s = fn(buf + b, e - b);
#pragma omp barrier
#pragma omp master
      seconds[r] = std::chrono::duration<double>(
                       std::chrono::steady_clock::now().time_since_epoch())
                       .count() -
                   seconds[r];
      if (r == 0) partial[t] = s;
    }
    sched_setaffinity(0, sizeof(saved), &saved);
  }
  uint64_t s = 0;
  for (uint64_t p : partial) s += p;
  *sum = s;
  *used_bytes = total;
  munmap(mem, total);
  return 0;
}

// Reads existing buffers (e.g. a model's weights where they lie) `repeats` times: each
// buffer's whole units split over the threads as above (the unit tail, < 512 bytes, by thread
// 0), buffer after buffer inside one parallel region.  Same timing as above; *sum: the sum of
// the 64-bit words read in one repetition (tails bytewise), only to keep the loads.  Method 2
// on a buffer not 64-byte aligned reads it by method 0.  Returns 0, or -1 bad arguments.
int piecewise_read_buffers(const void* const* ptrs, const int64_t* lens, int n, int threads,
                           int repeats, int method, double* seconds, uint64_t* sum) {
  if (n <= 0 || threads <= 0 || repeats <= 0 || method < 0 || method > 2) return -1;
  const int64_t unit = kStreams * kChunk;
  std::vector<uint64_t> partial(threads, 0);
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  sched_getaffinity(0, sizeof(allowed), &allowed);
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
  if (cpus.empty()) cpus.push_back(0);
#pragma omp parallel num_threads(threads)
  {
#ifdef _OPENMP
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    const int t = 0, nt = 1;
#endif
    cpu_set_t saved, mine;
    CPU_ZERO(&saved);
    sched_getaffinity(0, sizeof(saved), &saved);
    CPU_ZERO(&mine);
    CPU_SET(cpus[t % cpus.size()], &mine);
    sched_setaffinity(0, sizeof(mine), &mine);
    for (int r = 0; r < repeats; ++r) {
      uint64_t acc = 0;
#pragma omp barrier
#pragma omp master
      seconds[r] = std::chrono::duration<double>(
                       std::chrono::steady_clock::now().time_since_epoch())
                       .count();
#pragma omp barrier
      for (int i = 0; i < n; ++i) {
        const char* base = static_cast<const char*>(ptrs[i]);
        const int64_t units = lens[i] / unit;
        const int m = (method == 2 && reinterpret_cast<uintptr_t>(base) % 64) ? 0 : method;
        int64_t b, e;
        share(units, t, nt, &b, &e);
        if (e > b) acc += kMethods[m](base + b, e - b);
        if (t == 0)
          for (int64_t j = units * unit; j < lens[i]; ++j)
            acc += static_cast<unsigned char>(base[j]);
      }
#pragma omp barrier
#pragma omp master
      seconds[r] = std::chrono::duration<double>(
                       std::chrono::steady_clock::now().time_since_epoch())
                       .count() -
                   seconds[r];
      if (r == 0) partial[t] = acc;
    }
    sched_setaffinity(0, sizeof(saved), &saved);
  }
  uint64_t s = 0;
  for (uint64_t p : partial) s += p;
  *sum = s;
  return 0;
}

}  // extern "C"
