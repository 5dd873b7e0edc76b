"""Developer scripts: peer comparisons, stress and fuzzing, kernel compile checks,
draft-head training, workload generators and one-off measurements. Run them from the
repository root as `python -m tools.NAME` (they import each other as `tools.*` and
jaxserve as installed). What users run lives in the package (`jaxserve bench ...`)."""
