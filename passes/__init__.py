"""Compiler passes over post-grad FX graphs (one per file, ``@register_pass``), the pass manager,
the differential verifier and the fused custom ops under ``passes/ops`` (see passes/README.md)."""
