"""Building and running the server: the run config (``conf/`` + key=value overrides, the
same as a Hydra job's) → ``LLM`` → :class:`EngineLoop` → the app → uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from framework.engine.tokenizer import load_tokenizer
from framework.serve.app import API_KEY_ENV, OpenAIServer, ServerConfig
from framework.serve.engine_loop import EngineLoop

if TYPE_CHECKING:
    from framework.engine.llm import LLM

logger = logging.getLogger(__name__)


def compose_run_config(overrides: Sequence[str]) -> Any:
    """``conf/config.yaml`` composed with Hydra overrides (``compile=O1``,
    ``quantization=int8_per_token``, ``engine.enable_prefix_caching=true``, ...)."""
    from hydra import compose, initialize_config_dir

    from framework.engine.run_config import CONF_DIR, register_compile_schema

    register_compile_schema()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="serve"):
        return compose("config", overrides=list(overrides))


def build_llm(model_dir: str, overrides: Sequence[str] = ()) -> "LLM":
    """The ``LLM`` a Hydra job with these overrides would build for ``model_dir``."""
    import torch

    from framework.engine.llm import LLM
    from framework.engine.run_config import compilation_config, llm_kwargs

    cfg = compose_run_config(overrides)
    if cfg.get("num_threads"):
        torch.set_num_threads(int(cfg.num_threads))
    return LLM(str(model_dir), **llm_kwargs(cfg, compilation_config(cfg)))


@dataclass
class RunningServer:
    """A uvicorn server on a thread of this process (tests, benchmarks); ``url`` is its
    base URL (``http://host:port``)."""

    loop: EngineLoop
    server: Any
    thread: threading.Thread
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.loop.stop()


def make_app(llm: "LLM", config: ServerConfig, model_dir: str | Path) -> tuple[Any, EngineLoop]:
    loop = EngineLoop(llm)
    app = OpenAIServer(loop, load_tokenizer(model_dir), config).build()
    return app, loop


def serve_in_thread(
    llm: "LLM", config: ServerConfig, model_dir: str | Path, host: str = "127.0.0.1", port: int = 0
) -> RunningServer:
    """Start the engine loop and uvicorn on a thread; ``port`` 0 picks a free one."""
    import uvicorn

    app, loop = make_app(llm, config, model_dir)
    loop.start()
    server = uvicorn.Server(
        uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
    )
    server.install_signal_handlers = lambda: None  # a thread cannot take signals
    started = threading.Event()
    failed: list[BaseException] = []

    def run():
        try:
            server.run()
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            failed.append(e)
        finally:
            started.set()

    t = threading.Thread(target=run, name="uvicorn", daemon=True)
    t.start()
    while not started.wait(0.05):
        if server.started:
            break
    if failed or not server.started:
        loop.stop()
        raise RuntimeError(f"the server did not start on {host}:{port}: {failed}")
    bound = server.servers[0].sockets[0].getsockname()[1]
    return RunningServer(loop, server, t, host, bound)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m framework.serve",
        description="OpenAI-compatible server on the engine. Trailing key=value arguments "
        "are Hydra overrides of conf/config.yaml, as for python -m experiments.run "
        "(compile=O1, quantization=int8_per_token, engine.enable_prefix_caching=true, "
        "'passes=[-fuse_add_rmsnorm]', max_num_seqs=16, dtype=bfloat16, ...).",
    )
    ap.add_argument("model_dir", help="a Hugging Face folder (config.json + safetensors)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of conf/config.yaml")
    ap.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", default=None, help="default: the folder's name")
    ap.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV} when set)",
    )
    ap.add_argument("--max-waiting", type=int, default=ServerConfig.max_waiting)
    ap.add_argument("--overload-status", type=int, choices=(429, 503), default=429)
    ap.add_argument("--retry-after", type=int, default=ServerConfig.retry_after_s)
    ap.add_argument("--max-body-bytes", type=int, default=ServerConfig.max_body_bytes)
    ap.add_argument("--max-prompt-tokens", type=int, default=None)
    ap.add_argument("--log-level", default="info")
    args = ap.parse_intermixed_args(argv)  # overrides may come before or after the options
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        ap.error(f"overrides must be key=value, got {bad}")
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").is_file():
        ap.error(f"{model_dir}: not a model folder (no config.json)")
    logging.basicConfig(level=args.log_level.upper())
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import uvicorn

    llm = build_llm(str(model_dir), args.overrides)
    config = ServerConfig(
        model_name=args.served_model_name or model_dir.resolve().name,
        max_model_len=int(llm.max_model_len),
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_waiting=args.max_waiting,
        overload_status=args.overload_status,
        retry_after_s=args.retry_after,
        max_body_bytes=args.max_body_bytes,
        max_prompt_tokens=args.max_prompt_tokens,
    )
    app, loop = make_app(llm, config, model_dir)
    loop.start()
    logger.info(
        "serving %s on http://%s:%d/v1 (auth: %s)",
        config.model_name,
        args.host,
        args.port,
        "bearer key" if config.api_key else "none",
    )
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, lifespan="off")
    finally:
        loop.stop()
        llm.close()
    return 0
