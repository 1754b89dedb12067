"""A long-lived real vLLM, run by the vLLM venv's Python and driven over a pipe.

Run as ``.venv-vllm/bin/python -P minirad/bench/vllm_worker.py --model DIR [options]`` by
:class:`minirad.bench.peer.VLLMPeer`, never imported: vLLM cannot live in the course venv
(``minirad/peers/vllm_env.py``), so this file imports only the standard library, PIL, msgspec and
vLLM, none of minirad (``-P`` keeps this folder off ``sys.path``: its ``trace.py`` would
shadow the standard library's), but for ``worker_common.py`` beside it (standard library only,
shared with ``sglang_worker.py``), loaded by its path: the pipe's frames, the process tree, and
``rss.py``, which measures memory as the engine benchmark does.

It builds one offline ``vllm.LLM`` on the model (block size 32, float32 unless ``--dtype``,
``max_model_len`` 512, eager, prefix caching on), then answers commands until ``quit`` or the
end of its input.

Protocol. vLLM logs to stdout and stderr, so the replies get a channel of their own: before
vLLM is imported, the worker keeps its original stdout as the reply channel and points
file descriptor 1 at stderr (``worker_common.reply_channel``). Each message, both ways, is a
frame: a 4-byte big-endian length, then that many bytes of msgpack. Commands arrive on stdin
as maps with an ``op``:

- ``{"op": "generate", "requests": [{"prompt": str, "images": [PNG bytes, ...]}, ...],
  "max_tokens": int, "ignore_eos": bool, "structured": map | None}``: greedy, all requests in
  one ``LLM.generate`` call; ``structured`` (optional) holds the fields of vLLM's
  ``StructuredOutputsParams`` (``{"json": schema}``...), applied to every request.
  Reply ``{"ok": true, "seconds": float, "outputs": [...]}`` where ``seconds`` is the
  wall time of the ``generate`` call (PNG decoding excluded), ``kv_cache_usage`` is
  ``{"peak": float | None, "samples": int}`` (see :class:`_UsageSampler`), ``rss`` is
  ``{"start": int | None, "peak": int | None}``, bytes over this process and its descendants
  (the engine core, the model worker) around the call (``rss.peak_rss``), and each output is
  ``{"token_ids", "prompt_token_ids", "num_cached_tokens", "finish_reason", "ttft",
  "ttft_from_start"}``. ``ttft``: vLLM's own ``RequestOutput.metrics.first_token_latency``,
  seconds from the request's arrival (stamped as the front end starts preprocessing it, after
  the requests before it were added) to the step that produced its first token, queueing
  included; ``ttft_from_start``: from the start of the ``generate`` call. Both are None when
  vLLM kept no metrics.
- ``{"op": "reset_prefix_cache"}``: forget every cached block (``LLM.reset_prefix_cache``),
  and the preprocessed images and the encoder outputs too, so that the next run starts cold.
  Reply ``{"ok": true, "reset": bool}`` (False: vLLM refused, requests were in flight).
- ``{"op": "info"}``: ``{"ok": true, "info": {...}}`` (see :func:`_info`). The worker sends
  the same info unasked, as ``{"ok": true, "ready": true, "info": {...}}``, once the engine
  is up.
- ``{"op": "quit"}``: reply ``{"ok": true}``, shut vLLM down, exit 0.

A command that fails is answered ``{"ok": false, "error": "..."}`` and the worker keeps
serving; a frame it cannot decode ends it with exit code 3.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import os
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
rss = common.rss
_engine_pids = common.engine_pids  # this process (vLLM's front end), the engine core, its workers
_process = common.process


def _kv_cache_tensors(worker) -> list[dict]:
    """Shape and element size of each KV tensor the model worker allocated (runs there, by
    ``collective_rpc``): the physical pool, not vLLM's estimate of it."""
    return [
        {"shape": list(t.shape), "element_size": t.element_size()}
        for t in worker.model_runner.kv_caches
    ]


class _UsageSampler:
    """The peak of vLLM's ``SchedulerStats.kv_cache_usage`` (blocks running requests hold /
    usable blocks), fed by the front end's stat loggers: the engine core computes it after
    every step, once that step's finished requests are freed, and sends it with the step's
    outputs (``Scheduler.make_stats``, ``LLMEngine.step``)."""

    def __init__(self, llm) -> None:
        from vllm.v1.metrics.loggers import PerEngineStatLoggerAdapter, StatLoggerBase

        sampler = self

        class Logger(StatLoggerBase):  # vLLM's interface for custom stat loggers
            def __init__(self, vllm_config, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
                if scheduler_stats is not None:
                    sampler.samples += 1
                    sampler.peak = max(sampler.peak or 0.0, scheduler_stats.kv_cache_usage)

            def log_engine_initialized(self) -> None:
                pass

        # LLM() takes no stat loggers (LLMEngine.from_engine_args does): join its manager's.
        manager = llm.llm_engine.logger_manager
        manager.stat_loggers.append(
            PerEngineStatLoggerAdapter(llm.llm_engine.vllm_config, manager.engine_indexes, Logger)
        )
        self.reset()

    def reset(self) -> None:
        self.peak: float | None = None
        self.samples = 0


def _info(llm, kv_cache_tensors: list[dict]) -> dict:
    """vLLM's version and pool (its KV tensors as :func:`_kv_cache_tensors` read them), this
    process's torch threads, and every process of the engine (this one, the engine core, its
    workers) as :func:`_process` sees it."""
    import torch
    import vllm
    from vllm import envs

    config = llm.llm_engine.vllm_config
    processes = common.processes()
    return {
        "vllm_version": vllm.__version__,
        "block_size": config.cache_config.block_size,
        "num_gpu_blocks": config.cache_config.num_gpu_blocks,
        "kv_cache_size_tokens": config.cache_config.kv_cache_size_tokens,  # as vLLM logs it
        "kv_cache_tensors": kv_cache_tensors,
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "frontend_torch_threads": torch.get_num_threads(),
        "omp_threads_bind": envs.VLLM_CPU_OMP_THREADS_BIND,  # "auto" unless set
        "processes": processes,
    }


def _generate(llm, usage: _UsageSampler, command: dict) -> dict:
    from PIL import Image
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    prompts = []
    for request in command["requests"]:
        prompt: dict = {"prompt": request["prompt"]}
        images = [Image.open(io.BytesIO(data)) for data in request["images"]]
        for image in images:
            image.load()  # decode now, outside the timed call
        if images:
            prompt["multi_modal_data"] = {"image": images if len(images) > 1 else images[0]}
        prompts.append(prompt)
    structured = command.get("structured")
    params = SamplingParams(
        temperature=0.0,
        max_tokens=int(command["max_tokens"]),
        ignore_eos=bool(command.get("ignore_eos", False)),
        structured_outputs=None if structured is None else StructuredOutputsParams(**structured),
    )
    usage.reset()
    with rss.peak_rss(_engine_pids) as memory:
        wall0 = time.time()
        t0 = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
    kv_cache_usage = {"peak": usage.peak, "samples": usage.samples}
    outputs = []
    for r in results:
        metrics = r.metrics
        ttft = from_start = None
        if metrics is not None and metrics.first_token_latency:
            ttft = metrics.first_token_latency
            from_start = metrics.arrival_time + ttft - wall0
        outputs.append(
            {
                "token_ids": list(r.outputs[0].token_ids),
                "prompt_token_ids": list(r.prompt_token_ids),
                "num_cached_tokens": r.num_cached_tokens or 0,
                "finish_reason": r.outputs[0].finish_reason,
                "ttft": ttft,
                "ttft_from_start": from_start,
            }
        )
    return {
        "ok": True,
        "seconds": seconds,
        "kv_cache_usage": kv_cache_usage,
        "rss": {"start": memory.start, "peak": memory.peak},
        "outputs": outputs,
    }


def _reset(llm) -> dict:
    reset = llm.reset_prefix_cache()
    llm.reset_mm_cache()  # preprocessed images (the front end's and the engine core's)
    llm.llm_engine.reset_encoder_cache()  # the vision tower's outputs
    return {"ok": True, "reset": bool(reset)}


def main() -> int:
    # The reply channel first, before anything can print: vLLM's logs go to stderr from now.
    # vLLM forks its engine core: forked children let go of the reply pipe.
    channel = common.reply_channel()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model folder")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="requests in flight")
    parser.add_argument(
        "--num-gpu-blocks-override", type=int, default=None, help="KV pool in blocks (+1 null)"
    )
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--dtype", default="float32", help="vLLM's dtype (float32, bfloat16)")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--structured-outputs-backend", default=None, help="vLLM's grammar backend (guidance...)"
    )
    args = parser.parse_args()
    # vLLM's CPU backend wants 0.92 of a NUMA node's memory for KV unless told (GiB).
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # collective_rpc sends _kv_cache_tensors, a function, which vLLM pickles only when allowed;
    # its engine core listens on this machine's IPC sockets only.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"

    from vllm import LLM

    extra = {}
    if args.structured_outputs_backend is not None:
        # Engine-wide: vLLM 0.32 reads the backend (and its whitespace option) only from here.
        extra["structured_outputs_config"] = {"backend": args.structured_outputs_backend}
    llm = LLM(
        model=args.model,
        block_size=args.block_size,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        enforce_eager=True,
        enable_prefix_caching=True,
        max_num_seqs=args.max_num_seqs,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        seed=args.seed,
        disable_log_stats=False,  # keeps RequestOutput.metrics (the TTFT) and SchedulerStats
        **extra,
    )
    usage = _UsageSampler(llm)
    (kv_cache_tensors,) = llm.llm_engine.collective_rpc(_kv_cache_tensors)  # one worker
    channel.send({"ok": True, "ready": True, "info": _info(llm, kv_cache_tensors)})
    while True:
        try:
            command = channel.receive()
        except Exception as e:  # a frame that is not msgpack: the pipe is out of step
            print(f"vllm_worker: bad frame: {e!r}", file=sys.stderr)
            return 3
        if command is None:
            return 0
        op = command.get("op") if isinstance(command, dict) else None
        if op == "quit":
            channel.send({"ok": True})
            llm.llm_engine.engine_core.shutdown()  # stops the engine core and its workers
            return 0
        try:
            if op == "generate":
                reply = _generate(llm, usage, command)
            elif op == "reset_prefix_cache":
                reply = _reset(llm)
            elif op == "info":
                reply = {"ok": True, "info": _info(llm, kv_cache_tensors)}
            else:
                reply = {"ok": False, "error": f"unknown op {op!r}"}
        except Exception as e:  # reported to the client; the engine may still serve
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        channel.send(reply)


if __name__ == "__main__":
    sys.exit(main())
