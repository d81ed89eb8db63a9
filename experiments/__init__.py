"""Experiments on top of the engine: the Hydra runner (``run``), reports, benchmarks and the
synthetic task (see experiments/README.md)."""
