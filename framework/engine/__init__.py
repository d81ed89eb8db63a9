"""The engine on top of the compile spine: ``LLM``, the model runner, the scheduler and the
paged KV cache. Nothing below this layer imports it."""
