"""``python -m experiments.run`` (what ``make run`` calls): the Hydra job of ``job.py``."""

import os

from experiments.run.job import main

if __name__ == "__main__":
    # Hydra names a job after the module of its task function; the job keeps the name it has
    # always had (``run``: its log is run.log), not ``job``.
    os.environ.setdefault("HYDRA_MAIN_MODULE", "experiments.run")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
