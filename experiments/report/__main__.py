"""``python -m experiments.report DIR``: report.md and PNG plots of a Hydra multirun folder."""

import sys

from experiments.report.sweep_report import main

if __name__ == "__main__":
    sys.exit(main())
