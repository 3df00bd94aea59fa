# Two commands for a fresh CPU machine: `make demo` and `make test`. Each builds the venv first.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-gpu compile-check venv clean

# Bytecode is compiled once after the installs (pip's --no-compile skips it), on every core: where
# PYTHONDONTWRITEBYTECODE is set, every test process would otherwise compile torch and transformers
# from source again (about 200 s of CPU in one `make test` on 2 cores). compileall's status is
# ignored: files written for newer Pythons (torch's py312 test helpers) fail and are never imported.
# torchtitan goes in without its requirements (its trainer's ~146 MiB: datasets, tensorboard, wandb):
# tests/test_torchtitan_integration.py needs only its model code and the four packages after it.
$(STAMP): pyproject.toml constraints/cpu.txt
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q --no-compile -c constraints/cpu.txt torch
	$(VPY) -m pip install -q --no-compile -c constraints/cpu.txt -e '.[test,hf,demo]'
	$(VPY) -m pip install -q --no-compile --no-deps -c constraints/cpu.txt torchtitan
	$(VPY) -m pip install -q --no-compile -c constraints/cpu.txt spmd_types tyro docstring-parser typeguard
	$(VPY) -m compileall -q -j 0 "$$($(VPY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" moe_fp8 > /dev/null || true
	touch $(STAMP)

venv: $(STAMP)

# A DeepSeek-V3-style MoE LM trained in BF16 and FP8 side by side (CPU: a few minutes; see moe_fp8/demo).
demo: $(STAMP)
	$(VPY) -m moe_fp8.demo

# CPU tests in two pytest-xdist workers per core (many tests wait on the processes they start: the
# multi-rank and example tests); Triton kernels run in the interpreter. GPU tests (-m gpu) skip
# without CUDA. MALLOC_PERTURB_ makes glibc fill every fresh CPU allocation with 0x5A bytes, so an
# output a kernel leaves unwritten holds garbage, never zeros by luck. Test files go whole to
# whichever worker is free (a file's tests share their compiled graphs and fixtures), the files of
# the tests marked slow first (tests/conftest.py).
TEST_WORKERS ?= $(shell $(PY) -c "import os; print(2 * len(os.sched_getaffinity(0)))")
test: $(STAMP)
	MALLOC_PERTURB_=165 TRITON_INTERPRET=1 $(VPY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile \
	  --no-loadscope-reorder tests

# Every Triton kernel compiled offline for sm_90a, gfx942 and gfx950 (no GPU needed); fails on a
# kernel that does not compile or spills more on sm_90a than tools/compile_baseline.json allows.
compile-check: $(STAMP)
	$(VPY) tools/offline_compile.py --out build/offline_compile

test-gpu:
	python3 -m pytest -q -m gpu tests

clean:
	rm -rf $(VENV) build *.egg-info
