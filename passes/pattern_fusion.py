"""The pattern-matcher pass: fusions as small pattern objects.

A :class:`FusionPattern` is (pattern fn, replacement fn, example inputs).  Both functions are
plain torch (plus ``auto_functionalized`` calls of custom ops); Inductor's
``register_replacement`` traces them with ``fwd_only`` -- the same decompositions that produced
the post-grad graph -- so a pattern written as the model writes it matches the decomposed aten
form.  A fusion pass is a :class:`PatternFusionPass` subclass whose :meth:`patterns` yields its
pattern objects; they are registered into that pass's one ``PatternMatcherPass``.

Scalars that vary between models (``eps``) are pattern arguments listed in
``FusionPattern.scalars`` with a dummy trace value: they become wildcards of the pattern and are
passed to the replacement as matched.  Integer sizes (split sizes, head counts derived from
shapes) are re-derived by the matcher from each match's real shapes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Optional

import torch

from framework.compat import inductor as compat_inductor
from framework.compat.ops import FakeTensorMode, OpOverload, auto_functionalized
from passes.base import GraphPass, PassContext
from passes.fx_utils import canonicalize_auto_functionalized, mutable_arg_offset, schema_ordered

# torch._inductor.pattern_matcher is imported when a fusion is built or run, not when this
# module is: the pass registry imports every pass module to read its @register_pass metadata
# (levels, order), and importing the pattern matcher costs seconds (deferred imports below).
if TYPE_CHECKING:
    from framework.compat.inductor import Match, PatternMatcherPass

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class FusionPattern:
    """One rewrite rule: every subgraph computing ``pattern(*inputs)`` becomes
    ``replacement(*inputs)``.  Both take the same arguments and return the same number of
    tensors (the pattern's outputs are replaced one for one)."""

    name: str
    pattern: Callable[..., Any]
    replacement: Callable[..., Any]
    example_inputs: Callable[[], list[Any]]
    """Built lazily: tensors the functions are traced with (small, right dtypes)."""
    scalars: dict[str, float] = field(default_factory=dict)
    """Scalar arguments (by name) matched as wildcards; value = dummy used while tracing
    (pick one that cannot occur as another constant in the pattern)."""
    extra_check: Optional[Callable[[Match], bool]] = None


def call_mutating(op: OpOverload, **kwargs: Any) -> tuple[Any, ...]:
    """In a pattern or replacement: the functional form of a mutating op, returning the new
    values of its mutated arguments in schema order (``auto_functionalized`` v1)."""
    result = auto_functionalized(op, **schema_ordered(op, kwargs))
    offset = mutable_arg_offset(op)
    names = [
        a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write
    ]
    return tuple(result[offset + i] for i in range(len(names)))


def _scalars_are_constants(p: FusionPattern) -> Callable[[Match], bool]:
    """A scalar wildcard must have matched a Python number: a graph that computes ``eps`` as a
    tensor or symbol (fully dynamic traces can) cannot be passed to an op's ``float`` arg.
    A scalar missing from the match was burned into the pattern as a literal by the re-trace
    with the matched values (torch 2.11's ``register_replacement`` checks that re-traced
    pattern): it matched a Python number."""

    def check(match: Match) -> bool:
        for name in p.scalars:
            if name not in match.kwargs:
                continue
            value = match.kwargs.get(name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return False
        return p.extra_check is None or p.extra_check(match)

    return check


def views_to_reshapes(graph: torch.fx.Graph) -> None:
    """``aten.view`` -> ``aten.reshape``, as Inductor's post-grad ``view_to_reshape`` does before
    our passes run; applied to patterns and to eager-adaptor graphs so both spell views alike."""
    for node in graph.find_nodes(op="call_function", target=torch.ops.aten.view.default):
        node.target = torch.ops.aten.reshape.default


def trace_pattern(fn: Callable[..., Any], args: Any, **kwargs: Any) -> torch.fx.GraphModule:
    """``fwd_only`` followed by the same view canonicalization the post-grad graph got."""
    fwd_only = compat_inductor.pattern_matcher().fwd_only  # deferred: see the imports

    gm = fwd_only(fn, args, **kwargs)
    views_to_reshapes(gm.graph)
    gm.recompile()
    return gm


def float_dtypes(context: PassContext) -> tuple[torch.dtype, ...]:
    """Activation dtypes to register patterns for: the model's, or all float dtypes."""
    return (context.dtype,) if context.dtype is not None else FLOAT_DTYPES


class PatternFusionPass(GraphPass):
    """Runs one ``PatternMatcherPass`` holding every pattern of :meth:`patterns`.

    Tracing patterns costs ~0.1-0.5 s each, so the matcher is built once per process for each
    (pass class, config factors) and shared by every manager that uses the same config.
    """

    is_fusion: ClassVar[bool] = True
    trace_on_fake_tensors: ClassVar[bool] = False
    """Trace the patterns on fake tensors instead of real ones.  Set by passes whose
    patterns hold collectives: traced on real tensors, building the pass would run them (a
    cross-rank call, one that deadlocks on gloo under the tracer's Python dispatcher)."""
    _matchers: ClassVar[dict[tuple, PatternMatcherPass]] = {}

    def patterns(self) -> Iterable[FusionPattern]:
        raise NotImplementedError(f"{type(self).__name__} must yield FusionPattern objects")

    def config_factors(self) -> dict[str, Any]:
        return {"dtypes": [str(d) for d in float_dtypes(self.context)]}

    def __init__(self, context: Optional[PassContext] = None):
        super().__init__(context)
        key = (type(self), repr(sorted(self.config_factors().items())))
        matcher = PatternFusionPass._matchers.get(key)
        if matcher is None:
            PatternMatcherPass = compat_inductor.pattern_matcher().PatternMatcherPass  # deferred

            matcher = PatternMatcherPass(pass_name=self.name or type(self).__name__)
            for p in self.patterns():
                self._register(p, matcher, fake=self.trace_on_fake_tensors)
            PatternFusionPass._matchers[key] = matcher
        self.matcher = matcher

    @staticmethod
    def _register(p: FusionPattern, matcher: PatternMatcherPass, fake: bool = False) -> None:
        kwargs: dict[str, Any] = {}
        if p.scalars:
            kwargs["scalar_workaround"] = dict(p.scalars)
        kwargs["extra_check"] = _scalars_are_constants(p)
        # The example inputs are real tensors (fake ones with ``fake``): trace without
        # autograd, on CPU, once.
        with torch.no_grad(), FakeTensorMode() if fake else contextlib.nullcontext():
            compat_inductor.register_replacement(
                p.pattern,
                p.replacement,
                p.example_inputs(),
                trace_pattern,
                matcher,
                pattern_name=p.name,
                skip_duplicates=True,
                **kwargs,
            )

    def __call__(self, graph: torch.fx.Graph) -> None:
        views_to_reshapes(graph)
        canonicalize_auto_functionalized(graph)
        self.match_count = self.matcher.apply(graph)
        if self.match_count:
            # A replacement is inserted at the pattern's last output, which can precede an
            # input defined later in the graph (e.g. the quant's ``empty`` out buffer).
            stable_topological_sort = compat_inductor.pattern_matcher().stable_topological_sort

            stable_topological_sort(graph)
            graph.eliminate_dead_code()
