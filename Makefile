# Fresh-machine entry points: `make demo` and `make test`. Both are idempotent:
# the venv is (re)built only when pyproject.toml changes.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# CPU wheel for the dev/CI box. On a GPU box install your own torch into the
# venv first; the step below then leaves it alone.
TORCH_SPEC ?= torch==2.13.0
export RAY_AUTH_MODE ?= disabled

.PHONY: venv demo test bench clean-warehouse

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[hf,test]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/matrix models fetch smollm2-135m
	$(VENV)/bin/matrix run configs/smoke.yaml --warehouse warehouse
	$(VENV)/bin/matrix sql "select c.cell_id, c.dtype, c.attention, c.repeats, c.rows_per_repeat, c.bit_reproducible, count(l.position) as rows from cells c left join logits l using (cell_id) group by all order by c.cell_id" --warehouse warehouse

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) benchmarks/storage_bytes.py
	$(PY) benchmarks/capture_overhead.py

clean-warehouse:
	rm -rf warehouse
