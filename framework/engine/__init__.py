"""The engine on top of the compile spine: the ``LLM`` facade, the engine core (requests,
scheduler, step), executors and workers (model, KV cache, compiled forward, runner), the
sampler and the paged KV cache. Nothing below this layer imports it."""
