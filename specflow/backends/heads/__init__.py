"""The EAGLE-3 head: its model (`eagle.py`) and file formats, shared by the proposer, training and
the vLLM adapter."""
