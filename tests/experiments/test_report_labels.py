"""Report labels show override values as written, without Hydra's command-line escapes."""

from pathlib import Path

from experiments.report import Job, config_label, unescape_override


def test_labels_drop_hydra_escapes():
    assert (
        unescape_override(r"[mypasses.silu\:SigmoidMulToSilu]")
        == "[mypasses.silu:SigmoidMulToSilu]"
    )
    assert unescape_override(r"a\,b\=c\\d") == r"a,b=c\d"
    job = Job(
        name="0",
        path=Path("."),
        overrides=[r"compile.pass_config.passes=[+mypasses.silu\:SigmoidMulToSilu]"],
        results={},
    )
    assert (
        config_label(job, ["compile.pass_config.passes"])
        == "compile.pass_config.passes=[+mypasses.silu:SigmoidMulToSilu]"
    )
