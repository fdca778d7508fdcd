"""Policies: the draft length k of every row, every round (0 = plain decoding for that row)."""
