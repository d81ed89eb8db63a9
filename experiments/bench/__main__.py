"""``python -m experiments.bench`` (what ``make bench`` calls): the pytest-benchmark suite."""

import sys

from experiments.bench.pytest_bench import main

if __name__ == "__main__":
    sys.exit(main())
