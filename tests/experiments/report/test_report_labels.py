"""Report labels show override values as written, without Hydra's command-line escapes."""

from pathlib import Path

from experiments.report.sweep_report import Job, config_label, unescape_override


def test_labels_drop_hydra_escapes():
    assert unescape_override(r"[mylab.swap\:swap_add]") == "[mylab.swap:swap_add]"
    assert unescape_override(r"a\,b\=c\\d") == r"a,b=c\d"
    job = Job(
        name="0",
        path=Path("."),
        overrides=[r"compile.pass_config.passes=[+mylab.swap\:swap_add]"],
        results={},
    )
    assert (
        config_label(job, ["compile.pass_config.passes"])
        == "compile.pass_config.passes=[+mylab.swap:swap_add]"
    )
