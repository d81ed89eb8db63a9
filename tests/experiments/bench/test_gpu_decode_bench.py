"""The GPU decode benchmark's argument checks, table, and a CPU smoke run of its eager paths
(the graph modes need a GPU; scripts/gpu_check.sh runs them)."""

import pytest
import torch

from experiments.bench import gpu_decode as bench


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--decode-steps", "0", "--device", "cpu"], "--decode-steps must be positive"),
        (["--batch-sizes", "1", "-2", "--device", "cpu"], "--batch-sizes must be positive"),
        (["--modes", "turbo", "--device", "cpu"], "invalid choice"),
    ],
)
def test_rejects_bad_arguments(argv, match, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert match in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_needs_cuda_unless_cpu_is_asked_for(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args([])
    assert "CUDA is not available" in capsys.readouterr().err


def test_defaults():
    args = bench.parse_args(["--device", "cpu"])
    assert args.modes == ["eager", "piecewise", "full_and_piecewise", "hf_reduce_overhead"]
    assert args.batch_sizes == [1, 8, 32] and args.dtype == "bfloat16"
    assert args.attention_backend == "torch"


def test_table():
    results = {
        "eager": {"ms": {1: 2.0, 8: 4.0}, "startup_s": 1.0, "cudagraph_mode": "NONE"},
        "full_and_piecewise": {
            "ms": {1: 0.5, 8: 2.0},
            "startup_s": 9.0,
            "cudagraph_mode": "FULL_AND_PIECEWISE",
        },
        "piecewise": {"error": "RuntimeError: boom"},
    }
    table = bench.format_table(results, [1, 8])
    assert (
        "| full_and_piecewise | FULL_AND_PIECEWISE | 0.500 | 2.000 | 4.00x | 2.00x | 9.0 |" in table
    )
    assert "| piecewise | failed: RuntimeError: boom |" in table


def test_cpu_smoke_run(llama_checkpoint, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = bench.main(
        [
            "--device",
            "cpu",
            "--model-dir",
            str(llama_checkpoint),
            "--dtype",
            "float32",
            "--modes",
            "eager",
            "hf_eager",
            "--batch-sizes",
            "1",
            "2",
            "--decode-steps",
            "2",
            "--base-steps",
            "1",
            "--repeats",
            "1",
            "--out",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "| eager | NONE |" in text and "| hf_eager | - |" in text
    assert out.is_file()
