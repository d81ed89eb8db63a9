"""Reading what the runner wrote: the report of a sweep folder (``sweep_report``: report.md and
plots), its jobs, rounds and statistics, and the README tables generated from committed results
files (``readme_tables``).  ``python -m experiments.report DIR`` writes a sweep's report."""
