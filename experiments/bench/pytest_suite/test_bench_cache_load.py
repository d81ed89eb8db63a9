"""Load time of one compiled piece from the artifact store: index lookup + checksum
verification + ``CompiledArtifact.load`` (what a warm start does per unique piece).

Inductor's in-process caches are cleared before every round so a round does not reuse the
previous round's loaded module; a fresh process additionally pays its first ``dlopen``s, so
the warm-start number of ``experiments.bench.vs_hf`` is the end-to-end check.
"""

from __future__ import annotations

from collections import Counter

import pytest

pytestmark = [pytest.mark.bench, pytest.mark.slow]


def _clear_inductor_caches() -> None:
    from framework.compat.inductor import clear_caches

    clear_caches()


def test_cache_load_piece(benchmark, bench_llm):
    store = bench_llm.compiled.store
    if store is None:
        pytest.skip(reason=f"level {bench_llm.config.level} has no artifact store")
    entries = store.entries()
    assert entries, f"the artifact store {store.dir} has no entries"
    # The most shared graph is a decoder layer's piece: the typical artifact.
    common, _ = Counter(r["graph_hash"] for r in entries.values()).most_common(1)[0]
    key = next(k for k, r in entries.items() if r["graph_hash"] == common)
    compiler = bench_llm.compiled.backend.compiler
    benchmark.extra_info.update(entry=key, artifact_bytes=entries[key].get("size"))

    def load():
        path = store.lookup(key)
        assert path is not None, f"cache entry {key} failed verification"
        return compiler.load(path)

    fn = benchmark.pedantic(load, setup=_clear_inductor_caches, rounds=5, warmup_rounds=1)
    # What a warm start must get: the piece's lean form (no Inductor import, no ISA probing),
    # in a fresh Inductor state (caches cleared before every round).
    assert getattr(fn, "lean", False), f"entry {key} loaded through Inductor, not its lean form"
