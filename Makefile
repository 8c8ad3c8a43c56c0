# Two commands work on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.demo-installed
DEMO_OUT   := demo_out
# The public API modules the type checker reads (from build/docs-pkg, the installed layout).
TYPED := __init__ loader dataset validate stats run order/bucketing fetch/text_collate order/shard_shuffle remote/storage remote/cache/shard_cache cli \
	formats/__init__ formats/reader formats/writer formats/schema formats/ragged formats/errors \
	formats/lmdb_dataset formats/hdf5_dataset formats/sources formats/verify \
	vision/__init__ vision/preset vision/indexed vision/params cuda_ops/__init__ benchmark/__init__

.PHONY: demo test install lint typecheck docs gpu-bundle gpu-install gpu-check examples clean

$(VENV)/.torch:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip setuptools wheel
	# torch first, pinned: the local CPU wheel; nothing may pull a CUDA build later.
	$(PIP) install torch==2.13.0
	touch $@

$(STAMP): setup.py $(VENV)/.torch fastload/vision/_jpegwin.c fastload/vision/_lut.c formats/_ranges.c fastload/remote/_recv.c
	$(PIP) install -e '.[dev,dali,image,plot,frameworks,ray,docs,migrate,migrate-test]' torch==2.13.0
	# Test writers installed without their dependencies, which pull a torchvision built for another torch
	# (or downgrade numpy): LitData's `optimize` (tests/test_migrate_chunks.py) and MosaicML Streaming's
	# MDSWriter (tests/test_migrate.py). fastload reads both formats without these packages.
	$(PIP) install --no-deps litdata obstore tifffile 'mosaicml-streaming==0.13.0'
	touch $(STAMP)

# The demo needs only the image decoder (its synthetic JPEGs) and matplotlib (bench.png).
$(DEMO_STAMP): setup.py $(VENV)/.torch fastload/vision/_jpegwin.c fastload/vision/_lut.c formats/_ranges.c fastload/remote/_recv.c
	$(PIP) install -e '.[image,plot]' torch==2.13.0
	touch $(DEMO_STAMP)

install: $(STAMP)

demo: $(DEMO_STAMP)
	mkdir -p $(DEMO_OUT)
	$(VENV)/bin/fastload bench --plot $(DEMO_OUT)/bench.png --json $(DEMO_OUT)/bench.json | tee $(DEMO_OUT)/bench.txt
	@echo "chart: $(CURDIR)/$(DEMO_OUT)/bench.png (table: $(DEMO_OUT)/bench.txt, full results: $(DEMO_OUT)/bench.json)"

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(MAKE) --no-print-directory typecheck docs
	$(PY) -m pytest -q tests --timeout=900 -p no:cacheprovider

lint: $(STAMP)
	$(VENV)/bin/ruff check .

typecheck: $(STAMP)
	@$(PY) docs/hooks.py
	@echo "mypy: $(words $(TYPED)) public API modules + examples/ (mypy.ini)"
	@$(PY) -m mypy $(foreach m,$(TYPED),build/docs-pkg/fastload/$(m).py) examples

docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --quiet
	@echo "docs: $(CURDIR)/site/index.html"

examples: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m examples tests

# The GPU run (docs/gpu.md). Here, with network: the wheels and DALI parts a GPU host without network needs.
gpu-bundle:
	$(PYTHON) -m bench.gpu_bundle build $(GPU_BUNDLE_ARGS)

# On the GPU host, with its system python3 (its torch stays): install from build/gpu-bundle only.
gpu-install:
	python3 -m bench.gpu_bundle install $(GPU_INSTALL_ARGS)

# The environment gpu-install made, else the system python3; no venv of ours, no torch install.
GPU_PYTHON ?= $(if $(wildcard build/gpu-env/bin/python),build/gpu-env/bin/python,python3)
GPU_OUT    ?= build/gpu-check
gpu-check:
	$(GPU_PYTHON) -m bench.gpu_check --out $(GPU_OUT) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) build site $(DEMO_OUT) *.egg-info fastload/vision/*.so
