# Two commands for a fresh CPU machine: `make demo` and `make test`. Each builds the venv first.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-gpu venv clean

$(STAMP): pyproject.toml constraints/cpu.txt
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q -c constraints/cpu.txt torch
	$(VPY) -m pip install -q -c constraints/cpu.txt -e '.[test,hf,demo]'
	touch $(STAMP)

venv: $(STAMP)

# A DeepSeek-V3-style MoE LM trained in BF16 and FP8 side by side (CPU: a few minutes; see moe_fp8/demo).
demo: $(STAMP)
	$(VPY) -m moe_fp8.demo

# CPU tests; Triton kernels run in the interpreter. GPU tests (-m gpu) skip without CUDA.
test: $(STAMP)
	TRITON_INTERPRET=1 $(VPY) -m pytest -q tests

test-gpu:
	python3 -m pytest -q -m gpu tests

clean:
	rm -rf $(VENV) build *.egg-info
