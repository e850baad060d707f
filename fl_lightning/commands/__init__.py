"""The `fl-lightning` commands (`main`): the top of the package, which `python -m fl_lightning` and
the `fl-lightning` script run. Each command is a function of a layer below (fit, sweep, table,
dashboard, data, compare), its signature the command's schema."""
