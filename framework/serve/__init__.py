"""The serving layer: an OpenAI-compatible HTTP server over the engine's step API.

    python -m framework.serve MODEL_DIR --host 127.0.0.1 --port 8000 [key=value overrides]

One engine thread owns the ``LLM`` (:mod:`framework.serve.engine_loop`); the FastAPI app
(:mod:`framework.serve.app`) parses OpenAI requests (:mod:`framework.serve.protocol`),
submits them and streams their outputs, detokenised incrementally
(:mod:`framework.serve.detokenize`); ``/metrics`` renders :mod:`framework.serve.metrics`.
It sits above ``framework.engine`` and below ``experiments`` in the import contract.
"""
