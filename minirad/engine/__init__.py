"""The serving engine: requests, sampling, scheduling, encoder cache, model runner.

- :class:`LLMEngine` (``engine.py``): ``add_request`` / ``step`` / ``generate`` / ``stream``.
- :class:`GenerateRequest`, :class:`Request`, :class:`RequestOutput` (``request.py``): a
  request's input, state and output; :class:`SamplingParams` (``minirad/engine/sampling_params.py``,
  torch-free: the CLI checks its flags with it before loading the engine).
- :class:`InputProcessor` (``processing.py``): prompt + images -> ids, radix key, images.
- :class:`Scheduler` (``scheduler.py``): continuous batching, chunked prefill, preemption,
  prefix reuse through the radix cache; its policies (``schedule_policy.py``, torch-free:
  :data:`SCHEDULE_POLICIES`, the waiting queue's order).
- :class:`EncoderCache` (``encoder_cache.py``): image features by image hash.
- :class:`ModelRunner` (``model_runner.py``): a scheduled step -> one forward pass.
- :func:`sample` (``sampling.py``): greedy, temperature, top-k, top-p, seeded per request.
"""

from __future__ import annotations

from minirad.lazy import lazy_exports

# Public name -> the module of this package that defines it, imported on first use (so
# ``minirad.engine.sampling_params`` and the other light modules never pull in torch).
_EXPORTS: dict[str, str] = {
    "EncoderCache": "encoder_cache",
    "EngineConfig": "engine",
    "EngineStats": "engine",
    "LLMEngine": "engine",
    "available_devices": "engine",
    "resolve_device": "engine",
    "ModelRunner": "model_runner",
    "ImageItem": "processing",
    "ImageSegment": "processing",
    "InputProcessor": "processing",
    "ProcessedPrompt": "processing",
    "load_image": "processing",
    "EngineCoreRequest": "request",
    "GenerateRequest": "request",
    "Request": "request",
    "RequestOutput": "request",
    "RequestStats": "request",
    "RequestStatus": "request",
    "apply_top_k": "sampling",
    "apply_top_p": "sampling",
    "sample": "sampling",
    "sample_one": "sampling",
    "SamplingParams": "sampling_params",
    "PREFIX_STRATEGIES": "schedule_policy",
    "SCHEDULE_POLICIES": "schedule_policy",
    "SchedulePolicy": "schedule_policy",
    "ScheduledRequest": "scheduler",
    "Scheduler": "scheduler",
    "SchedulerConfig": "scheduler",
    "SchedulerObserver": "scheduler",
    "SchedulerOutput": "scheduler",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
