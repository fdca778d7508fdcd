"""Training draft heads on the target's own outputs (`specflow train-head`)."""
