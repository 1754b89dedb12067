"""minirad.peers.vllm_env: finding the vLLM venv, and subprocesses that do not outlive their
parent."""

import os
import signal
import subprocess
import sys
import time

import pytest

from minirad.errors import PeerError
from minirad.peers.vllm_env import vllm_python

PARENT = """
import subprocess, sys
from minirad.peers.vllm_env import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                         start_new_session=True, preexec_fn=die_with_parent)
print(child.pid, flush=True)
time_to_die = sys.stdin.readline()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_started_with_die_with_parent_goes_when_its_parent_is_killed():
    """A Jupyter kernel killed without atexit (restart, shutdown) must not leave vLLM running:
    the child gets SIGTERM from the kernel, in its own session or not."""
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    child = int(parent.stdout.readline())
    os.kill(child, 0)  # running
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the child outlived its killed parent")


def test_a_missing_venv_says_how_to_build_it(tmp_path):
    with pytest.raises(PeerError, match="make vllm"):
        vllm_python(tmp_path / "nowhere")
