"""The server's configuration is the Hydra runs' (conf/ + key=value overrides), and the one
command ``python -m framework.serve MODEL_DIR --port P [overrides]`` serves the model; one O2
server's greedy output equals the offline O2 generate."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from serve_helpers import MODEL_NAME, start

from framework import SamplingParams
from framework.engine.run_config import compilation_config, llm_kwargs
from framework.serve.server import build_llm, compose_run_config

ROOT = Path(__file__).resolve().parents[3]


def test_overrides_map_to_llm_arguments_as_in_a_hydra_job():
    cfg = compose_run_config(
        [
            "compile=O1",
            "quantization=int8_per_token",
            "engine.enable_prefix_caching=true",
            "engine.block_size=32",
            "max_num_seqs=3",
            "dtype=bfloat16",
            "passes=[-fuse_add_rmsnorm]",
            "cache_dir=/tmp/somewhere",
        ]
    )
    cc = compilation_config(cfg)
    kw = llm_kwargs(cfg, cc)
    assert cc.level == 1 and cc.cache_dir == "/tmp/somewhere"
    assert cc.pass_config.passes == ["-fuse_add_rmsnorm"]
    assert kw["quantization"] == "int8_per_token" and kw["dtype"] == "bfloat16"
    assert kw["enable_prefix_caching"] is True and kw["block_size"] == 32
    assert kw["max_num_seqs"] == 3 and kw["compilation_config"] is cc
    with pytest.raises(Exception, match="no_such_key"):
        compose_run_config(["no_such_key=1"])


def test_build_llm_applies_engine_overrides(chat_model_dir):
    llm = build_llm(
        str(chat_model_dir), ["compile=O0", "engine.enable_prefix_caching=true", "max_model_len=64"]
    )
    assert llm.config.level == 0 and llm.max_model_len == 64
    assert "prefix_cache_queried_tokens" in llm.stats


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_waiting", -1),
        ("max_body_bytes", 0),
        ("overload_status", 500),
        ("api_key", ""),
        ("max_prompt_tokens", True),
    ],
)
def test_server_config_names_the_bad_field(field, value):
    from framework.serve.app import ServerConfig

    with pytest.raises(ValueError, match=f"ServerConfig.{field}"):
        ServerConfig(model_name="m", max_model_len=64, **{field: value})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_the_one_command_serves_with_an_api_key(chat_model_dir):
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), PIECEWISE_API_KEY="k3y")
    cmd = [sys.executable, "-m", "framework.serve", str(chat_model_dir), "--port", str(port)]
    proc = subprocess.Popen(
        cmd + ["compile=O0", "max_model_len=128"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() - t0 < 180, "server did not come up"
            time.sleep(0.3)
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="k3y", max_retries=0)
        assert [m.id for m in c.models.list().data] == [MODEL_NAME]  # the folder's name
        r = c.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4, temperature=0)
        assert r.usage.completion_tokens >= 1
        assert httpx.get(f"{url}/v1/models").status_code == 401
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_an_o2_server_streams_the_offline_o2_tokens(chat_model_dir, compile_cache_dir):
    overrides = ["compile=O2", f"cache_dir={compile_cache_dir}", "max_model_len=128"]
    served = build_llm(str(chat_model_dir), overrides)
    offline = build_llm(str(chat_model_dir), overrides)
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11, 12], [200, 100]]
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    want = offline.generate(prompts, sampling_params=sp)
    srv = start(served, chat_model_dir)
    try:
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=120)
        for p, w in zip(prompts, want):
            chunks = c.completions.create(
                model=MODEL_NAME,
                prompt=p,
                max_tokens=12,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            assert [t for ch in chunks for t in ch.choices[0].model_extra["token_ids"]] == w
    finally:
        srv.stop()
