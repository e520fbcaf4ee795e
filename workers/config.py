"""Mock engine configuration: the reference mocker's vLLM-flavour defaults, validated at construction.

``speedup_ratio`` divides every pass duration and ``decode_speedup_ratio`` additionally divides the
decode part, as the reference mocker does. A ratio of 0 is allowed and means "no engine delay": every
duration that ratio applies to is 0 ns, so passes take no virtual time and a live worker never sleeps;
live benchmarks use it to measure the system around the engines.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Annotated, Literal

import msgspec
import msgspec.inspect
from msgspec import Meta

from kvemu.errors import InvalidArgument
from kvemu.limits import MAX_KV_GROUPS, MAX_OUTPUT_TOKENS, Weight
from kvemu.messages import MAX_KNOB_CHARS, EngineSettings
from kvemu.validation import check_struct
from kvemu.transfer import Bandwidth, BytesPerToken

__all__ = ["EngineConfig", "EvictionPolicyName", "PreemptionMode", "Backend", "TrtllmConfig", "VllmConfig",
           "VllmSemantics", "SglangConfig", "DEFAULT_BLOCK_SIZE", "PolynomialTimingSpec", "InterpolatedTimingSpec",
           "TimingSpec", "HostOffloadConfig",
           "SpeculativeConfig", "DEFAULT_ACCEPTANCE_RATES", "MAX_SPECULATIVE_TOKENS", "KvGroupSpec", "KvCacheGroup",
           "KV_GROUP_KINDS", "MAX_ENGINE_COUNT", "SPEC_KIND"]

EvictionPolicyName = Literal["lru", "lineage"]
PreemptionMode = Literal["lifo", "fifo"]
Backend = Literal["vllm", "sglang", "trtllm"]

DEFAULT_BLOCK_SIZE: dict[str, int] = {"vllm": 64, "sglang": 1, "trtllm": 32}
"""The reference mocker's KV block size per backend when ``block_size`` is not given."""

MAX_ENGINE_COUNT = 1 << 32
"""Most blocks (GPU or host), tokens a step or sequences an engine knob may name: far beyond any GPU's."""
Count = Annotated[int, Meta(ge=1, le=MAX_ENGINE_COUNT)]
Ratio = Weight


class PolynomialTimingSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="polynomial",
                       tag_field="type"):
    """The reference mocker's default pass timing (``workers.timing.PolynomialTiming``)."""


class InterpolatedTimingSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="interpolated",
                         tag_field="type"):
    """Pass timing interpolated from profile data measured on a real GPU (``workers.profile``; docs/profiles.md)."""

    path: Annotated[str, Meta(min_length=1, max_length=4096)]
    """The profile: ``.npz`` in the reference's layout or kvemu's ``.csv``; a scenario resolves it against
    its own directory."""


TimingSpec = PolynomialTimingSpec | InterpolatedTimingSpec


class TrtllmConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """TRT-LLM flavour knobs (the reference accepts only its default capacity policy)."""

    capacity_scheduler_policy: Literal["guaranteed_no_evict"] = "guaranteed_no_evict"
    """Admit a request only once its whole KV (prompt + max output) is reserved; never preempt."""


VllmSemantics = Literal["dynamo", "vllm-0.34"]
SglangSemantics = Literal["dynamo", "sglang-0.5.23"]


class VllmConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """vLLM flavour knobs: whose scheduling decisions it reproduces (docs/vllm-semantics.md lists what differs)."""

    semantics: VllmSemantics = "dynamo"
    """``dynamo``: Dynamo 1.6.1's mocker, the contract of kvemu's fidelity figures. ``vllm-0.34``: vLLM 0.34.0's
    own scheduler, step for step as ``tests/oracle`` checks it against that release (its null block, its
    preemption victims, its order of running requests)."""
    async_scheduling: bool = False
    """With ``semantics`` vllm-0.34: vLLM's asynchronous scheduling (its default on a GPU), where each pass is
    scheduled while the previous one runs: a request's last token is seen, and its blocks freed, one pass later,
    and a block its newest token fills is cached one pass later."""
    scheduling_policy: Literal["priority", "fcfs"] = "priority"
    """``priority``: the waiting queue orders by request priority, then arrival (Dynamo's mocker always does).
    ``fcfs``: priorities are ignored, as vLLM does unless started with ``--scheduling-policy priority``."""


class SglangConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """SGLang flavour knobs: whose decisions it reproduces, the reference mocker's five, plus its engine-level
    ``prefill_decode_interval``."""

    semantics: SglangSemantics = "dynamo"
    """``dynamo``: Dynamo 1.6.1's mocker, the contract of kvemu's fidelity figures. ``sglang-0.5.23``: SGLang
    0.5.23's own scheduler (its non-overlap loop), step for step as ``tests/oracle`` checks it against that release
    (its admission budget, its first token's KV slot, its retraction victims and their return, its aborts);
    docs/vllm-semantics.md lists what differs."""
    schedule_policy: Literal["fifo", "lpm"] = "fifo"
    """Waiting order: arrival (retracted and half-prefilled requests first), or longest cached prefix first."""
    max_prefill_tokens: Count = 16384
    """Prompt tokens one extend pass may take (page-rounded charges; nothing is chunked by it)."""
    chunked_prefill_size: Count = 8192
    """Prompt tokens one extend pass may compute; a longer prompt is chunked. A multiple of ``block_size``."""
    clip_max_new_tokens: Annotated[int, Meta(ge=0, le=MAX_OUTPUT_TOKENS)] = 4096
    """Output tokens reserved per request at admission are capped at this."""
    schedule_conservativeness: Annotated[float, Meta(ge=0, le=1e6)] = 1.0
    """Scales the initial output reservation ratio (0.7 x this), as SGLang's option does."""
    prefill_decode_interval: Annotated[int, Meta(ge=0, le=MAX_ENGINE_COUNT)] = 0
    """Decode passes that run after an extend pass before the next one may start (while requests run)."""


Gbps = Annotated[float, Meta(ge=0, le=1e6)]


class HostOffloadConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A host-memory KV tier (vLLM's CPU offloading; the reference's ``native_host_offload``; workers/vllm/host_tier.py).

    Newly full prompt blocks are copied to host memory (device to host) and loaded back (host to device)
    when a later prompt misses them on the GPU; a transfer of n blocks takes ``latency_to_first_byte_ms``
    + n x block bytes / bandwidth on one first-in-first-out lane per direction.
    """

    num_host_blocks: Count
    """Host capacity, in engine blocks."""
    d2h_bandwidth_gbps: Gbps = 32.0
    """Device-to-host (store) bandwidth in decimal GB/s; 0 means instantaneous."""
    h2d_bandwidth_gbps: Gbps = 32.0
    """Host-to-device (load) bandwidth in decimal GB/s; 0 means instantaneous."""
    latency_to_first_byte_ms: Annotated[float, Meta(ge=0, le=1e6)] = 0.0
    """Added before each transfer starts."""
    scope: Literal["dp_rank_local"] = "dp_rank_local"
    """Each DP rank has its own host tier (the reference's ``cluster_shared`` scope is not emulated)."""

    def __post_init__(self) -> None:
        check_struct(self)


MAX_SPECULATIVE_TOKENS = 16
"""Longest draft kvemu models (vLLM allows more; a tree or a draft past 16 tokens is not a decode any more)."""
DEFAULT_ACCEPTANCE_RATES = (0.85, 0.3, 0.0, 0.0, 0.0)
"""Dynamo's mocker default conditional acceptance rates (``aic_nextn_accept_rates``), zero-padded or cut to k."""


class SpeculativeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Speculative decoding: each decode pass verifies ``num_speculative_tokens`` drafts per request and emits
    1 + the accepted prefix of them (Dynamo's mocker MTP burst sampling; ``workers/speculative.py``)."""

    method: Literal["mtp", "eagle", "ngram"]
    """Who drafts: MTP heads or an EAGLE draft model (``draft_cost`` per draft token), or n-gram prompt lookup
    (free)."""
    num_speculative_tokens: Annotated[int, Meta(ge=1, le=MAX_SPECULATIVE_TOKENS)]
    """Draft tokens verified per decode pass and request (vLLM's name; Dynamo's ``aic_nextn``)."""
    acceptance_rates: (Annotated[list[Annotated[float, Meta(ge=0, le=1)]], Meta(max_length=MAX_SPECULATIVE_TOKENS)]
                       | Annotated[float, Meta(ge=0, le=1)] | None) = None
    """Conditional acceptance: entry i is P(draft i accepted | drafts before it accepted); one number for every
    position; a shorter list is zero-padded. None: Dynamo's default (0.85, 0.3, 0, 0, 0), cut to k."""
    seed: Annotated[int, Meta(ge=0, le=(1 << 63) - 1)] = 42
    """Seeds each rank's own acceptance stream (mixed with the worker id and DP rank; Dynamo's ``aic_mtp_seed``)."""
    draft_cost: Annotated[float, Meta(ge=0, le=10)] = 0.0
    """Cost of drafting one token as a fraction of a target pass (MTP/EAGLE: the draft runs k steps per decode
    pass and once over each prompt chunk); n-gram drafts cost nothing, so it must stay 0 there."""

    def __post_init__(self) -> None:
        check_struct(self)
        rates = self.acceptance_rates
        if isinstance(rates, list) and len(rates) > self.num_speculative_tokens:
            raise InvalidArgument(
                f"speculative.acceptance_rates has {len(rates)} entries for num_speculative_tokens "
                f"{self.num_speculative_tokens}: give at most one per draft position", field="speculative.acceptance_rates")
        if self.method == "ngram" and self.draft_cost:
            raise InvalidArgument("speculative.draft_cost must be 0 for method ngram (prompt lookup runs no draft "
                                  "model); remove it or pick mtp/eagle", field="speculative.draft_cost")

    @property
    def conditional_rates(self) -> list[float]:
        """The k conditional acceptance rates this config means (the default or a number spread, zero-padded)."""
        k = self.num_speculative_tokens
        rates = self.acceptance_rates
        if rates is None:
            given = list(DEFAULT_ACCEPTANCE_RATES[:k])
        elif isinstance(rates, list):
            given = [float(r) for r in rates]
        else:
            given = [float(rates)] * k
        return given + [0.0] * (k - len(given))

    @property
    def mean_tokens_per_pass(self) -> float:
        """Expected tokens a decode pass emits per request: 1 + r1 + r1*r2 + ... (before a max_tokens cut)."""
        total = prob = 1.0
        for r in self.conditional_rates:
            prob *= r
            total += prob
        return total


KV_GROUP_KINDS = ("full_attention", "sliding_window", "state")


class KvGroupSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One kind of layer of a hybrid model (``kv_groups``): how many layers, and how they keep KV.

    ``full_attention`` keeps every token's KV; ``sliding_window`` keeps the last ``window`` tokens (vLLM frees a
    block once all its tokens are before ``computed - window + 1``); ``state`` is a recurrent (Mamba-like) layer
    with a fixed state per request, one block per state (vLLM's ``MambaSpec``; the page is taken as already
    unified with the attention page, as vLLM pads it). See docs/hybrid-kv.md.
    """

    kind: Literal["full_attention", "sliding_window", "state"]
    layers: Annotated[int, Meta(ge=1, le=100_000)]
    """How many layers of this kind the model has (vLLM groups them as in ``KvCacheGroup``)."""
    window: Annotated[int, Meta(ge=2, le=1 << 40)] | None = None
    """``sliding_window`` only: the window in tokens (vLLM's ``sliding_window``)."""
    cache_mode: Literal["align", "all"] | None = None
    """``state`` only, with prefix caching: which states vLLM caches (``mamba_cache_mode``). ``align`` (the default;
    the only mode of vLLM 0.34, also in 0.15 to ~0.30): only where a scheduler step ends on a block boundary, with
    block-aligned prefill chunks; ``all`` (0.12, and 0.15 to ~0.30 for models that support it): after every block."""

    def __post_init__(self) -> None:
        check_struct(self)
        if (self.kind == "sliding_window") != (self.window is not None):
            raise InvalidArgument(
                f"kv_groups: kind {self.kind!r} " + ("needs a window (tokens)" if self.window is None
                                                     else "takes no window; only sliding_window does"),
                field="kv_groups.window")
        if self.cache_mode is not None and self.kind != "state":
            raise InvalidArgument(f"kv_groups: kind {self.kind!r} takes no cache_mode; only state does",
                                  field="kv_groups.cache_mode")

    @property
    def mode(self) -> str | None:
        """The state cache mode in force (``align`` unless ``all`` is given); None for attention kinds."""
        if self.kind != "state":
            return None
        return self.cache_mode or "align"


SPEC_KIND = {"full_attention": "full_attention", "sliding_window": "sliding_window", "state": "mamba"}
"""``kv_cache_spec_kind`` vLLM sends for each KV cache group kind (its ``KVCacheSpecKind`` values)."""


class KvCacheGroup(msgspec.Struct, frozen=True):
    """One KV cache group as vLLM forms them: layers sharing one block table (``KVCacheGroupSpec``)."""

    kind: str
    """``full_attention``, ``sliding_window`` or ``state``."""
    window: int | None
    layers: int
    """Layers of the model in this group (the last group of a kind may be padded up to ``group_size``)."""
    cache_mode: str | None = None
    """``state`` groups: ``align`` or ``all`` (``KvGroupSpec.cache_mode``; None is ``align``)."""


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One DP rank's engine knobs (names and defaults of the reference mocker, vLLM flavour).

    Ranges are declared once (``msgspec.Meta``) and checked on construction and in scenario files alike.
    A speedup ratio of 0 means no engine delay (see the module docstring); live benchmarks use it.
    """

    backend: Backend = "vllm"
    """Which engine the mock behaves like: scheduling, admission, prefix reuse and default block size."""
    num_gpu_blocks: Count = 16384
    block_size: Count | None = None
    """KV block size in tokens; None takes the backend's default (``DEFAULT_BLOCK_SIZE``: 64, TRT-LLM 32)."""
    max_num_seqs: Count = 256
    max_num_batched_tokens: Count = 8192
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    speedup_ratio: Ratio = 1.0
    """Every pass duration is divided by this; 0 means no engine delay at all."""
    decode_speedup_ratio: Ratio = 1.0
    """The decode part is additionally divided by this."""
    preemption_mode: PreemptionMode = "lifo"
    eviction_policy: EvictionPolicyName = "lru"
    dp_size: Count = 1
    record_token_times: bool = True
    """Keep every token's timestamp per request (off: only first token and completion are kept)."""
    kv_transfer_bandwidth: Bandwidth | None = None
    """Disaggregated prefill ranks: the KV link to decode ranks in decimal GB/s (None: transfers are instant)."""
    kv_transfer_bytes_per_token: BytesPerToken | None = None
    """Disaggregated prefill ranks: KV bytes per token (layers x 2 x KV heads x head dim x dtype bytes)."""
    kv_transfer_timing_mode: Literal["full_prompt", "destination_missing"] = "full_prompt"
    """What a transfer moves: the whole prompt, or the prompt blocks the decode rank does not hold yet."""
    timing_model: TimingSpec = PolynomialTimingSpec()
    """How long a pass takes: ``{type: polynomial}`` (the reference's default) or ``{type: interpolated, path}``."""
    trtllm: TrtllmConfig = TrtllmConfig()
    """TRT-LLM flavour knobs (used when ``backend`` is trtllm)."""
    vllm: VllmConfig = VllmConfig()
    """vLLM flavour knobs (used when ``backend`` is vllm)."""
    sglang: SglangConfig = SglangConfig()
    """SGLang flavour knobs (used when ``backend`` is sglang)."""
    kv_cache_bytes_per_token: Annotated[int, Meta(ge=1, le=1 << 40)] | None = None
    """KV bytes per token on this rank; sizes host-tier blocks (``native_host_offload`` requires it)."""
    native_host_offload: HostOffloadConfig | None = None
    """A host-memory KV tier behind the GPU pool (vLLM backend with prefix caching only); None: off."""
    speculative: SpeculativeConfig | None = None
    """Speculative decoding: drafts verified per decode pass (every backend); None: off."""
    kv_groups: Annotated[list[KvGroupSpec], Meta(max_length=MAX_KV_GROUPS)] | None = None
    """A hybrid model's layers by kind (vLLM's hybrid KV cache manager; vLLM flavour only); None: every layer is
    full attention (one group, the plain engine). ``num_gpu_blocks`` then stays the blocks of the memory a
    full-attention model of the same layer count would get; see ``kv_cache_groups`` and docs/hybrid-kv.md."""

    def __post_init__(self) -> None:
        check_struct(self)
        if self.kv_groups is not None:
            self._check_kv_groups()
        if self.native_host_offload is not None:
            self._check_host_offload()
        if self.block_size is None:
            msgspec.structs.force_setattr(self, "block_size", DEFAULT_BLOCK_SIZE[self.backend])
        if self.backend == "sglang":
            self._check_sglang()
        if self.vllm != VllmConfig():
            self._check_vllm_semantics()
        if self.speculative is not None:
            self._check_speculative()
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise InvalidArgument(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running request can decode in one pass",
                field="max_num_batched_tokens",
            )

    def _check_kv_groups(self) -> None:
        groups = self.kv_groups
        assert groups is not None
        if not groups:
            raise InvalidArgument("kv_groups: give at least one layer kind, or leave kv_groups out", field="kv_groups")
        if self.backend != "vllm":
            raise InvalidArgument(f"kv_groups: supported only with backend vllm (its hybrid KV cache manager), got "
                                  f"{self.backend!r}", field="kv_groups")
        keys = [(g.kind, g.window) for g in groups]
        if len(set(keys)) != len(keys):
            raise InvalidArgument("kv_groups: give each (kind, window) once, with all its layers", field="kv_groups")
        if self.native_host_offload is not None:
            raise InvalidArgument("kv_groups: not supported with native_host_offload yet; remove one of them",
                                  field="kv_groups")
        bs = self.block_size if self.block_size is not None else DEFAULT_BLOCK_SIZE[self.backend]
        if self.enable_prefix_caching and any(g.mode == "align" for g in groups) and self.max_num_batched_tokens < bs:
            raise InvalidArgument(
                f"kv_groups: a state group in cache_mode align computes prefill chunks of whole blocks, so "
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least block_size ({bs}); raise it, "
                "or use cache_mode all", field="max_num_batched_tokens")
        windowed = any(g.kind == "sliding_window" or (g.kind == "state" and self.enable_prefix_caching) for g in groups)
        if self.eviction_policy == "lineage" and windowed:
            raise InvalidArgument(
                "kv_groups: eviction_policy lineage assumes a request holds a prefix of its blocks, but sliding-window "
                "and cached state groups free their oldest blocks first; use lru (vLLM's free queue)",
                field="eviction_policy")

    @property
    def kv_cache_groups(self) -> list[KvCacheGroup]:
        """The KV cache groups vLLM forms from ``kv_groups`` (empty list: off), in ``group_idx`` order.

        One kind only: one group. Otherwise vLLM's rule: ``group_size`` = the fewest layers of a kind (the most,
        if that is under 1.5 times the fewest), each kind split into ``ceil(layers / group_size)`` groups of
        ``group_size`` layers (the last padded), kinds in the order given.
        """
        specs = self.kv_groups
        if not specs:
            return []
        if len(specs) == 1:
            g = specs[0]
            return [KvCacheGroup(g.kind, g.window, g.layers, g.mode)]
        size = self.kv_group_size
        out: list[KvCacheGroup] = []
        for g in specs:
            for _ in range(-(-g.layers // size)):
                out.append(KvCacheGroup(g.kind, g.window, size, g.mode))
        return out

    @property
    def kv_group_size(self) -> int:
        """Layers per KV cache group (vLLM's ``group_size``; the layer count of the one kind if only one)."""
        specs = self.kv_groups
        if not specs:
            return 0
        counts = [g.layers for g in specs]
        lo, hi = min(counts), max(counts)
        return hi if len(counts) == 1 or hi < 1.5 * lo else lo

    @property
    def pool_blocks(self) -> int:
        """Blocks of the engine's one block pool. Plain engine: ``num_gpu_blocks``. With ``kv_groups`` the memory
        is that of ``num_gpu_blocks`` full-attention blocks over all the model's layers, and a block is one page
        in each layer of a group (vLLM: ``num_blocks = memory // (page x group_size)``, shared by every group):
        ``num_gpu_blocks x total layers // group_size``. Under ``vllm.semantics`` vllm-0.34, one block fewer: vLLM
        keeps block 0 as a null block nobody holds."""
        specs = self.kv_groups
        if not specs:
            return self.num_gpu_blocks - 1 if self.vllm.semantics != "dynamo" else self.num_gpu_blocks
        return max(1, self.num_gpu_blocks * sum(g.layers for g in specs) // self.kv_group_size)

    def _check_vllm_semantics(self) -> None:
        """vLLM's own semantics come without FIFO victims, a host tier, hybrid groups or drafts (not checked yet)."""
        semantics = self.vllm.semantics
        if self.vllm.async_scheduling and semantics == "dynamo":
            raise InvalidArgument("vllm.async_scheduling needs vllm.semantics vllm-0.34 (Dynamo's mocker schedules "
                                  "synchronously)", field="vllm.async_scheduling")
        if semantics == "dynamo":
            return
        if self.backend != "vllm":
            raise InvalidArgument(f"vllm.semantics {semantics!r} needs backend vllm, got {self.backend!r}",
                                  field="vllm.semantics")
        if self.preemption_mode != "lifo":
            raise InvalidArgument(f"vllm.semantics {semantics!r}: vLLM preempts the latest admitted request (or, "
                                  f"by priority, the lowest); preemption_mode must be lifo", field="preemption_mode")
        for name in ("native_host_offload", "speculative", "kv_groups"):
            if getattr(self, name) is not None:
                raise InvalidArgument(f"vllm.semantics {semantics!r} is checked against vLLM without {name}; "
                                      f"leave {name} out or use semantics dynamo", field=name)
        if self.num_gpu_blocks < 2:
            raise InvalidArgument("vllm.semantics: vLLM keeps one block as its null block; num_gpu_blocks must be "
                                  ">= 2", field="num_gpu_blocks")

    def _check_sglang(self) -> None:
        exact = self.sglang.semantics != "dynamo"
        if not self.enable_chunked_prefill and not exact:
            raise InvalidArgument("enable_chunked_prefill: false (SGLang's chunked_prefill_size -1) needs "
                                  "sglang.semantics sglang-0.5.23 (Dynamo's mocker always chunks); remove it",
                                  field="enable_chunked_prefill")
        if exact:
            for name in ("speculative", "kv_groups", "native_host_offload"):
                if getattr(self, name) is not None:
                    raise InvalidArgument(f"sglang.semantics {self.sglang.semantics!r} is checked against SGLang without "
                                          f"{name}; leave {name} out or use semantics dynamo", field=name)
            if self.resolved_block_size != 1 or self.sglang.prefill_decode_interval:
                raise InvalidArgument(f"sglang.semantics {self.sglang.semantics!r} is checked with 1-token pages and no "
                                      "prefill_decode_interval; set block_size 1 and leave prefill_decode_interval out",
                                      field="block_size" if self.resolved_block_size != 1 else
                                      "sglang.prefill_decode_interval")
        if self.sglang.chunked_prefill_size % self.resolved_block_size:
            raise InvalidArgument(
                f"sglang.chunked_prefill_size ({self.sglang.chunked_prefill_size}) must be a multiple of block_size "
                f"({self.block_size}, the SGLang page size)", field="sglang.chunked_prefill_size")
        if self.sglang.schedule_conservativeness != self.sglang.schedule_conservativeness:
            raise InvalidArgument("sglang.schedule_conservativeness must be a number", field="sglang.schedule_conservativeness")

    def _check_speculative(self) -> None:
        if self.decode_speedup_ratio != 1.0:
            raise InvalidArgument(
                f"speculative: needs decode_speedup_ratio 1, got {self.decode_speedup_ratio} (the speed-up comes from "
                "the tokens each pass emits, as in Dynamo's mocker); remove decode_speedup_ratio", field="speculative")

    def _check_host_offload(self) -> None:
        """The reference's cross-checks of ``native_host_offload``."""
        if self.backend != "vllm":
            raise InvalidArgument(f"native_host_offload: supported only with backend vllm, got {self.backend!r}",
                                  field="native_host_offload")
        if not self.enable_prefix_caching:
            raise InvalidArgument("native_host_offload: needs enable_prefix_caching true (host blocks are found by "
                                  "their prefix hashes)", field="native_host_offload")
        if self.kv_cache_bytes_per_token is None:
            raise InvalidArgument("native_host_offload: needs kv_cache_bytes_per_token (it sizes the host blocks "
                                  "and their transfers)", field="kv_cache_bytes_per_token")

    @property
    def resolved_block_size(self) -> int:
        """``block_size`` as an ``int``: the value given, else the backend's default (``__post_init__`` already
        stores it, so this is ``block_size`` itself; read it once, outside hot loops)."""
        bs = self.block_size
        return bs if bs is not None else DEFAULT_BLOCK_SIZE[self.backend]

    @property
    def capacity_tokens(self) -> int:
        """KV tokens one rank can hold (``num_gpu_blocks * block_size``)."""
        return self.num_gpu_blocks * self.resolved_block_size

    def settings(self) -> EngineSettings:
        """What a worker registers of its engine (``Register.engine``): a digest of every knob but ``dp_size`` (a
        worker's own choice) and each knob's JSON value, or the digest of one longer than ``MAX_KNOB_CHARS``."""
        knobs = []
        for name in self.__struct_fields__:
            if name == "dp_size":
                continue
            knob = getattr(self, name)
            if name in _float_knobs() and type(knob) is int:  # 4 and 4.0 are one setting
                knob = float(knob)
            value = msgspec.json.encode(knob).decode()
            knobs.append((name, value if len(value) <= MAX_KNOB_CHARS else "#" + _digest(value)[:16]))
        return EngineSettings(digest=_digest(msgspec.json.encode(knobs).decode()), knobs=knobs)


@functools.cache
def _float_knobs() -> frozenset[str]:
    """The ``EngineConfig`` knobs that take a float (an int given there is the same setting)."""
    def takes_float(t: msgspec.inspect.Type) -> bool:
        types = t.types if isinstance(t, msgspec.inspect.UnionType) else (t,)
        return any(isinstance(x, msgspec.inspect.FloatType) for x in types)

    info = msgspec.inspect.type_info(EngineConfig)
    assert isinstance(info, msgspec.inspect.StructType)
    return frozenset(f.name for f in info.fields if takes_float(f.type))


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
