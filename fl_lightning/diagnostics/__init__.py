"""Diagnostics of the papers' mechanisms, each a callback that is off unless listed in the config's
`callbacks:` with its own schedule (`every` n rounds). What they compute is added to the round's
metrics row, so it lands in metrics.jsonl, W&B and `fl-lightning table` like any metric."""
