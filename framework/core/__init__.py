"""The base layer every package may import: configs (compilation, passes, quantization), the
forward context and the shared vocabulary (registry, ops, CUDA-graph mode, compile ranges)."""
