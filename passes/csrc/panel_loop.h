// The driver the small-M kernels share (small_m_linear.cpp, int8_linear.cpp): the weight is
// laid out in panels of `lanes` output features, each panel one contiguous stream; panels are
// split over OpenMP threads, and inside a panel every row of x meets the panel's bytes while
// they are in cache, so the weight is read from memory ONCE whatever M is.
//
// Inside a panel the rows go in passes of at most kMaxTileRows (the register tile: 6 rows x 4
// vectors of 16 lanes = 24 accumulators), balanced (8 rows -> 4 + 4, 16 -> 6 + 5 + 5, 40 ->
// five passes of 6 and two of 5).  One pass streams the whole panel.  With several passes the
// panel is cut into k-blocks (`block` k-steps; 64 KB of a panel in both kernels) that stay in
// L1/L2 while every pass runs over them; the partial sums of the rows wait in `buf` (m x lanes
// accumulators) between blocks.  Each output is computed by one thread in one order (k
// ascending, whatever the blocking), so M, the pass split and the thread count never change a
// bit of a row's result.
//
// Overlap: left to the hardware, only the first pass over a block would read memory and the
// later ones would be pure compute, DRAM idle.  So every pass over a block prefetches its
// share of the NEXT block of the weight stream (the bytes right after this block: the panel's
// next block, or the next panel's first), spread evenly over all the passes (`Prefetch`):
// DRAM keeps streaming while the rows compute, and the time is max(stream, compute), not
// their sum.  One pass (m <= 6) leaves the streaming to the hardware prefetchers, as before.
//
// The kernel supplies `panel(p, m0, mr, i0, i1, buf, first, last, pf)`: rows [m0, m0 + mr)
// over k-steps [i0, i1) of panel p; `first`: start from zero, else from the partial sums in
// `buf` (mr x lanes, row-major); `last`: run the epilogue and store, else leave the partial
// sums in `buf`; `pf`: which k-steps of the next block to prefetch.  An optional
// `prologue(r)` prepares row r of x (quantise, widen) before any panel runs, the rows split
// over the same threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <type_traits>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace pw_panel {

// Prefetch the 4 cache lines (256 bytes: one k-step of a 64-lane panel in both layouts) at p.
inline void prefetch_step(const void* p) {
#if defined(__GNUC__) || defined(__clang__)
  const char* c = static_cast<const char*>(p);
  __builtin_prefetch(c, 0, 2);
  __builtin_prefetch(c + 64, 0, 2);
  __builtin_prefetch(c + 128, 0, 2);
  __builtin_prefetch(c + 192, 0, 2);
#else
  (void)p;
#endif
}

constexpr int kMaxTileRows = 6;  // rows per pass over a panel (the register tile's height)
// Below this much weight traffic (bytes x row passes) one thread finishes before a team wakes.
constexpr int64_t kParallelMinBytes = 96 * 1024;

// The k-steps of the next block one pass prefetches: step i0 + d of this block prefetches step
// i1 + d of the stream when (d + phase) % every == 0 (every == 0: none).  The passes over a
// block take phases 0 .. every - 1 with every = passes: each next step exactly once.
struct Prefetch {
  int64_t every = 0, phase = 0;
};

// The prefetches of one sweep of a pair-tile loop (`pair_tiles`, below), where the rows of a
// pass go over each k-block of the panel in several sweeps (row pairs x lane halves) from L1:
// the k-steps the pass must bring in (the next k-block, or its share of the next row-pass
// block) are dealt out over all the sweeps of a block, step j of the block to sweep
// j % sweeps, so DRAM streams evenly while every sweep computes.  `sweeps == 0`: none.
struct SweepPrefetch {
  int64_t delta = 0;  // step i prefetches step i + delta
  int64_t every = 1;  // ... when it is one of every `every`-th steps of the pass,
  int64_t turn = 0;   //     counting from `turn` at the block's first step
  int sweeps = 0, sweep = 0;
  int64_t period = 0;  // lcm(sweeps, every), set once per panel call (row_tiles)
};

// Steps [i0, i1) of one sweep, body(i) for each, with the sweep's prefetches (SweepPrefetch):
// step t = i - i0 prefetches where t % sweeps == sweep and (turn + t) % every == 0, which
// holds for one step in every lcm(sweeps, every) (or none).  Instead of two counters kept per
// step (GCC kept them in cmov chains and on the stack: 15 of the 57 instructions of a 5-row
// AVX2 bf16 step), either one compare per step against the next such step, or (`kGrouped`)
// the steps in groups of that period, each group's prefetch issued before it: fewest
// instructions where the body leaves registers for the nested loop (the bf16 wide tiles: 42 a
// step against 51 with the compare, M = 5 1.06-1.08x against 1.02x), not where it does not
// (the int8 weight-only pair tile spilled more: 0.91x; with the compare 1.00-1.05x).
template <bool kGrouped = false, class Body>
inline void sweep_steps(const SweepPrefetch& spf, const void* panel, int64_t step_bytes,
                        int64_t i0, int64_t i1, const Body& body) {
  const int64_t period = spf.period;
  int64_t first = -1;
  if (spf.sweeps > 0) {
    // the first t = sweep + j * sweeps with (turn + t) % every == 0, the residue kept by
    // additions: no division in a sweep's setup (with every = 13 row passes, a 64-row call,
    // one `%` per candidate t cost 0.89x; lcm and `%` once a call still 0.95x)
    int64_t add = spf.sweeps, res = spf.turn + spf.sweep;
    while (add >= spf.every) add -= spf.every;
    while (res >= spf.every) res -= spf.every;
    for (int64_t t = spf.sweep; t < period; t += spf.sweeps) {
      if (res == 0) {
        first = t;
        break;
      }
      res += add;
      if (res >= spf.every) res -= spf.every;
    }
  }
  if (first < 0) {
    for (int64_t i = i0; i < i1; ++i) body(i);
    return;
  }
  const char* base = static_cast<const char*>(panel) + spf.delta * step_bytes;
  if constexpr (kGrouped) {
    for (int64_t g = i0; g < i1; g += period) {
      if (g + first < i1) prefetch_step(base + (g + first) * step_bytes);
      const int64_t e = std::min(i1, g + period);
      for (int64_t i = g; i < e; ++i) body(i);
    }
  } else {
    for (int64_t i = i0, next = i0 + first; i < i1; ++i) {
      if (i == next) {
        prefetch_step(base + i * step_bytes);
        next += period;
      }
      body(i);
    }
  }
}

// m rows in passes of at most `most` (the register tile's kMaxTileRows; 16 for AMX tiles)
// whose sizes differ by at most one.
struct RowPasses {
  int64_t passes, base, extra;
  explicit RowPasses(int64_t m, int64_t most = kMaxTileRows)
      : passes((m + most - 1) / most),
        base(passes ? m / passes : 0),
        extra(passes ? m % passes : 0) {}
  int64_t start(int64_t j) const { return j * base + std::min(j, extra); }
  int64_t rows(int64_t j) const { return base + (j < extra ? 1 : 0); }
};

// Every row pass of panel p over k-steps [0, ksteps).
template <class Acc, class Panel>
inline void run_panel(int64_t m, int64_t ksteps, int64_t block, int64_t lanes, int64_t p,
                      std::vector<Acc>& buf, const Panel& panel, int64_t most = kMaxTileRows) {
  const RowPasses rp(m, most);
  if (rp.passes == 1) {
    panel(p, int64_t{0}, m, int64_t{0}, ksteps, static_cast<Acc*>(nullptr), true, true,
          Prefetch{});
    return;
  }
  buf.resize(static_cast<size_t>(m * lanes));
  for (int64_t i0 = 0; i0 < ksteps; i0 += block) {
    const int64_t i1 = std::min(ksteps, i0 + block);
    for (int64_t j = 0; j < rp.passes; ++j) {
      const int64_t m0 = rp.start(j);
      const Prefetch pf{rp.passes, j};
      panel(p, m0, rp.rows(j), i0, i1, buf.data() + m0 * lanes, i0 == 0, i1 == ksteps, pf);
    }
  }
}

// A pass's partial sums held in memory (the AVX2 and portable panels; mr x lanes, row-major,
// the layout of `buf`): zero on a pass's first block, else what its previous block left.
template <class Acc>
inline void load_partials(Acc* acc, const Acc* buf, int64_t n, bool first) {
  if (first)
    std::fill(acc, acc + n, Acc{});
  else
    std::copy(buf, buf + n, acc);
}

// The tiles of the AVX2 kernels (16 vector registers): one row sweeps the whole panel (8
// vectors of 8 lanes, left to the hardware prefetchers: one stream); more rows go over k-blocks
// of `block` steps held in L1, in register tiles of G rows x V vectors (`row_tiles`; the int8
// kernels' `pair_tiles`: pairs over half panels, 2 x 4 accumulators, an odd last row alone).
// `sweep(Int<G>{}, Int<V>{}, r, b0, b1, v0, spf)` runs rows [r, r + G) over steps
// [b0, b1) and lanes [8 v0, 8 (v0 + V)) (a kernel passes a generic lambda).  Prefetch:
// without the driver's (one row pass over the whole panel) the sweeps of a block bring in the
// next block; with it (`pf`, several row passes over a block of `run_panel`) they bring in
// this pass's share of the next such block, as the AVX-512 kernels do; either way dealt out
// over all the sweeps (SweepPrefetch).  `next`: the step, counted from the panel's first, at
// which the bytes that follow [i0, i1) in memory begin -- i1, or past it where the kernel adds
// steps of its own after the sweeps (the bf16 kernel's odd last k) -- so that the last block's
// prefetches land on the next block's first bytes, not one step past them.
template <int N>
using Int = std::integral_constant<int, N>;

// MR rows over k-steps [i0, i1) in tiles of G rows x V vectors (G x V accumulators), k-block
// by k-block; one row alone sweeps the whole panel with no prefetch of its own.
template <int MR, int G, int V, class Sweep>
inline void row_tiles(int64_t i0, int64_t i1, int64_t next, int64_t block, const Prefetch& pf,
                      const Sweep& sweep) {
  constexpr int kSweeps = ((MR + G - 1) / G) * ((8 + V - 1) / V);
  const int64_t period = pf.every ? std::lcm<int64_t>(kSweeps, pf.every) : kSweeps;
  for (int64_t b0 = i0; b0 < i1; b0 += block) {
    const int64_t b1 = std::min(i1, b0 + block);
    if constexpr (MR == 1) {
      sweep(Int<1>{}, Int<8>{}, 0, b0, b1, 0, SweepPrefetch{});
    } else {
      // step i of this block prefetches step i + delta: the block after it in memory
      SweepPrefetch spf{(b1 < i1 ? b1 : next) - b0, 1, 0, kSweeps, 0, period};
      if (pf.every) {
        spf.delta = next - i0;
        spf.every = pf.every;
        spf.turn = (b0 - i0 + pf.phase) % pf.every;
      }
      // rows in groups of G (the last group the rows left), each over the panel's 8 vectors
      // in runs of V (the last run the vectors left); loops, not unrolled, over the full
      // groups and runs, so each tile shape's sweep is inlined once
      constexpr int kFullG = MR / G, kRestG = MR % G, kFullV = 8 / V, kRestV = 8 % V;
      auto group = [&](auto g, int r) {
        for (int c = 0; c < kFullV; ++c, ++spf.sweep) sweep(g, Int<V>{}, r, b0, b1, c * V, spf);
        if constexpr (kRestV > 0) {
          sweep(g, Int<kRestV>{}, r, b0, b1, kFullV * V, spf);
          ++spf.sweep;
        }
      };
      for (int r = 0; r < kFullG * G; r += G) group(Int<G>{}, r);
      if constexpr (kRestG > 0) group(Int<kRestG>{}, kFullG * G);
    }
  }
}

// Rows in pairs over half panels (2 x 4 accumulators), an odd last row alone (the int8 kernels).
template <int MR, class Sweep>
inline void pair_tiles(int64_t i0, int64_t i1, int64_t next, int64_t block, const Prefetch& pf,
                       const Sweep& sweep) {
  row_tiles<MR, 2, 4>(i0, i1, next, block, pf, sweep);
}

// One row (a batch-1 decode step) over panels [b, e) of 64 outputs, for a kernel whose single-row
// pass streams one panel at a time (the bf16 AVX2 kernel; the int8 AVX2 kernels, more
// compute per weight byte, measured no gain from it: W8A8 1.01-1.02x, weight-only 0.79x in
// chunks of 2 quads and 1.01x in chunks of 8 over the tiny and 1.1B shapes): the share is cut into
// `Streams` contiguous parts read side by side, `chunk` k-steps of a part's current panel at a
// time, its accumulators waiting in `acc` (L1) between chunks, so that several weight streams
// per thread are in flight for the hardware prefetchers.  `step(p, i0, i1, acc)` adds k-steps
// [i0, i1) of panel p into acc (64 accumulators, in and out); `finish(p, acc)` runs the
// epilogue.  Each output still sees its k-steps in ascending order, so its bits are those of
// one pass over the panel.
template <class Acc, int Streams, class Step, class Finish>
inline void one_row_streams(int64_t b, int64_t e, int64_t ksteps, int64_t chunk, const Step& step,
                            const Finish& finish) {
  constexpr int kLanes = 64;
  const int n = static_cast<int>(std::min<int64_t>(Streams, e - b));
  alignas(64) Acc acc[Streams][kLanes];
  int64_t pan[Streams], end[Streams], at[Streams];
  for (int s = 0; s < n; ++s) {
    pan[s] = b + (e - b) * s / n;
    end[s] = b + (e - b) * (s + 1) / n;
    at[s] = 0;
    std::fill(acc[s], acc[s] + kLanes, Acc{});
  }
  for (int live = n; live > 0;) {
    live = 0;
    for (int s = 0; s < n; ++s) {
      if (pan[s] == end[s]) continue;
      ++live;
      const int64_t i1 = std::min(ksteps, at[s] + chunk);
      step(pan[s], at[s], i1, acc[s]);
      at[s] = i1;
      if (i1 < ksteps) continue;
      finish(pan[s], acc[s]);
      std::fill(acc[s], acc[s] + kLanes, Acc{});
      at[s] = 0;
      ++pan[s];
    }
  }
}

struct NoPrologue {
  void operator()(int64_t) const {}
};

// All `panels` panels over OpenMP threads (torch's pool: libgomp is shared by soname), static
// schedule; `prologue` first, for every row.  `weight_bytes`: the bytes one pass over the
// whole weight reads (the parallel threshold).
template <class Acc, class Prologue, class Panel>
void run_panels(int64_t m, int64_t panels, int64_t ksteps, int64_t block, int64_t lanes,
                int64_t weight_bytes, const Prologue& prologue, const Panel& panel) {
  const bool parallel = panels > 1 && weight_bytes * RowPasses(m).passes >= kParallelMinBytes;
#pragma omp parallel if (parallel)
  {
    if constexpr (!std::is_same_v<Prologue, NoPrologue>) {
#pragma omp for schedule(static)
      for (int64_t r = 0; r < m; ++r) prologue(r);
    }  // (the implicit barrier: every row is ready before any panel runs)
    std::vector<Acc> buf;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; ++p) run_panel<Acc>(m, ksteps, block, lanes, p, buf, panel);
  }
}

}  // namespace pw_panel
