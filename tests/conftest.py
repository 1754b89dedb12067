"""Shared pytest setup: deterministic hypothesis in CI, fixed seeds and torch thread count.

- Hypothesis profiles: https://hypothesis.readthedocs.io/en/latest/settings.html#settings-profiles
  With CI set (``.ci/run`` exports CI=true), the "ci" profile derandomizes example generation,
  so a CI failure reproduces on every run, and drops the wall-clock deadline (shared runners).
- torch: intra-op reductions are ordered by thread, so the thread count is fixed for
  reproducible floats (https://pytorch.org/docs/stable/notes/randomness.html).
"""

import os
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from tiny_models import FAMILIES, tiny_model

# The exercises' shared tests live in exercise_contract.py, not a test_*.py file: pytest must be
# told to rewrite its asserts, or their failures show no values
# (https://docs.pytest.org/en/stable/how-to/writing_plugins.html#assertion-rewriting).
pytest.register_assert_rewrite("exercise_contract")

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

# One thread: the course's tensors are tiny, and a second intra-op thread only adds
# synchronisation, which cost up to 20x on a busy 2-core machine.
TORCH_THREADS = 1


def pytest_configure(config: pytest.Config) -> None:
    import torch

    torch.set_num_threads(TORCH_THREADS)


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    """Every test starts from the same random state (Python, NumPy, torch)."""
    import torch

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tokenizer():
    """The course's shipped tokenizer (data/tokenizer/)."""
    from minirad.models.tokenizer import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def steps(tokenizer):
    """The visualizer's frames of SGLang's Figure 3, one per panel."""
    from viz.sources import scenario_frames

    return scenario_frames(per="step", tokenizer=tokenizer)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    """Each supported VLM family in turn (tests/tiny_models.py)."""
    return request.param


@pytest.fixture(scope="module")
def model(family):
    """A tiny config-built model of ``family``, random weights."""
    return tiny_model(family)


@pytest.fixture(scope="session")
def vllm_python():
    """The real vLLM's Python (``make vllm``). Without it the test is skipped, except in CI,
    where the vLLM tests must run: ``.ci/run`` builds the venv first."""
    from minirad.errors import PeerError
    from minirad.peers.vllm_env import vllm_python

    try:
        return vllm_python()
    except PeerError as e:
        if os.environ.get("CI"):
            pytest.fail(str(e))
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def router_venv():
    """The real routers' venv (``make routers``). Without it the test is skipped, except in
    CI, where ``.ci/run`` builds it first."""
    from minirad.cluster.replicas import ROUTER_VENV, ROUTERS, router_executable
    from minirad.errors import PeerError

    try:
        for router in ROUTERS:
            router_executable(router)
    except PeerError as e:
        if os.environ.get("CI"):
            pytest.fail(str(e))
        pytest.skip(str(e))
    return ROUTER_VENV


@pytest.fixture(scope="session")
def browser():
    """One headless chromium for every browser test (Debian's, by path: see viz.bench)."""
    from viz.bench import chromium

    with chromium() as b:
        yield b
