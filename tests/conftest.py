"""Shared pytest setup: deterministic hypothesis in CI, fixed seeds and torch thread count.

- Hypothesis profiles: https://hypothesis.readthedocs.io/en/latest/settings.html#settings-profiles
  With CI set (``.ci/run`` exports CI=true), the "ci" profile derandomizes example generation,
  so a CI failure reproduces on every run, and drops the wall-clock deadline (shared runners).
- torch: intra-op reductions are ordered by thread, so the thread count is fixed for
  reproducible floats (https://pytorch.org/docs/stable/notes/randomness.html).
- pytest-xdist (``make test`` runs ``-n auto --dist loadfile``): each test file, and each
  notebook under nbval, is one unit of work for one worker (a notebook's cells share a kernel;
  a file's module fixtures start once), the files that share the real vLLM server are one unit,
  and the slowest units are handed out first (:data:`SLOW_FIRST`), so that no worker is left
  with a long one at the end.
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


# ---------------------------------------------------------------------- xdist's units of work
# Files that share one xdist worker, because they share what a worker starts once: the
# session's real vLLM server (the ``vllm_server`` fixture below).
SHARED_WORKER = {
    "tests/test_vllm_events.py": "vllm_server",
    "tests/test_vllm_recording.py": "vllm_server",
}
# The slowest units, slowest first (``.ci/run`` prints the 15 slowest tests; a unit missing here
# only starts later). Under xdist they are handed out first: the many short files then fill
# in around them, and the run ends with short units on both workers.
SLOW_FIRST = (
    "vllm_server",
    "tests/test_browser_vllm.py",
    "tests/test_browser_committed.py",
    "tests/test_browser_save.py",
    "tests/test_browser_live.py",
    "tests/test_browser.py",
    "tests/test_sglang_cache.py",
    "tests/test_bench_structured.py",
    "tests/test_vllm_parity.py",
    "tests/test_vllm_hybrid.py",
    "tests/test_swa_sglang_parity.py",
    "tests/test_vllm_gemma3_vlm.py",
    "tests/test_bench_engine.py",
    "tests/test_bench_sglang.py",
    "tests/test_serve_hostile.py",
    "tests/test_routers.py",
    "notebooks/10_replicas.ipynb",
    "tests/test_tiny_vlm.py",
    "tests/test_tiny_gemma3_vlm.py",
    "tests/test_server_process.py",
    "tests/test_bench.py",
)


def unit_of_work(nodeid: str) -> str:
    """The xdist unit a test belongs to: its file (a notebook under nbval is a file), or the
    name of the files of :data:`SHARED_WORKER` it shares a worker with."""
    path = nodeid.split("::", 1)[0]
    return SHARED_WORKER.get(path, path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadfile``, with the files of :data:`SHARED_WORKER` as one unit. (pytest-xdist's
    own ``loadgroup`` cannot group here: it renames ``item._nodeid``, which pytest 9 no longer
    reads.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Units(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of_work(nodeid)

    return Units(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In an xdist worker: the units of :data:`SLOW_FIRST` first (every worker collects the
    same order, and ``--no-loadscope-reorder`` hands the units out in it). Elsewhere the order
    is pytest's own."""
    if not hasattr(config, "workerinput"):
        return
    rank = {unit: i for i, unit in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(unit_of_work(item.nodeid), len(rank)))  # stable


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
def sglang_python():
    """The real SGLang's Python (``make sglang``). Without it the test is skipped, except in
    CI, where the SGLang tests must run: ``.ci/run`` builds the venv first."""
    from minirad.errors import PeerError
    from minirad.peers.sglang_env import sglang_python

    try:
        return sglang_python()
    except PeerError as e:
        if os.environ.get("CI"):
            pytest.fail(str(e))
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def vllm_server(vllm_python):
    """One real vLLM server (:class:`~minirad.peers.vllm_server.VLLMServer`, default settings)
    for the session: ``(server, recording)``, where ``recording`` is chapter 08's session
    (:func:`minirad.course.recordings.record`) taken on it right after its start, while it was
    fresh. tests/test_vllm_recording.py checks the recording, tests/test_vllm_events.py uses the
    server afterwards (and restarts it). A start costs 30-70 s on 2 cores."""
    from minirad.course import recordings
    from minirad.peers.vllm_server import VLLMServer

    said: list[str] = []  # what start(progress=...) said: tests/test_vllm_recording.py
    with VLLMServer(python=vllm_python).start(progress=said.append) as server:
        print(f"vLLM server up in {server.startup_s:.1f} s")
        server.start_lines = said
        yield server, recordings.record(server)


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


@pytest.fixture
def page(browser):
    """A fresh 1280 x 900 page of the session's chromium, closed after the test (a test file
    may define its own)."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    yield page
    page.close()
