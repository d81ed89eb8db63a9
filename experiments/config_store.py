"""The strict config dataclasses registered with Hydra's ConfigStore.

Hydra is the experiments' front end, so its registration lives here and not beside the
dataclasses (``framework.core`` imports no Hydra: the engine runs where Hydra is absent).

- :func:`register_compile_schema` stores :class:`~framework.core.config.CompilationConfig` as
  the schema of the ``compile`` group (conf/compile/*.yaml are validated against it).
- :func:`register_quantization_schema` stores
  :class:`~framework.core.quantization.QuantizationConfig` as a ``quantization`` group.  The
  runner does not call it: a config *group* named ``quantization`` makes Hydra treat the
  top-level ``quantization`` value of conf/config.yaml as a group and reject
  ``quantization=int8_per_token`` ("Could not override 'quantization'. No match in the
  defaults list").  Values are checked by ``QuantizationConfig.parse`` when the LLM is built;
  the schema is there for a config that wants a typed node.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from framework.core.config import CompilationConfig
from framework.core.quantization import QuantizationConfig


def register_compile_schema() -> None:
    """(No ``passes`` group: ``passes`` is the top-level short pass list of conf/config.yaml,
    framework/engine/pass_cli.py.)"""
    ConfigStore.instance().store(group="compile", name="compile_schema", node=CompilationConfig)


def register_quantization_schema() -> None:
    ConfigStore.instance().store(
        group="quantization", name="quantization_schema", node=QuantizationConfig
    )
