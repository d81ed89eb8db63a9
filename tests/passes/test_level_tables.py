"""Which passes each optimization level runs on CPU and on CUDA, and in what order, written out
literally. The tables are derived from each pass's ``@register_pass`` metadata; this test pins
the result so a change of metadata that changes a level's behaviour fails here."""

import pytest

from passes.registry import canonical_order, level_passes, order_passes

_CPU_BASE = ["noop_elimination", "prepack_linear", "fix_functionalization"]
PINNED: dict[tuple[int, str], list[str]] = {
    (0, "cpu"): [],
    (1, "cpu"): _CPU_BASE,
    (2, "cpu"): _CPU_BASE,
    (3, "cpu"): [
        "noop_elimination",
        "fuse_add_rmsnorm",
        "fuse_rmsnorm_quant",
        "fuse_silu_mul_quant",
        "fuse_qk_norm_rope",
        "fuse_moe_router",
        "prepack_linear",
        "fix_functionalization",
    ],
    (0, "cuda"): [],
    (1, "cuda"): [
        "noop_elimination",
        "fuse_rmsnorm_quant",
        "fuse_silu_mul_quant",
        "fix_functionalization",
    ],
    (2, "cuda"): [
        "noop_elimination",
        "fuse_add_rmsnorm",
        "fuse_rmsnorm_quant",
        "fuse_silu_mul_quant",
        "fuse_moe_router",
        "fix_functionalization",
    ],
    (3, "cuda"): [
        "noop_elimination",
        "fuse_add_rmsnorm",
        "fuse_rmsnorm_quant",
        "fuse_silu_mul_quant",
        "fuse_qk_norm_rope",
        "fuse_moe_router",
        "fix_functionalization",
    ],
}


@pytest.mark.parametrize("level, device", sorted(PINNED))
def test_level_runs_the_pinned_passes_in_the_pinned_order(level, device):
    assert order_passes(level_passes(level, device)) == PINNED[(level, device)]
    assert level_passes(level, device) == PINNED[(level, device)]


def test_canonical_order_of_the_builtin_passes():
    assert [n for n in canonical_order() if n in PINNED[(3, "cpu")]] == PINNED[(3, "cpu")]


def test_unknown_device_types_use_the_cpu_table():
    assert level_passes(2, "mps") == PINNED[(2, "cpu")]


def test_deriving_the_tables_imports_no_pattern_matcher_or_dynamo():
    """Reading the metadata imports every pass module; none may pull in the pattern matcher or
    Dynamo at import (the engine resolves the level's passes on the warm-start path)."""
    import subprocess
    import sys

    code = (
        "import sys; from passes.registry import level_passes; level_passes(3, 'cuda'); "
        "bad = [m for m in ('torch._inductor.pattern_matcher', 'torch._dynamo') "
        "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
