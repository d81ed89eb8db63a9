"""What the serving tests share: the served model's name, its configuration, and
starting a server on a free loopback port."""

from __future__ import annotations

from framework.serve.app import ServerConfig
from framework.serve.server import serve_in_thread

MODEL_NAME = "tiny-chat"
OVERRIDES = ["compile=O0", "max_num_seqs=8", "max_model_len=256", "dtype=float32"]


def start(llm, model_dir, **config):
    config.setdefault("model_name", MODEL_NAME)
    config.setdefault("max_model_len", llm.max_model_len)
    return serve_in_thread(llm, ServerConfig(**config), model_dir)
