"""The transformers wing: model folders and GGUF files loaded through transformers, the HF
forward with a slot cache, and the tokenizer."""
