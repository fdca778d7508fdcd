"""Model backends: transformers (hf.py) and the table-driven synthetic model."""
