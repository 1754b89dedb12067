"""Greedy generation of a few image prompts through the real vLLM, on a saved
``Gemma3ForConditionalGeneration``; write what it produced.

Runs in the vLLM venv (``make vllm``), started by ``tests/test_vllm_gemma3_vlm.py``::

    .venv-vllm/bin/python tests/vllm_gemma3_vlm_trace.py MODEL_DIR TRACE_JSON OUT_JSON

``TRACE_JSON`` is ``{"prompts": [{"ids": [token ids], "images": [PNG paths]}], "max_tokens":
N}``; each prompt holds one ``<start_of_image>`` per image, which vLLM's Gemma 3 processor
expands to the full image sequence. ``OUT_JSON`` gets, per prompt, vLLM's expanded
``prompt_token_ids``, the greedy ``token_ids``, the log-probability vLLM gave each prompt
token after the first (``prompt_logprobs``) and each generated one (``logprobs``); then the
attention backend's name and the seconds taken. The engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), float32, eager, no prefix caching.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: starts sooner


def main() -> None:
    model, trace_path, out_path = sys.argv[1:4]
    with open(trace_path) as f:
        trace = json.load(f)
    from PIL import Image
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.monotonic()
    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        enable_prefix_caching=False,
        max_num_seqs=4,
        seed=0,
        limit_mm_per_prompt={"image": max(len(p["images"]) for p in trace["prompts"])},
    )
    params = SamplingParams(
        max_tokens=trace["max_tokens"],
        temperature=0.0,
        ignore_eos=True,
        logprobs=0,
        prompt_logprobs=0,
    )
    prompts = [
        TokensPrompt(
            prompt_token_ids=p["ids"],
            multi_modal_data={"image": [Image.open(path).convert("RGB") for path in p["images"]]},
        )
        for p in trace["prompts"]
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)

    def chosen(logprobs, ids):
        return [None if lp is None else lp[t].logprob for lp, t in zip(logprobs, ids, strict=True)]

    rows = []
    for out in outs:
        gen = out.outputs[0]
        rows.append(
            {
                "prompt_token_ids": list(out.prompt_token_ids),
                "token_ids": list(gen.token_ids),
                "prompt_logprobs": chosen(out.prompt_logprobs, out.prompt_token_ids),
                "logprobs": chosen(gen.logprobs, gen.token_ids),
            }
        )
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    backends = sorted({g.backend.get_name() for g in _attn_groups(runner)})
    with open(out_path, "w") as f:
        json.dump({"rows": rows, "backends": backends, "seconds": time.monotonic() - start}, f)


def _attn_groups(runner) -> list:
    """The runner's attention groups (the backend each layer kind uses), or [] if unknown."""
    try:
        return [g for groups in runner.attn_groups for g in groups]
    except AttributeError:
        return []


if __name__ == "__main__":
    main()
