"""The runner: the Hydra job (``job``: one LLM, one workload, ``results.json``), its inputs and
summary, the compiler's environment, multirun sweeps in interleaved rounds with one baseline per
cell, the trace format and MLflow tracking.  ``python -m experiments.run`` is the job."""
