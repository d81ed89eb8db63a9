"""``python -m experiments.run`` (what ``make run`` calls): the Hydra job of ``job.py``."""

import os

from experiments.run.job import main

if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
