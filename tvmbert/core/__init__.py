"""What every layer stands on: the job's configuration, the tables of stages, engines and model
families, targets and every question about what a target can do, artifacts on disk, errors, and
the toolchain checks. Imports nothing else of tvmbert (and neither torch nor TVM at import)."""
