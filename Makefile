# Two commands work on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: demo test install lint clean

$(STAMP): setup.py fastload/vision/_jpegwin.c fastload/vision/_lut.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip setuptools wheel
	# torch first, pinned: the local CPU wheel; nothing may pull a CUDA build later.
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev,dali,image,plot]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fastload bench

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q tests --timeout=900 -p no:cacheprovider

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info fastload/vision/*.so
