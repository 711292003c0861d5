# =====================================================================================================
# One OpenMP thread per process: OMP_NUM_THREADS=1 (unless set) for this process and every subprocess a test starts,
# set here, before any test module imports torch. The tests' tensors are tiny, and on a loaded machine OpenMP's
# threads spin-wait for each other: tests/test_runtime.py and tests/test_examples_realistic.py took 173 s instead of
# 41 s beside busy processes. expq's CPU pipeline runs torch on one thread anyway (pipeline.cpu_threads).
# =====================================================================================================
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

# expq's cache of transformers' parameter sizes (expq.formats.stock_model) in a folder of this session's, for this
# process and every subprocess a test starts: tests never write into the user's ~/.cache.
if "EXPQ_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["EXPQ_CACHE_DIR"] = tempfile.mkdtemp(prefix="expq-test-cache-")
    atexit.register(shutil.rmtree, os.environ["EXPQ_CACHE_DIR"], ignore_errors=True)


# The default dispositions of SIGINT, SIGTERM and SIGHUP, for this process and every expq process a test starts:
# the suite tests how expq handles them, and an ignore inherited from the runner (nohup, a shell's background job)
# would pass on to those processes, which then rightly leave the signal ignored (expq.interrupts).
import signal  # noqa: E402

for _sig, _default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL),
                       (signal.SIGHUP, signal.SIG_DFL)):
    if signal.getsignal(_sig) == signal.SIG_IGN:
        signal.signal(_sig, _default)


# Tests marked slow (a kill at every fsync, the CI recipe end to end, the kernel tuner end to end) run with
# EXPQ_SLOW=1 only: `make test-slow` runs them, and CI runs it after `make test`.
def pytest_collection_modifyitems(config, items):
    if os.environ.get("EXPQ_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: EXPQ_SLOW=1 (make test-slow)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
# ======================================= end of test set-up ==========================================


# =====================================================================================================
# hub_server fixture: a local Hugging Face Hub-compatible server (tests/hub_server.py) that the real
# huggingface_hub client talks to through HF_ENDPOINT. Self-contained block: keep it together when
# adding other fixtures to this file.
# =====================================================================================================


def _hub_server_module():
    try:  # tests/ on sys.path (pytest's default "prepend" import mode, no tests/__init__.py)
        import hub_server
    except ImportError:  # tests/ is a package
        from tests import hub_server
    return hub_server


@pytest.fixture
def hub_server(tmp_path, monkeypatch):
    """A started HubServer (token "hf_test_token", user "test-user") with huggingface_hub pointed at it.

    Sets HF_ENDPOINT, HF_TOKEN, HF_HOME/HF_HUB_CACHE (under tmp_path), HF_HUB_DISABLE_TELEMETRY=1,
    HF_HUB_ENABLE_HF_TRANSFER=0, HF_HUB_DISABLE_XET=1 (clients >= 1.x pick Xet on their own when hf_xet is
    installed; this server only speaks LFS), unsets HF_HUB_OFFLINE, and patches the values huggingface_hub
    copied from the environment at import time (huggingface_hub.constants.*, huggingface_hub.hf_api.api).
    """
    mod = _hub_server_module()
    server = mod.HubServer(tmp_path / "hub-server-data").start()
    try:
        mod.configure_hf_client(monkeypatch, server.url, tmp_path / "hf-home", server.token)
        yield server
    finally:
        server.stop()


# ===================================== end of hub_server fixture =====================================


# =====================================================================================================
# Report header: the arithmetic paths this CPU takes (numpy's OpenBLAS sgemm kernel, which tl.dot uses under Triton's
# interpreter; numpy's and ATen's SIMD levels). Results of order-sensitive code differ between them (see
# tests/test_kernels.py); `make test-cpu-variants` runs the tests that depend on them under each.
# =====================================================================================================
def _openblas_core() -> str:
    import ctypes

    import numpy  # noqa: F401  (loads numpy's OpenBLAS)

    try:
        with open("/proc/self/maps") as maps:
            libs = {line.split()[-1] for line in maps if "openblas" in line.lower()}
    except OSError:
        return "unknown"
    for lib in sorted(libs):
        for name in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename64_",
                     "openblas_get_corename"):
            func = getattr(ctypes.CDLL(lib), name, None)
            if func is not None:
                func.restype = ctypes.c_char_p
                return func().decode()
    return "unknown"


def pytest_report_header(config):
    import numpy
    import torch
    from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__

    simd = [d for d in __cpu_dispatch__ if __cpu_features__.get(d)]
    return (f"arithmetic paths: OpenBLAS kernel {_openblas_core()}; numpy {numpy.__version__} SIMD "
            f"{'+'.join(simd) or 'baseline'}; torch {torch.__version__} {torch.backends.cpu.get_cpu_capability()}")
# ====================================== end of report header =========================================


# =====================================================================================================
# cpu_path fixture: runs a test once per CPU arithmetic path of expq.cpu_kernels (EXPQ_CPU_KERNEL=torch, the
# reference, and =numba, the fused kernels), so that every exactness test proves each path.
# =====================================================================================================
@pytest.fixture(params=["torch", "numba"])
def cpu_path(request, monkeypatch):
    """The CPU path name, with EXPQ_CPU_KERNEL set to it for the test (numba: skipped where it is not installed)."""
    if request.param == "numba":
        pytest.importorskip("numba")
    monkeypatch.setenv("EXPQ_CPU_KERNEL", request.param)
    from expq import cpu_kernels

    assert cpu_kernels.active() == request.param
    return request.param
# ====================================== end of cpu_path fixture ======================================


class StandInVllmLog:
    """vLLM's log as ``vllm_logging`` stands in for it: ``expq_lines()``, the lines of expq's loggers (the plugin's,
    ``vllm.expq``, and its children) as vLLM's handler wrote them, without the logger's name."""

    def __init__(self, buffer):
        self.buffer = buffer

    def expq_lines(self) -> list[str]:
        from expq.engines.vllm_kernel import LOGGER

        return [f"{head} {rest}" for head, name, rest in (line.split(" ", 2) for line in self.buffer.getvalue()
                                                          .splitlines())
                if name == LOGGER or name.startswith(LOGGER + ".")]


@pytest.fixture
def vllm_logging(monkeypatch):
    """The ``vllm`` logger as vLLM's default logging leaves it (a handler of its own, level INFO, no propagation),
    writing to a buffer (``StandInVllmLog``); restored afterwards.

    Where real vLLM is importable it is imported first, as in vLLM's own processes, where vLLM is imported before
    any plugin logs: vLLM 0.24 configures its logging when ``vllm.logger`` is imported (``dictConfig``, which
    replaces the handlers of ``vllm``), so a stand-in handler installed before the plugin's first ``import
    vllm.config`` would be dropped, and restoring the logger afterwards would undo vLLM's configuration. vLLM's own
    lines (0.29+: Triton's notices when ``vllm.config`` is first imported) reach the buffer too: tests read
    ``expq_lines``."""
    import importlib
    import importlib.util
    import io
    import logging

    if importlib.util.find_spec("vllm") is not None:
        importlib.import_module("vllm.logger")
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(logging.Formatter("vllm-format %(name)s %(levelname)s %(message)s"))
    theirs = logging.getLogger("vllm")
    for name, value in dict(handlers=[handler], propagate=False).items():
        monkeypatch.setattr(theirs, name, value)
    level = theirs.level
    theirs.setLevel(logging.INFO)  # setLevel, not the attribute: loggers cache their effective level
    yield StandInVllmLog(buffer)
    theirs.setLevel(level)
