"""framework.engine.cpu_env: settings that slow a CPU engine are named at build time."""

from __future__ import annotations

import warnings

import pytest

from framework.engine.cpu_env import CpuSettingsWarning, cpu_setting_problems, warn_cpu_settings


@pytest.mark.parametrize("value", ["PASSIVE", "passive", " Passive "])
def test_passive_wait_policy_is_named_with_its_fix(value):
    (msg,) = cpu_setting_problems({"OMP_WAIT_POLICY": value})
    assert msg.startswith(f"OMP_WAIT_POLICY={value.strip()}") and "Unset it" in msg


@pytest.mark.parametrize("env", [{}, {"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_NUM_THREADS": "2"}])
def test_other_settings_pass(env):
    assert cpu_setting_problems(env) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_cpu_settings(env) == []


def test_warning_has_its_own_category():
    with pytest.warns(CpuSettingsWarning, match="OMP_WAIT_POLICY=PASSIVE"):
        warn_cpu_settings({"OMP_WAIT_POLICY": "PASSIVE"})


def test_a_cpu_engine_warns_when_built_under_passive(monkeypatch, tmp_path):
    from framework import LLM
    from models.tiny import ensure_tiny_model

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # read by this check, not by libgomp now
    with pytest.warns(CpuSettingsWarning, match="OMP_WAIT_POLICY"):
        llm = LLM(
            str(ensure_tiny_model(preset="test-llama")),
            optimization_level=0,
            max_model_len=32,
            cache_dir=str(tmp_path),
        )
    assert llm.generate([[1, 2, 3]], 2, ignore_eos=True)[0]  # the engine still works
