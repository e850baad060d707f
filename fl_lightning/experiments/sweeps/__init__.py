"""Running a plan: locally (local.py) or as SLURM array jobs (slurm.py), the tuning stage that
runs the plan's tuning rule, progress, the estimate and its step costs, the data check, and how a
plan's resources are honoured."""
