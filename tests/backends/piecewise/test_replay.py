"""Piece replay (backends/piecewise/replay.py): a lean piece records the native calls of a run
and replays them from C++ for the same inputs; what cannot be replayed runs as always."""

import ctypes
import weakref

import pytest
import torch

from backends.piecewise import replay as R
from backends.piecewise.compiler import make_compiler
from framework.core.forward_context import ForwardContext, set_forward_context


def _replaying(on: bool = True):
    return set_forward_context(ForwardContext(attn_metadata={}, kv_caches={}, cpu_replay=on))


def test_word_kinds_of_inductor_argument_types():
    assert R.word_kind("const at::BFloat16*") == "ptr"
    assert R.word_kind("float*") == "ptr"
    assert R.word_kind("const int64_t") == "int"
    assert R.word_kind("bool") == "int"
    assert R.word_kind("const float") is None  # a vector register: not a word
    assert R.word_kind("double") is None


CALL = """class Runner:
    def call(self, args):
        arg0_1, arg1_1, s0 = args
        args.clear()
        buf0 = empty_strided_cpu((s0, 8), (8, 1), torch.bfloat16)
        buf1 = _pw_direct_packed_linear(reinterpret_tensor(arg0_1, (s0, 8), (8, 1), 0), arg1_1)
        cpp_fused_relu_0(buf1, buf0, s0)
        del buf1
        return (buf0, )
"""


@pytest.mark.parametrize(
    "body, reason",
    [
        ("", None),
        ("        torch.ops.piecewise.rms_norm.default(buf0)\n", "calls torch.ops"),
        ("        extern_kernels.mm(buf0, buf0)\n", "calls extern_kernels.mm"),
        ("        if s0 > 1:\n            pass\n", "a If statement"),
        ("        buf0.copy_(arg0_1)\n", "calls buf0.copy_"),
        ("        other_kernel(buf0)\n", "calls other_kernel"),
    ],
)
def test_only_allocations_views_and_recorded_calls_replay(body, reason):
    source = CALL.replace("        return", body + "        return")
    got = R.replay_refusal(source, {"_pw_direct_packed_linear", "cpp_fused_relu_0"})
    if reason is None:
        assert got is None
    else:
        assert got is not None and got.startswith(reason), got


def test_the_replayer_runs_calls_in_order_and_stops_at_an_error():
    lib = R.load_replayer()
    if lib is None:
        pytest.skip("no replay library on this platform")
    libc = ctypes.CDLL(None)
    labs = ctypes.cast(libc.labs, ctypes.c_void_p).value
    ok = R.Tape(lib, [(labs, 1, [0], "labs(0)")], outputs="out", keep=[])
    assert ok.run("piece p") == "out"
    bad = R.Tape(lib, [(labs, 1, [0], "labs(0)"), (labs, 1, [-7], "labs(-7)")], "out", [])
    with pytest.raises(RuntimeError, match=r"piece p: replayed native call 1 \(labs\(-7\)\) "):
        bad.run("piece p")


@pytest.fixture
def lean_piece(tmp_path, native_ops_loaded, count_direct_calls, request):
    """The loaded lean form of ``linear_piece``, the function it computes, its inputs and the
    calls of the linear's Python-callable kernel it makes."""
    calls = count_direct_calls("piecewise::packed_linear")  # bound when the piece loads
    _, save, f, x, w = request.getfixturevalue("linear_piece")
    if R.load_replayer() is None:
        pytest.skip("the replay library does not build here")
    save(tmp_path / "piece.bin")
    loaded = make_compiler("inductor").load(tmp_path / "piece.bin")
    if loaded.replay is None:
        pytest.skip("the piece has no replay here")
    return loaded, f, x, w, calls


def test_a_piece_replays_its_native_calls_for_the_same_inputs(lean_piece):
    loaded, f, x, w, calls = lean_piece
    replay = loaded.replay
    with torch.inference_mode(), _replaying():
        first = loaded(x, w)[0]  # first sight of these inputs: recorded while it runs
        assert replay.recorded == 1 and replay.replayed == 0 and replay.refusals == {}
        assert torch.equal(first, f(x, w)[0])
        assert calls == []  # the recording ran the linear's recording kernel
        assert 0 < replay.tape_bytes < 4096  # the output and the linear's (4 x 96 bf16 each)
        for step in range(3):  # new values in the same buffer: replayed, no Python kernel call
            x.copy_(torch.randn(4, 64).to(torch.bfloat16))
            got = loaded(x, w)[0]
            assert got is first  # the recording's buffer, rewritten
            assert torch.equal(got, f(x, w)[0])
        assert replay.replayed == 3 and calls == []
        other = torch.randn(4, 64).to(torch.bfloat16)  # other inputs: a tape of their own
        assert torch.equal(loaded(other, w)[0], f(other, w)[0])
        assert replay.recorded == 2 and replay.replayed == 3
        gone = weakref.ref(other)
        del other
        assert gone() is None  # a tape keeps the buffers it wrote, not its inputs


def test_no_replay_unless_asked_or_while_ops_are_watched(lean_piece):
    loaded, f, x, w, _ = lean_piece
    replay = loaded.replay
    with torch.inference_mode():
        with _replaying():
            loaded(x, w)  # recorded
        for _ in range(2):
            assert torch.equal(loaded(x, w)[0], f(x, w)[0])  # no forward context
        with _replaying(False):
            loaded(x, w)
        with _replaying(), torch.profiler.profile() as prof:
            loaded(x, w)
        assert replay.replayed == 0
        assert any(e.name == "piecewise::packed_linear" for e in prof.events())
        with _replaying():
            loaded(x, w)
        assert replay.replayed == 1


def test_a_piece_without_recording_kernels_says_why_it_has_no_replay(
    tmp_path, native_ops_loaded, monkeypatch, request
):
    """An op with a direct kernel but no recording kernel: the piece loads without a replay
    and says which call stopped it."""
    from framework.core import ops as core_ops

    _, save, f, x, w = request.getfixturevalue("linear_piece")
    save(tmp_path / "piece.bin")
    monkeypatch.setattr(core_ops, "_RECORDERS", {})
    loaded = make_compiler("inductor").load(tmp_path / "piece.bin")
    assert loaded.replay is None
    assert loaded.replay_refusal == "_pw_direct_packed_linear has no recording kernel"
    with torch.inference_mode(), _replaying():
        assert torch.equal(loaded(x, w)[0], f(x, w)[0])


def test_a_call_its_kernel_cannot_replay_is_refused(lean_piece, monkeypatch):
    """The op took a path with no native call to report (its Python twin): the inputs are
    not recorded, and the piece runs as always, with the reason kept."""
    from framework.core import ops as core_ops

    loaded, f, x, w, _ = lean_piece
    replay = loaded.replay
    real = core_ops.direct_recorder("piecewise::packed_linear")
    monkeypatch.setitem(replay._recorders, "_pw_direct_packed_linear", lambda *a: (real(*a)[0], []))
    with torch.inference_mode(), _replaying():
        for _ in range(4):
            assert torch.equal(loaded(x, w)[0], f(x, w)[0])
    assert replay.recorded == 0 and replay.replayed == 0
    # one recording tried (the first call), then the inputs run as always
    assert replay.refusals == {"_pw_direct_packed_linear: a call its kernel cannot replay": 1}


def test_engine_tokens_are_the_same_with_and_without_replay(
    llama_checkpoint, compile_cache_dir, monkeypatch
):
    """Greedy generation at batch 1 and 3 (prompts of different lengths): the same tokens with
    piece replay on and off, and on means replayed calls."""
    from framework import LLM

    runs = []
    real_run = R.Tape.run

    def counted(self, piece):
        runs.append(piece)
        return real_run(self, piece)

    monkeypatch.setattr(R.Tape, "run", counted)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (3, 11, 20)]
    out = {}
    for limit in (64, 0):
        llm = LLM(
            str(llama_checkpoint),
            dtype="bfloat16",
            optimization_level=2,
            max_num_seqs=3,
            max_model_len=64,
            cache_dir=compile_cache_dir,
            compilation_config={"progress_bar": False, "cpu_replay_max_tokens": limit},
        )
        out[limit] = (
            llm.generate(prompts[:1], 12, ignore_eos=True),
            llm.generate(prompts, 12, ignore_eos=True),
        )
        if limit:
            if R.load_replayer() is None:
                pytest.skip("no replay library on this platform")
            assert len(runs) > 20
            runs.clear()
    assert out[64] == out[0]
    assert runs == []


def test_tapes_are_bounded_least_recently_used_first(lean_piece, monkeypatch):
    """A piece keeps at most MAX_TAPES tapes and MAX_TAPE_BYTES of their buffers; the least
    recently replayed go first, and a dropped tape's inputs are recorded again."""
    loaded, f, x, w, _ = lean_piece
    replay = loaded.replay
    inputs = [torch.randn(4, 64).to(torch.bfloat16) for _ in range(4)]
    with torch.inference_mode(), _replaying():
        loaded(inputs[0], w)
        one = replay.tape_bytes
        monkeypatch.setattr(R, "MAX_TAPE_BYTES", 3 * one)  # room for three
        for a in inputs[1:3]:
            loaded(a, w)
        loaded(inputs[0], w)  # replayed: now the most recently used
        assert replay.recorded == 3 and replay.replayed == 1
        loaded(inputs[3], w)  # a fourth: the least recently used (inputs[1]) goes
        assert replay.recorded == 4 and replay.tape_bytes == 3 * one
        for a in (inputs[0], inputs[2], inputs[3]):
            assert torch.equal(loaded(a, w)[0], f(a, w)[0])
        assert replay.replayed == 4 and replay.recorded == 4
        assert torch.equal(loaded(inputs[1], w)[0], f(inputs[1], w)[0])
        assert replay.recorded == 5  # recorded again
        monkeypatch.setattr(R, "MAX_TAPES", 1)
        loaded(torch.randn(4, 64).to(torch.bfloat16), w)  # recorded: the others go
        assert len(replay._tapes) == 1 and replay.tape_bytes == one
