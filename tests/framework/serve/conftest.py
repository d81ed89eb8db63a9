"""A served tiny model: the 2-layer test-llama checkpoint with a byte-level tokenizer and a
chat template, an O0 ``LLM`` behind a real uvicorn server on a free loopback port, and an
offline ``LLM`` of the same configuration to compare with."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from checkpoints import write_byte_tokenizer
from serve_helpers import MODEL_NAME, OVERRIDES, start

from framework.serve.server import build_llm


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory, llama_checkpoint) -> Path:
    d = tmp_path_factory.mktemp("served") / MODEL_NAME
    shutil.copytree(llama_checkpoint, d)
    write_byte_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def offline(chat_model_dir):
    """The same configuration as the served LLM, used offline (generate)."""
    return build_llm(str(chat_model_dir), OVERRIDES)


@pytest.fixture(scope="module")
def served_llm(chat_model_dir):
    return build_llm(str(chat_model_dir), OVERRIDES)


@pytest.fixture(scope="module")
def spare_llm(chat_model_dir):
    """An LLM for the tests that start their own server (one at a time): an engine has one
    owner loop, so it must not be the module server's."""
    return build_llm(str(chat_model_dir), OVERRIDES)


@pytest.fixture(scope="module")
def server(served_llm, chat_model_dir):
    srv = start(served_llm, chat_model_dir, max_waiting=64, max_body_bytes=64 * 1024)
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
