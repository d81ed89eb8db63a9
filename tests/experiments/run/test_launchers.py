"""The launcher configs in conf/hydra/launcher/ compose, and joblib_local and submitit_local
really launch.

Every config must point at the plugin's launcher class and use only fields of the plugin's
own config class (a field the plugin does not know would be passed on to sbatch / ray and
fail on the cluster, far from where it was written).  The submitit fields come from the
installed plugin (the `launchers` extra, pulled in by `dev`); ray is not installed (a large
install and a local cluster start), so its config is checked as a plain config group.
"""

import dataclasses
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

CONF_DIR = Path(__file__).resolve().parents[3] / "conf"

# Fields of the plugins' config classes (hydra-submitit-launcher 1.2: BaseQueueConf +
# SlurmQueueConf / LocalQueueConf; hydra-ray-launcher 1.2: RayLauncherConf).
SUBMITIT_BASE = {
    "_target_",
    "submitit_folder",
    "timeout_min",
    "cpus_per_task",
    "gpus_per_node",
    "tasks_per_node",
    "mem_gb",
    "nodes",
    "name",
    "stderr_to_stdout",
}
SUBMITIT_SLURM = SUBMITIT_BASE | {
    "partition",
    "qos",
    "comment",
    "constraint",
    "exclude",
    "gres",
    "cpus_per_gpu",
    "gpus_per_task",
    "mem_per_gpu",
    "mem_per_cpu",
    "account",
    "signal_delay_s",
    "max_num_timeout",
    "additional_parameters",
    "array_parallelism",
    "setup",
}

LAUNCHERS = {
    "submitit_slurm": (
        "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher",
        SUBMITIT_SLURM,
    ),
    "submitit_local": (
        "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher",
        SUBMITIT_BASE,
    ),
    "ray": ("hydra_plugins.hydra_ray_launcher.ray_launcher.RayLauncher", {"_target_", "ray"}),
}


def _compose_launcher(name, *extra):
    import experiments.run.job  # noqa: F401  (registers the config schemas with the ConfigStore)

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="smoke"):
        cfg = compose(
            "config", overrides=[f"hydra/launcher={name}", *extra], return_hydra_config=True
        )
    return cfg.hydra.launcher, cfg


@pytest.mark.parametrize("name", sorted(LAUNCHERS))
def test_cluster_launcher_configs_compose(name):
    target, allowed = LAUNCHERS[name]
    launcher, cfg = _compose_launcher(name)
    assert launcher._target_ == target
    assert set(launcher.keys()) <= allowed, set(launcher.keys()) - allowed
    resolved = OmegaConf.to_container(launcher, resolve=True)
    if name.startswith("submitit"):
        assert resolved["submitit_folder"] == f"{cfg.hydra.sweep.dir}/.submitit/%j"
        assert resolved["name"] == "smoke" and resolved["tasks_per_node"] == 1
    else:
        assert resolved["ray"] == {"init": {"address": None}, "remote": {}}


def test_cluster_launcher_overrides_apply():
    launcher, _ = _compose_launcher(
        "submitit_slurm", "hydra.launcher.partition=gpu", "hydra.launcher.timeout_min=30"
    )
    assert launcher.partition == "gpu" and launcher.timeout_min == 30
    launcher, _ = _compose_launcher(
        "ray", "hydra.launcher.ray.init.address=auto", "+hydra.launcher.ray.remote.num_gpus=1"
    )
    assert launcher.ray.init.address == "auto" and launcher.ray.remote.num_gpus == 1


def test_joblib_local_extends_the_installed_plugin_without_schema_warning():
    from hydra_plugins.hydra_joblib_launcher.config import JobLibLauncherConf

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same-name schema matching warning would raise
        launcher, _ = _compose_launcher("joblib_local")
    assert launcher._target_ == JobLibLauncherConf._target_ and launcher.n_jobs == 2
    # every plugin field is present and the result validates against the plugin schema
    OmegaConf.merge(OmegaConf.structured(JobLibLauncherConf), launcher)
    plugin, _ = _compose_launcher("joblib")  # the plugin's own node still works
    assert plugin.n_jobs == -1


def test_submitit_fields_are_the_installed_plugins():
    """The hard-coded field sets above are the plugin's own (so the ray set, which cannot be
    checked here, was written the same way)."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf, SlurmQueueConf

    assert {f.name for f in dataclasses.fields(LocalQueueConf)} == SUBMITIT_BASE
    assert {f.name for f in dataclasses.fields(SlurmQueueConf)} == SUBMITIT_SLURM


def _write_app(tmp_path):
    app = tmp_path / "app.py"
    app.write_text(
        "import os, hydra\n"
        "import experiments.run.job  # registers the config schemas\n"
        f"@hydra.main(config_path={str(CONF_DIR)!r}, config_name='config', version_base='1.3')\n"
        "def main(cfg):\n"
        "    open(os.path.join(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir,\n"
        "                      'pid.txt'), 'w').write(str(os.getpid()))\n"
        "main()\n"
    )
    return app


def test_submitit_local_really_launches(tmp_path):
    """submitit's local executor (no cluster): each job runs in its own process, submitted
    and awaited by the submitit launcher, with its own .submitit folder."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    app = _write_app(tmp_path)
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [
            sys.executable,
            str(app),
            "-m",
            "hydra/launcher=submitit_local",
            f"hydra.sweep.dir={sweep}",
            "hydra.launcher.timeout_min=5",
            "+x=1,2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(CONF_DIR.parent)),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    pids = {(sweep / str(i) / "pid.txt").read_text() for i in (0, 1)}
    assert len(pids) == 2 and str(os.getpid()) not in pids
    # one submitit job folder per job (named by job id) next to the submission folder "%j"
    assert len([d for d in (sweep / ".submitit").iterdir() if d.name.isdigit()]) == 2
    assert (sweep / "1" / ".hydra" / "overrides.yaml").read_text().strip() == "- +x=2"


def test_joblib_local_runs_jobs_in_parallel_processes(tmp_path):
    app = _write_app(tmp_path)
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [
            sys.executable,
            str(app),
            "-m",
            "hydra/launcher=joblib_local",
            f"hydra.sweep.dir={sweep}",
            "+x=1,2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(CONF_DIR.parent)),
    )
    assert proc.returncode == 0, proc.stderr
    assert "n_jobs=2" in proc.stdout + proc.stderr
    assert "validated against ConfigStore schema" not in proc.stderr
    pids = {(sweep / str(i) / "pid.txt").read_text() for i in (0, 1)}
    assert len(pids) == 2  # two worker processes, not the launching one
    assert (sweep / "1" / ".hydra" / "overrides.yaml").read_text().strip() == "- +x=2"
