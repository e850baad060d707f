"""Experiments: grids of runs (methods x settings x seeds) described by a plan file (`plans/`), run locally
or on SLURM (`sweeps/`), and read back as the papers' tables, plots and dashboards (`results/`), all over one
reader of run folders (`runs.py`)."""
