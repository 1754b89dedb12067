"""``python -m viz.bench``: how fast the visualizer follows a big, busy radix tree.

1. **Python.** A multi-turn chat trace (:func:`minirad.bench.trace.make_chat_trace`, >= 1,000
   requests) runs through a real :class:`~minirad.kvcache.radix_cache.RadixCache` and
   :class:`~minirad.kvcache.kv_pool.TokenToKVPoolAllocator`, each request as the scheduler does it
   (match and lock the prefix, evict when the pool is short, allocate, insert when finished;
   see :mod:`minirad.bench.radix`), with a :class:`~viz.frame_builder.FrameBuilder`
   subscribed to the cache's bus taking one frame per event, as a live
   :class:`~viz.widget.RadixView` does. It
   prints the time per event spent building frames (apply + snapshot) and turning them into
   the JSON the browser gets (:meth:`~viz.frame.Frame.to_dict`, memoized as in live mode).
   Aim: < 5 ms per event.
2. **Browser** (``--browser``): the frames around the largest tree are exported as a
   standalone page (:func:`viz.export.write_html`) and opened in Debian's chromium (headless,
   driven by Playwright, a dev dependency). For steps forward one at a time, it measures the
   script time of drawing the step, the time to the first painted frame, and, while the
   step's animations run, the interval between animation frames (display rate: ~16.7 ms at
   60 Hz). Once with the tree collapsed to ``--max-nodes`` visible nodes (the widget's
   default, 300) and once with every node drawn.

Timings depend on the machine and its load: this prints them, no test asserts them.

Example::

    python -m viz.bench                      # Python only, ~10 s
    python -m viz.bench --browser            # + chromium (needs `apt-get install chromium`)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minirad.bench.trace import ChatTrace, make_chat_trace
from minirad.events import EventBus
from minirad.kvcache.kv_pool import TokenToKVPoolAllocator
from minirad.kvcache.radix_cache import RadixCache, Req

from .export import write_html
from .frame import Frame
from .frame_builder import FrameBuilder

__all__ = ["PythonResult", "bench_browser", "bench_python", "chromium", "main", "make_trace"]


# ---------------------------------------------------------------------- the trace
def make_trace(min_requests: int = 1000, seed: int = 0) -> ChatTrace:
    """A chat trace of at least ``min_requests`` requests with short turns (a few tokens each:
    the tree's shape, not its token count, is what the visualizer pays for).

    Conversations are added until the trace has enough requests (each conversation has a
    random number of turns, so the count is not known in advance).
    """
    conversations = -(-min_requests // 4)
    while True:
        trace = make_chat_trace(
            conversations,
            turns=4,
            seed=seed,
            vocab_size=1000,
            num_system_prompts=4,
            system_prompt_len=(8, 24),
            user_median=6,
            answer_median=10,
            arrival_interval=4.0,
            think_time=200.0,
        )
        if len(trace.requests) >= min_requests:
            return trace
        conversations += -(-(min_requests - len(trace.requests)) // 4)


@dataclass
class PythonResult:
    """What the Python half measured (times in seconds)."""

    requests: int
    events: int
    frames: list[Frame]
    build_s: list[float]  # per event: FrameBuilder.apply (the snapshot included)
    wire_s: list[float]  # per frame: Frame.to_dict, memoized as a live view does
    capacity: int
    evicted_tokens: int

    @property
    def max_nodes(self) -> int:
        return max(len(f.nodes) for f in self.frames)


def bench_python(trace: ChatTrace, cache_share: float = 0.5) -> PythonResult:
    """Replay ``trace`` through a RadixCache with a FrameBuilder taking a frame per event.

    Args:
        trace: the workload.
        cache_share: the pool holds what the running requests need at their peak plus this
            share of what a cache that never evicts would hold (so the tree grows big, and
            eviction still happens).
    """
    capacity = trace.peak_running_tokens() + int(cache_share * trace.max_cached_tokens())
    bus = EventBus()
    alloc = TokenToKVPoolAllocator(capacity, bus=bus)
    cache = RadixCache(token_to_kv_pool_allocator=alloc, bus=bus)
    builder = FrameBuilder(pool_size=capacity, max_chars=16)
    builder.snapshot()
    clock = time.perf_counter
    build_s: list[float] = []

    def timed(event) -> None:
        t0 = clock()
        builder.apply(event)
        build_s.append(clock() - t0)

    unsubscribe = bus.subscribe(timed)
    running: dict[int, Req] = {}
    evicted = 0
    for ev in trace.events:
        r = trace.requests[ev.request]
        if ev.kind == "start":
            req = Req(r.rid, r.prompt)
            cache.match_prefix_for_req(req)
            need = len(r.prompt) + len(r.output) - 1 - len(req.kv_indices)
            short = need - alloc.available_size()
            if short > 0:
                evicted += len(cache.evict(short))
            req.kv_indices += alloc.alloc(need, owner=r.rid)
            running[ev.request] = req
        else:
            req = running.pop(ev.request)
            req.output_ids = r.output
            cache.cache_finished_req(req)
    unsubscribe()
    memo: dict = {}
    wire_s = []
    for f in builder.frames:
        t0 = clock()
        f.to_dict(memo)
        wire_s.append(clock() - t0)
        memo = {id(o): memo[id(o)] for o in (*f.nodes, f.pool)}  # as RadixView keeps it
    return PythonResult(
        len(trace.requests), len(build_s), builder.frames, build_s, wire_s, capacity, evicted
    )


def _ms(xs: list[float]) -> str:
    xs = sorted(xs)
    p99 = xs[min(len(xs) - 1, int(0.99 * len(xs)))]
    return f"mean {1e3 * statistics.fmean(xs):.3f} ms, p99 {1e3 * p99:.3f}, max {1e3 * xs[-1]:.3f}"


# ---------------------------------------------------------------------- the browser
@contextlib.contextmanager
def chromium(executable: str | None = None) -> Iterator[Any]:
    """Debian's chromium, headless, driven by Playwright: ``with chromium() as browser:``.

    Launched by path (``shutil.which("chromium")``): Playwright's own browser downloads are
    not used. ``--no-sandbox`` because the course machines and CI run as root.

    Raises:
        RuntimeError: chromium or the ``playwright`` package is missing.
    """
    path = executable or shutil.which("chromium")
    if path is None:
        raise RuntimeError("chromium is not installed (apt-get install chromium)")
    try:
        # Imported here: Playwright is a dev dependency (pip install -e .[dev]) that only the
        # benchmark's --browser part needs, not the widget.
        from playwright.sync_api import sync_playwright
    except ImportError as e:
        raise RuntimeError("the playwright package is missing: pip install -e '.[dev]'") from e
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=path, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


# Runs in the page: step forward once and measure the draw (script time), the first painted
# frame, and the animation frames until every animation of the step has finished.
_MEASURE_STEP = """
async () => {
  const root = document.querySelector(".radix-view");
  const t0 = performance.now();
  root.querySelector(".rv-fwd").click();
  const drawn = performance.now();
  const stamps = [];
  await new Promise((ok) => requestAnimationFrame((t) => { stamps.push(t); ok(); }));
  const painted = performance.now();
  const animations = document.getAnimations();
  const done = Promise.all(animations.map((a) => a.finished.catch(() => null)));
  let finished = false;
  done.then(() => { finished = true; });
  while (!finished) {
    await new Promise((ok) => requestAnimationFrame((t) => { stamps.push(t); ok(); }));
  }
  const gaps = stamps.slice(1).map((t, i) => t - stamps[i]);
  return {
    draw_ms: drawn - t0,
    paint_ms: painted - t0,
    animations: animations.length,
    gaps,
    visible: root.querySelectorAll(".rv-node").length,
    counter: root.querySelector(".rv-counter").textContent,
  };
}
"""


def bench_browser(
    frames: list[Frame], max_nodes: int, steps: int = 20, out_dir: Path | None = None
) -> dict:
    """Open ``frames`` as an exported page in chromium and step through the last ``steps``
    of them; returns the measurements (times in ms)."""
    out_dir = Path(out_dir or tempfile.mkdtemp(prefix="viz-bench-"))
    page_path = write_html(frames, out_dir / f"bench-{max_nodes}.html", step=0, max_nodes=max_nodes)
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        t0 = time.perf_counter()
        page.goto(page_path.as_uri())
        page.wait_for_selector(".radix-view .rv-node")
        load_ms = 1e3 * (time.perf_counter() - t0)
        page.evaluate(
            f"() => {{ const s = document.querySelector('.rv-slider');"
            f" s.value = {len(frames) - steps - 1}; s.dispatchEvent(new Event('input')); }}"
        )
        runs = [page.evaluate(_MEASURE_STEP) for _ in range(steps)]
        if errors:
            raise RuntimeError(f"the page failed: {errors}")
    gaps = [g for r in runs for g in r["gaps"]]
    return {
        "max_nodes": max_nodes,
        "tree_nodes": max(len(f.nodes) for f in frames[-steps:]),
        "visible": max(r["visible"] for r in runs),
        "load_ms": load_ms,
        "page_bytes": page_path.stat().st_size,
        "draw_ms": [r["draw_ms"] for r in runs],
        "paint_ms": [r["paint_ms"] for r in runs],
        "animations": [r["animations"] for r in runs],
        "gaps_ms": gaps,
    }


def _browser_report(r: dict) -> str:
    gaps = sorted(r["gaps_ms"]) or [0.0]
    slow = sum(g > 1000 / 50 for g in gaps)  # frames under 50 Hz
    draw, paint = statistics.median(r["draw_ms"]), statistics.median(r["paint_ms"])
    return (
        f"  max_nodes={r['max_nodes']}: {r['visible']} of {r['tree_nodes']} nodes drawn; "
        f"page {r['page_bytes'] / 1e6:.1f} MB, loaded in {r['load_ms']:.0f} ms\n"
        f"    one step: draw {draw:.1f} ms (median; max {max(r['draw_ms']):.1f}), first paint "
        f"{paint:.1f} ms (max {max(r['paint_ms']):.1f}); animations per step: median "
        f"{statistics.median(r['animations']):.0f}, max {max(r['animations'])}\n"
        f"    while animating: {len(gaps)} frames, interval mean {statistics.fmean(gaps):.1f} ms "
        f"({1000 / statistics.fmean(gaps):.0f} fps), max {gaps[-1]:.1f} ms, "
        f"{slow} slower than 20 ms"
    )


# ---------------------------------------------------------------------- the command
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m viz.bench", description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1000, help="at least this many requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--browser", action="store_true", help="also measure chromium")
    ap.add_argument("--max-nodes", type=int, default=300, help="collapse above this many nodes")
    ap.add_argument("--window", type=int, default=60, help="frames exported for the browser")
    ap.add_argument("--steps", type=int, default=20, help="steps measured in the browser")
    ap.add_argument("--out", type=Path, default=None, help="folder for the exported pages")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args(argv)

    trace = make_trace(args.requests, args.seed)
    t0 = time.perf_counter()
    py = bench_python(trace)
    total = time.perf_counter() - t0
    sizes = [len(f.nodes) - 1 for f in py.frames]
    print(
        f"trace: {py.requests} requests, {py.events} cache/pool events, pool {py.capacity} "
        f"slots, {py.evicted_tokens} tokens evicted; tree up to {max(sizes)} nodes "
        f"(last frame {sizes[-1]}); replay + frames {total:.1f} s"
    )
    print(f"python, frame per event (apply + snapshot): {_ms(py.build_s)}")
    print(f"python, frame to JSON (to_dict, memoized): {_ms(py.wire_s)}")
    figures: dict[str, Any] = {
        "requests": py.requests,
        "events": py.events,
        "max_tree_nodes": max(sizes),
        "build_ms_mean": 1e3 * statistics.fmean(py.build_s),
        "wire_ms_mean": 1e3 * statistics.fmean(py.wire_s),
    }
    if args.browser:
        # The window ends where the tree is largest.
        end = max(range(len(py.frames)), key=lambda i: (len(py.frames[i].nodes), i)) + 1
        window = py.frames[max(0, end - args.window) : end]
        steps = min(args.steps, len(window) - 1)
        print(f"chromium: frames {end - len(window)}..{end - 1}, {steps} steps each")
        figures["browser"] = []
        for max_nodes in (args.max_nodes, 1 + max(sizes)):
            r = bench_browser(window, max_nodes, steps, args.out)
            print(_browser_report(r))
            figures["browser"].append(r)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
