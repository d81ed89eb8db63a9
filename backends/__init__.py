"""Backends: ``backends.attention`` (attention backends: the ops models call, a low layer) and
``backends.piecewise`` (the piecewise torch.compile backend and its compiler adaptors, a layer
above the artifact cache and the passes it drives)."""
