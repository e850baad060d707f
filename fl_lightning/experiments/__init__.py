"""Experiments: grids of runs (methods x settings x seeds) described by a plan file, run locally or on
SLURM, and summarised as the papers' tables."""
