"""``python -m framework.cache``: list, verify, prune and explain cache entries."""

from framework.cache.cli import main

raise SystemExit(main())
