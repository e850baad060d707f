"""A plan and its grid: the plan file (plan.py), overrides and variants, the grid's resolution
into each point's `fit` settings, the tuning rule (candidates, choice, its record) and the plan's
`resources:` as read. Nothing here runs a point."""
