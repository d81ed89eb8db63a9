"""The Triton paged-attention kernels against the plain-torch backend: compiled on CUDA, in
the Triton interpreter on CPU.  Shapes are tiny: the interpreter runs every program in
Python."""

import random

import pytest
import torch
from triton_aot import MODEL_DTYPES, compile_for_sm90, require_cuda_backend
from triton_interpreter import (
    ON_GPU,
    kernel_test,
    language_is_interpreted,
    run_module_in_interpreter,
)

DEVICE = "cuda" if ON_GPU else "cpu"
TOL = dict(atol=2e-4, rtol=2e-4) if ON_GPU else dict(atol=1e-5, rtol=1e-5)  # GPU SDPA: TF32

triton = pytest.importorskip("triton")

from backends.attention import (
    torch_paged,  # noqa: E402,F401  (registers "torch")
    triton_paged,  # noqa: E402
)
from backends.attention.common import AttentionCGSupport, get_backend  # noqa: E402
from framework.core.attention_metadata import AttentionMetadata  # noqa: E402


def in_process(fn):
    """A test that launches the kernels here: compiled on CUDA; on CPU only in a process
    started with TRITON_INTERPRET=1 (test_in_interpreter starts one)."""
    return pytest.mark.triton_kernel(kernel_test(fn))


@pytest.mark.skipif(
    ON_GPU or language_is_interpreted(), reason="the kernel tests run in this process"
)
def test_in_interpreter(request):
    run_module_in_interpreter(__file__, request)


BLOCK_SIZE = 4
HEAD_DIM = 16


def make_batch(
    requests,
    *,
    hq=4,
    hkv=2,
    num_blocks=24,
    pad_tokens=0,
    pad_reqs=0,
    dtype=torch.float32,
    seed=0,
    max_blocks=None,
):
    """``requests``: list of (context already cached, new query tokens).  Returns q, k, v,
    kv_cache (old context filled with random K/V) and metadata; blocks are shuffled so the
    block table really is indirect.  Padding tokens get slot -1; padded requests have zero
    query length (what the runner does for graphs)."""
    g = torch.Generator().manual_seed(seed)
    free = list(range(1, num_blocks))  # block 0 stays the reserved null block
    random.Random(seed).shuffle(free)
    n = sum(ql for _, ql in requests)
    total = n + pad_tokens
    max_blocks = max_blocks or max(-(-(c + ql) // BLOCK_SIZE) for c, ql in requests)
    reqs = len(requests) + pad_reqs
    block_table = torch.zeros(reqs, max_blocks, dtype=torch.int32)
    slot_mapping = torch.full((total,), -1, dtype=torch.int64)
    qsl, seq_lens, tok = [0], [], 0
    for i, (ctx, ql) in enumerate(requests):
        nblk = -(-(ctx + ql) // BLOCK_SIZE)
        blocks = [free.pop() for _ in range(nblk)]
        block_table[i, :nblk] = torch.tensor(blocks, dtype=torch.int32)
        for j in range(ql):
            p = ctx + j
            slot_mapping[tok + j] = blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        tok += ql
        qsl.append(tok)
        seq_lens.append(ctx + ql)
    qsl += [tok] * pad_reqs
    seq_lens += [0] * pad_reqs
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, hkv, HEAD_DIM, generator=g).to(dtype)
    q = torch.randn(total, hq, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(total, hkv, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(total, hkv, HEAD_DIM, generator=g).to(dtype)
    md = AttentionMetadata(
        attention_backend="triton",
        num_actual_tokens=n,
        num_reqs=reqs,
        max_query_len=max(ql for _, ql in requests),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        slot_mapping=slot_mapping,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    if DEVICE != "cpu":
        q, k, v, kv_cache = (t.to(DEVICE) for t in (q, k, v, kv_cache))
        md = AttentionMetadata(
            **{
                **md.__dict__,
                **{
                    f: getattr(md, f).to(DEVICE)
                    for f in ("query_start_loc", "seq_lens", "block_table", "slot_mapping")
                },
            }
        )
    return q, k, v, kv_cache, md


def run_both(q, k, v, kv_cache, md, window, real_reqs=None):
    scale = HEAD_DIM**-0.5
    cache_ref, cache_tri = kv_cache.clone(), kv_cache.clone()
    out_ref = torch.full_like(q, float("nan"))
    out_tri = torch.full_like(q, float("nan"))
    md_ref = md
    if real_reqs is not None:  # the torch backend loops over real requests only
        md_ref = AttentionMetadata(
            **{
                **md.__dict__,
                "num_reqs": real_reqs,
                "query_start_loc_cpu": md.query_start_loc_cpu[: real_reqs + 1],
                "seq_lens_cpu": md.seq_lens_cpu[:real_reqs],
            }
        )
    get_backend("torch").forward(q, k, v, out_ref, cache_ref, md_ref, scale, window)
    get_backend("triton").forward(q, k, v, out_tri, cache_tri, md, scale, window)
    return out_ref, out_tri, cache_ref, cache_tri


MIXES = {
    "decode": [(5, 1), (9, 1), (0, 1)],
    "prefill": [(0, 6), (0, 3)],
    "mixed": [(7, 1), (0, 5), (3, 4)],
    "chunked_prefill": [(8, 3), (2, 1)],
}


@in_process
@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("window", [0, 3])
def test_matches_torch_backend(mix, window):
    q, k, v, cache, md = make_batch(MIXES[mix], seed=sorted(MIXES).index(mix))
    out_ref, out_tri, cache_ref, cache_tri = run_both(q, k, v, cache, md, window)
    torch.testing.assert_close(out_tri, out_ref, **TOL)
    torch.testing.assert_close(cache_tri, cache_ref, atol=0, rtol=0)


@in_process
@pytest.mark.parametrize("hq,hkv", [(2, 2), (6, 2), (4, 1)])
def test_gqa_group_sizes(hq, hkv):
    q, k, v, cache, md = make_batch([(6, 2), (3, 1)], hq=hq, hkv=hkv, seed=hq * 10 + hkv)
    out_ref, out_tri, _, _ = run_both(q, k, v, cache, md, 0)
    torch.testing.assert_close(out_tri, out_ref, **TOL)


@in_process
def test_padding_tokens_and_requests():
    """Graph-style padding: tokens past the real ones (slot -1) and zero-length requests.
    Padding rows come out zero, the cache only changes at real slots."""
    q, k, v, cache, md = make_batch([(5, 1), (2, 3)], pad_tokens=3, pad_reqs=2, seed=7)
    out_ref, out_tri, cache_ref, cache_tri = run_both(q, k, v, cache, md, 0, real_reqs=2)
    torch.testing.assert_close(out_tri, out_ref, **TOL)
    assert torch.count_nonzero(out_tri[md.num_actual_tokens :]) == 0
    torch.testing.assert_close(cache_tri, cache_ref, atol=0, rtol=0)
    assert torch.equal(cache_tri[:, 0], cache[:, 0])  # null block untouched


@in_process
def test_half_precision():
    q, k, v, cache, md = make_batch(MIXES["mixed"], dtype=torch.float16, seed=3)
    out_ref, out_tri, _, _ = run_both(q, k, v, cache, md, 0)
    torch.testing.assert_close(out_tri, out_ref, atol=2e-3, rtol=2e-3)


def test_declares_full_graph_support():
    assert get_backend("triton") is triton_paged.TritonPagedAttention
    assert triton_paged.TritonPagedAttention.cudagraph_support is AttentionCGSupport.ALWAYS


@in_process
def test_rejects_bad_head_counts():
    q, k, v, cache, md = make_batch([(1, 1)], hq=3, hkv=2, seed=1)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        triton_paged.paged_attention_triton(q, torch.empty_like(q), cache, md, 1.0, 0)


@pytest.mark.parametrize("dt", MODEL_DTYPES)
def test_kernels_compile_for_sm90_without_a_gpu(dt, tmp_path, monkeypatch):
    """Both kernels through Triton's real compiler for sm_90 (see tests/triton_aot.py), with
    the cache in ``dt`` and the head shapes of real models (GQA group 4 and 1, D 64 and 128)."""
    require_cuda_backend()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    write_kv, attention = triton_paged._kernels(False)
    for hkv, d in ((8, 128), (2, 64)):
        compile_for_sm90(
            write_kv,
            dict(
                k_ptr=f"*{dt}",
                v_ptr=f"*{dt}",
                key_cache_ptr=f"*{dt}",
                value_cache_ptr=f"*{dt}",
                slot_mapping_ptr="*i64",
                stride_kt="i32",
                stride_vt="i32",
                stride_cache_slot="i32",
            ),
            dict(ROW=hkv * d, BLOCK_ROW=hkv * d),
        )
    ints = (
        "num_reqs",
        "sliding_window",
        "block_size",
        "stride_qt",
        "stride_qh",
        "stride_ot",
        "stride_oh",
        "stride_cache_block",
        "stride_cache_slot",
        "stride_cache_head",
        "stride_bt",
    )
    for group, d in ((4, 128), (1, 64)):
        compile_for_sm90(
            attention,
            dict(
                q_ptr=f"*{dt}",
                out_ptr=f"*{dt}",
                key_cache_ptr=f"*{dt}",
                value_cache_ptr=f"*{dt}",
                block_table_ptr="*i32",
                query_start_loc_ptr="*i32",
                seq_lens_ptr="*i32",
                scale="fp32",
                **{name: "i32" for name in ints},
            ),
            dict(GROUP=group, HEAD_DIM=d, BLOCK_G=group, BLOCK_D=d, BLOCK_N=16, REQ_CHUNK=64),
        )


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_full_cuda_graph_replays_a_different_mix():
    """The ALWAYS claim: captured once, the kernels replay correctly for another batch of the
    same padded shape (8 tokens, 3 requests) with different lengths, blocks and contents."""
    shape = dict(pad_tokens=2, max_blocks=4)
    static = make_batch([(5, 1), (0, 3), (2, 2)], seed=1, **shape)  # 6 real tokens
    other = make_batch([(9, 2), (3, 1), (0, 3)], seed=2, **shape)  # 6 real tokens
    q, k, v, cache, md = static
    out = torch.empty_like(q)
    scale = HEAD_DIM**-0.5
    backend = get_backend("triton")
    backend.forward(q, k, v, out, cache, md, scale, 0)  # warm-up (JIT)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.forward(q, k, v, out, cache, md, scale, 0)
    q2, k2, v2, cache2, md2 = other
    for dst, src in (
        (q, q2),
        (k, k2),
        (v, v2),
        (cache, cache2),
        (md.query_start_loc, md2.query_start_loc),
        (md.seq_lens, md2.seq_lens),
        (md.block_table, md2.block_table),
        (md.slot_mapping, md2.slot_mapping),
    ):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    ref_out, ref_cache = torch.empty_like(q2), cache2.clone()
    get_backend("torch").forward(q2, k2, v2, ref_out, ref_cache, md2, scale, 0)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0)
