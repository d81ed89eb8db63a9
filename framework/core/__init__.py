"""The base layer every package may import: strict config dataclasses, compilation and
quantization configs, the forward context. It imports nothing else from the project."""
