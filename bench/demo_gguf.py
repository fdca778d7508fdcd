"""Convert the demo target to an f32 GGUF for llama.cpp (`make llama-cpp`), with llama.cpp's own
converter: python bench/demo_gguf.py <llama.cpp source> <out.gguf>.

The demo tokenizer's pre-tokenizer is GPT-2's byte-level split, but its hash is not in the
converter's table of known tokenizers, which refuses it; naming it `gpt-2` converts it exactly
(the token ids and every tensor were checked equal against specflow's).
"""
from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main() -> None:
    src, out = pathlib.Path(sys.argv[1]), sys.argv[2]
    sys.path.insert(0, str(src))
    sys.path.insert(1, str(src / "gguf-py"))
    sys.path.insert(0, str(ROOT))
    from specflow.backends.hf.backend import DEMO_DIR

    import conversion.base as base
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    import convert_hf_to_gguf

    sys.argv = ["convert_hf_to_gguf.py", "--outtype", "f32", "--outfile", out,
                str(DEMO_DIR / "target")]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
