"""A running server under load (``python -m minirad.bench load``).

Closed-loop clients, ``--concurrency`` of them at once, send ``--requests`` chat requests to an
OpenAI-compatible server (``minirad serve``, or any other at ``--url``) and time each answer.
Half of the requests carry a fresh picture (a new scene, upscaled to ``--image-size`` pixels
and sent as a PNG data URL, so the server decodes, hashes and preprocesses every one); the
other half are text questions with no picture. Per server and concurrency it prints:

- **req/s**: requests answered per second of wall time, seen by the clients;
- **p50 / p99**: latency of all requests, in milliseconds;
- **text p99**: latency of the text-only requests alone: what the other clients pay for the
  pictures (a server that preprocesses images on its engine thread holds every step up while
  it does);
- **errors**: answers that were not 200.

Several ``--url`` are measured in turns, the rounds alternated (the machine is shared and
noisy), and each keeps its best round (``--repeats``). Without ``--url`` it starts ``minirad
serve`` from this checkout on a free port and stops it afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from minirad.entrypoints.argtypes import positive_int
from minirad.errors import InvalidArgumentError

__all__ = ["LoadRun", "add_arguments", "make_requests", "run_cli", "run_load"]

QUESTIONS = ("What colour is the circle?", "Describe the image.", "How many shapes are there?")
TEXT_QUESTIONS = ("What is red?", "Name a colour.", "What is a square?")


@dataclass(frozen=True)
class LoadRun:
    """One server at one concurrency: timings in seconds."""

    label: str
    concurrency: int
    wall_s: float
    latencies: tuple[float, ...]
    text_latencies: tuple[float, ...]
    errors: int

    @property
    def requests_per_s(self) -> float:
        return len(self.latencies) / self.wall_s

    def row(self) -> str:
        def ms(xs: Sequence[float], q: float) -> str:
            return f"{1000 * _quantile(xs, q):8.0f}" if xs else "       -"

        return (
            f"{self.label:<12} {self.concurrency:>5} {self.requests_per_s:8.1f} "
            f"{ms(self.latencies, 0.5)} {ms(self.latencies, 0.99)} "
            f"{ms(self.text_latencies, 0.99)} {self.errors:>6}"
        )


HEADER = f"{'server':<12} {'conc':>5} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'text p99':>8} " + (
    f"{'errors':>6}"
)


def _quantile(xs: Sequence[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def make_requests(n: int, image_size: int, seed: int = 0) -> list[dict]:
    """``n`` chat request bodies: every other one with a fresh scene as a PNG data URL."""
    from minirad.course.scenes import random_scene, render  # Pillow: only the command needs it

    rng = random.Random(seed)
    bodies = []
    for i in range(n):
        body = {"max_tokens": 8, "temperature": 0}
        if i % 2:
            body["messages"] = [{"role": "user", "content": rng.choice(TEXT_QUESTIONS)}]
        else:
            image = render(random_scene(rng)).resize((image_size, image_size))
            png = io.BytesIO()
            image.save(png, format="PNG")
            url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
            content = [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": rng.choice(QUESTIONS)},
            ]
            body["messages"] = [{"role": "user", "content": content}]
        bodies.append(body)
    return bodies


async def _drive(url: str, bodies: list[dict], concurrency: int, label: str) -> LoadRun:
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    latencies, text, errors = [], [], 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal errors
        while not queue.empty():
            body = queue.get_nowait()
            start = time.perf_counter()
            resp = await http.post(f"{url}/v1/chat/completions", json=body)
            took = time.perf_counter() - start
            errors += resp.status_code != 200
            latencies.append(took)
            if isinstance(body["messages"][0]["content"], str):
                text.append(took)

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return LoadRun(label, concurrency, wall, tuple(latencies), tuple(text), errors)


def run_load(
    urls: dict[str, str], concurrencies: Sequence[int], requests: int, repeats: int, image_size: int
) -> list[LoadRun]:
    """Every server at every concurrency, ``repeats`` rounds alternated; the best (highest
    req/s) run of each."""
    bodies = make_requests(requests, image_size)
    best: dict[tuple[str, int], LoadRun] = {}
    for _ in range(repeats):
        for c in concurrencies:
            for label, url in urls.items():
                run = asyncio.run(_drive(url, bodies, c, label))
                key = (label, c)
                if key not in best or run.requests_per_s > best[key].requests_per_s:
                    best[key] = run
    return [best[(label, c)] for c in concurrencies for label in urls]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url",
        action="append",
        default=[],
        metavar="[LABEL=]URL",
        help="a running server (repeat to compare several); default: start minirad serve",
    )
    p.add_argument("--concurrency", type=positive_int, nargs="+", default=[8, 32])
    p.add_argument("--requests", type=positive_int, default=300, help="requests per run")
    p.add_argument("--repeats", type=positive_int, default=3, help="rounds; best kept")
    p.add_argument(
        "--image-size", type=positive_int, default=512, help="pixels per side of each picture"
    )


def run_cli(args: argparse.Namespace) -> int:
    urls = {}
    for i, spec in enumerate(args.url):
        label, eq, url = spec.partition("=")
        label, url = (label, url) if eq else (f"server{i}", spec)
        if not url.startswith(("http://", "https://")):
            raise InvalidArgumentError(f"--url {spec!r}: expected [LABEL=]http://HOST:PORT")
        urls[label] = url.rstrip("/")
    worker = None
    if not urls:
        from minirad.cluster.replicas import MiniradWorker

        worker = MiniradWorker(page_size=1, num_kv_slots=16384).start()
        urls["minirad"] = worker.base_url
    try:
        runs = run_load(urls, args.concurrency, args.requests, args.repeats, args.image_size)
    finally:
        if worker is not None:
            worker.stop()
    print(
        f"{args.requests} requests, half with a fresh {args.image_size}px picture; best of "
        f"{args.repeats} (latency quantiles: nearest rank)"
    )
    print(HEADER)
    for run in runs:
        print(run.row())
    return 0
