import os

import torch

# Triton kernels run under the interpreter on CPU-only machines. This must be set before anything
# imports triton (jit functions read it when they are defined), so it lives in the root conftest.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# Keep CPU tests deterministic and light on a 2-core machine.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed_and_float_modes():
    torch.manual_seed(0)
    yield
    # The trainer and the serving engine flush denormals on CPU (a process-wide mode, for speed);
    # tests that check denormal values (MXFP4 scale 0, gate bounds) must not inherit it.
    torch.set_flush_denormal(False)


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (engine / generation tests: many tiny ops, where a second thread
    only adds synchronisation on the shared 2-core machine); restored afterwards."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)
