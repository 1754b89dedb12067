"""When a slower KV tier pays: loading tokens' KV back against computing it again.

A prefix that was evicted from the device can come back two ways:

- **load back** from a slower tier (host DRAM over PCIe, an NVMe disk, another machine):
  ``transfers * latency + n_tokens * bytes_per_token / bandwidth``;
- **recompute** it, a prefill of the same tokens: ``n_tokens / prefill_tokens_per_s``.

Both grow with ``n_tokens``; loading also pays a fixed latency per transfer. So when loading
costs less per token than recomputing (``bytes_per_token / bandwidth < 1 / prefill_rate``),
there is a length above which loading wins, the *break-even length*::

    n* = transfers * latency / (1 / prefill_rate - bytes_per_token / bandwidth)

and below it the latency makes recomputing a short prefix cheaper (why SGLang does not load
back host segments shorter than a threshold). When loading costs as much or more per token,
it never pays, however long the prefix.

The model is deliberately linear, like SGLang's benchmark-only storage simulator
(``mem_cache/storage/sim_storage.py``, which sleeps bytes over a bandwidth plus one operation
latency per batch): a learner can ask "and over PCIe? from an NVMe?" and get the same answer
every time. Two simplifications to keep in mind:

- Recompute is linear here. A real prefill also pays attention over the whole context,
  quadratic in its length, so at long contexts recomputing costs more than this model says
  and loading pays earlier: the break-even length it gives is an upper bound.
- One load-back is one transfer by default (a batched copy, as SGLang's simulator charges one
  latency per batch). Copying page by page is ``transfers = pages``: the latency term grows
  with it.

Units: bandwidths in GB/s of 10**9 bytes, latencies in microseconds, times in seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from minirad.errors import InvalidArgumentError

__all__ = [
    "PRESETS",
    "TierLink",
    "break_even_tokens",
    "kv_bytes_per_token",
    "load_time_s",
    "recompute_time_s",
]


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidArgumentError(f"{name} must be a positive number, got {value!r}")
    if not math.isfinite(value):
        raise InvalidArgumentError(f"{name} must be finite, got {value!r}")
    return float(value)


def _count(name: str, value: int, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class TierLink:
    """A copy path between two KV tiers.

    Attributes:
        name: what it is, e.g. ``"pcie4-x16"``.
        bandwidth_gb_s: sustained copy bandwidth, GB/s (10**9 bytes per second), > 0.
        latency_us: fixed cost of one transfer, microseconds, >= 0 (a DMA or kernel launch, a
            disk read's access time, a network round trip).
        source: where the figures come from (``"typical, not measured"``, ``"measured here"``,
            or a reference).
    """

    name: str
    bandwidth_gb_s: float
    latency_us: float
    source: str = "given"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidArgumentError(f"a link needs a name, got {self.name!r}")
        _positive("bandwidth_gb_s", self.bandwidth_gb_s)
        lat = self.latency_us
        if isinstance(lat, bool) or not isinstance(lat, (int, float)) or not lat >= 0:
            raise InvalidArgumentError(f"latency_us must be a number >= 0, got {lat!r}")
        if not math.isfinite(lat):
            raise InvalidArgumentError(f"latency_us must be finite, got {lat!r}")

    @property
    def seconds_per_byte(self) -> float:
        """Time to move one more byte once a transfer is under way."""
        return 1.0 / (self.bandwidth_gb_s * 1e9)

    @property
    def latency_s(self) -> float:
        """Fixed cost of one transfer, in seconds."""
        return self.latency_us * 1e-6


# Named links with typical figures, for "and over PCIe? from an NVMe?". None of them is
# measured here: `python -m minirad.bench transfer-cost` measures this machine's host copy and
# prints it beside them. Effective (achieved) rates, below the nominal line rates.
PRESETS: dict[str, TierLink] = {
    link.name: link
    for link in (
        # typical, not measured: one CPU core's memcpy between two DRAM buffers is ~5-15 GB/s;
        # a call costs about a microsecond.
        TierLink("host-dram", 10.0, 1.0, "typical, not measured"),
        # typical, not measured: PCIe 4.0 x16 is 32 GB/s nominal, ~25 GB/s achieved for pinned
        # host <-> GPU copies; a cudaMemcpyAsync costs ~10 us to launch and complete.
        TierLink("pcie4-x16", 25.0, 10.0, "typical, not measured"),
        # typical, not measured: PCIe 5.0 x16 doubles the lanes' rate, ~50 GB/s achieved.
        TierLink("pcie5-x16", 50.0, 10.0, "typical, not measured"),
        # typical, not measured: a PCIe 4.0 NVMe SSD reads ~7 GB/s sequentially, ~100 us a read.
        TierLink("nvme-gen4", 7.0, 100.0, "typical, not measured"),
        # typical, not measured: a PCIe 3.0 NVMe SSD, ~3 GB/s.
        TierLink("nvme-gen3", 3.0, 100.0, "typical, not measured"),
        # typical, not measured: 100 Gb/s RDMA (InfiniBand / RoCE) is 12.5 GB/s on the wire,
        # ~11 GB/s achieved, a few microseconds per operation plus software: ~20 us.
        TierLink("rdma-100g", 11.0, 20.0, "typical, not measured"),
        # the defaults of SGLang's storage simulator (sim_read_gbps 5, sim_op_latency_us 100).
        TierLink("sglang-sim", 5.0, 100.0, "SGLang sim_storage defaults"),
    )
}


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of one token's KV: K and V in every layer, ``layers * 2 * kv_heads * head_dim *
    dtype_bytes``.

    Raises:
        InvalidArgumentError: an argument is not a positive integer.
    """
    dims = {
        "num_layers": num_layers,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "dtype_bytes": dtype_bytes,
    }
    for name, value in dims.items():
        _count(name, value, 1)
    return num_layers * 2 * num_kv_heads * head_dim * dtype_bytes


def load_time_s(n_tokens: int, bytes_per_token: int, link: TierLink, transfers: int = 1) -> float:
    """Seconds to load ``n_tokens`` tokens' KV back over ``link`` in ``transfers`` copies:
    ``transfers * latency + n_tokens * bytes_per_token / bandwidth``. Zero tokens cost nothing
    (no transfer is made).

    Raises:
        InvalidArgumentError: a negative or non-integer count, ``bytes_per_token`` or
            ``transfers`` below 1, ``link`` not a :class:`TierLink`.
    """
    _count("n_tokens", n_tokens, 0)
    _count("bytes_per_token", bytes_per_token, 1)
    _count("transfers", transfers, 1)
    if not isinstance(link, TierLink):
        raise InvalidArgumentError(f"link must be a TierLink, got {link!r}")
    if n_tokens == 0:
        return 0.0
    return transfers * link.latency_s + n_tokens * bytes_per_token * link.seconds_per_byte


def recompute_time_s(n_tokens: int, prefill_tokens_per_s: float) -> float:
    """Seconds to compute ``n_tokens`` tokens' KV again, a prefill at ``prefill_tokens_per_s``.

    Linear in ``n_tokens``: attention's quadratic part is left out (see the module docstring).

    Raises:
        InvalidArgumentError: a negative or non-integer count, a rate that is not positive.
    """
    _count("n_tokens", n_tokens, 0)
    return n_tokens / _positive("prefill_tokens_per_s", prefill_tokens_per_s)


def break_even_tokens(
    bytes_per_token: int, link: TierLink, prefill_tokens_per_s: float, transfers: int = 1
) -> float | None:
    """The prefix length, in tokens, above which loading back over ``link`` (in
    ``transfers`` copies) is faster than recomputing at ``prefill_tokens_per_s``:
    ``transfers * latency / (1 / prefill_rate - bytes_per_token / bandwidth)``.

    Returns:
        The length (a float: the lines cross between tokens; 0.0 for a link with no latency
        that is faster per token), or None when the link costs as much or more per token than
        recomputing: loading back never pays.

    Raises:
        InvalidArgumentError: as :func:`load_time_s` and :func:`recompute_time_s`.
    """
    _count("bytes_per_token", bytes_per_token, 1)
    _count("transfers", transfers, 1)
    rate = _positive("prefill_tokens_per_s", prefill_tokens_per_s)
    if not isinstance(link, TierLink):
        raise InvalidArgumentError(f"link must be a TierLink, got {link!r}")
    saved_per_token = 1.0 / rate - bytes_per_token * link.seconds_per_byte
    if saved_per_token <= 0:
        return None
    return transfers * link.latency_s / saved_per_token
