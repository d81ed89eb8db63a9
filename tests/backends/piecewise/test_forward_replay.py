"""Whole-forward replay (backends/piecewise/forward_replay.py): the native calls of every part
of a forward, recorded once per set of inputs and replayed as one; the same tokens, a refusal
where a part cannot report, tapes dropped when the weights move."""

import operator

import pytest
import torch
import torch.fx as fx
from checkpoints import FAMILIES

import backends.attention  # noqa: F401  (defines piecewise::attention)
from backends.piecewise import replay as R
from backends.piecewise.split import native_parts


def _llm(checkpoint, cache_dir, compilation=None, **kwargs):
    from framework import LLM

    kwargs = {"max_num_seqs": 3, "max_model_len": 64, **kwargs}
    return LLM(
        str(checkpoint),
        dtype="bfloat16",
        optimization_level=2,
        cache_dir=cache_dir,
        compilation_config={"progress_bar": False, **(compilation or {})},
        **kwargs,
    )


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 200, (n,), generator=g).tolist() for n in (3, 11, 20)]


def _forward_replay(llm):
    replay = llm.worker.forward_replay
    if replay is None or replay.refusal is not None:
        pytest.skip(f"no forward replay here ({replay and replay.refusal})")
    return replay


def test_native_parts_are_the_pieces_and_attention_calls_and_nothing_else():
    """A forward's reporting parts: each piece call and each attention call; ``getitem`` on a
    piece's outputs is Python; any other node runs outside the parts: no recording."""
    g = fx.Graph()
    x = g.placeholder("x")
    y = g.call_module("submod_0", (x,))
    a = g.call_function(operator.getitem, (y, 0))
    g.call_function(torch.ops.piecewise.attention.default, (a, a, a, a, "l", 0.1, 0))
    z = g.call_module("submod_2", (a,))
    g.output(z)
    root = {"submod_0": torch.nn.Identity(), "submod_2": torch.nn.Identity()}
    assert native_parts(fx.GraphModule(root, g), {"submod_0", "submod_2"}) == (3, None)
    count, why = native_parts(fx.GraphModule(root, g), {"submod_0"})  # submod_2: not a piece
    assert count == 0 and "submod_2" in why and "outside the pieces" in why
    g.inserting_before(g.output_node())
    g.call_function(torch.relu, (a,))
    count, why = native_parts(fx.GraphModule(root, g), {"submod_0", "submod_2"})
    assert count == 0 and "relu" in why


def test_engine_tokens_are_the_same_with_and_without_forward_replay(
    llama_checkpoint, compile_cache_dir
):
    """Greedy generation at batch 1 and 3 (prompts of different lengths): the same tokens
    with the forward replayed whole and with only its pieces replayed; replayed means one
    recording per batch shape, then replays."""
    llm = _llm(llama_checkpoint, compile_cache_dir)
    replay = _forward_replay(llm)
    prompts = _prompts()
    on = (
        llm.generate(prompts[:1], 12, ignore_eos=True),
        llm.generate(prompts, 12, ignore_eos=True),
    )
    assert replay.refusals == {}
    assert replay.recorded >= 2 and replay.replayed >= 18  # b1: 11 decodes, b3: 11 (shrinking)
    stats = llm.stats
    assert stats["forward_replays"] == replay.replayed and stats["forward_replay_refusals"] == {}
    replay.enabled = False
    done = replay.replayed
    off = (
        llm.generate(prompts[:1], 12, ignore_eos=True),
        llm.generate(prompts, 12, ignore_eos=True),
    )
    assert off == on and replay.replayed == done
    plain = _llm(llama_checkpoint, compile_cache_dir, {"cpu_replay_forward": False})
    assert plain.worker.forward_replay is None


def test_no_forward_replay_while_ops_are_watched(llama_checkpoint, compile_cache_dir):
    """Under the profiler every op must be seen: the forward runs as always."""
    llm = _llm(llama_checkpoint, compile_cache_dir)
    replay = _forward_replay(llm)
    prompt = _prompts()[1]
    want = llm.generate([prompt], 6, ignore_eos=True)
    done = replay.replayed
    with torch.profiler.profile() as prof:
        got = llm.generate([prompt], 6, ignore_eos=True)
    assert got == want and replay.replayed == done
    assert any(e.name == "piecewise::cpu_paged_attention" for e in prof.events())


def test_moved_weights_drop_every_tape(llama_checkpoint, compile_cache_dir):
    """A parameter given new memory (``param.data = ...``) is read at its new address: the
    next replay finds it moved, drops every tape and records again -- the tokens are those of
    the new weights (here the final norm negated: the greedy tokens change), never the old."""
    llm = _llm(llama_checkpoint, compile_cache_dir)
    replay = _forward_replay(llm)
    prompt = _prompts()[2]
    before = llm.generate([prompt], 8, ignore_eos=True)
    (norm,) = [p for n, p in llm.worker.model.named_parameters() if n.endswith("model.norm.weight")]
    old = norm.data  # kept alive: a stale tape would read these values, not garbage
    norm.data = -old
    replay.enabled = False
    want = llm.generate([prompt], 8, ignore_eos=True)
    assert want != before
    replay.enabled = True
    got = llm.generate([prompt], 8, ignore_eos=True)
    assert got == want and replay.invalidations == 1 and replay.replayed > 0


def test_a_forward_with_a_part_that_cannot_report_is_not_replayed(
    llama_checkpoint, compile_cache_dir
):
    """The torch attention backend reports no native call: the forward is refused (each
    piece still replays on its own) and says how many parts reported; the tokens are those of
    the fused attention's engine."""
    want = _llm(llama_checkpoint, compile_cache_dir).generate(_prompts(), 6, ignore_eos=True)
    llm = _llm(llama_checkpoint, compile_cache_dir, attention_backend="torch")
    replay = _forward_replay(llm)
    runs = []
    real_run = R.Tape.run

    def counted(self, piece):
        runs.append(piece)
        return real_run(self, piece)

    R.Tape.run = counted
    try:
        got = llm.generate(_prompts(), 6, ignore_eos=True)
    finally:
        R.Tape.run = real_run
    assert replay.replayed == 0 and replay.recorded == 0
    (why,) = replay.refusals
    assert "parts reported their native calls" in why
    assert runs and "forward" not in runs  # the pieces replayed, the forward did not
    assert len(got) == len(want)


@pytest.mark.parametrize("family", FAMILIES + ("qwen3_moe",))
def test_every_family_replays_its_forward_with_the_same_tokens(
    tiny_checkpoint, compile_cache_dir, family
):
    """Each dense family (QK norm, sliding window, biases) replays whole forwards and gives
    the tokens of its pieces replayed alone; a mixture of experts is refused -- its layers'
    MoE op has no recording kernel -- and says so, its tokens unchanged."""
    llm = _llm(tiny_checkpoint(family), compile_cache_dir)
    replay = _forward_replay(llm)
    prompts = _prompts()
    on = (
        llm.generate(prompts[:1], 10, ignore_eos=True),
        llm.generate(prompts, 10, ignore_eos=True),
    )
    replay.enabled = False
    off = (
        llm.generate(prompts[:1], 10, ignore_eos=True),
        llm.generate(prompts, 10, ignore_eos=True),
    )
    assert on == off
    if family in FAMILIES:
        assert replay.refusals == {} and replay.replayed >= 14
    else:
        assert replay.replayed == 0
        assert all("fused_moe_packed has no recording kernel" in why for why in replay.refusals)


def test_tokens_hold_under_preemption_and_prefix_caching(llama_checkpoint, compile_cache_dir):
    """KV pressure that preempts (recompute) and prefix caching (two prompts share a prefix),
    bf16 O2: the tokens with forward replay equal those with every piece running its Python
    (``cpu_replay_max_tokens=0``), and forwards did replay."""
    import random

    from framework.engine.kv_cache import KVCacheSpec
    from models.config import ModelConfig

    mc = ModelConfig.from_hf_dir(str(llama_checkpoint))
    spec = KVCacheSpec(mc.num_layers, mc.num_kv_heads, mc.head_dim, torch.bfloat16, 16)
    g = random.Random(2)
    shared = [g.randrange(3, 256) for _ in range(20)]
    prompts = [shared + [g.randrange(3, 256) for _ in range(4)] for _ in range(2)]
    prompts += [[g.randrange(3, 256) for _ in range(20)] for _ in range(2)]
    outs = {}
    for limit in (16, 0):
        llm = _llm(
            llama_checkpoint,
            compile_cache_dir,
            {"cpu_replay_max_tokens": limit},
            max_num_seqs=4,
            max_model_len=128,
            kv_cache_memory_bytes=12 * spec.bytes_per_block,  # 4 x 2 blocks admitted, 4 x 4 later
            enable_prefix_caching=True,
        )
        outs[limit] = llm.generate(prompts, 40, ignore_eos=True)
        assert llm.stats["preemptions"] > 0
        if limit:
            assert _forward_replay(llm).replayed > 0
    assert outs[16] == outs[0]
