"""Real-browser tooling for the visualizer: JupyterLab started here, Debian's chromium driven
by Playwright (launched by path, see :func:`viz.bench.chromium`), and what a test reads from
the widget's DOM.

- :func:`jupyter_lab`: a JupyterLab server on 127.0.0.1, a free port, a random token, the
  repository as its root, ``make lab``'s server config (``tools/jupyter_server_config.py``:
  the pre-save hook, no news, no update checks), and settings of its own (in a temporary
  folder) that turn off autosave (running a chapter must not rewrite it) and the notebook's
  windowed rendering (every output stays in the DOM).
- :func:`run_all_cells`: open a notebook and run it with Run > Run All Cells.
- :func:`write_notebook`, :func:`cell_view`: a notebook written by a test, and the player a
  cell displayed.
- :func:`record`, :func:`play`: follow one player while it plays; each step's nodes, edges,
  pool cells and the animations it started.
- :func:`player_view`, :func:`wait_for_view`: what a live player shows now (status line,
  nodes, image chips), and a wait until it shows what a test expects.
- :func:`screenshot_image_fork`: the README picture, the widget mid-animation at an image
  fork; ``python tests/browser_tools.py docs/visualizer.png`` (``make screenshot``).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium")


def missing() -> str | None:
    """Why the browser tests cannot run here (None: they can)."""
    if CHROMIUM is None:
        return "chromium is not installed (apt-get install chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install -e '.[dev]')"
    return None


# ---------------------------------------------------------------------- JupyterLab
# Settings a fresh JupyterLab reads from LabApp.user_settings_dir (plugin id -> values).
LAB_SETTINGS = {
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
    "@jupyterlab/notebook-extension/tracker": {
        "windowingMode": "none",
        "autoStartDefaultKernel": True,  # no "Select Kernel" dialog
    },
}
# make lab's server config: also turns off JupyterLab's news and update checks.
LAB_CONFIG = ROOT / "tools" / "jupyter_server_config.py"


@dataclass
class Lab:
    """A running JupyterLab: ``url`` (no trailing slash), ``token``, its ``log`` file."""

    url: str
    token: str
    log: Path

    def tree(self, path: str) -> str:
        """The URL that opens ``path`` (relative to the repository) in JupyterLab."""
        return f"{self.url}/lab/tree/{path}?token={self.token}"

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def jupyter_lab(tmp: Path, root: Path = ROOT, timeout: float = 60.0) -> Iterator[Lab]:
    """Start JupyterLab (this Python's) serving ``root``; stop it on exit.

    Config, runtime files, settings and workspaces live under ``tmp``, so neither the
    user's JupyterLab setup nor this run leaks into the other; the server config is
    ``make lab``'s (:data:`LAB_CONFIG`).

    Raises:
        RuntimeError: the server did not answer within ``timeout`` seconds.
    """
    settings = tmp / "lab-settings"
    for plugin, values in LAB_SETTINGS.items():
        path = settings / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    port, token = free_port(), secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp / "config"))
    env["JUPYTER_RUNTIME_DIR"] = str(tmp / "runtime")
    log = tmp / "jupyterlab.log"
    cmd = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--ip=127.0.0.1",
        f"--port={port}",
        "--no-browser",
        "--allow-root",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        f"--LabApp.user_settings_dir={settings}",
        f"--LabApp.workspaces_dir={tmp / 'workspaces'}",
        f"--config={LAB_CONFIG}",
    ]
    lab = Lab(f"http://127.0.0.1:{port}", token, log)
    with running_lab(cmd, env, root, lab, timeout):
        yield lab


@contextlib.contextmanager
def running_lab(cmd: list[str], env: dict, cwd: Path, lab: Lab, timeout: float) -> Iterator[None]:
    """Run the JupyterLab command ``cmd`` (its output to ``lab.log``) until the block ends,
    entering it once the server answers at ``lab.url``.

    Raises:
        RuntimeError: the server exited, or did not answer within ``timeout`` seconds.
    """
    with lab.log.open("w") as out:
        # No stdin: a server that could read the terminal would be stopped (SIGTTIN) when the
        # tests run in the background.
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd
        )
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{lab.url}/api/status?token={lab.token}", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"JupyterLab did not start:\n{lab.log_tail()}") from None
                time.sleep(0.3)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class Console:
    """The page's JavaScript errors: console.error lines and uncaught exceptions."""

    errors: list[str] = field(default_factory=list)

    def watch(self, page) -> Console:
        page.on(
            "console",
            lambda m: self.errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else 0,
        )
        page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        return self


def run_all_cells(page, lab: Lab, notebook: str, root: Path = ROOT, timeout: float = 120.0) -> int:
    """Open ``notebook`` and run it with Run > Run All Cells; wait until every code cell has
    run. Returns the number of code cells.

    Raises:
        AssertionError: a cell failed (an error output), or the run did not finish in time.
    """
    cells = json.loads((root / notebook).read_text(encoding="utf-8"))["cells"]
    n = sum(c["cell_type"] == "code" for c in cells)
    page.goto(lab.tree(notebook))
    # Loaded (every code cell drawn) and its kernel started and idle; a run started earlier
    # would find an empty notebook or wait on a kernel dialog.
    ready = """n => document.querySelectorAll('.jp-Notebook .jp-CodeCell').length === n &&
      /[|] Idle/.test(document.querySelector('#jp-main-statusbar')?.textContent) &&
      !/No Kernel/.test(document.querySelector('#jp-main-statusbar')?.textContent)"""
    page.wait_for_function(ready, arg=n, timeout=90_000, polling=250)
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
    done = """n => {
      const prompts = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')];
      return prompts.length === n && prompts.every((p) => /\\[\\d+\\]/.test(p.textContent));
    }"""
    # A failing cell stops the run (the cells after it keep "[ ]:"): report its traceback.
    failed = """() => [...document.querySelectorAll('.jp-Notebook .jp-OutputArea-output')]
      .map((o) => o.textContent).filter((t) => t.includes('Traceback (most recent call last)'))"""
    try:
        page.wait_for_function(done, arg=n, timeout=timeout * 1000, polling=250)
    finally:
        tracebacks = page.evaluate(failed)
        assert not tracebacks, f"{notebook}: a cell failed:\n{tracebacks[0][-3000:]}"
    return n


def write_notebook(path: Path, sources: Sequence[str]) -> Path:
    """Write a notebook of code cells ``sources`` (no outputs, the default Python kernel) for
    :func:`run_all_cells`. Returns ``path``."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in sources]
    kernel = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["kernelspec"] = kernel
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def cell_view(page, cell: int):
    """A locator of the ``.radix-view`` that code cell ``cell`` (from 0) displayed."""
    code_cells = page.locator(".jp-Notebook .jp-CodeCell")
    return code_cells.nth(cell).locator(".jp-OutputArea-output .radix-view")


# ---------------------------------------------------------------------- one player
# Installed on a .radix-view element: logs what the player shows each time its counter
# changes (one entry per drawn frame), and the animations that this step started.
_RECORD = """
(root) => {
  const log = [];
  const snap = () => {
    const anims = document.getAnimations().filter((a) => root.contains(a.effect.target));
    log.push({
      counter: root.querySelector(".rv-counter").textContent,
      title: root.querySelector(".rv-title").textContent,
      caption: root.querySelector(".rv-caption").textContent,
      nodes: [...root.querySelectorAll(".rv-node")].map(
        (g) => [Number(g.dataset.id), g.getAttribute("class"), g.style.transform]),
      edges: root.querySelectorAll(".rv-edge").length,
      thumbs: [...root.querySelectorAll(".rv-thumb")].filter(
        (t) => t.style.display !== "none").length,
      imageEdges: root.querySelectorAll(".rv-edge.image").length,
      cells: [...root.querySelectorAll(".rv-cell")].map((c) => c.getAttribute("class")),
      animations: anims.map((a) => ({
        kind: a.animationName || `transition:${a.transitionProperty}`,
        target: a.effect.target.closest("[data-id]")?.dataset.id ?? null,
        duration: a.effect.getComputedTiming().duration,
      })),
    });
  };
  root.__rvlog = log;
  snap();
  new MutationObserver(snap).observe(root.querySelector(".rv-counter"),
    { childList: true, characterData: true, subtree: true });
}
"""

# Resolves when the player's animations have ended (JupyterLab's own, some endless, are not
# waited for).
_ANIMATIONS_END = """
async (root) => Promise.all(document.getAnimations()
  .filter((a) => root.contains(a.effect.target))
  .map((a) => a.finished.catch(() => null)))
"""

# The computed colours of the node boxes in the current frame.
_BOX_STYLES = """
(root) => {
  return [...root.querySelectorAll(".rv-node")].map((g) => {
    const s = getComputedStyle(g.querySelector(".rv-box"));
    return { id: Number(g.dataset.id), class: g.getAttribute("class"), fill: s.fill,
             stroke: s.stroke, dash: s.strokeDasharray, opacity: getComputedStyle(g).opacity };
  });
}
"""


def player_state(view) -> dict:
    """``{"counter": "3 / 9", "title": ...}`` of one ``.radix-view`` locator."""
    return view.evaluate(
        """(root) => ({ counter: root.querySelector('.rv-counter').textContent,
                        title: root.querySelector('.rv-title').textContent })"""
    )


def record(view) -> None:
    """Start logging every frame the player draws (see :func:`recorded`)."""
    view.evaluate(_RECORD)


def recorded(view) -> list[dict]:
    """One entry per frame drawn since :func:`record` (the frame shown then first)."""
    return view.evaluate("(root) => root.__rvlog")


def play(view, speed: str = "4", timeout: float = 60.0) -> None:
    """Press play at ``speed`` (an option of the speed menu) and wait for the last frame."""
    view.locator(".rv-speed").select_option(speed)
    view.locator(".rv-play").click()
    view.page.wait_for_function(
        """(root) => { const [i, n] = root.querySelector('.rv-counter').textContent.split(' / ');
                       return i === n && root.querySelector('.rv-play').textContent === '▶'; }""",
        arg=view.element_handle(),
        timeout=timeout * 1000,
        polling=100,
    )


def step_through(view, steps: int) -> None:
    """Step forward ``steps`` times (or to the last frame), letting each animation end."""
    for _ in range(steps):
        counter = player_state(view)["counter"]
        i, n = counter.split(" / ")
        if i == n:
            return
        view.locator(".rv-fwd").click()
        view.evaluate(_ANIMATIONS_END)


# What a player shows now: its status line, counter, title, and each node drawn with its
# classes, the text of its image chips and its hover text (the whole edge).
_PLAYER_VIEW = """
(root) => ({
  status: root.querySelector(".rv-status").textContent,
  counter: root.querySelector(".rv-counter").textContent,
  title: root.querySelector(".rv-title").textContent,
  nodes: [...root.querySelectorAll(".rv-node")].map((g) => ({
    id: Number(g.dataset.id),
    classes: g.getAttribute("class").split(" "),
    chips: [...g.querySelectorAll("tspan.rv-chip")].map((t) => t.textContent),
    hover: g.querySelector("title")?.textContent ?? "",
  })),
})
"""


def player_view(view) -> dict:
    """``{"status", "counter", "title", "nodes": [{"id", "classes", "chips", "hover"}]}``:
    what the ``.radix-view`` locator ``view`` shows now. ``chips``: the image chips' texts as
    drawn, such as ``"img 3fa2c1 x29"`` (cut with "…" where the box is full); ``hover``: the
    node's tooltip, its whole edge (images as ``[img 3fa2c1 x29]``)."""
    return view.evaluate(_PLAYER_VIEW)


def wait_for_view(
    view, condition: Callable[[dict], bool], what: str, timeout: float = 30.0
) -> dict:
    """Poll :func:`player_view` until ``condition`` holds; returns that view.

    Raises:
        AssertionError: not within ``timeout`` seconds; the message says ``what`` was awaited
            and what the player showed last.
    """
    deadline = time.monotonic() + timeout
    while True:
        shown = player_view(view)
        if condition(shown):
            return shown
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:g} s for {what}; the player shows {shown}")
        view.page.wait_for_timeout(100)


def box_styles(view) -> list[dict]:
    """The computed fill, stroke, dash and opacity of every node box once animations end."""
    view.evaluate(_ANIMATIONS_END)
    return view.evaluate(_BOX_STYLES)


def rgb(hex_colour: str) -> str:
    """``"#3a8a2e"`` -> ``"rgb(58, 138, 46)"`` (how getComputedStyle writes colours)."""
    h = hex_colour.lstrip("#")
    return "rgb({}, {}, {})".format(*(int(h[i : i + 2], 16) for i in (0, 2, 4)))


# ---------------------------------------------------------------------- the README picture
FORK_IMAGES = ("red_circle_left_of_blue_square.png", "blue_square_left_of_red_circle.png")


def fork_requests(processor, images_dir: Path) -> list:
    """Two questions about each of two images under one system prompt: the tree forks at the
    image (different pad ids right after the shared system turn), then at the question."""
    from minirad.course.scenes import SYSTEM_PROMPTS
    from minirad.engine import GenerateRequest, SamplingParams

    def ask(question: str, image: str):
        messages = [
            {"role": "system", "content": SYSTEM_PROMPTS[1]},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
        ]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return GenerateRequest(text, [images_dir / image], SamplingParams(max_new_tokens=6))

    questions = ("What colour is the circle?", "Where is the square?")
    return [ask(q, im) for im in FORK_IMAGES for q in questions]


def fork_frame(frames) -> int:
    """The first frame in which one node has two children that start with different images."""
    for f in frames:
        firsts: dict[int, set[str]] = {}
        for n in f.live:
            if n.label.images and n.label.images[0][0] == 0:
                firsts.setdefault(n.parent, set()).add(n.label.images[0][2])
        if any(len(names) > 1 for names in firsts.values()):
            return f.index
    raise ValueError("no frame forks at an image")


# Pause every animation at `fraction` of its length: a deterministic "mid-animation" picture.
_FREEZE = """
(fraction) => {
  for (const a of document.getAnimations()) {
    a.pause();
    a.currentTime = fraction * a.effect.getComputedTiming().duration;
  }
}
"""


def screenshot_image_fork(out: Path, fraction: float = 0.45) -> Path:
    """Run :func:`fork_requests` through the shipped model, export the replay, step into the
    frame where the tree forks at the images, and save a PNG of the player with its
    animations paused at ``fraction`` of their length."""
    import torch

    from minirad.engine import LLMEngine
    from minirad.models import DEFAULT_MODEL_DIR
    from viz import run_engine
    from viz.bench import chromium

    torch.set_num_threads(1)
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL_DIR, num_kv_slots=512)
    requests = fork_requests(engine.processor, ROOT / "data" / "images")
    view, _ = run_engine(engine, requests)
    i = fork_frame(view.frames)
    view.step = i - 1
    with tempfile.TemporaryDirectory() as tmp:
        page_path = view.to_html(Path(tmp) / "fork.html", title="minirad: two images, one tree")
        with chromium() as browser:
            page = browser.new_page(viewport={"width": 980, "height": 900})
            console = Console().watch(page)
            page.goto(page_path.as_uri())
            view_el = page.locator(".radix-view")
            view_el.locator(".rv-fwd").click()
            page.evaluate(_FREEZE, fraction)
            page.locator("body").screenshot(path=str(out), animations="allow")
            assert not console.errors, console.errors
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python tests/browser_tools.py OUT.png", file=sys.stderr)
        return 2
    if reason := missing():
        print(reason, file=sys.stderr)
        return 1
    out = screenshot_image_fork(Path(argv[0]))
    print(f"wrote {out} ({out.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
