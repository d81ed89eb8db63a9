"""The on-disk artifact cache: key factors (``key``), the store with its index and atomic
writes (``store``) and the ``python -m framework.cache`` command line (``cli``)."""
