"""Compilation configuration and optimization levels O0–O3.

Every field left ``None`` is "not set": :meth:`CompilationConfig.resolve` fills it from the
optimization level, so an explicit user setting always beats the level default.

Leaf module: imports nothing from ``backends``/``passes``/``models``.
"""

from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from framework.core.config_base import NO_HASH, StrictConfig, check_sizes
from framework.core.cudagraph_mode import effective_cudagraph_mode
from framework.core.forward_context import CUDAGraphMode

logger = logging.getLogger(__name__)

DEFAULT_LEVEL = 0
"""The optimization level when none is given (``LLM(optimization_level=None)``, an unset
``CompilationConfig.level``): eager. The experiments' Hydra config picks O2 explicitly."""

LevelPasses = Callable[[int, str], list[str]]
"""``(level, device_type) -> pass names`` the level runs by default (``passes.registry``)."""

ATTENTION_OP = "piecewise::attention"
"""Qualified name of the attention custom op the backend splits around by default."""


class CompilationMode(enum.Enum):
    """How the model is compiled."""

    NONE = 0
    """Eager PyTorch (O0)."""
    PIECEWISE = 2
    """Trace once, split around attention, compile each piece per token range."""


def parse_pass_list(items: Optional[list[str]], where: str = "PassConfig.passes") -> PassList:
    """The one spelling of a pass list: exact names, or ``+name`` / ``-name`` edits of the
    optimization level's list (never both).  ``None`` is the level's list unchanged."""
    if items is None:
        return PassList(None, (), ())
    if isinstance(items, str) or not isinstance(items, (list, tuple)):
        raise ValueError(
            f"{where}={items!r}: expected a list, e.g. [+name], [-name] or [a,b] "
            f"(quote it in the shell: 'passes=[+mypkg.mod:fn]')"
        )
    exact: list[str] = []
    add: list[str] = []
    remove: list[str] = []
    for item in items:
        if not isinstance(item, str) or not item.strip("+-"):
            raise ValueError(f"{where}: {item!r} is not a pass name, +name or -name")
        if item[0] == "+":
            add.append(item[1:])
        elif item[0] == "-":
            remove.append(item[1:])
        else:
            exact.append(item)
    if exact and (add or remove):
        raise ValueError(
            f"{where}={list(items)}: mixes exact names {exact} with +/- edits; either list the "
            f"passes exactly ([a,b]) or edit the level's list ([+x,-y])"
        )
    for kind, names in (("", exact), ("+", add), ("-", remove)):
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"{where}: duplicate pass name(s) {[kind + d for d in dup]}")
    both = sorted(set(add) & set(remove))
    if both:
        raise ValueError(f"{where}={list(items)}: {both} both added (+) and removed (-)")
    if exact or not (add or remove):  # [] runs no pass at all
        return PassList(exact, (), ())
    return PassList(None, tuple(add), tuple(remove))


@dataclass(frozen=True)
class PassList:
    """A parsed :attr:`PassConfig.passes`: ``exact`` names, or edits of the level's list."""

    exact: Optional[list[str]]
    add: tuple[str, ...]
    remove: tuple[str, ...]

    def resolve(self, level_default: list[str]) -> list[str]:
        if self.exact is not None:
            return list(self.exact)
        names = list(level_default) + [n for n in self.add if n not in level_default]
        return [n for n in names if n not in self.remove]


@dataclass
class PassConfig(StrictConfig):
    """Which compiler passes run on every piece, and how they are checked."""

    passes: Optional[list[str]] = None
    """The pass list, in one of two forms (never mixed):

    - exact names (registry names or ``module.sub:ClassName`` import paths): exactly these
      passes run; ``[]`` runs none;
    - edits of the optimization level's list: ``+name`` adds a pass (the pass manager places
      it at its declared position), ``-name`` removes one: ``["+my_pass", "-prepack_linear"]``.

    ``None``: the level's list.  The Hydra runs' top-level ``passes=[...]`` and their
    ``toggle_passes=[...]`` sweeps are spellings of this one field."""
    verify_passes: bool = False
    """Run each piece before and after every pass on the same random inputs and fail on the
    first pass whose error exceeds the dtype's tolerance."""
    verify_tolerance: Optional[float] = None
    """Absolute tolerance of ``verify_passes``; ``None``: per dtype (fp32 1e-3, bf16 5e-2)."""
    warn_on_no_match: bool = True
    """Warn (naming the pass) when an enabled fusion matched nothing in the whole model."""
    sequence_parallel_min_tokens: int = 256
    """``sequence_parallelism`` (tensor parallelism) rewrites only pieces compiled for one
    concrete size of at least this many tokens (and divisible by the world size)."""

    def validate(self) -> None:
        parse_pass_list(self.passes)
        if self.verify_tolerance is not None and self.verify_tolerance <= 0:
            raise ValueError("PassConfig.verify_tolerance: must be positive")

    @property
    def edits_level_list(self) -> bool:
        """Whether :attr:`passes` is the level's list (``None``) or edits of it."""
        return parse_pass_list(self.passes).exact is None

    def resolved_passes(self, level_default: list[str]) -> list[str]:
        """The exact pass names this config runs, given the level's default list."""
        return parse_pass_list(self.passes).resolve(level_default)


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    return default if value is None else value not in ("", "0")


@dataclass
class KernelConfig(StrictConfig):
    """Which hand-written kernels the engine's layers use, and where.  Part of the compile
    cache key; fixed when the weights are re-laid out (model preparation), never read from
    the environment at call time."""

    small_m_linear: bool = field(
        default_factory=lambda: _env_flag("PIECEWISE_SMALL_M_LINEAR", True)
    )
    """Run bf16 linears of few rows on the small-M kernel (``passes/small_m_linear.py``).
    Default: the environment variable ``PIECEWISE_SMALL_M_LINEAR`` (``0`` turns it off), else on."""
    small_m_max_rows: int = 64
    """Rows (tokens) up to which a linear runs the small-M kernel; more go to oneDNN.  The
    kernel streams each weight panel once for all rows (row passes over k-blocks in cache), so
    it leads oneDNN up to at least 64 rows on the tiny and 1.1B shapes
    (``passes.small_m_linear.DEFAULT_MAX_ROWS``, ``experiments/bench/small_m_linear.py``); on
    AMX CPUs through its tile path (the geometric mean over those shapes 1.24x / 1.21x /
    1.06x oneDNN's AMX path at M = 1 / 8 / 64: ``experiments/bench/results/``
    ``small_m_amx_2026-12-05.md``)."""
    int8_small_m_max_rows: int = 64
    """Rows up to which an int8 linear (``int8_per_token``, ``int8_per_channel_weight_only``)
    runs the small-M int8 kernel (``passes/int8_small_m.py``; its weight is then re-laid out
    once for it); more go to ``torch._int_mm`` / torch's weight-only path.  0: int8 weights stay
    plain and every call runs torch's path (the quant fusion passes then see the quant op).
    ``small_m_linear = False`` turns this kernel off too.  Default: the measured crossover
    (``passes.int8_small_m.DEFAULT_MAX_ROWS``)."""

    def validate(self) -> None:
        if not isinstance(self.small_m_linear, bool):
            raise ValueError(
                f"KernelConfig.small_m_linear: must be a bool, got {self.small_m_linear!r}"
            )
        for name in ("small_m_max_rows", "int8_small_m_max_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"KernelConfig.{name}: must be an int >= 0, got {value!r}")

    def max_rows(self) -> int:
        """Rows up to which the small-M kernel runs (0: never)."""
        return self.small_m_max_rows if self.small_m_linear else 0

    def int8_max_rows(self) -> int:
        """Rows up to which the small-M int8 kernel runs (0: never, int8 weights stay plain)."""
        return self.int8_small_m_max_rows if self.small_m_linear else 0


@dataclass
class CompilationConfig(StrictConfig):
    """How the model is traced, split, compiled, cached and wrapped in CUDA graphs."""

    renamed_fields = {"backend": "compiler"}

    level: Optional[int] = None
    """Optimization level 0–3 whose defaults fill every unset field (``None``:
    :data:`DEFAULT_LEVEL`)."""
    mode: Optional[CompilationMode] = None
    """NONE (eager) or PIECEWISE.  (Stock ``torch.compile`` baselines of the transformers
    model are contenders in ``experiments/bench/contenders.py``, not a mode of this engine.)"""
    compiler: Optional[str] = None
    """Compiler adaptor for pieces: ``inductor``, ``eager`` or a registered plugin
    (``backends.piecewise.compiler.COMPILERS``)."""
    splitting_ops: Optional[list[str]] = None
    """Qualified op names the graph is split at; ``[]`` keeps one whole graph."""
    compile_ranges_endpoints: Optional[list[int]] = None
    """Range endpoints e0 < e1 < ...: ranges [1,e0], [e0+1,e1], ..., up to max_num_tokens."""
    compile_sizes: Optional[list[int]] = None
    """Token counts compiled with concrete shapes; they win over the range holding them."""
    max_num_tokens: Optional[int] = None
    """Largest token count of one step (set from the runner's budget when unset)."""
    cudagraph_mode: Optional[CUDAGraphMode] = None
    """NONE, PIECEWISE, FULL, FULL_DECODE_ONLY or FULL_AND_PIECEWISE."""
    cudagraph_capture_sizes: Optional[list[int]] = None
    """Token counts captured as CUDA graphs; ``None``: [1,2,4] + every 8 to 256 + every 16."""
    cudagraph_debug: bool = False
    """Check at replay that input addresses match the captured ones."""
    inductor_config: dict[str, Any] = field(default_factory=dict)
    """Extra ``torch._inductor.config`` options for every piece (part of the cache key)."""
    pass_config: PassConfig = field(default_factory=PassConfig)
    kernel_config: KernelConfig = field(default_factory=KernelConfig)
    """Kernel settings of this engine's layers (part of the cache key)."""
    """Compiler passes run on every piece."""
    cpu_replay_max_tokens: int = field(default=16, metadata=NO_HASH)
    """CPU steps of at most this many tokens replay each lean piece's recorded native calls
    from C++ instead of running its Python (``backends/piecewise/replay.py``: a piece records
    a set of inputs the first time it sees them and keeps its most recently used recordings,
    at most 256 and 64 MB of the buffers they wrote).  0: never.  Compiled code does not
    change (not in the cache key).  The Python a replay saves is the same at any size while
    the kernels grow with the tokens, and a recording holds its buffers: at 1.1B b32 replay
    gained 1% of the step and 0.13 GB of peak RSS; the tiny model's b1 step gained 6%, its
    tapes after b1 and b8 generations held 3.8 MB in all
    (``experiments/bench/results/cpu_replay_2026-12-07.md``); hence 16 (decode batches up to
    16, verify steps of 1 + 4 tokens up to 3 requests)."""
    cpu_replay_forward: bool = field(default=True, metadata=NO_HASH)
    """With ``cpu_replay_max_tokens``: a step's whole forward, once every part of it has
    recorded its native calls, replays as one recording (``backends/piecewise/forward_replay.py``:
    the CPU counterpart of a FULL CUDA graph; no Python between the pieces).  False: each
    piece replays on its own.  Compiled code does not change (not in the cache key)."""
    use_cache: bool = field(default=True, metadata=NO_HASH)
    """Read and write the on-disk artifact cache."""
    cache_weights: bool = field(default=True, metadata=NO_HASH)
    """With ``use_cache``: also keep the processed weights (quantized, re-laid out) in the
    cache and map them on a warm start (``framework/cache/weights.py``; CPU models)."""
    cache_dir: Optional[str] = field(default=None, metadata=NO_HASH)
    """Root of the artifact cache (default ``$PIECEWISE_CACHE_DIR`` or ~/.cache/piecewise)."""
    debug_dump_path: Optional[str] = field(default=None, metadata=NO_HASH)
    """Write split graph, piece code, pass snapshots and decompiled bytecode here."""
    progress_bar: bool = field(default=True, metadata=NO_HASH)
    """Show a progress bar while compiling and capturing."""

    def validate(self) -> None:
        if self.level is not None and self.level not in LEVEL_DEFAULTS:
            raise ValueError(
                f"CompilationConfig.level: must be one of 0, 1, 2, 3, got {self.level!r}"
            )
        if self.compiler is not None and (not isinstance(self.compiler, str) or not self.compiler):
            # The name itself is checked against backends.piecewise.compiler.COMPILERS (plugins
            # included) when the compiler is built.
            raise ValueError(
                f"CompilationConfig.compiler: expected a compiler adaptor name such as "
                f"'inductor' or 'eager', got {self.compiler!r}"
            )
        if self.max_num_tokens is not None and (
            isinstance(self.max_num_tokens, bool)
            or not isinstance(self.max_num_tokens, int)
            or self.max_num_tokens <= 0
        ):
            raise ValueError(
                f"CompilationConfig.max_num_tokens: must be a positive int, got "
                f"{self.max_num_tokens!r}"
            )
        r = self.cpu_replay_max_tokens
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(
                f"CompilationConfig.cpu_replay_max_tokens: must be an int >= 0, got {r!r}"
            )
        upper = self.max_num_tokens
        check_sizes("CompilationConfig", "compile_sizes", self.compile_sizes, upper=upper)
        check_sizes(
            "CompilationConfig",
            "cudagraph_capture_sizes",
            self.cudagraph_capture_sizes,
            upper=upper,
        )
        check_sizes(
            "CompilationConfig",
            "compile_ranges_endpoints",
            self.compile_ranges_endpoints,
            upper=upper,
        )
        eps = self.compile_ranges_endpoints
        if eps is not None and eps != sorted(eps):
            raise ValueError(
                f"CompilationConfig.compile_ranges_endpoints: must be increasing, got {eps}"
            )
        if self.splitting_ops is not None:
            bad = [op for op in self.splitting_ops if "::" not in str(op)]
            if bad:
                raise ValueError(
                    f"CompilationConfig.splitting_ops: expected qualified op "
                    f"names like 'piecewise::attention', got {bad}"
                )

    def resolve(
        self,
        *,
        max_num_tokens: int,
        level_passes: LevelPasses,
        has_cuda: bool | None = None,
    ) -> "CompilationConfig":
        """A copy with every unset field filled from the level and ``max_num_tokens``.

        ``level_passes(level, device_type)``: the passes a level runs by default
        (``passes.registry.level_passes``; this module may not import ``passes``)."""
        import torch

        level = DEFAULT_LEVEL if self.level is None else self.level
        defaults = LEVEL_DEFAULTS[level]
        values = {}
        for name, default in defaults.items():
            current = getattr(self, name)
            values[name] = default if current is None else current
        values["level"] = level
        values["max_num_tokens"] = self.max_num_tokens or max_num_tokens
        if values["compiler"] is None:
            values["compiler"] = "inductor"
        if values["splitting_ops"] is None:
            values["splitting_ops"] = [ATTENTION_OP]
        if values["compile_ranges_endpoints"] is None:
            values["compile_ranges_endpoints"] = []
        if values["compile_sizes"] is None:
            values["compile_sizes"] = []
        if values["cudagraph_capture_sizes"] is None:
            values["cudagraph_capture_sizes"] = default_capture_sizes(values["max_num_tokens"])
        has_cuda = torch.cuda.is_available() if has_cuda is None else has_cuda
        requested = values["cudagraph_mode"]
        mode, why = effective_cudagraph_mode(
            requested,
            has_cuda=has_cuda,
            piecewise_compiled=values["mode"] == CompilationMode.PIECEWISE,
        )
        if why is not None and (self.cudagraph_mode is not None or level > 0):
            logger.info("cudagraph_mode %s resolves to %s: %s", requested.name, mode.name, why)
        values["cudagraph_mode"] = mode
        pass_defaults = (
            level_passes(level, "cuda" if has_cuda else "cpu")
            if self.pass_config.edits_level_list
            else []
        )
        values["pass_config"] = self.pass_config.replace(
            passes=self.pass_config.resolved_passes(pass_defaults)
        )
        return self.replace(**values)


def round_sizes_to_query_len(
    config: CompilationConfig, query_len: int, max_num_seqs: int
) -> tuple[CompilationConfig, Optional[str]]:
    """A resolved config for batches of ``query_len`` query tokens per request (speculative
    verify steps: 1 + k): its compile sizes and CUDA-graph capture sizes rounded up to
    multiples of ``query_len`` (deduplicated; sizes past ``max_num_tokens`` dropped), so a
    uniform verify batch of any request count up to ``max_num_seqs`` lands on a size.
    Returns it and, when those sizes cannot cover ``max_num_seqs * query_len`` tokens (verify
    steps above the largest size would run without graphs), the warning to show, with the
    sizes.  ``query_len`` 1: the config unchanged."""
    if isinstance(query_len, bool) or not isinstance(query_len, int) or query_len < 1:
        raise ValueError(
            f"round_sizes_to_query_len: query_len must be an int >= 1, got {query_len!r}"
        )
    if query_len == 1:
        return config, None
    upper = config.max_num_tokens

    def rounded(sizes: Optional[list[int]]) -> list[int]:
        out = sorted({-(-s // query_len) * query_len for s in sizes or []})
        return [s for s in out if upper is None or s <= upper]

    capture = rounded(config.cudagraph_capture_sizes)
    compile_sizes = rounded(config.compile_sizes)
    need = max_num_seqs * query_len
    problems = []
    if upper is not None and upper < need:
        problems.append(
            f"max_num_tokens={upper} < max_num_seqs ({max_num_seqs}) x (1 + k) = {need}: a "
            f"full verify batch does not fit one step (drafts are cut to the token budget)"
        )
    if config.cudagraph_mode is not None and config.cudagraph_mode != CUDAGraphMode.NONE:
        if not capture or capture[-1] < need:
            problems.append(
                f"cudagraph_capture_sizes {capture} (rounded up to multiples of 1 + k = "
                f"{query_len}) stop below max_num_seqs x (1 + k) = {need}: verify steps of "
                f"more tokens run WITHOUT CUDA graphs; add capture sizes up to {need}"
            )
    warning = None
    if problems:
        warning = "speculative decoding: " + "; ".join(problems)
    return config.replace(cudagraph_capture_sizes=capture, compile_sizes=compile_sizes), warning


def default_capture_sizes(max_num_tokens: int) -> list[int]:
    """[1, 2, 4] + every 8 up to 256 + every 16 beyond, capped at ``max_num_tokens``."""
    sizes = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, max_num_tokens + 1, 16))
    return [s for s in sizes if s <= max_num_tokens]


# Level defaults for every "unset" field. Which passes each level runs is not here: it is
# metadata on each pass (``@register_pass(levels=...)``, passes/registry.py), passed to
# :meth:`CompilationConfig.resolve` as ``level_passes`` by the layer above.
LEVEL_DEFAULTS: dict[int, dict[str, Any]] = {
    0: dict(mode=CompilationMode.NONE, cudagraph_mode=CUDAGraphMode.NONE, compiler="eager"),
    1: dict(
        mode=CompilationMode.PIECEWISE, cudagraph_mode=CUDAGraphMode.PIECEWISE, compiler="inductor"
    ),
    2: dict(
        mode=CompilationMode.PIECEWISE,
        cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
        compiler="inductor",
    ),
    3: dict(
        mode=CompilationMode.PIECEWISE,
        cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
        compiler="inductor",
    ),
}
for _d in LEVEL_DEFAULTS.values():
    for _name in (
        "splitting_ops",
        "compile_ranges_endpoints",
        "compile_sizes",
        "cudagraph_capture_sizes",
        "compiler",
    ):
        _d.setdefault(_name, None)
