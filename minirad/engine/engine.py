"""LLMEngine: requests in, tokens out, through the radix cache and our paged decoder.

The parts, each in its own module (nano-vllm's ``LLMEngine`` layout, vLLM's names)::

    GenerateRequest --InputProcessor--> Request --Scheduler.add_request--> waiting queue
    step():  Scheduler.schedule()            which requests, how many tokens, which KV slots
             _execute_model()                ModelRunner: one ForwardBatch, image features
                                             from the EncoderCache, PagedVLM -> logits
             _sample()                       grammar masks, then greedy / temperature /
                                             top-k / top-p, per request
             Scheduler.update_from_output()  append tokens, stop, cache in the radix tree
             _process_outputs()              jump-forward (tokens a grammar forces), the
                                             text; finish at a stop string
             _record_step()                  the StepEvent and EngineStats
    -> RequestOutput (token ids, text, finish reason, stats)

Memory: one :class:`~minirad.kvcache.kv_pool.KVCache` of ``num_kv_slots`` token slots in pages of
``page_size``; a :class:`~minirad.kvcache.kv_pool.TokenToKVPoolAllocator` hands them out; the
:class:`~minirad.kvcache.radix_cache.RadixCache` keeps finished prefixes and evicts them when the
allocator is short. All three share the engine's :class:`~minirad.events.EventBus`
(``engine.bus``), so a subscriber sees every match, insert, lock, eviction, alloc and free.

Threads: the tiny models of this course run fastest with ``torch.set_num_threads(1)``; the
engine never changes torch's global settings, so set it in the calling program.

Device and dtype: the engine runs where the model is, or moves the model to
``EngineConfig.device`` (checked by :func:`resolve_device`), and in the model's dtype: the KV
pool takes both, and every tensor a step builds goes to the pool's device (the
:class:`~minirad.models.ForwardBatch`, image inputs, grammar masks). Sampling draws on the CPU
(:mod:`minirad.engine.sampling` says why); outputs' logits come back on the CPU.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import numbers
import os
import reprlib
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields, replace

import torch

from minirad.engine.encoder_cache import EncoderCache
from minirad.engine.explain import MissExplainer
from minirad.engine.grammar import GrammarCompiler, allocate_token_bitmask, apply_token_bitmask
from minirad.engine.model_runner import PREFETCH_LOOKAHEAD, ModelRunner
from minirad.engine.processing import InputProcessor
from minirad.engine.request import (
    EngineCoreRequest,
    GenerateRequest,
    Request,
    RequestOutput,
    RequestStatus,
)
from minirad.engine.sampling import sample
from minirad.engine.sampling_params import SamplingParams
from minirad.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from minirad.errors import GrammarError, InvalidArgumentError, InvariantError, RequestError
from minirad.events import EventBus, JumpForwardEvent, StepEvent
from minirad.kv_events.block_events import VLLM_BLOCK_SIZE
from minirad.kvcache.hicache_storage import HiCacheFile
from minirad.kvcache.hiradix_cache import HiRadixCache
from minirad.kvcache.host_pool import make_host_pool
from minirad.kvcache.kv_pool import KVCache, TokenToKVPoolAllocator
from minirad.kvcache.radix_cache import RadixCache
from minirad.kvcache.tensor_transfer import TensorTransfer
from minirad.kvcache.tiers import WRITE_POLICIES
from minirad.models import PagedVLM, get_family, kv_cache_dims, load_model

__all__ = ["EngineConfig", "EngineStats", "LLMEngine", "available_devices", "resolve_device"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings (nano-vllm's ``Config``).

    Attributes:
        num_kv_slots: KV pool capacity in tokens (a multiple of ``page_size``).
        page_size: tokens per KV page (= the radix tree's page and the pool's block size).
        max_num_seqs, max_num_batched_tokens, policy, prefix_strategy,
            in_batch_prefix_threshold: see :class:`~minirad.engine.SchedulerConfig` (``policy``
            is the scheduling order, a name in
            :data:`~minirad.engine.schedule_policy.SCHEDULE_POLICIES`: SGLang's
            ``--schedule-policy``).
        max_model_len: context length in tokens; None: the text model's
            ``max_position_embeddings``.
        eviction_policy: which unlocked leaf the radix tree evicts first: a name in
            :data:`minirad.kvcache.eviction.EVICTION_POLICIES` (SGLang's
            ``--radix-eviction-policy``), or a policy object.
        encoder_cache_size: image-feature rows the encoder cache keeps.
        seed: seeds the engine's generator, which seeds sampling requests without a seed.
        kv_events_endpoint: publish the radix tree's full blocks as vLLM KV events
            (:class:`~minirad.kv_events.block_events.RadixBlockEvents`, one batch per step) on this
            ZMQ endpoint, e.g. ``"tcp://*:5557"`` (vLLM's ``KVEventsConfig.endpoint``); None:
            nothing is published and nothing listens to the bus for it.
        kv_events_replay_endpoint: vLLM's replay socket (``"tcp://*:5558"``), or None.
        kv_events_block_size: tokens per published block (vLLM's CPU backend: 32).
        jump_forward: append the tokens a request's grammar forces in one prefill chunk
            (:meth:`Request.jump_forward`) instead of decoding them one by one.
        device: where the engine runs (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``, or a
            ``torch.device``): the model is moved there, in place (``model.to(device)``, as a
            Hugging Face pipeline does), and the KV pool is made there. None: the model's
            own device (``model.device``), the model left where it is. Checked by
            :func:`resolve_device`.
        prepack_weights: on a CPU, also keep a oneDNN-packed copy of the text model's weights
            for steps of a few rows, decode steps above all (:mod:`minirad.models.linear`): one
            more copy of those weights in memory for faster decode steps.
        cascade_attention: decodes that share a long prefix attend to it once
            (:mod:`minirad.models.cascade_attention`; vLLM's ``disable_cascade_attn`` off).
        hicache_ratio: give the radix tree a host tier this many times the KV pool
            (:class:`~minirad.kvcache.hiradix_cache.HiRadixCache`, SGLang's
            ``--enable-hierarchical-cache --hicache-ratio``; 2 is SGLang's default). None: no
            tiers, a plain :class:`~minirad.kvcache.radix_cache.RadixCache`.
        hicache_write_policy: when the host gets a copy: ``"write_through"`` (every insert;
            the default), ``"write_through_selective"`` (once hot), ``"write_back"`` (on
            eviction). Needs ``hicache_ratio``.
        hicache_storage_dir: a folder for the disk tier (one safetensors file per page,
            :class:`~minirad.kvcache.hicache_storage.HiCacheFile`), shared by every engine
            of the same model that names it; needs ``hicache_ratio``. None: no disk tier.
        explain_misses: label every prompt token of every request with why it hit or missed
            (``RequestStats.miss_causes``; :meth:`LLMEngine.explain`). Off: no cost.
    """

    num_kv_slots: int = 4096
    page_size: int = 1
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    policy: str = "fcfs"
    prefix_strategy: str = "radix"
    in_batch_prefix_threshold: int | None = 16
    max_model_len: int | None = None
    eviction_policy: str = "lru"
    encoder_cache_size: int = 4096
    seed: int = 0
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_block_size: int = VLLM_BLOCK_SIZE
    jump_forward: bool = True
    device: str | torch.device | None = None
    prepack_weights: bool = True
    cascade_attention: bool = True
    hicache_ratio: float | None = None
    hicache_write_policy: str | None = None
    hicache_storage_dir: str | os.PathLike | None = None
    explain_misses: bool = False


@dataclass
class EngineStats:
    """Engine-wide counters (tokens unless named otherwise).

    ``prefill_tokens`` and ``decode_tokens`` are what the model computed; ``cached_tokens``
    and ``preempted_cached_tokens`` what the radix tree saved (see ``RequestStats``);
    ``queried_tokens`` the prompt tokens looked up in the tree at first admissions (the hit
    rate's denominator: vLLM's ``prefix_cache_queries``, ``cached_tokens`` its hits);
    ``encoder_calls`` / ``encoder_hits`` vision-tower runs and runs the encoder cache saved;
    ``forced_tokens`` the output tokens jump-forward appended (decode steps they did not need);
    ``cached_tokens_by_source`` ``cached_tokens`` by tier (``device``, ``host``, ``storage``;
    see ``RequestStats``).
    """

    num_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    cached_tokens: int = 0
    queried_tokens: int = 0
    preempted_cached_tokens: int = 0
    num_preemptions: int = 0
    num_finished: int = 0
    encoder_calls: int = 0
    encoder_hits: int = 0
    forced_tokens: int = 0
    cached_tokens_by_source: dict[str, int] = field(default_factory=dict)


def _resolve_config(config: EngineConfig | None, overrides: dict) -> EngineConfig:
    """``config`` (or the defaults) with ``overrides`` applied; unknown names refused."""
    known = {f.name for f in fields(EngineConfig)}
    if unknown := set(overrides) - known:
        raise InvalidArgumentError(f"unknown engine settings {sorted(unknown)}")
    return replace(config or EngineConfig(), **overrides)


def _check_hicache(cfg: EngineConfig) -> None:
    """The tier settings, checked before anything is built (a disk tier starts a thread)."""
    ratio, policy, folder = cfg.hicache_ratio, cfg.hicache_write_policy, cfg.hicache_storage_dir
    if ratio is not None:
        try:
            ok = isinstance(ratio, numbers.Real) and not isinstance(ratio, bool)
            ok = ok and math.isfinite(float(ratio)) and float(ratio) > 0
        except OverflowError:
            ok = False
        if not ok:
            raise InvalidArgumentError(f"hicache_ratio must be a finite number > 0, got {ratio!r}")
    if policy is not None and policy not in WRITE_POLICIES:
        raise InvalidArgumentError(
            f"hicache_write_policy must be one of {WRITE_POLICIES}, got {policy!r}"
        )
    if folder is not None and not isinstance(folder, str | os.PathLike):
        raise InvalidArgumentError(f"hicache_storage_dir must be a path or None, got {folder!r}")
    if ratio is None and (policy is not None or folder is not None):
        raise InvalidArgumentError(
            "hicache_write_policy and hicache_storage_dir need hicache_ratio (a host tier)"
        )


def _weights_fingerprint(model: torch.nn.Module) -> str:
    """A digest of every parameter's name, shape and 64 of its values spread over it: two
    checkpoints of one architecture (a fine-tune) differ in it, at no cost worth counting."""
    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.detach().reshape(-1)
            idx = torch.linspace(0, flat.numel() - 1, min(64, flat.numel())).long()
            sample = flat[idx.to(flat.device)].float().cpu()
            h.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
            h.update(sample.numpy().tobytes())
    return h.hexdigest()


def _check_host_memory(num_bytes: int, ratio: float) -> None:
    """Refuse a host pool larger than the memory this machine has free (SGLang refuses a
    ``--hicache-size`` its host cannot hold, rather than being killed for it)."""
    try:  # MemAvailable counts the page cache the kernel would give back; MemFree does not
        with open("/proc/meminfo") as f:
            line = next(ln for ln in f if ln.startswith("MemAvailable:"))
        free = int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError, IndexError):  # not Linux: no check
        return
    if num_bytes > free:
        raise InvalidArgumentError(
            f"hicache_ratio {ratio:g} asks for a host pool of {num_bytes / 2**30:,.1f} GiB of KV; "
            f"this machine has {free / 2**30:,.1f} GiB free"
        )


# Accelerator backends a device string may name, each a torch module with ``is_available()``
# and ``device_count()`` (torch.cuda, torch.xpu, torch.mps).
_ACCELERATORS = ("cuda", "xpu", "mps")
_SHOW = reprlib.Repr()  # resolve_device's messages: device strings cut at 80 characters
_SHOW.maxstring = _SHOW.maxother = 80


def available_devices() -> list[str]:
    """The devices this process can run the engine on: ``"cpu"``, then every visible
    accelerator (``"cuda:0"``, ``"cuda:1"``..., ``"mps"``)."""
    found = ["cpu"]
    for kind in _ACCELERATORS:
        backend = getattr(torch, kind, None)
        if backend is None or not backend.is_available():
            continue
        count = backend.device_count()
        found += [kind] if kind == "mps" else [f"{kind}:{i}" for i in range(count)]
    return found


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a :class:`torch.device` this process can use.

    Raises:
        InvalidArgumentError: not a device string torch parses (``"gpu"``, ``"cuda:x"``), a
            device type torch has no usable backend for here (``"cuda"`` in a CPU-only torch
            or on a machine without a GPU, ``"mps"`` off Apple silicon, ``"meta"``, which holds
            no data), or an index past the device count (``"cuda:3"`` with one GPU). The
            message names the device and :func:`available_devices`.
    """
    available = f"available here: {', '.join(available_devices())}"
    # The device as the messages show it: a 100 kB command-line string stays one short line.
    shown = _SHOW.repr(str(device) if isinstance(device, torch.device) else device)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise InvalidArgumentError(
            f"device {shown} is not a torch device (write e.g. 'cpu', 'cuda', 'cuda:1', "
            f"'mps'); {available}"
        ) from None
    if dev.type == "cpu":
        return torch.device("cpu")  # torch ignores a CPU index ('cpu:1' is the CPU)
    backend = getattr(torch, dev.type, None) if dev.type in _ACCELERATORS else None
    if backend is None or not backend.is_available():
        why = (
            f"torch.{dev.type}.is_available() is False (torch {torch.__version__})"
            if backend is not None
            else f"the engine runs on cpu, {', '.join(_ACCELERATORS)}"
        )
        raise InvalidArgumentError(f"device {shown} is not available: {why}; {available}")
    count = backend.device_count()
    if dev.index is not None and dev.index >= count:
        raise InvalidArgumentError(
            f"device {shown} does not exist: torch sees {count} {dev.type} device(s); {available}"
        )
    return dev


def _eos_token_ids(model: torch.nn.Module) -> tuple[int, ...]:
    eos = model.generation_config.eos_token_id
    return () if eos is None else tuple(eos) if isinstance(eos, list | tuple) else (eos,)


class LLMEngine:
    """A continuous-batching VLM engine with radix prefix reuse.

    Args:
        model: a supported HF VLM (:func:`~minirad.models.get_family`), e.g. from
            :func:`~minirad.models.load_model`.
        processor: its HF processor (``AutoProcessor``); None to serve token-id prompts
            without images (outputs then have no text).
        bus: the event bus shared by the tree and the allocator (a new one if None).
        config: an :class:`EngineConfig`; keyword arguments override its fields.

    Raises:
        InvalidArgumentError: a bad setting (unknown field, pool size, policy, a device this
            process cannot use...).
        UnsupportedModelError: the model is not a supported family.

    The engine runs in the model's dtype (load it in bf16 for a bf16 engine, KV pool included)
    on ``config.device``; with a device set, ``model`` is moved there in place. Do not move or
    cast the model afterwards: the engine keeps its tensors as they were at construction.

    Example::

        engine = LLMEngine(model, processor, num_kv_slots=2048, policy="lpm")
        outs = engine.generate([GenerateRequest("<image> What is this?", [img])])
        for out in engine.stream(GenerateRequest("Tell me more")):
            print(out.new_text, end="")
    """

    def __init__(
        self,
        model: torch.nn.Module,
        processor=None,
        *,
        bus: EventBus | None = None,
        config: EngineConfig | None = None,
        **kwargs,
    ) -> None:
        self.config = cfg = _resolve_config(config, kwargs)
        device = None if cfg.device is None else resolve_device(cfg.device)
        text_config = model.config.text_config
        self.max_model_len = cfg.max_model_len or text_config.max_position_embeddings
        self.vocab_size = text_config.vocab_size  # logit columns
        self.bus = bus if bus is not None else EventBus()
        self.allocator = TokenToKVPoolAllocator(cfg.num_kv_slots, cfg.page_size, self.bus)
        _check_hicache(cfg)
        self.encoder_cache = EncoderCache(cfg.encoder_cache_size)
        scheduler_config = self._scheduler_config()
        get_family(model.config)  # every check before the caller's model moves
        if device is not None:
            model.to(device)  # in place (nn.Module.to), as HF pipelines do
        # Where every tensor of a step is made: the model's device, after the move (a bare
        # "cuda" becomes the "cuda:0" the parameters went to), and its dtype.
        self.device: torch.device = model.device
        self.dtype: torch.dtype = model.dtype
        self.kv_cache = KVCache(
            num_blocks=cfg.num_kv_slots // cfg.page_size,
            block_size=cfg.page_size,
            dtype=self.dtype,
            device=self.device,
            **kv_cache_dims(model.config),
        )
        self.host_kv_cache: KVCache | None = None
        self.tree_cache = self._make_tree_cache(model)
        # After the move: the decoder keeps the model's tensors (RoPE's inv_freq, the packed
        # weight copies of minirad.models.linear), which a later model.to() would not move.
        self.vlm = PagedVLM(
            model, self.kv_cache, prepack=cfg.prepack_weights, cascade=cfg.cascade_attention
        )
        self.scheduler = Scheduler(self.tree_cache, scheduler_config)
        self.model_runner = ModelRunner(self.vlm, self.encoder_cache)
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.input_processor = InputProcessor(
            processor,
            image_token_id=self.vlm.image_token_id,
            vocab_size=self.vocab_size,
            image_input_names=self.vlm.family.image_input_names,
            max_prompt_tokens=self.max_model_len,
        )
        self.eos_token_ids = _eos_token_ids(model)  # what HF generate() stops on
        self._grammar_compiler: GrammarCompiler | None = None  # built at the first grammar
        self._grammar_lock = threading.Lock()  # process_inputs may run on several threads
        self._generator = torch.Generator().manual_seed(cfg.seed)
        self._next_rid = 0
        self._stats = EngineStats()
        self.kv_events = self.kv_event_publisher = None
        if cfg.kv_events_endpoint is not None:
            self._start_kv_events()
        self.explainer: MissExplainer | None = None
        if cfg.explain_misses:
            self.explain()

    def _make_tree_cache(self, model) -> RadixCache:
        """The radix tree; with ``hicache_ratio``, over a host KV cache in CPU memory (and a
        disk tier in ``hicache_storage_dir``), copies through real tensors."""
        cfg = self.config
        if cfg.hicache_ratio is None:
            return RadixCache(cfg.page_size, cfg.eviction_policy, self.allocator, self.bus)
        ratio, kv = float(cfg.hicache_ratio), self.kv_cache
        host_pages = max(1, int(min(self.allocator.num_pages * ratio, 2.0**62)))
        _check_host_memory(host_pages * cfg.page_size * kv.bytes_per_token, ratio)
        host_pool = make_host_pool(self.allocator, ratio)
        self.host_kv_cache = KVCache(
            num_blocks=host_pool.num_pages,
            block_size=cfg.page_size,
            dtype=self.dtype,
            **kv_cache_dims(model.config),
        )
        storage, fingerprint = None, ""
        page_size = -(-32 // cfg.page_size) * cfg.page_size  # HiRadixCache's default
        if cfg.hicache_storage_dir is not None:
            # Pages are for these weights, dtype and layout only: another model's files miss.
            layout = f"{model.config.to_json_string()}|{self.dtype}|{kv.num_kv_heads}x{kv.head_dim}"
            layout += f"|{page_size}|{_weights_fingerprint(model)}"
            fingerprint = hashlib.sha256(layout.encode()).hexdigest()[:32]
            max_bytes = page_size * kv.bytes_per_token + (1 << 16)  # the tensors and a header
            try:
                storage = HiCacheFile(
                    cfg.hicache_storage_dir, fingerprint, max_page_bytes=max_bytes
                )
            except InvalidArgumentError as e:
                raise InvalidArgumentError(f"hicache_storage_dir: {e}") from None
        try:
            return HiRadixCache(
                cfg.page_size,
                cfg.eviction_policy,
                self.allocator,
                self.bus,
                host_pool=host_pool,
                write_policy=cfg.hicache_write_policy or "write_through",
                transfer=TensorTransfer(kv, self.host_kv_cache),
                storage=storage,
                storage_page_size=page_size,
                storage_namespace=fingerprint,
            )
        except BaseException:
            if storage is not None:
                storage.close()  # its writer thread
            raise

    def _scheduler_config(self) -> SchedulerConfig:
        cfg = self.config
        return SchedulerConfig(
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            policy=cfg.policy,
            prefix_strategy=cfg.prefix_strategy,
            in_batch_prefix_threshold=cfg.in_batch_prefix_threshold,
            max_model_len=self.max_model_len,
        )

    def _start_kv_events(self) -> None:
        """Publish the tree's full blocks as vLLM KV events (opt-in: pyzmq is imported only
        here)."""
        from minirad.kv_events import KVEventPublisher
        from minirad.kv_events.block_events import RadixBlockEvents

        cfg = self.config
        self.kv_events = RadixBlockEvents(
            self.bus,
            block_size=cfg.kv_events_block_size,
            # With tiers, the device is vLLM's "GPU" and the host pool its "CPU" (offloading).
            medium="CPU" if cfg.hicache_ratio is None else "GPU",
            image_token_id=self.vlm.image_token_id,
            vocab_size=self.vocab_size,
        )
        self.kv_event_publisher = KVEventPublisher(
            cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint
        )
        self.kv_events.sink = self.kv_event_publisher.publish

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, *, dtype: torch.dtype | str = torch.float32, **kwargs
    ) -> LLMEngine:
        """Load a model directory with :func:`~minirad.models.load_model` in ``dtype`` (a
        floating ``torch.dtype`` or its name, ``"bfloat16"``) and build an engine on it
        (``kwargs`` as in the constructor). The settings, the device included, are checked
        before any weight is read.

        Raises:
            InvalidArgumentError: a bad setting or dtype, a device this process cannot use, or
                ``path`` is not a model directory.
            UnsupportedModelError: the model is not a supported family.
        """
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, dtype)
        # float8 is floating too, but no weights load in it ("couldn't find storage object").
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
            raise InvalidArgumentError(
                f"dtype must be a floating-point torch dtype of 16 bits or more (torch.float32, "
                f"torch.bfloat16), got {dtype!r}"
            )
        settings = {k: v for k, v in kwargs.items() if k not in ("bus", "config")}
        cfg = _resolve_config(kwargs.get("config"), settings)
        if cfg.device is not None:
            resolve_device(cfg.device)
        model, processor = load_model(path, dtype=dtype)
        return cls(model, processor, **kwargs)

    # ------------------------------------------------------------------ requests
    def process_inputs(self, request: GenerateRequest | str) -> EngineCoreRequest:
        """Tokenize the prompt, load and preprocess its images, resolve its stop tokens and
        compile its grammar: an :class:`EngineCoreRequest` for :meth:`add_request`.

        Thread-safe, and touches no engine state but the input and grammar caches: a server
        calls it off the engine thread, so that one request's big picture or grammar holds up
        nobody's step (vLLM runs its input processor in the API server process).

        Raises:
            RequestError: not a request; empty prompt, bad ids, a text too long to fit; stop
                token ids outside the vocabulary.
            GrammarError: its json_schema / regex / choice does not compile, or is too big
                or too complex (the message says why); the engine has no tokenizer.
            ImageError: an image is missing, unreadable or too large, or the images do not
                match the prompt's placeholders.
        """
        if isinstance(request, str):
            request = GenerateRequest(request)
        if not isinstance(request, GenerateRequest):
            raise RequestError(f"expected a GenerateRequest or str, got {type(request).__name__}")
        params = request.sampling_params
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling_params must be SamplingParams, got {params!r}")
        stop = self.eos_token_ids if params.stop_token_ids is None else params.stop_token_ids
        if bad := [t for t in stop if t >= self.vocab_size]:
            raise RequestError(
                f"stop_token_ids {bad[:5]} are outside the vocabulary (0..{self.vocab_size - 1})"
            )
        processed = self.input_processor.process(request.prompt, request.images)
        grammar = None
        if params.structured_output_kind is not None:
            grammar = self.grammar_compiler.compile(params, stop)
        return EngineCoreRequest(
            request.rid, processed, params, tuple(stop), grammar, request.return_logits
        )

    def add_request(self, request: GenerateRequest | EngineCoreRequest | str) -> str:
        """Queue a request (processing it first with :meth:`process_inputs` unless it is an
        :class:`EngineCoreRequest`); it runs from the next :meth:`step`. Returns its rid.

        Raises:
            RequestError, GrammarError, ImageError: what :meth:`process_inputs` raises; a
                duplicate rid, a prompt too long for the context, a request that could never
                fit in the KV pool, an :class:`EngineCoreRequest` added before.
            Nothing is queued when it raises.
        """
        if not isinstance(request, EngineCoreRequest):
            request = self.process_inputs(request)
        if request.added:
            raise RequestError("this EngineCoreRequest was added already (its grammar is used)")
        params = request.sampling_params
        rid = request.rid if request.rid is not None else self._new_rid()
        if rid in self.scheduler.requests:
            raise RequestError(f"request id {rid!r} is already in the engine")
        generator = None
        if not params.greedy:
            seed = params.seed
            if seed is None:
                seed = int(torch.randint(2**62, (), generator=self._generator))
            generator = torch.Generator().manual_seed(seed)
        processed = request.prompt
        req = Request(
            rid,
            processed.prompt_token_ids,
            params,
            stop_token_ids=request.stop_token_ids,
            key_ids=processed.key_ids,
            images=processed.images,
            segments=processed.segments,
            generator=generator,
            return_logits=request.return_logits,
            grammar=request.grammar,
        )
        self.scheduler.add_request(req)
        request.added = True
        # A grammar may force the first tokens ('{"shapes": [{"colour": "'): they join the
        # prompt's prefill, so requests with the same prompt share them in the tree too.
        self._jump_forward(req)
        return rid

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """The engine's :class:`~minirad.engine.grammar.GrammarCompiler` (its cache of compiled
        grammars), built on first use.

        Raises:
            GrammarError: the engine has no tokenizer (token-id prompts only).
        """
        with self._grammar_lock:
            if self._grammar_compiler is None:
                if self.tokenizer is None:
                    raise GrammarError("structured output needs the model's tokenizer (processor)")
                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size)
            return self._grammar_compiler

    def _jump_forward(self, request: Request) -> None:
        """Append the tokens the request's grammar forces next (:meth:`Request.jump_forward`),
        up to but not including a token that would complete a stop string: that one is
        sampled in the next step, which finishes the request on it, so token ids, text and
        usage end where they end without jump-forward."""
        if not self.config.jump_forward or request.grammar is None:
            return
        start = request.num_tokens
        n = request.jump_forward(self.max_model_len)
        if n and request.sampling_params.stop:
            n -= self._forced_past_stop(request, n)
        if n:
            self._stats.forced_tokens += n
            if self.bus.active:
                self.bus.emit(JumpForwardEvent(self.bus.tick(), request.rid, start, n))

    def _forced_past_stop(self, request: Request, n: int) -> int:
        """How many of the last ``n`` (forced) tokens were taken back because one of them
        completes a stop string: that one and every one after it."""
        ids, stops = request.output_ids, request.sampling_params.stop
        if not any(s in self._decode(ids) for s in stops):
            return 0
        first = len(ids) - n
        keep = next(
            k for k in range(first, len(ids)) if any(s in self._decode(ids[: k + 1]) for s in stops)
        )
        dropped = len(ids) - keep
        request.rollback_forced(dropped)
        return dropped

    def _new_rid(self) -> str:
        while f"req-{self._next_rid}" in self.scheduler.requests:
            self._next_rid += 1
        rid = f"req-{self._next_rid}"
        self._next_rid += 1
        return rid

    def abort_request(self, rid: str) -> RequestOutput | None:
        """Stop a request (its computed KV stays cached). Returns its final output, or None
        if no such request is unfinished."""
        request = self.scheduler.finish_request(rid)
        if self.kv_events is not None:  # its KV went into the tree outside a step
            self.kv_events.flush()
        if request is None:
            return None
        self._detokenize(request)  # a grammar's forced tokens may have come since the step
        return self._make_output(request)

    def fail_unfinished(self, error: Exception) -> list[RequestOutput]:
        """End every unfinished request with ``error`` (finish reason ``"error"``), caching
        none of their own KV: what a server does when a step raised outside any one request
        (:meth:`step` handles the failures it can pin on requests itself). Their outputs."""
        requests = list(self.scheduler.requests.values())
        self._stats.num_finished += sum(not r.is_finished for r in requests)
        return [self._fail(r, error, keep_kv=False) for r in requests]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample, update. Returns an output for every request that
        got a token in this step (finished ones included).

        A failure ends the requests it belongs to, never the engine (a forward pass that raises
        is rerun request by request to find them): they come out with finish reason
        ``"error"`` and the exception in ``error``."""
        scheduled = self.scheduler.schedule()
        if not scheduled.scheduled:
            if self.scheduler.has_unfinished_requests():  # cannot happen: guards a busy loop
                raise InvariantError("unfinished requests but nothing could be scheduled")
            return []
        out, logits, failed = self._execute_model(scheduled)
        advanced: list[Request] = []
        if out.scheduled:
            tokens = self._sample(out, logits)
            advanced = self.scheduler.update_from_output(out, tokens)
            self._process_outputs(advanced)
        self._record_step(scheduled, out, failed, advanced)
        return failed + [self._make_output(r) for r in advanced]

    def _execute_model(
        self, out: SchedulerOutput
    ) -> tuple[SchedulerOutput, torch.Tensor | None, list[RequestOutput]]:
        """The step's forward pass: ``(out, logits, [])``. If it raises, each request runs
        alone to find the one that fails (a request's KV slots are its own, so writing them
        again is harmless): those end with the error, their new KV uncached, and the step
        goes on with the others: ``(out without them, their logits, the failed outputs)``."""
        waiting = itertools.islice(self.scheduler.waiting, PREFETCH_LOOKAHEAD)
        try:
            upcoming = (im for r in waiting for im in r.images)
            return out, self.model_runner.execute_model(out, upcoming), []
        except Exception:
            log.exception("a forward pass of %d request(s) failed", len(out.scheduled))
        kept, rows, failed = [], [], []
        for s in out.scheduled:
            try:
                rows.append(self.model_runner.execute_model(replace(out, scheduled=[s]))[0])
                kept.append(s)
            except Exception as e:
                log.exception("request %s fails its forward pass", s.request.rid)
                failed.append(self._fail(s.request, e, keep_kv=False))
        logits = torch.stack(rows) if rows else None
        return replace(out, scheduled=kept), logits, failed

    def _sample(self, out: SchedulerOutput, logits: torch.Tensor) -> list[int]:
        """A token for each scheduled request whose chunk reaches its last token (``sample``),
        in batch order: its grammar's mask applied, then its sampling parameters. The raw rows
        of requests that return logits are kept."""
        rows = [i for i, s in enumerate(out.scheduled) if s.sample]
        requests = [out.scheduled[i].request for i in rows]
        chosen = logits[rows]  # a copy: the raw rows stay for return_logits
        self._apply_grammars(chosen, requests)
        tokens = self._sample_rows(chosen, requests)
        for row, request in zip(rows, requests, strict=True):
            if request.logits is not None:  # a copy on the CPU (no device memory kept)
                request.logits.append(logits[row].to("cpu", torch.float32, copy=True))
        return tokens

    def _sample_rows(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """One token per row of ``logits``. A row whose sampling raises fails its request (its
        token, a placeholder, is then dropped by the scheduler)."""
        try:
            return sample(
                logits, [r.sampling_params for r in requests], [r.generator for r in requests]
            )
        except Exception:  # find the row: sample them one by one
            tokens = []
            for row, request in zip(logits, requests, strict=True):
                try:
                    tokens += sample(row[None], [request.sampling_params], [request.generator])
                except Exception as e:
                    log.exception("sampling failed for request %s", request.rid)
                    request.fail(e)
                    tokens.append(0)
            return tokens

    def _process_outputs(self, advanced: list[Request]) -> None:
        """After the update: each advanced request's grammar-forced tokens, then its text
        (which may finish it at a stop string). A failure here ends that request alone."""
        for request in advanced:
            try:
                self._jump_forward(request)
                self._detokenize(request)
            except Exception as e:
                log.exception("request %s failed after its step", request.rid)
                self._fail(request, e)

    def _fail(self, request: Request, error: Exception, keep_kv: bool = True) -> RequestOutput:
        """End ``request`` with ``error`` (finish reason ``"error"``); its output."""
        if not request.is_finished:  # else the scheduler has released it already
            self.scheduler.finish_request(request.rid, keep_kv=keep_kv)
        request.fail(error)
        return self._make_output(request)

    def _record_step(
        self,
        scheduled: SchedulerOutput,
        ran: SchedulerOutput,
        failed: list[RequestOutput],
        advanced: list[Request],
    ) -> None:
        """The step's telemetry: its :class:`StepEvent` (the batch as scheduled) and the
        engine's counters (the batch that ran). Each request that ended in the step counts
        once, whether it failed its forward pass or finished after it."""
        finished = [o.rid for o in failed] + [r.rid for r in advanced if r.is_finished]
        self._emit_step(scheduled, finished)
        st = self._stats
        st.num_finished += len(finished)
        if ran.scheduled:  # else every request failed its forward pass: nothing was computed
            st.num_steps += 1
            st.prefill_tokens += ran.num_prefill_tokens
            st.decode_tokens += ran.num_decode_tokens

    def _emit_step(self, out: SchedulerOutput, finished: list[str]) -> None:
        t = self.bus.tick()
        if self.bus.active:
            sched = out.scheduled
            self.bus.emit(
                StepEvent(
                    t,
                    rids=tuple(s.request.rid for s in sched),
                    starts=tuple(s.start for s in sched),
                    num_tokens=tuple(s.num_tokens for s in sched),
                    is_prefill=tuple(s.is_prefill for s in sched),
                    preempted=tuple(r.rid for r in out.preempted),
                    deferred=tuple(r.rid for r in out.deferred),
                    finished=tuple(finished),
                )
            )

    @staticmethod
    def _apply_grammars(logits: torch.Tensor, requests: list[Request]) -> None:
        """Mask each constrained row of ``logits`` ``[B, V]`` in place: one bitmask row per
        request, filled by its grammar on the CPU, then one masked fill for the batch."""
        constrained = [i for i, r in enumerate(requests) if r.grammar is not None]
        if not constrained:
            return
        bitmask = allocate_token_bitmask(len(constrained), logits.shape[-1])
        for row, i in enumerate(constrained):
            try:
                requests[i].grammar.fill_bitmask(bitmask, row)
            except GrammarError as e:
                # A matcher in an error state (past its resource limits, say) ends its own
                # request, its sample dropped, never the engine (compile already refuses a
                # grammar whose first state allows nothing).
                requests[i].fail(e)
        rows = logits[constrained]
        apply_token_bitmask(rows, bitmask)
        logits[constrained] = rows

    def _detokenize(self, request: Request) -> None:
        """Decode the request's outputs into ``output_text`` and finish the request at its
        first stop string, cutting the text there (vLLM checks stop strings in its output
        processor, on the detokenized text, then aborts the request in the engine core; here
        the scheduler finishes it within the step, so the step's events say so).

        The whole text is searched each step: a stop string split across tokens, or across
        steps (a grammar's forced run), is found in the step that completes it. A request that
        hit ``max_new_tokens`` in the same step still ends on the string, as "stop".

        A stop token's own text is left out, unless ``include_stop_str_in_output`` (vLLM's
        rule: a stop token that is not a special token would otherwise show in the answer)."""
        params = request.sampling_params
        ids = request.output_ids
        if self._stopped_on_token(request) and not params.include_stop_str_in_output:
            ids = ids[:-1]
        text = self._decode(ids)
        found = [(i, s) for s in params.stop or () if (i := text.find(s)) >= 0]
        if found:
            i, s = min(found)
            text = text[: i + len(s)] if params.include_stop_str_in_output else text[:i]
            if request.is_finished:
                request.status = RequestStatus.FINISHED_STOPPED
            else:
                self.scheduler.finish_request(request.rid, RequestStatus.FINISHED_STOPPED)
        request.output_text = text

    @staticmethod
    def _stopped_on_token(request: Request) -> bool:
        return (
            request.status is RequestStatus.FINISHED_STOPPED
            and bool(request.output_ids)
            and request.output_ids[-1] in request.stop_token_ids
        )

    def _make_output(self, request: Request) -> RequestOutput:
        new_ids = request.output_ids[request.num_sent_tokens :]
        request.num_sent_tokens = len(request.output_ids)
        # Streamed text is never taken back, so hold back what the next tokens may change: a
        # trailing replacement character (the next token may complete the UTF-8 sequence it
        # stands for, byte-level BPE) and, with stop strings, the last max(len) - 1
        # characters (they may be the start of one, which must not be sent).
        sendable = request.output_text
        if not request.is_finished:
            sendable = sendable.rstrip("\ufffd")
            if stops := request.sampling_params.stop:
                sendable = sendable[: max(len(sendable) - max(map(len, stops)) + 1, 0)]
        new_text = ""
        if sendable.startswith(request.sent_text):  # text only grows (unless a tokenizer rewrites)
            new_text, request.sent_text = sendable[len(request.sent_text) :], sendable
        return RequestOutput(
            rid=request.rid,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_ids),
            text=sendable,
            new_token_ids=new_ids,
            new_text=new_text,
            finished=request.is_finished,
            finish_reason=request.status.finish_reason,
            stats=replace(request.stats),
            logits=torch.stack(request.logits) if request.logits else None,
            error=request.error,
        )

    def _decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None or not token_ids:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    # ------------------------------------------------------------------ conveniences
    def generate(self, requests: Iterable[GenerateRequest | str]) -> list[RequestOutput]:
        """Run requests to completion, batched; their final outputs, in order.

        Every request is validated before any is queued. Requests added earlier with
        :meth:`add_request` advance too, but their outputs are not returned here.
        """
        requests = list(requests)
        rids: list[str] = []
        try:
            for r in requests:
                rids.append(self.add_request(r))
        except Exception:
            for rid in rids:
                self.scheduler.finish_request(rid)
            raise
        wanted, done = set(rids), {}
        while len(done) < len(rids):
            for out in self.step():
                if out.finished and out.rid in wanted:
                    done[out.rid] = out
        return [done[rid] for rid in rids]

    def stream(self, request: GenerateRequest | str) -> Iterator[RequestOutput]:
        """Run one request, yielding an output (``new_token_ids``, ``new_text``) for every
        token as soon as it is sampled; the last has ``finished`` set. Closing the iterator
        early aborts the request. Other queued requests advance in the same steps."""
        rid = self.add_request(request)
        finished = False
        try:
            while not finished:
                for out in self.step():
                    if out.rid == rid:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.scheduler.finish_request(rid)

    # ------------------------------------------------------------------ state
    @property
    def stats(self) -> EngineStats:
        """A snapshot of the engine's counters."""
        return replace(
            self._stats,
            cached_tokens=self.scheduler.num_cached_tokens,
            queried_tokens=self.scheduler.num_queried_tokens,
            preempted_cached_tokens=self.scheduler.num_preempted_cached_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            encoder_calls=self.encoder_cache.num_encoder_calls,
            encoder_hits=self.encoder_cache.num_hits,
            cached_tokens_by_source=dict(self.scheduler.cached_tokens_by_source),
        )

    def explain(self) -> MissExplainer:
        """Explain every request's misses from now on (:mod:`minirad.engine.explain`): each
        request admitted for the first time gets ``RequestStats.miss_causes``, every prompt
        token with one cause. Returns the engine's :class:`MissExplainer` (made at the first
        call; its ``totals()`` sums the causes). Call it between steps (a server: on the
        engine thread); best before the first request, else what was evicted before is unknown
        to it."""
        if self.explainer is None or self.explainer.error is not None:
            self.explainer = MissExplainer(self)
        return self.explainer

    def check_invariants(self) -> None:
        """Tree, locks and slot accounting (:meth:`Scheduler.check_invariants`).

        Raises:
            InvariantError: on the first breach.
        """
        self.scheduler.check_invariants()

    def reset_prefix_cache(self) -> None:
        """Empty the radix tree and the encoder cache (no request may be in flight).

        Raises:
            RequestError: requests are still running or waiting.
        """
        if self.scheduler.has_unfinished_requests():
            raise RequestError("cannot reset the prefix cache while requests are in flight")
        self.tree_cache.reset()
        self.encoder_cache.clear()
        if self.kv_events is not None:  # AllBlocksCleared now, not with the next step's events
            self.kv_events.flush()

    def close(self) -> None:
        """Stop publishing KV events: send what is pending, close the sockets. Nothing to
        do without ``kv_events_endpoint``; the engine still serves afterwards."""
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_event_publisher.close()
            self.kv_events = self.kv_event_publisher = None
        storage = getattr(self.tree_cache, "storage", None)
        if storage is not None:  # the pages written behind reach the disk
            storage.flush()

    def __repr__(self) -> str:
        c = self.config
        return (
            f"LLMEngine(family={self.vlm.family.model_type!r}, num_kv_slots={c.num_kv_slots}, "
            f"page_size={c.page_size}, policy={c.policy!r}, prefix_strategy={c.prefix_strategy!r}"
            f", running={len(self.scheduler.running)}, waiting={len(self.scheduler.waiting)})"
        )
