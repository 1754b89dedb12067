"""Our hybrid (Full, SWA) radix cache against the real SGLang 0.5.23's ``UnifiedRadixCache``
with components (FULL, SWA), run in-process on the CPU by ``minirad/bench/sglang_swa_worker.py``
in the SGLang venv: the same traces must give, op by op, the same match lengths and branching
points, the same evictable and protected sizes per component, the same tombstoned spans and the
same free slots in both pools (so the same evictions, cascades and recoveries).

The traces (``tests/swa_parity.py``): a scripted one where windows decide (a 20-token system
prompt, prompts over three windows long, decode with out-of-window frees, a branch inside a
tombstone that misses then inserts early and recovers it, evictions per component), and
50-request random traces over a shared system prompt with small pools, the SWA pool at several
``swa_full_tokens_ratio`` (the worker resizes the test kit's SWA pool). Without the SGLang venv the
comparison is skipped (not in CI); our side of the scripted trace runs anyway.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from swa_parity import random_trace, replay_ours, scripted_trace

ROOT = Path(__file__).resolve().parents[1]
WORKER = "minirad/bench/sglang_swa_worker.py"
# (window, full pool, swa_full_tokens_ratio) per random trace: small pools, so admissions evict
# (in one pool or both) and some run out.
RANDOM_CASES = [
    (3, 60, 1.0),
    (4, 48, 1.0),
    (2, 40, 1.0),
    (6, 64, 1.0),
    (4, 160, 1.0),
    (3, 60, 0.5),
    (4, 120, 0.8),
    (6, 100, 0.6),
    (5, 160, 0.4),
    (2, 80, 0.7),
]


def test_our_side_of_the_scripted_trace():
    records = replay_ours(4, 200, scripted_trace())
    assert [r["match"] for r in records if r["op"] == "start"] == [0, 0, 20, 20, 20]
    assert [r["branching"] for r in records if r["op"] == "start"] == [None, 20, None, None, None]
    finish_a = records[21]
    assert finish_a["tombstones"] == [[0, 28]] and finish_a["sizes"]["swa"] == [5, 0]
    assert records[23]["tombstones"] == [[0, 15], [20, 28]]  # b's early insert recovered 15..20


def test_same_matches_tombstones_and_evictions_as_sglang(sglang_python):
    cases = [(4, 200, 0.8, scripted_trace())]
    cases += [(w, kv, r, random_trace(seed)) for seed, (w, kv, r) in enumerate(RANDOM_CASES)]
    spec = {
        "traces": [
            {"window": w, "kv_size": kv, "swa_size": int(kv * r), "ops": ops}
            for w, kv, r, ops in cases
        ]
    }
    done = subprocess.run(
        [str(sglang_python), "-P", WORKER],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(done.stdout)
    hits = 0
    for (w, kv, r, ops), sglang in zip(cases, theirs, strict=True):
        ours = replay_ours(w, kv, ops, r)
        assert len(ours) == len(sglang) == len(ops)
        for i, (a, b) in enumerate(zip(ours, sglang, strict=True)):
            assert a == b, f"window {w}, pool {kv}x{r}, op {i} {ops[i][:2]}: {a} != SGLang {b}"
        hits += sum(r["match"] > 0 for r in ours if r["op"] == "start")
    assert hits > 300  # the traces do share prefixes
