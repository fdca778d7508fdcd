"""Backends: what computes a model's logits, behind one contract (`contract.py`).

- `contract.py`: the backend and tokenizer contract every target and draft meets.
- `plan.py`, `slot_cache.py`: the static slot plan and the slot-addressed KV cache both wings use.
- `synthetic.py`: the table-driven model the tests and the simulator run.
- `turns.py`, `choice_cache.py`, `threads.py`: choosing between ways by timing them, and keeping
  the times per machine, model and settings.
- `hf/`: the transformers wing (loading folders and GGUF files, the HF forward, the tokenizer).
- `lean/`: the lean wing (the lean forward, its kernels, the native C product and pass, static
  steps and graphs, and its choices). New weight layouts go here.
- `heads/`: the EAGLE-3 head and its file formats, shared by the proposer, training and vLLM.
"""
