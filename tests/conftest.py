"""Test-session set-up.

Without CUDA, Triton kernels run in the interpreter: TRITON_INTERPRET=1 is set here, before any
kernel module is imported, so a plain `pytest` works on a CPU machine. Markers:

* ``gpu``: needs CUDA; skipped without it (run `pytest -m gpu` on the H200).
* ``interpreter``: runs Triton kernels on CPU tensors; skipped unless TRITON_INTERPRET=1.
* ``slow(seconds)``: a test of several seconds (its time alone on one core, for scheduling only).
  The slow tests are collected first, longest first; ``make test`` hands whole files to free
  pytest-xdist workers in the order of their first test (``--dist loadfile
  --no-loadscope-reorder``), so the long files start early and the workers end together.
"""

import os

# One CPU thread per process: pytest-xdist runs a worker per core and the multi-rank tests spawn
# several processes per worker. With torch's default (a thread per core in every process) OpenMP's
# barriers spin against each other: a 4-rank gloo test on 2 cores ran 10x slower. Spawned ranks and
# subprocesses inherit the variable.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

# The processes the tests start (CLIs, benchmark scripts) get the interpreter shortcuts too.
_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "interpreter_site")
if INTERPRETING and _SITE not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_SITE, os.environ.get("PYTHONPATH")) if p)


def _import_kernel_modules() -> None:
    """Import every module that defines a Triton kernel now, while ``TRITON_INTERPRET`` holds its session
    value: kernels are decorated at import, so one first imported inside a test that turns the
    interpreter off (``torch_references``) would stay a GPU kernel for the rest of the session."""
    import importlib
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent / "moe_fp8"
    for path in sorted(root.rglob("*.py")):
        if "@triton.jit" in path.read_text():
            importlib.import_module(".".join(("moe_fp8", *path.relative_to(root).with_suffix("").parts)))


if INTERPRETING:
    _import_kernel_modules()


def interpreter_numpy_problem(triton_version: str, numpy_version: str) -> str | None:
    """Why Triton's interpreter cannot run our kernels with these versions, or ``None``.

    Below triton 3.7 the interpreter turns a loop bound into an int with ``int()`` of a one-element
    array, which numpy 2.4 refuses (triton-lang/triton report 9171): every kernel with a runtime loop bound
    fails with "only 0-dimensional arrays can be converted to Python scalars"."""
    from packaging.version import Version  # pytest's own dependency

    def major_minor(v: str) -> tuple[int, ...]:
        return Version(v).release[:2]  # release candidates count as their release: 2.4.0rc1 -> (2, 4)

    if major_minor(triton_version) < (3, 7) and major_minor(numpy_version) >= (2, 4):
        return (f"triton {triton_version}'s interpreter fails with numpy {numpy_version} (triton-lang/triton "
                "report 9171, fixed in triton 3.7): install 'numpy<2.4' or triton >= 3.7 to run the interpreter tests")
    return None


def pytest_configure(config):
    if INTERPRETING:
        import numpy
        import triton

        problem = interpreter_numpy_problem(triton.__version__, numpy.__version__)
        if problem:
            raise pytest.UsageError(problem)
        from interpreter_builtins import install

        install()


def _seconds(item: pytest.Item) -> float:
    mark = item.get_closest_marker("slow")
    return mark.args[0] if mark else 0.0


def pytest_collection_modifyitems(config, items):
    items.sort(key=_seconds, reverse=True)  # stable: the tests not marked slow keep their order
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the H200)")
    skip_interp = pytest.mark.skip(reason="runs Triton on CPU tensors: needs TRITON_INTERPRET=1")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "interpreter" in item.keywords and not INTERPRETING:
            item.add_marker(skip_interp)


@pytest.fixture
def torch_references(monkeypatch):
    """CPU code paths through the kernels' pure-torch references (bit-identical to the kernels, which
    their own tests run in the interpreter): for tests of what is built around the kernels (whole
    models, benchmark plumbing), which the interpreter would make minutes long."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture
def long_rows(monkeypatch) -> int:
    """A row length that takes the long-row paths (``K`` above ``MAX_SINGLE_PASS_K``: the two-pass
    rowwise kernel, no one-read column amax) at interpreter sizes: the limit lowered to 256 and the
    two-pass step to 128, so rows of 304 elements (a multiple of 16, as GEMM operands need) loop
    three times with a partial last step, as rows of 16400 do at the real limits (which the GPU
    tests keep)."""
    from moe_fp8.quant.kernels import rowwise

    monkeypatch.setattr(rowwise, "MAX_SINGLE_PASS_K", 256)
    monkeypatch.setattr(rowwise, "TWO_PASS_BLOCK_K", 128)
    return 304
