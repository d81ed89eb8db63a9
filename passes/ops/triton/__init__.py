"""Triton kernels of the ``piecewise`` ops (GPU path).

Each module exposes launchers with exactly the signature of the op's plain-torch
implementation; :func:`framework.core.ops.define_op` binds them to the ``cuda`` device lazily, so
nothing here is imported unless a CUDA tensor reaches an op.  The launchers also run on CPU
tensors under ``TRITON_INTERPRET=1`` (how the tests check them against the torch versions).
This ``__init__`` imports nothing on purpose.
"""
