"""Experiments: workloads, the simulator tables, A/B runs, reports and plots."""
