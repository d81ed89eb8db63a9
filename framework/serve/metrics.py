"""The server's own measurements and the Prometheus text exposition of ``/metrics``.

Latencies are measured by the engine thread when it hands an output to its request: time to
first token from submission, inter-token latency as the gap between outputs divided by the
tokens they added. Engine counters (KV blocks, preemptions, prefix-cache hits) come from a
snapshot of ``LLM.stats`` the engine thread takes when asked.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
RATE_WINDOW_S = 10.0


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self):
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, v: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += times
        self.total += v * times
        self.n += times

    def lines(self, name: str) -> list[str]:
        out, cum = [], 0
        for le, c in zip(self.buckets, self.counts):
            cum += c
            out.append(f'{name}_bucket{{le="{le}"}} {cum}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
        out.append(f"{name}_sum {self.total}")
        out.append(f"{name}_count {self.n}")
        return out


class ServingMetrics:
    """Counters and histograms written by the engine thread and the handlers (one lock)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.generation_tokens = 0
        self.prompt_tokens = 0
        self.finished: dict[str, int] = {}
        self.client_aborts = 0
        self.rejected: dict[int, int] = {}
        self.step_errors = 0
        self._recent: deque[tuple[float, int]] = deque()

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def tokens(self, n: int, gap_s: float | None, now: float) -> None:
        """``n`` new tokens of one request; ``gap_s`` since its previous output (None for its
        first), spread evenly over them."""
        with self._lock:
            self.generation_tokens += n
            if gap_s is not None and n > 0:
                self.itl.observe(gap_s / n, n)
            self._recent.append((now, n))
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()

    def finish(self, reason: str, prompt_tokens: int) -> None:
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.prompt_tokens += prompt_tokens

    def client_abort(self) -> None:
        with self._lock:
            self.client_aborts += 1

    def reject(self, status: int) -> None:
        with self._lock:
            self.rejected[status] = self.rejected.get(status, 0) + 1

    def step_error(self) -> None:
        with self._lock:
            self.step_errors += 1

    def tokens_per_second(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            n = sum(k for t, k in self._recent if t >= now - RATE_WINDOW_S)
        return n / RATE_WINDOW_S

    def render(self, running: int, waiting: int, engine: dict[str, Any], model: str) -> str:
        """Prometheus text format (version 0.0.4)."""
        p = "piecewise_"
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[str]) -> None:
            lines.append(f"# HELP {p}{name} {help_}")
            lines.append(f"# TYPE {p}{name} {kind}")
            lines.extend(f"{p}{s}" for s in samples)

        def gauge(name: str, help_: str, value: Any) -> None:
            metric(name, "gauge", help_, [f"{name} {value}"])

        def counter(name: str, help_: str, value: Any) -> None:
            metric(name, "counter", help_, [f"{name} {value}"])

        tps = self.tokens_per_second()
        with self._lock:
            metric("model_info", "gauge", "the served model", [f'model_info{{model="{model}"}} 1'])
            gauge("requests_running", "requests that have produced a token, not finished", running)
            gauge("requests_waiting", "requests submitted that have produced no token yet", waiting)
            total = engine.get("kv_blocks_total")
            free = engine.get("kv_blocks_free")
            if total is not None and free is not None:
                gauge("kv_blocks_total", "usable KV cache blocks", total)
                gauge("kv_blocks_used", "KV cache blocks held by requests", total - free)
                gauge("kv_blocks_free", "KV cache blocks free or evictable", free)
            counter("preemptions_total", "requests preempted", engine.get("preemptions", 0))
            counter(
                "engine_aborted_total", "requests aborted in the engine", engine.get("aborted", 0)
            )
            counter("client_aborts_total", "requests aborted by a client", self.client_aborts)
            counter("step_errors_total", "engine steps that raised", self.step_errors)
            metric(
                "requests_finished_total",
                "counter",
                "finished requests by finish reason",
                [
                    f'requests_finished_total{{finish_reason="{r}"}} {c}'
                    for r, c in sorted(self.finished.items())
                ]
                or ['requests_finished_total{finish_reason="stop"} 0'],
            )
            metric(
                "requests_rejected_total",
                "counter",
                "requests refused for overload, by status",
                [
                    f'requests_rejected_total{{status="{s}"}} {c}'
                    for s, c in sorted(self.rejected.items())
                ]
                or ['requests_rejected_total{status="429"} 0'],
            )
            counter("prompt_tokens_total", "prompt tokens of finished requests", self.prompt_tokens)
            counter("generation_tokens_total", "tokens generated", self.generation_tokens)
            gauge(
                "generation_tokens_per_second",
                f"tokens generated per second over the last {RATE_WINDOW_S:g} s",
                f"{tps:.3f}",
            )
            queried = engine.get("prefix_cache_queried_tokens")
            if queried is not None:
                hits = engine.get("prefix_cache_hit_tokens", 0)
                counter("prefix_cache_queried_tokens_total", "prompt tokens looked up", queried)
                counter("prefix_cache_hit_tokens_total", "prompt tokens found cached", hits)
                gauge(
                    "prefix_cache_hit_rate",
                    "hit tokens / queried tokens",
                    f"{hits / queried:.6f}" if queried else 0,
                )
            steps = [
                (kind, q, engine[f"{kind}_ms_{q}"])
                for kind in ("prefill", "decode", "mixed")
                for q in ("median", "p90")
                if f"{kind}_ms_{q}" in engine
            ]
            if steps:
                metric(
                    "engine_step_ms",
                    "gauge",
                    "engine step time over the server's life, by step kind and quantile",
                    [f'engine_step_ms{{kind="{k}",quantile="{q}"}} {v}' for k, q, v in steps],
                )
            metric(
                "time_to_first_token_seconds",
                "histogram",
                "submission to first token",
                [s[len(p) :] for s in self.ttft.lines(f"{p}time_to_first_token_seconds")],
            )
            metric(
                "inter_token_latency_seconds",
                "histogram",
                "time between tokens of one request",
                [s[len(p) :] for s in self.itl.lines(f"{p}inter_token_latency_seconds")],
            )
        return "\n".join(lines) + "\n"
