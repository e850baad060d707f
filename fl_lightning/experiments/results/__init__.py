"""Reading what a plan's runs logged: the table (its sources, outcomes, cells, statistics, LaTeX
and plots), the papers' reference numbers, `compare`, the W&B dashboard and publishing runs to it.
Nothing here runs or schedules a run: results never import sweeps."""
