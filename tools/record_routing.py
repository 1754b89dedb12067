"""Record chapter 10's routing sessions: two ``minirad serve`` workers behind the real routers,
drawn by :class:`viz.ReplicaCacheView` from their KV events, saved under ``data/recordings/``.

    .venv/bin/python tools/record_routing.py        # needs `make routers`; ~1 min

Six requests, three over each of two system prompts (2 blocks of 32 tokens, then a question
of another block), in the order A A B B A B, one at a time:

- ``routing_round_robin.jsonl``: sglang-router, round_robin: each system prompt lands on both
  workers, and is computed twice;
- ``routing_cache_aware.jsonl``: sglang-router, cache_aware: all six on one worker (one client
  at a time: the light-traffic pile-up);
- ``routing_kv_aware.jsonl``: vllm-router, kv_aware, after A was sent to worker 0 and B to
  worker 1 behind the router's back: every request goes where its system prompt is cached.

Each session has fresh workers and a fresh router.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from minirad.bench.common import make_prompts
from minirad.cluster.replicas import MiniradWorker, Router
from minirad.course.recordings import RECORDINGS_DIR
from minirad.models.tokenizer import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import viz  # noqa: E402  (the repository root, when run as a script)

ORDER = ((0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (1, 2))  # (system prompt, question)
SESSIONS = (
    ("sglang", "round_robin", "routing_round_robin.jsonl"),
    ("sglang", "cache_aware", "routing_cache_aware.jsonl"),
    ("vllm", "kv_aware", "routing_kv_aware.jsonl"),
)


def chapter_prompts(tokenizer) -> dict[int, list[str]]:
    """Three prompts per system prompt: ``{system: [prompt, ...]}``."""
    prompts = make_prompts(
        tokenizer, num_requests=24, num_system_prompts=2, system_tokens=64, user_tokens=40
    )
    by_system: dict[str, list[str]] = {}
    for p in prompts:
        by_system.setdefault(p.split("\nQ: ")[0], []).append(p)
    return {k: by_system[s][:3] for k, s in enumerate(sorted(by_system))}


def record(workers, router: str, policy: str, prompts, tokenizer, path: Path) -> None:
    model = workers[0].model_name
    with Router(router, workers, policy) as front:
        view = viz.watch_replicas(front.workers, names=[f"replica {i}" for i in range(2)])
        try:
            if policy == "kv_aware":  # behind the router's back: A on worker 0, B on worker 1
                for w, k in zip(workers, (0, 1), strict=True):
                    system = prompts[k][0].split("\nQ: ")[0]
                    w.post("/v1/completions", {"model": model, "prompt": system, "max_tokens": 1})
                time.sleep(1.0)  # the router reads the BlockStored events
            for k, j in ORDER:
                prompt = prompts[k][j]
                # kv_aware consults the caches only for token-id prompts.
                if policy == "kv_aware":
                    prompt = tokenizer(prompt)["input_ids"]
                body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
                view.send(front, body, label=f"system {'AB'[k]}, question {j + 1}")
        finally:
            view.stop()
    view.save_recording(path)
    print(f"{path.name}: {[r.replica for r in view.routes]}, {repr(view)}")


def main() -> int:
    tokenizer = load_tokenizer()
    prompts = chapter_prompts(tokenizer)
    for router, policy, name in SESSIONS:
        # Fresh workers: a recording starts from empty caches, and a view subscribing to
        # them replays no earlier session's events.
        workers = [MiniradWorker(cpus=[i], kv_events=True) for i in range(2)]
        try:
            for w in workers:
                w.start(timeout_s=120)
            record(workers, router, policy, prompts, tokenizer, RECORDINGS_DIR / name)
        finally:
            for w in workers:
                w.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
