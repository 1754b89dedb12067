"""The serving engine: requests, sampling, scheduling, encoder cache, model runner.

- :class:`LLMEngine` (``engine.py``): ``add_request`` / ``step`` / ``generate`` / ``stream``.
- :class:`GenerateRequest`, :class:`Request`, :class:`RequestOutput` (``request.py``): a
  request's input, state and output; :class:`SamplingParams` (``minirad/sampling_params.py``,
  torch-free: the CLI checks its flags with it before loading the engine).
- :class:`InputProcessor` (``processing.py``): prompt + images -> ids, radix key, images.
- :class:`Scheduler` (``scheduler.py``): continuous batching, chunked prefill, preemption,
  prefix reuse through the radix cache, ``fcfs`` / ``lpm``.
- :class:`EncoderCache` (``encoder_cache.py``): image features by image hash.
- :class:`ModelRunner` (``model_runner.py``): a scheduled step -> one forward pass.
- :func:`sample` (``sampling.py``): greedy, temperature, top-k, top-p, seeded per request.
"""

from ..sampling_params import SamplingParams
from .encoder_cache import EncoderCache
from .engine import EngineConfig, EngineStats, LLMEngine
from .model_runner import ModelRunner
from .processing import ImageItem, ImageSegment, InputProcessor, ProcessedPrompt, load_image
from .request import (
    EngineCoreRequest,
    GenerateRequest,
    Request,
    RequestOutput,
    RequestStats,
    RequestStatus,
)
from .sampling import apply_top_k, apply_top_p, sample, sample_one
from .scheduler import (
    POLICIES,
    PREFIX_STRATEGIES,
    ScheduledRequest,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

__all__ = [
    "POLICIES",
    "PREFIX_STRATEGIES",
    "EncoderCache",
    "EngineCoreRequest",
    "EngineConfig",
    "EngineStats",
    "GenerateRequest",
    "ImageItem",
    "ImageSegment",
    "InputProcessor",
    "LLMEngine",
    "ModelRunner",
    "ProcessedPrompt",
    "Request",
    "RequestOutput",
    "RequestStats",
    "RequestStatus",
    "SamplingParams",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "apply_top_k",
    "apply_top_p",
    "load_image",
    "sample",
    "sample_one",
]
