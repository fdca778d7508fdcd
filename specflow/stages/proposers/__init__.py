"""Proposers: each turns the committed tokens of a row into up to k draft tokens (+ their q)."""
