"""A long-lived real SGLang, run by the SGLang venv's Python and driven over a pipe.

Run as ``.venv-sglang/bin/python -P minirad/bench/sglang_worker.py --model DIR [options]`` by
:class:`minirad.bench.sglang_peer.SGLangPeer`, never imported: SGLang cannot live in the course
venv (``minirad/peers/sglang_env.py``), so this file imports only the standard library, msgspec
and SGLang, none of minirad, but for ``worker_common.py`` beside it (standard library only),
loaded by its path: the pipe's frames, the process tree and ``rss.py``, shared with
``vllm_worker.py``.

It builds one offline ``sglang.Engine`` on a *text* model folder (SGLang 0.5.23 cannot serve
LLaVA on CPU: ``minirad/peers/text_model.py``) with ``device="cpu"``, the radix cache on, the
pool, page size, requests in flight and dtype it is given, and ``sleep_on_idle`` (an idle
SGLang scheduler otherwise busy-polls a whole core, which would slow whichever system runs
next), then answers commands until ``quit`` or the end of its input. The engine is SGLang's own
three processes: its tokenizer manager in this process, its scheduler (the model runs there)
and its detokenizer in processes of their own.

Threads: SGLang's CPU backend binds threads only through its ``sgl_kernel`` build (not in this
lean venv), so the worker sets them itself before SGLang starts: ``--omp-threads-bind CPUS``
pins this process, and with it every process SGLang starts, to ``CPUS`` and gives the scheduler
one OpenMP thread per CPU (``OMP_NUM_THREADS``); without it nothing is pinned and
``OMP_NUM_THREADS`` is the environment's, 1 if unset (one computing thread, as HF and minirad at
``--threads 1`` and vLLM's ``auto`` on a small machine).

Protocol: the frames and replies of ``vllm_worker.py``'s docstring, with these commands:

- ``{"op": "generate", "requests": [{"prompt": str}, ...], "max_tokens": int,
  "ignore_eos": bool}``: greedy, all requests in one batch (``Engine.generate``'s path, with
  ``return_prompt_token_ids``). Reply ``{"ok": true, "seconds": float, "rss": {...},
  "outputs": [...]}``: ``seconds`` is the wall time of the call, ``rss`` the peak over this
  process and its descendants (``rss.peak_rss``), and each output is ``{"token_ids",
  "prompt_token_ids", "num_cached_tokens", "finish_reason", "ttft", "ttft_from_start"}``.
  ``num_cached_tokens``: SGLang's ``meta_info["cached_tokens"]``, prompt tokens its radix
  tree served. ``ttft``: SGLang's own ``meta_info["first_token_latency"]`` (``enable_metrics``),
  seconds from the request's arrival at the tokenizer manager to the end of its prefill, queueing
  included; ``ttft_from_start``: from the start of the call.
- ``{"op": "reset_prefix_cache"}``: ``Engine.flush_cache()``, the whole radix tree dropped.
  Reply ``{"ok": true, "reset": bool}`` (False: SGLang refused, requests were in flight).
- ``{"op": "info"}``: ``{"ok": true, "info": {...}}`` (see :func:`_info`), also sent unasked
  as ``{"ok": true, "ready": true, "info": {...}}`` once the engine is up.
- ``{"op": "quit"}``: reply ``{"ok": true}``, shut SGLang down, exit 0.

A command that fails is answered ``{"ok": false, "error": "..."}`` and the worker keeps
serving; a frame it cannot decode ends it with exit code 3.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import sys
import time
from pathlib import Path


def _load_common():
    """``worker_common.py`` beside this file, loaded by its path (standard library only)."""
    name = "minirad_bench_worker_common"
    if name not in sys.modules:
        path = Path(__file__).with_name("worker_common.py")
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


common = _load_common()

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def parse_cpus(text: str) -> list[int]:
    """``"0-1"``, ``"0,2"``, ``"0-3,6"``: the CPUs, sorted.

    Raises:
        ValueError: not such a list.
    """
    cpus: set[int] = set()
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        first, last = int(lo), int(hi) if dash else int(lo)
        if first < 0 or last < first:
            raise ValueError(f"bad CPU range {part!r}")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise ValueError("no CPUs")
    return sorted(cpus)


def kv_bytes_per_token(model_dir: str, dtype: str) -> int:
    """K plus V of one token over all layers, as SGLang's ``MHATokenToKVPool`` lays them out
    (per layer a K and a V buffer of ``[tokens, kv_heads, head_dim]`` in the KV dtype, which is
    the model's ``dtype`` here: ``kv_cache_dtype`` is ``auto``)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * _DTYPE_BYTES[dtype]


def _info(engine, args) -> dict:
    """SGLang's version and settings as its scheduler reports them (``get_server_info``), its
    KV pool, and every process of the engine (this one, the scheduler, the detokenizer) as
    ``worker_common.process`` sees it."""
    import sglang

    server = engine.get_server_info()
    state = server["internal_states"][0]  # one scheduler (tp 1, dp 1)
    memory = state["memory_usage"]
    return {
        "sglang_version": sglang.__version__,
        "token_capacity": int(memory["token_capacity"]),
        "kv_cache_gb": float(memory["kvcache"]),  # SGLang's own figure, rounded to 1 MB
        "kv_bytes_per_token": kv_bytes_per_token(args.model, state["dtype"]),
        "page_size": int(state["page_size"]),
        "max_running_requests": int(state["max_running_requests"]),
        "chunked_prefill_size": state["chunked_prefill_size"],
        "schedule_policy": state["schedule_policy"],
        "overlap_schedule": not state["disable_overlap_schedule"],
        "attention_backend": state["attention_backend"],
        "radix_eviction_policy": state["radix_eviction_policy"],
        "dtype": state["dtype"],
        "sleep_on_idle": bool(state["sleep_on_idle"]),
        "omp_threads_bind": args.omp_threads_bind,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "processes": common.processes(),
    }


def _generate(engine, command: dict) -> dict:
    from sglang.srt.managers.io_struct import GenerateReqInput

    requests = command["requests"]
    if any(r.get("images") for r in requests):
        raise ValueError("SGLang 0.5.23 serves no LLaVA on CPU: text requests only")
    params = {
        "max_new_tokens": int(command["max_tokens"]),
        "temperature": 0.0,
        "ignore_eos": bool(command.get("ignore_eos", False)),
    }
    # Engine.generate's own path, with the prompt's token ids returned as SGLang tokenized them.
    request = GenerateReqInput(
        text=[r["prompt"] for r in requests],
        sampling_params=params,
        return_prompt_token_ids=True,
    )
    with common.rss.peak_rss(common.engine_pids) as memory:
        wall0 = time.time()
        t0 = time.perf_counter()
        generator = engine.tokenizer_manager.generate_request(request, None)
        results = engine.loop.run_until_complete(generator.__anext__())
        seconds = time.perf_counter() - t0
    outputs = []
    for r in results:
        meta = r["meta_info"]
        ttft = meta.get("first_token_latency")
        received = meta.get("request_received_ts")
        finish = meta.get("finish_reason") or {}
        outputs.append(
            {
                "token_ids": list(r["output_ids"]),
                "prompt_token_ids": list(r.get("prompt_token_ids") or []),
                "num_cached_tokens": int(meta.get("cached_tokens") or 0),
                "finish_reason": finish.get("type") if isinstance(finish, dict) else finish,
                "ttft": ttft,
                "ttft_from_start": None
                if ttft is None or received is None
                else received + ttft - wall0,
            }
        )
    return {
        "ok": True,
        "seconds": seconds,
        "rss": {"start": memory.start, "peak": memory.peak},
        "outputs": outputs,
    }


def _reset(engine) -> dict:
    result = engine.flush_cache()
    return {"ok": True, "reset": bool(getattr(result, "success", result))}


def main() -> int:
    # The reply channel first, before anything can print: SGLang's logs go to stderr from now.
    channel = common.reply_channel()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a text model folder")
    parser.add_argument("--max-running-requests", type=int, default=8, help="requests in flight")
    parser.add_argument("--max-total-tokens", type=int, default=4096, help="KV pool, tokens")
    parser.add_argument("--page-size", type=int, default=1, help="tokens per KV page")
    parser.add_argument("--dtype", default="float32", help="SGLang's dtype (float32, bfloat16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--schedule-policy", default=None, help="SGLang's --schedule-policy (default: its own)"
    )
    parser.add_argument(
        "--omp-threads-bind",
        default=None,
        metavar="CPUS",
        help="pin SGLang to these CPUs, one OpenMP thread each (0-1, 0,1); default: unpinned, "
        "OMP_NUM_THREADS as set (1 if unset)",
    )
    args = parser.parse_args()
    # Before SGLang (and torch) is imported: its processes inherit the CPUs and the variable.
    if args.omp_threads_bind is not None:
        cpus = parse_cpus(args.omp_threads_bind)
        os.sched_setaffinity(0, cpus)
        os.environ["OMP_NUM_THREADS"] = str(len(cpus))
    else:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    # SIGTERM (the client's close(), our parent's death) ends the process through Python, so
    # that the Engine's atexit shutdown stops the scheduler and the detokenizer.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    import sglang

    extra = {} if args.schedule_policy is None else {"schedule_policy": args.schedule_policy}
    engine = sglang.Engine(
        model_path=args.model,
        device="cpu",
        dtype=args.dtype,
        disable_cuda_graph=True,  # CUDA only
        mem_fraction_static=0.1,  # the pool is max_total_tokens; this only bounds it
        max_total_tokens=args.max_total_tokens,
        max_running_requests=args.max_running_requests,
        page_size=args.page_size,
        enable_cache_report=True,  # meta_info["cached_tokens"]
        enable_metrics=True,  # meta_info["first_token_latency"]
        sleep_on_idle=True,
        skip_server_warmup=True,
        random_seed=args.seed,
        log_level="error",
        **extra,
    )
    try:
        channel.send({"ok": True, "ready": True, "info": _info(engine, args)})
        while True:
            try:
                command = channel.receive()
            except Exception as e:  # a frame that is not msgpack: the pipe is out of step
                print(f"sglang_worker: bad frame: {e!r}", file=sys.stderr)
                return 3
            if command is None:
                return 0
            op = command.get("op") if isinstance(command, dict) else None
            if op == "quit":
                channel.send({"ok": True})
                return 0
            try:
                if op == "generate":
                    reply = _generate(engine, command)
                elif op == "reset_prefix_cache":
                    reply = _reset(engine)
                elif op == "info":
                    reply = {"ok": True, "info": _info(engine, args)}
                else:
                    reply = {"ok": False, "error": f"unknown op {op!r}"}
            except Exception as e:  # reported to the client; the engine may still serve
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            channel.send(reply)
    finally:
        engine.shutdown()  # the scheduler and the detokenizer


if __name__ == "__main__":
    sys.exit(main())
