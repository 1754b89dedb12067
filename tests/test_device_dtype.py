"""Device and dtype: where the engine runs and in which precision.

- ``device=``: the engine moves the model there and makes every tensor of a step there (KV
  pool, ForwardBatch, image inputs, logits); a device this process cannot use is refused with
  an :class:`~minirad.errors.InvalidArgumentError` that names it and what is available. The
  placement test runs on every device of :func:`~minirad.engine.available_devices` (only the
  CPU on a CPU-only machine; a CUDA machine adds its GPUs).
- dtype: the engine runs in the model's dtype, KV pool included. In bf16 it is compared with
  HF ``generate()`` on the same bf16 model (:func:`assert_greedy_agrees` says how).
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from test_engine import hf_generate

from minirad.engine import (
    GenerateRequest,
    LLMEngine,
    SamplingParams,
    available_devices,
    resolve_device,
)
from minirad.entrypoints.chat_utils import chat_prompt
from minirad.errors import InvalidArgumentError
from minirad.models import DEFAULT_MODEL_DIR, ForwardBatch, load_model

IMAGES = sorted((DEFAULT_MODEL_DIR.parents[1] / "images").glob("*.png"))
QUESTIONS = ("Describe the image.", "How many shapes are there?", "What colour is the circle?")
MAX_NEW = 16
# bf16 keeps 8 significant bits: a value is stored to within 2^-8 of itself (half an ulp), and
# a logit computed through the same ops in a batch of another shape (other GEMM row counts,
# other padding in attention) may round differently, by about an ulp of the row's largest
# logits (measured: at most 2^-7.1 of max|row| on the shipped model, 21 prompts x 16 steps,
# and at the real widths). The tolerance is 2^-6 of the row's largest |logit|, twice that,
# and the same 2^-6 that torch.testing takes as bf16's rtol. It is relative to the row's
# largest logit, not to each entry: a small logit's error comes from the same large terms.
BF16_TOL = 2**-6


def assert_greedy_agrees(out, hf_tokens: list[int], hf_logits: torch.Tensor, rel_tol: float) -> int:
    """Our greedy run (``out``, a RequestOutput with logits) against HF's, step by step.

    While the two contexts are the same, every step's logits must be within
    ``rel_tol * max|row|`` of HF's (``atol``; ``rtol`` 0). Within that, HF's argmax is ours
    for sure when HF's top-1 / top-2 margin is above twice the tolerance (no entry moves by
    more than the tolerance): those steps must give the same token. A step with a smaller
    margin is a near-tie: either token is a correct bf16 answer. If ours took the other one,
    the contexts differ from there on and the comparison stops; if not, it goes on.

    Returns:
        How many steps were compared (the caller checks that they are most of them, so that
        a run of near-ties cannot make the test pass vacuously).
    """
    assert out.logits is not None and out.logits.device.type == "cpu"
    for i, want in enumerate(hf_tokens):
        assert i < len(out.token_ids), f"ours stopped after {i} tokens, HF gave {hf_tokens}"
        theirs = hf_logits[i].float().cpu()
        tol = rel_tol * theirs.abs().max().item()
        torch.testing.assert_close(out.logits[i], theirs, atol=tol, rtol=0)
        top2 = theirs.topk(2).values
        got = out.token_ids[i]
        if (top2[0] - top2[1]).item() > 2 * tol:
            assert got == want, f"step {i}: ours {got}, HF {want} (margin {top2.tolist()})"
        elif got != want:
            return i + 1
    assert out.token_ids == hf_tokens
    return len(hf_tokens)


def hf_greedy(model, processor, prompt: str, image, max_new_tokens: int):
    """HF's greedy tokens and per-step logits ``[steps, vocab]`` for one request (``image``:
    a path)."""
    return hf_generate(model, processor, prompt, [Image.open(image).convert("RGB")], max_new_tokens)


def requests(processor, cases, **kw) -> list[GenerateRequest]:
    params = SamplingParams(max_new_tokens=MAX_NEW, **kw)
    return [
        GenerateRequest(chat_prompt(processor, q, 1), [str(im)], params, return_logits=True)
        for q, im in cases
    ]


class Recorder:
    """A pass-through around the engine's real :class:`~minirad.models.PagedVLM`: it keeps what
    each step gives the model (the ForwardBatch, the image inputs) and gets back (the logits),
    and changes nothing (every call goes to the real object)."""

    def __init__(self, vlm) -> None:
        self._vlm = vlm
        self.batches: list[tuple[ForwardBatch, torch.Tensor]] = []
        self.image_inputs: list[dict[str, torch.Tensor]] = []

    def __getattr__(self, name):
        return getattr(self._vlm, name)

    def encode_images(self, inputs):
        self.image_inputs.append(dict(inputs))
        return self._vlm.encode_images(inputs)

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        logits = self._vlm(batch)
        self.batches.append((batch, logits))
        return logits


@pytest.fixture(scope="module")
def shipped():
    """The shipped model in fp32, on the CPU, and its processor."""
    return load_model(DEFAULT_MODEL_DIR)


@pytest.mark.parametrize("device", available_devices())
def test_the_engine_runs_on_its_device_and_makes_every_step_tensor_there(device):
    """``device=`` moves the model and puts the KV pool, each step's ForwardBatch, the image
    inputs and the logits on that device; the outputs (greedy, seeded sampling, a grammar)
    are the CPU engine's. On the CPU they are exactly the default engine's."""
    model, processor = load_model(DEFAULT_MODEL_DIR)  # its own: the engine moves it
    cases = [(q, im) for q in QUESTIONS[1:] for im in IMAGES[:2]]
    greedy = requests(processor, cases)
    seeded = requests(processor, cases[:1], temperature=0.8, seed=7)
    choice = requests(processor, cases[2:3], choice=["red", "blue", "green"])
    default = LLMEngine(model, processor)
    assert default.device == torch.device("cpu") and default.config.device is None
    want = default.generate(greedy + seeded + choice)

    engine = LLMEngine(model, processor, device=device)
    dev = resolve_device(device)
    assert engine.device.type == dev.type and model.device == engine.device
    assert engine.config.device == device
    assert engine.kv_cache.k_cache.device == engine.device == engine.kv_cache.v_cache.device
    assert engine.model_runner.device == engine.device
    engine.model_runner.vlm = recorder = Recorder(engine.vlm)
    got = engine.generate(greedy + seeded + choice)

    assert recorder.batches and recorder.image_inputs
    for batch, logits in recorder.batches:
        tensors = [v for v in vars(batch).values() if isinstance(v, torch.Tensor)]
        assert len(tensors) >= 7  # the seven index tensors, and the image rows when any
        assert {t.device for t in tensors} == {engine.device}, vars(batch)
        assert logits.device == engine.device and logits.dtype == engine.dtype
    assert {t.device for inputs in recorder.image_inputs for t in inputs.values()} == {
        engine.device
    }
    assert got[-1].text in ("red", "blue", "green")
    if dev.type == "cpu":
        for a, b in zip(got, want, strict=True):
            assert a.token_ids == b.token_ids and a.text == b.text
            assert torch.equal(a.logits, b.logits)
    else:  # another device's kernels: the greedy answers agree where no token is near a tie
        for a, b in zip(got[: len(greedy)], want, strict=False):
            assert_greedy_agrees(a, b.token_ids, b.logits, rel_tol=1e-3)
    engine.check_invariants()


def test_an_unusable_device_is_refused_with_what_is_available(shipped):
    model, processor = shipped
    with pytest.raises(InvalidArgumentError, match=r"device 'gpu' is not a torch device") as e:
        LLMEngine(model, processor, device="gpu")
    assert "available here: cpu" in str(e.value)
    with pytest.raises(InvalidArgumentError, match=r"'cuda:x' is not a torch device"):
        LLMEngine(model, processor, device="cuda:x")
    with pytest.raises(InvalidArgumentError, match=r"'meta' is not available"):
        LLMEngine(model, processor, device="meta")  # holds no data: nothing to serve from
    with pytest.raises(InvalidArgumentError, match=r"^device 'xxx.*\.\.\..*xxx' is not a") as e:
        LLMEngine(model, processor, device="x" * 100_000)  # a pasted blob: one short line
    assert len(str(e.value)) < 200
    if not torch.backends.mps.is_available():
        with pytest.raises(InvalidArgumentError, match=r"'mps' is not available"):
            LLMEngine(model, processor, device="mps")
    assert model.device == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_refused_before_anything_loads(shipped):
    model, processor = shipped
    for device in ("cuda", torch.device("cuda", 0)):
        with pytest.raises(InvalidArgumentError) as e:
            LLMEngine(model, processor, device=device)
        message = str(e.value)
        assert "is not available: torch.cuda.is_available() is False" in message
        assert message.endswith("available here: " + ", ".join(available_devices()))
    # from_pretrained checks the device before it reads a weight (or even the folder).
    with pytest.raises(InvalidArgumentError, match="'cuda' is not available"):
        LLMEngine.from_pretrained("/no/such/model", device="cuda")


def test_a_gpu_index_past_the_count_is_refused(monkeypatch):
    """``cuda:3`` on a machine with one GPU (torch's own answers stand in for the hardware)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda")
    with pytest.raises(InvalidArgumentError) as e:
        resolve_device("cuda:3")
    assert str(e.value) == (
        "device 'cuda:3' does not exist: torch sees 1 cuda device(s); available here: cpu, cuda:0"
    )


def test_from_pretrained_refuses_a_dtype_that_is_not_floating_point():
    for dtype in (torch.int8, "int8", "float33", 32, torch.float8_e4m3fn, "float8_e5m2"):
        with pytest.raises(InvalidArgumentError, match="floating-point torch dtype"):
            LLMEngine.from_pretrained(DEFAULT_MODEL_DIR, dtype=dtype)


def test_bf16_engine_matches_hf_generate_on_the_same_bf16_model():
    """The shipped model in bf16: the KV pool is bf16, and our greedy tokens and logits agree
    with HF ``generate()`` on the same bf16 model (:func:`assert_greedy_agrees`, within
    :data:`BF16_TOL`), for 21 prompts in one batch (our GEMMs then have other shapes than HF's,
    one request at a time) and for one prompt alone.

    Measured (CPU, torch 2.13): alone, our logits equal HF's bit for bit; batched, at most
    0.125 apart (0.0625 at the first step) on logits up to ~21 in magnitude, i.e. one bf16 ulp
    of the row's largest logit, every greedy token equal (the smallest top-1/top-2 margin of
    HF's, 0.094, is below 2x the tolerance: such steps are near-ties, see the helper).
    """
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL_DIR, dtype="bfloat16", device="cpu")
    model, processor = engine.vlm.model, engine.processor
    assert model.dtype == torch.bfloat16 == engine.dtype
    assert engine.kv_cache.k_cache.dtype == torch.bfloat16 == engine.kv_cache.v_cache.dtype
    cases = [(q, im) for im in IMAGES for q in QUESTIONS]
    reqs = requests(processor, cases)
    refs = [
        hf_greedy(model, processor, r.prompt, im, MAX_NEW)
        for r, (_, im) in zip(reqs, cases, strict=True)
    ]

    outs = engine.generate(reqs)
    compared = sum(
        assert_greedy_agrees(o, *ref, BF16_TOL) for o, ref in zip(outs, refs, strict=True)
    )
    assert compared >= 0.9 * sum(len(tokens) for tokens, _ in refs)

    (alone,) = engine.generate(requests(processor, cases[:1]))
    assert assert_greedy_agrees(alone, *refs[0], BF16_TOL) == len(refs[0][0])
    engine.check_invariants()
