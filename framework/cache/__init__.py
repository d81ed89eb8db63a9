"""The on-disk artifact cache: key factors (``key``), crash-safe files and locks (``files``), the
index format (``index``), the store (``store``) and ``python -m framework.cache`` (``cli``)."""
