"""What the serving tests share: the served model's name, its configuration, starting a
server on a free loopback port, reading its metrics, and the offline output to compare with."""

from __future__ import annotations

import time

import httpx

from framework import SamplingParams
from framework.engine.outputs import RequestOutput
from framework.serve.app import ServerConfig
from framework.serve.server import serve_in_thread

MODEL_NAME = "tiny-chat"
OVERRIDES = ["compile=O0", "max_num_seqs=8", "max_model_len=256", "dtype=float32"]


def start(llm, model_dir, **config):
    config.setdefault("model_name", MODEL_NAME)
    config.setdefault("max_model_len", llm.max_model_len)
    return serve_in_thread(llm, ServerConfig(**config), model_dir)


def metrics(url: str, **headers) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{url}/metrics", headers=headers, timeout=30).text)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {series (name with labels): value}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def offline_out(llm, prompt, max_tokens, **kw) -> RequestOutput:
    sp = SamplingParams(max_tokens=max_tokens, **kw)
    return llm.generate([prompt], sampling_params=sp, return_outputs=True)[0]


def wait_for(cond, timeout=30.0):
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("timed out waiting")
        time.sleep(0.02)


def blocks_used(url: str) -> float:
    return metrics(url)["piecewise_kv_blocks_used"]
