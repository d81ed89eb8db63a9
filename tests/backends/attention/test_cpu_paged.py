"""The fused CPU paged-attention backend against the plain-torch reference backend: mixed
prefill+decode batches, block boundaries, GQA/MQA, sliding windows, head_dim 32/64/128,
float32 and bfloat16, contexts 1..4k, padding, the KV write, errors and opcheck."""

import math
from pathlib import Path

import pytest
import torch

import backends.attention  # noqa: F401  (registers the op and the backends)
from backends.attention.cpu_paged import paged_attention
from backends.attention.cpu_paged_build import isa, load_library
from framework.core.attention_metadata import AttentionMetadata
from framework.core.forward_context import ForwardContext, set_forward_context


def make_step(ctx_lens, q_lens, hq, hkv, d, block_size, dtype, pad=0, seed=0):
    """A step where request i has ``ctx_lens[i]`` tokens of context after the step, the last
    ``q_lens[i]`` of them new.  Returns (q, k, v, out, kv_cache, metadata); the cache holds
    random KV for the earlier positions, in blocks handed out from a shuffled order."""
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-n // block_size) for n in ctx_lens]
    num_blocks = sum(nblk) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    kv = torch.randn(2, num_blocks, block_size, hkv, d, generator=g).to(dtype)
    table = torch.zeros(len(ctx_lens), max(nblk), dtype=torch.int32)
    slots, qsl = [], [0]
    for i, (L, ql) in enumerate(zip(ctx_lens, q_lens)):
        blocks = [order.pop() for _ in range(nblk[i])]
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(L - ql, L)]
        qsl.append(qsl[-1] + ql)
    n = qsl[-1]
    q = torch.randn(n + pad, hq, d, generator=g).to(dtype)
    k = torch.randn(n + pad, hkv, d, generator=g).to(dtype)
    v = torch.randn(n + pad, hkv, d, generator=g).to(dtype)
    md = AttentionMetadata(
        "torch",
        n,
        len(ctx_lens),
        max(q_lens),
        max(ctx_lens),
        torch.tensor(qsl, dtype=torch.int32),
        torch.tensor(ctx_lens, dtype=torch.int32),
        table,
        torch.tensor(slots + [-1] * pad, dtype=torch.int64),
        qsl,
        list(ctx_lens),
    )
    out = torch.full_like(q, float("nan"))
    return q, k, v, out, kv, md


def run(backend, q, k, v, out, kv, md, scale, window, library=None):
    """The attention op through ``backend``; with ``library`` (a build of the kernel, e.g. the
    portable one) the kernel is called through it instead (ctypes), on copies alike."""
    md = AttentionMetadata(**{**md.__dict__, "attention_backend": backend})
    out, kv = out.clone(), kv.clone()
    if library is not None:
        paged_attention(q, k, v, out, kv, md, scale, window, library=library)
        return out, kv
    with set_forward_context(ForwardContext({"l": md}, {"l": kv})):
        torch.ops.piecewise.attention(q, k, v, out, "l", scale, window)
    return out, kv


def check(
    ctx_lens,
    q_lens,
    hq=8,
    hkv=4,
    d=64,
    block_size=16,
    dtype=torch.float32,
    window=-1,
    pad=0,
    seed=0,
    library=None,
):
    step = make_step(ctx_lens, q_lens, hq, hkv, d, block_size, dtype, pad, seed)
    scale = 1 / math.sqrt(d)
    ref_out, ref_kv = run("torch", *step, scale, window)
    out, kv = run("cpu_paged", *step, scale, window, library=library)
    assert torch.equal(kv, ref_kv), "the KV write differs from the reference"
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, ref_out, **tol)
    if pad:
        assert torch.equal(out[-pad:], torch.zeros_like(out[-pad:]))
    return out


def test_library_builds_for_this_cpu():
    assert load_library() is load_library()  # built once, cached
    assert isa() in ("avx512", "avx2", "neon", "portable")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
def test_decode_batch(dtype, d):
    """bf16 at head_dim 32/64/128/256 takes the direct path on AVX512-BF16 builds, 96 the
    staged one (as fp32 does)."""
    check([1, 17, 80, 128], [1, 1, 1, 1], d=d, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_prefill_and_decode_with_padding(dtype):
    # a fresh prompt, a chunked prefill continuing a context, decodes, a 1-token prompt
    check([37, 70, 5, 1, 200], [37, 20, 1, 1, 1], dtype=dtype, pad=5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 3, 16, 128])
def test_block_boundaries(block_size, dtype):
    lens = [block_size - 1 or 1, block_size, block_size + 1, 2 * block_size, 3 * block_size + 2]
    q_lens = [min(ql, L) for ql, L in zip([1, 2, 1, 5, 3], lens)]
    check(lens, q_lens, block_size=block_size, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2), (8, 1), (12, 3), (32, 2)])
def test_gqa_and_mqa(hq, hkv, dtype):
    # (32, 2): 16 query heads a KV head, so a prefill tile's rows outnumber one pass of the
    # direct path's value accumulators
    check([40, 9, 23], [1, 9, 4], hq=hq, hkv=hkv, dtype=dtype)


@pytest.mark.parametrize("window", [1, 4, 16, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window(window, dtype):
    check([64, 50, 7, 100], [1, 25, 7, 1], window=window, dtype=dtype, block_size=8)


@pytest.mark.parametrize("ctx", [1, 2, 127, 1000, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_context_lengths(ctx, dtype):
    check([ctx], [1], dtype=dtype, d=128)
    check([ctx, 3], [min(ctx, 33), 2], dtype=dtype, d=64, seed=1)


def test_noncontiguous_q_view_of_a_fused_projection():
    """q/k/v as the model passes them: views of one qkv projection (token stride > row)."""
    hq, hkv, d = 8, 2, 32
    q, k, v, out, kv, md = make_step([30, 3], [30, 1], hq, hkv, d, 16, torch.float32)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    qv, kv_, vv = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
    views = (qv.view(-1, hq, d), kv_.view(-1, hkv, d), vv.view(-1, hkv, d))
    assert not views[0].is_contiguous()
    ref = run("torch", q, k, v, out, kv, md, 0.2, -1)
    got = run("cpu_paged", *views, out, kv, md, 0.2, -1)
    torch.testing.assert_close(got[0], ref[0], atol=2e-5, rtol=2e-5)
    assert torch.equal(got[1], ref[1])


def test_zero_query_padding_requests_are_skipped():
    """FULL-graph style padding: extra requests with no query tokens and empty context."""
    q, k, v, out, kv, md = make_step([12, 5], [1, 1], 8, 4, 64, 16, torch.float32)
    qsl = md.query_start_loc_cpu + [2]
    lens = md.seq_lens_cpu + [0]
    table = torch.cat([md.block_table, torch.zeros(1, md.block_table.shape[1], dtype=torch.int32)])
    md2 = AttentionMetadata(
        "torch",
        2,
        3,
        1,
        12,
        torch.tensor(qsl, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32),
        table,
        md.slot_mapping,
        qsl,
        lens,
    )
    ref = run("torch", q, k, v, out, kv, md, 0.125, -1)
    got = run("cpu_paged", q, k, v, out, kv, md2, 0.125, -1)
    torch.testing.assert_close(got[0], ref[0], atol=2e-5, rtol=2e-5)


def test_errors_name_the_problem():
    q, k, v, out, kv, md = make_step([8], [2], 8, 4, 64, 4, torch.float32)
    with pytest.raises(ValueError, match="share one dtype"):
        run("cpu_paged", q.half(), k, v, out, kv, md, 0.1, -1)
    with pytest.raises(ValueError, match="contiguous heads"):
        run("cpu_paged", q.transpose(1, 2).contiguous().transpose(1, 2), k, v, out, kv, md, 0.1, -1)
    bad = AttentionMetadata(**{**md.__dict__, "block_table": md.block_table + 100})
    with pytest.raises(ValueError, match="outside the KV cache"):
        run("cpu_paged", q, k, v, out, kv, bad, 0.1, -1)


def test_opcheck():
    q, k, v, out, kv, md = make_step([20, 6], [4, 1], 8, 4, 32, 4, torch.float32)
    md.attention_backend = "cpu_paged"
    with set_forward_context(ForwardContext({"l": md}, {"l": kv})):
        torch.library.opcheck(
            torch.ops.piecewise.attention.default,
            (q, k, v, out, "l", 0.125, -1),
            test_utils=("test_schema", "test_faketensor"),
        )


def test_opcheck_of_the_kernel_op():
    """piecewise::cpu_paged_attention: its schema (out and the cache mutated) and its fake."""
    q, k, v, out, kv, md = make_step([20, 6], [4, 1], 8, 4, 32, 4, torch.bfloat16)
    torch.library.opcheck(
        torch.ops.piecewise.cpu_paged_attention.default,
        (q, k, v, out, kv, md.slot_mapping, md.block_table, md.query_start_loc, md.seq_lens,
         md.num_reqs, md.num_actual_tokens, 0.125, -1),
        test_utils=("test_schema", "test_faketensor"),
    )  # fmt: skip


def test_portable_build_matches_reference():
    """The build without -march=native (what a machine without the native flags gets)."""
    assert isa(portable=True) in ("portable", "neon", "avx2")
    lib = load_library(portable=True)
    check([37, 70, 5, 200], [37, 20, 1, 1], dtype=torch.bfloat16, window=16, block_size=8,
          library=lib)  # fmt: skip
    check([129, 3], [1, 3], hq=8, hkv=1, d=128, library=lib)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_ops_cpp_kernel_is_the_ctypes_kernel_bit_for_bit(dtype):
    """The backend's calls reach the op's C++ CPU kernel (csrc/cpu_paged_op.cpp, the kernel
    source compiled into the torch op library); the Python body calls the ctypes build of the
    same source: the same bits, output and KV write."""
    from backends.attention.cpu_paged_build import load_op

    assert load_op(), "the op library builds here"
    step = make_step([37, 70, 5, 200], [37, 20, 1, 1], 8, 2, 64, 16, dtype, pad=3)
    out, kv = run("cpu_paged", *step, 0.125, 24)
    ref_out, ref_kv = run("cpu_paged", *step, 0.125, 24, library=load_library())
    assert torch.equal(kv, ref_kv)
    assert torch.equal(out, ref_out)  # the 3 padding rows too: each path zeroes them


def test_the_backend_calls_the_ops_kernel_without_the_dispatcher(count_direct_calls):
    """Where the op library is also a Python module, the backend calls its kernel function
    (framework.core.ops.direct_call) and gets the op's bits; under the profiler the call goes
    through the dispatcher, which records it."""
    from backends.attention import cpu_paged
    from backends.attention.cpu_paged_build import OP_LIBRARY, load_op
    from framework.core.ops import direct_kernel

    assert load_op(), "the op library builds here"
    module = OP_LIBRARY.python_module()
    if OP_LIBRARY._binds_python():  # Python's headers are here: the module must be there
        assert module is not None
        assert direct_kernel("piecewise::cpu_paged_attention") is module.cpu_paged_attention
    step = make_step([37, 70, 5, 200], [37, 20, 1, 1], 8, 2, 64, 16, torch.bfloat16, pad=3)
    want = run("cpu_paged", *step, 0.125, 24, library=load_library())
    calls = count_direct_calls("piecewise::cpu_paged_attention")
    cpu_paged._op_call.cache_clear()  # bind the counted kernel
    try:
        got = run("cpu_paged", *step, 0.125, 24)
        assert calls == [13]
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        with torch.profiler.profile() as prof:
            got = run("cpu_paged", *step, 0.125, 24)
        assert calls == [13]  # the dispatcher's call, recorded
        assert any(e.name == "piecewise::cpu_paged_attention" for e in prof.events())
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    finally:
        cpu_paged._op_call.cache_clear()


def test_the_op_python_body_checks_what_the_cpp_kernel_checks():
    """Both kernels of piecewise::cpu_paged_attention refuse the same inputs with the same
    ValueError (the Python body runs where the op library cannot be built)."""
    from backends.attention.cpu_paged import call_kernel, cpu_paged_attention
    from backends.attention.cpu_paged_build import load_op

    assert load_op(), "the op library builds here"
    q, k, v, out, kv, md = make_step([8, 4], [2, 4], 8, 4, 64, 4, torch.float32)
    meta = (md.slot_mapping, md.block_table, md.query_start_loc, md.seq_lens)
    cases = {
        "share one dtype": (q.half(), k, v, out, kv, *meta, 2, 6),
        "contiguous heads": (q, k[:, :2], v, out, kv, *meta, 2, 6),
        "exceeds the rows of q/k/v/out": (q, k[:3], v, out, kv, *meta, 2, 6),
        "exceeds the block table": (
            q,
            k,
            v,
            out,
            kv,
            md.slot_mapping,
            md.block_table[:, :1],
            *meta[2:],
            2,
            6,
        ),
        "metadata seq_lens must be a 1-D CPU torch.int32": (
            q,
            k,
            v,
            out,
            kv,
            *meta[:3],
            md.seq_lens.long(),
            2,
            6,
        ),
        "query_start_loc ends at 6 > num_actual_tokens=5": (q, k, v, out, kv, *meta, 2, 5),
        "slot_mapping has 6 entries": (q, k, v, out, kv, *meta, 2, 7),
        "outside the KV cache": (
            q,
            k,
            v,
            out,
            kv,
            md.slot_mapping,
            md.block_table + 100,
            *meta[2:],
            2,
            6,
        ),
    }
    for match, args in cases.items():
        for fn in (cpu_paged_attention, call_kernel):  # the C++ kernel, the Python body
            with pytest.raises(ValueError, match=match):
                fn(*args, 0.1, -1)


@pytest.mark.parametrize("portable", [False, True])
def test_softmax_exp_of_the_block_path_has_the_scalar_bits(portable):
    """The block softmax's 16-lane exp (AVX-512 builds) gives every input exp_neg's bits: a
    verify row and the decode row it stands for may take either path, and the values must
    stay within the polynomial's ~2 ulp of exp."""
    lib = load_library(portable=portable)
    g = torch.Generator().manual_seed(0)
    edges = torch.tensor([0.0, -0.0, -87.0, -87.0001, -86.9999, -1e-30, -float("inf"), 1e-3])
    x = torch.cat([edges, -100 * torch.rand(200_003, generator=g), -torch.rand(5_000, generator=g)])
    vec, scalar = torch.empty_like(x), torch.empty_like(x)
    lib.piecewise_cpu_paged_exp_neg(x.data_ptr(), vec.data_ptr(), scalar.data_ptr(), x.numel())
    assert torch.equal(vec.view(torch.int32), scalar.view(torch.int32))
    live = x >= -87
    ref = torch.exp(x.double())
    rel = ((scalar.double() - ref).abs() / ref)[live]
    assert rel.max() < 1e-6
    assert torch.all(scalar[~live] == 0)
    nan = torch.full((3,), float("nan"))
    lib.piecewise_cpu_paged_exp_neg(nan.data_ptr(), vec.data_ptr(), scalar.data_ptr(), 3)
    assert torch.isnan(vec[:3]).all() and torch.isnan(scalar[:3]).all()


def test_default_backend_is_the_fused_kernel_on_cpu(monkeypatch):
    from backends.attention import selector

    assert selector.default_backend("cpu") == "cpu_paged"
    assert selector.default_backend("cuda") == "torch"
    monkeypatch.setattr(selector, "compiler", lambda: None)
    assert selector.default_backend("cpu") == "torch"


def test_short_inputs_and_block_table_are_rejected_before_the_kernel():
    q, k, v, out, kv, md = make_step([8, 4], [2, 4], 8, 4, 64, 4, torch.float32)
    with pytest.raises(ValueError, match="exceeds the rows of q/k/v/out"):
        run("cpu_paged", q, k[:3], v, out, kv, md, 0.1, -1)
    narrow = AttentionMetadata(**{**md.__dict__, "block_table": md.block_table[:, :1]})
    with pytest.raises(ValueError, match="exceeds the block table"):
        run("cpu_paged", q, k, v, out, kv, narrow, 0.1, -1)
    with pytest.raises(ValueError, match="runs on CPU tensors"):  # (the op sends meta to fake)
        paged_attention(q.to("meta"), k, v, out, kv, md, 0.1, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [-1, 24])
@pytest.mark.parametrize("ctx", [21, 37, 64, 90])
@pytest.mark.parametrize("portable", [False, True])
def test_a_verify_row_has_the_bits_of_the_decode_step_it_stands_for(portable, ctx, window, dtype):
    """Speculative decoding keeps greedy tokens only if a verify step's row i (1 + k query
    tokens of one request) computes exactly what a decode step at that position would: the
    keys beyond the row are masked, and neither they nor where the block's keys start (the
    window) may change the order of the softmax sums (they did on AVX2: 3 of 16 cases)."""
    lib = load_library(portable=True) if portable else None
    ql = 5
    q, k, v, out, kv, md = make_step([ctx], [ql], 8, 4, 64, 16, dtype)
    scale = 1 / math.sqrt(64)
    verify, kv_after = run("cpu_paged", q, k, v, out, kv, md, scale, window, library=lib)
    for i in range(ql):
        L = ctx - ql + 1 + i
        one = AttentionMetadata(
            "cpu_paged",
            1,
            1,
            1,
            L,
            torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([L], dtype=torch.int32),
            md.block_table,
            md.slot_mapping[i : i + 1].clone(),
            [0, 1],
            [L],
        )
        dec, _ = run("cpu_paged", q[i : i + 1], k[i : i + 1], v[i : i + 1],
                     out[i : i + 1], kv_after, one, scale, window, library=lib)  # fmt: skip
        assert torch.equal(dec[0], verify[i]), f"row {i} (context {L}) differs from its decode"


def test_a_recorded_forward_gets_the_kernel_call_it_can_replay():
    """While a whole forward is recorded (a NativeTapeSink on the context), the backend runs
    the op's recording kernel and reports the native call it made: the words-ABI entry (the
    scale as its float's bits) and its 25 arguments, nonzero on error.  Replayed on fresh
    copies of the same tensors' contents -- in the same memory -- it writes the op's bits."""
    from backends.attention.cpu_paged_build import OP_LIBRARY, load_op
    from backends.piecewise import replay as R
    from framework.core.native_tape import NativeTapeSink

    assert load_op(), "the op library builds here"
    if not OP_LIBRARY._binds_python() or R.load_replayer() is None:
        pytest.skip("no recording kernel (no Python module) or no replay library here")
    q, k, v, out, kv, md = make_step([37, 70, 5], [5, 5, 1], 8, 2, 64, 16, torch.bfloat16, pad=1)
    md = AttentionMetadata(**{**md.__dict__, "attention_backend": "cpu_paged"})
    want_out, want_kv = out.clone(), kv.clone()
    paged_attention(q, k, v, want_out, want_kv, md, 0.125, 0)
    kv0 = kv.clone()
    sink = NativeTapeSink()
    with set_forward_context(ForwardContext({"l": md}, {"l": kv}, native_tape=sink)):
        paged_attention(q, k, v, out, kv, md, 0.125, 0)
    assert sink.refusal is None and sink.reports == 1
    ((fn, kind, words, label),) = sink.calls
    assert kind == 1 and len(words) == 25 and label == "cpu_paged_attention"
    assert words[0] == q.data_ptr() and words[6] == out.data_ptr() and words[8] == kv.data_ptr()
    assert torch.equal(out, want_out) and torch.equal(kv, want_kv)  # the call itself ran
    out.fill_(float("nan"))
    kv.copy_(kv0)
    tape = R.Tape(R.load_replayer(), sink.calls, None, [])
    tape.run("attention")
    assert torch.equal(out, want_out) and torch.equal(kv, want_kv)
    md.block_table[0, 0] = kv.shape[1] + 5  # a block outside the cache: the kernel refuses
    with pytest.raises(RuntimeError, match=r"cpu_paged_attention\) returned error 4"):
        tape.run("attention")


def test_an_item_of_every_kv_head_gives_the_bits_of_one_head_items():
    """With decode / verify tiles enough for every thread (2 per thread), a work item takes
    every KV head of its tile (each key row read whole); otherwise one head.  Each row's
    result is the same either way, bit for bit: here the choice is flipped through the
    thread count the kernel sees (64 threads: 8 tiles are too few to group)."""
    step = make_step(
        [37, 70, 5, 200, 16, 90, 33, 120], [1, 1, 1, 1, 5, 5, 1, 1], 8, 2, 64, 16, torch.bfloat16
    )
    lib = load_library()
    qsl = step[-1].query_start_loc

    def heads() -> int:  # the kernel's choice for this call (its direct path: bf16 on AVX512-BF16)
        return lib.piecewise_cpu_paged_item_heads(qsl.data_ptr(), 8, 2, 64, 1)

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        grouped, heads_2 = run("cpu_paged", *step, 0.125, 24), heads()
        torch.set_num_threads(64)
        alone, heads_64 = run("cpu_paged", *step, 0.125, 24), heads()
    finally:
        torch.set_num_threads(threads)
    assert heads_64 == 1
    cpu = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if isa() == "avx512" and "avx512_bf16" in cpu:  # the build has the direct bf16 path
        assert heads_2 == 2, "8 one-token tiles on 2 threads: one item per tile, both heads"
    assert torch.equal(grouped[0], alone[0]) and torch.equal(grouped[1], alone[1])
    assert not grouped[0][: step[-1].num_actual_tokens].isnan().any()
