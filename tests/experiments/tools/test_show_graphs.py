"""``python -m experiments.tools.show_graphs`` prints a piece's graph at each stage."""

from experiments.tools.show_graphs import main


def test_prints_dynamo_post_grad_and_after_each_pass(llama_checkpoint, tmp_path, capsys):
    code = main(
        [
            "--model",
            str(llama_checkpoint),
            "--compiler",
            "eager",
            "--piece",
            "submod_2",
            "--dump",
            str(tmp_path / "dump"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    stages = [
        line.split(" · ")[1].split(" (")[0]
        for line in out.splitlines()
        if line.startswith("===== submod_2")
    ]
    assert stages[0] == "dynamo" and stages[1].startswith("post_grad")
    assert [s.split(" [")[0] for s in stages[2:]] == [
        "after_noop_elimination",
        "after_prepack_linear",
        "after_fix_functionalization",
    ]
    post_grad = out.split("· post_grad", 1)[1].split("=====", 1)[0]
    # SiLU as the passes see it: div(x, add(exp(neg(x)), 1))
    assert "aten.neg.default" in post_grad and "aten.exp.default" in post_grad
    assert "aten.div.Tensor" in post_grad and "aten.silu" not in post_grad


def test_unknown_piece_lists_the_pieces(llama_checkpoint, tmp_path, capsys):
    code = main(
        [
            "--model",
            str(llama_checkpoint),
            "--compiler",
            "eager",
            "--piece",
            "nope",
            "--dump",
            str(tmp_path / "dump"),
        ]
    )
    captured = capsys.readouterr()
    assert code == 2 and "no piece 'nope'" in captured.err
    assert "submod_0: dynamo, post_grad" in captured.out
