"""Run one ``experiments.run.job`` job in-process, as Hydra would, from a composed config.

A subprocess per job costs ~5 s of interpreter and torch start-up on this machine; running the
job's real entry point (``main_entry``) in the test process keeps the smoke tests fast while
still going through composition, the ``${hydra:...}`` resolver and results.json writing.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf, open_dict

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
TINY = ["model.preset=test-llama", "workload.num_prompts=2", "workload.max_new_tokens=4"]
"""Overrides that make any job tiny: the 2-layer test model, 2 prompts, 4 new tokens."""


def compose_job(overrides: list[str], *, hydra_node: bool = False):
    import experiments.run.job  # noqa: F401  registers the config schemas and the eq resolver

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="test"):
        return compose("config", overrides=overrides, return_hydra_config=hydra_node)


@contextmanager
def hydra_job_context(cfg, out_dir: Path):
    """Install ``cfg.hydra`` (with ``runtime.output_dir = out_dir``) as the running job's
    HydraConfig and yield the job config without the ``hydra`` node."""
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(out_dir)
    HydraConfig.instance().set_config(cfg)
    job_cfg = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"])
    try:
        yield job_cfg
    finally:
        HydraConfig.instance().cfg = None  # other tests expect "no Hydra job running"


def run_job_in_process(overrides: list[str], out_dir: Path) -> dict:
    """Compose ``overrides``, run ``experiments.run.job.main_entry`` with ``out_dir`` as the job
    folder and return the results.json it wrote."""
    from experiments.run.job import main_entry

    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = compose_job(overrides, hydra_node=True)
    with hydra_job_context(cfg, out_dir) as job_cfg:
        main_entry(job_cfg)
    return json.loads((out_dir / "results.json").read_text())
