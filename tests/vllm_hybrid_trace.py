"""Run a token trace through the real vLLM, one request at a time, with its hybrid KV-cache
manager on and then off (``--disable-hybrid-kv-cache-manager``); write what it reported.

Runs in the vLLM venv (``make vllm``), started by ``tests/test_vllm_hybrid.py``::

    .venv-vllm/bin/python tests/vllm_hybrid_trace.py MODEL_DIR TRACE_JSON OUT_JSON

``TRACE_JSON`` is ``{"prompts": [[token ids], ...], "max_tokens": N}``. ``OUT_JSON`` gets, per
mode (``"hybrid"``, ``"disabled"``): each request's output ids and ``num_cached_tokens``, the
KV-cache groups (layer indices and spec class per group), the pool size and the seconds taken.
The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), with no tokenizer
(token prompts, ``skip_tokenizer_init``), block size 32, float32, eager.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: starts sooner


def groups_of(llm) -> list[dict]:
    """vLLM's KV-cache groups: layer indices and spec class of each."""
    config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    return [
        {
            "layers": sorted(int(re.search(r"layers\.(\d+)\.", n).group(1)) for n in g.layer_names),
            "spec": type(g.kv_cache_spec).__name__,
        }
        for g in config.kv_cache_groups
    ]


def run(model: str, trace: dict, disable_hybrid: bool) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.monotonic()
    llm = LLM(
        model=model,
        block_size=32,
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        enable_prefix_caching=True,
        max_num_seqs=1,
        skip_tokenizer_init=True,
        seed=0,
        disable_hybrid_kv_cache_manager=disable_hybrid,
    )
    params = SamplingParams(
        max_tokens=trace["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False
    )
    rows = []
    for prompt in trace["prompts"]:
        [out] = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        rows.append({"output": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens})
    result = {
        "rows": rows,
        "groups": groups_of(llm),
        "num_gpu_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
        "seconds": time.monotonic() - start,
    }
    llm.llm_engine.engine_core.shutdown()
    return result


def main() -> None:
    model, trace_path, out_path = sys.argv[1:4]
    with open(trace_path) as f:
        trace = json.load(f)
    results = {
        "hybrid": run(model, trace, disable_hybrid=False),
        "disabled": run(model, trace, disable_hybrid=True),
    }
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
