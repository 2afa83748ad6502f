"""Configuration: frozen, validated once, built from flags and environment.

Values only known once the model is loaded (number of KV blocks, EOS ids, the model's
context length) live in `worker.engine.model_runner.RuntimeInfo`, never written back here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from worker.hardware import KEY_LAYOUTS, KV_CACHE_DTYPES, PREFILL_ATTENTION_DTYPES
from worker.limits import QUEUE_DEFAULT_MAX_TOKENS

Policy = Literal["fcfs", "priority", "fair"]
PrefillMix = Literal["decode-first", "prefill-first", "chunked"]
Scheduling = Literal["continuous", "static"]

# The KV cache's size when neither num_kv_blocks nor kv_cache_bytes is given.
DEFAULT_CPU_KV_BYTES = 2 << 30
CUDA_MEMORY_FRACTION = 0.9  # of the memory free once the model is loaded

# "auto": chosen at start-up from what the hardware multiplies natively (worker.hardware).
CPU_DTYPES = ("auto", "float32", "bfloat16", "int8")
CUDA_DTYPES = ("auto", "float16", "bfloat16", "float32")
ATTENTION_BACKENDS = ("auto", "native", "torch")
LINEAR_BACKENDS = ("auto", "onednn", "torch", "int16")
# Decode steps as CUDA graphs (worker.engine.decode_graphs): "auto" on CUDA, "off", or
# "eager": the graphs' fixed-shape steps run without capture (any device whose decode
# attention is torch's), to tell a capture's fault from the fixed shapes' own
DECODE_GRAPHS = ("auto", "off", "eager")


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes the engine. Invalid combinations raise ValueError.

    KV capacity: give `num_kv_blocks` or `kv_cache_bytes`; with neither, the runner
    takes `DEFAULT_CPU_KV_BYTES` on CPU, `CUDA_MEMORY_FRACTION` of free memory on CUDA.
    """

    model: str | None = None  # HF directory or .gguf file; None = the bundled default
    dtype: str = "auto"
    device: str = "cpu"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None = the model's own context length
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    enable_prefix_caching: bool = True
    policy: Policy = "fcfs"
    # policy "fair": each client's share of service is in proportion to its weight
    # (unlisted clients weigh 1); at most `client_max_running` sequences per client.
    client_weights: tuple[tuple[str, float], ...] = ()
    client_max_running: int | None = None
    # How a step mixes prefill and decode work: decode-first (running requests catch
    # up first, new prompts take what budget is left), prefill-first (new prompts are
    # admitted first: lower TTFT, longer gaps between tokens), chunked (decode first,
    # and new prompt tokens take at most `prefill_budget` tokens of each step).
    prefill_mix: PrefillMix = "decode-first"
    prefill_budget: int = 256
    scheduling: Scheduling = "continuous"
    # Priority aging: waiting `aging_s` seconds is worth one priority level, so low
    # priority work cannot starve forever. 0 disables aging.
    aging_s: float = 30.0
    # A single prefill chunk takes at most this many tokens of the step budget, so one
    # long prompt cannot crowd out the others (0 = no cap beyond the budget).
    long_prefill_token_threshold: int = 0
    max_tokens_cap: int | None = None  # refuse requests asking for more output than this
    cache_dir: str | None = None  # where converted GGUF models go
    # torch intra-op threads on CPU; None = the cores this process may use (affinity, cgroup)
    num_threads: int | None = None
    # Decode attention on CPU: "native" reads the paged cache in place with the C kernel
    # (worker.model.native; built on first use), "torch" gathers blocks and runs matmuls,
    # "auto" takes native where it builds and torch elsewhere (and on CUDA).
    attention: str = "auto"
    # Linear layers on CPU: "onednn" packs their weights once at load for oneDNN's matmul
    # (worker.model.packing), "torch" keeps torch's plain matmul, "auto" packs where
    # this torch has oneDNN (CPU only); "int16" computes float32 layers as 16-bit integer
    # products in C, which auto takes for float32 it chose on a CPU with AVX2 and no
    # AVX-512 or with AVX-512 VNNI (worker.hardware.choose_int16_linear).
    linear: str = "auto"
    # The KV cache's dtype: "auto" is bfloat16 on CPU behind bfloat16 or int16 linear
    # layers where the C kernel reads the cache in place ("bfloat16-int8", bfloat16 keys
    # over int8 values, behind bfloat16 layers on a CPU with AMX where prompts take SDPA),
    # the activations' elsewhere; bfloat16 holds twice the blocks in the same memory
    # (worker.hardware.choose_kv_dtype).
    kv_cache_dtype: str = "auto"
    # How a bfloat16 keys' cache lays out a block: "rows" (a key's D values together) or
    # "pairs" (each pair of dimensions of a block's keys together, [D / 2, block_size, 2]
    # a head: the C decode kernel scores 16 keys a vector without sums across lanes);
    # "auto" takes pairs behind bfloat16 keys read in place on a CPU with AVX-512
    # (worker.hardware.choose_key_layout).
    key_layout: str = "auto"
    # Prefill attention on CPU: "bfloat16" runs SDPA on bfloat16 copies of q, k and v,
    # "float32" on the activations, "native" the C decode kernel in place, a query row at
    # a time, "flash" the C prompt kernel in place, tiles of queries at a time (over keys
    # in pairs on bfloat16 products where the CPU has avx512_bf16); "auto" takes bfloat16
    # where the CPU has AMX behind bfloat16 linear layers, flash over keys in pairs where
    # it has avx512_bf16 without AMX, over a bfloat16 cache (native where the keys are
    # asked to be rows), flash where it has AVX2 without AVX-512 or behind int16 linear
    # layers over a bfloat16 cache
    # (worker.hardware.choose_prefill_attention).
    prefill_attention: str = "auto"
    # Measure decode tokens/s against batch size at start-up and run at most the smallest
    # batch within 5% of the best rate (worker.engine.tuning); max_num_seqs stays the cap.
    tune_batch: bool = False
    # CUDA: decode-only steps replayed as CUDA graphs, one per bucket of batch size and
    # context, captured on first use: a small model's decode step is bound by its ~1,000
    # kernel launches, not by the GPU (DECODE_GRAPHS)
    decode_graphs: str = "auto"

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            bad(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        allowed = CPU_DTYPES if self.device == "cpu" else CUDA_DTYPES
        if self.dtype not in allowed:
            bad(f"dtype {self.dtype!r} is not supported on {self.device}; choose one of {allowed}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                bad(f"{name} must be a positive integer, got {v!r}")
        if self.block_size & (self.block_size - 1):
            bad(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            bad(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            bad(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.num_kv_blocks is not None and self.kv_cache_bytes is not None:
            bad("give num_kv_blocks or kv_cache_bytes, not both")
        if self.max_model_len is not None and self.max_model_len < 2:
            bad(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.policy not in ("fcfs", "priority", "fair"):
            bad(f"policy must be 'fcfs', 'priority' or 'fair', got {self.policy!r}")
        for name, weight in self.client_weights:
            if not isinstance(weight, (int, float)) or not weight > 0:
                bad(f"the weight of client {name!r} must be a positive number, got {weight!r}")
        if self.client_max_running is not None and self.client_max_running < 1:
            bad(f"client_max_running must be positive, got {self.client_max_running}")
        if self.prefill_mix not in ("decode-first", "prefill-first", "chunked"):
            bad(
                "prefill_mix must be 'decode-first', 'prefill-first' or 'chunked', "
                f"got {self.prefill_mix!r}"
            )
        if self.prefill_budget < 1:
            bad(f"prefill_budget must be positive, got {self.prefill_budget}")
        if self.scheduling not in ("continuous", "static"):
            bad(f"scheduling must be 'continuous' or 'static', got {self.scheduling!r}")
        if self.aging_s < 0:
            bad(f"aging_s must be >= 0, got {self.aging_s}")
        if self.long_prefill_token_threshold < 0:
            bad("long_prefill_token_threshold must be >= 0")
        if self.max_tokens_cap is not None and self.max_tokens_cap < 1:
            bad(f"max_tokens_cap must be positive, got {self.max_tokens_cap}")
        if self.num_threads is not None and self.num_threads < 1:
            bad(f"num_threads must be positive, got {self.num_threads}")
        if self.attention not in ATTENTION_BACKENDS:
            bad(f"attention must be one of {ATTENTION_BACKENDS}, got {self.attention!r}")
        if self.attention == "native" and self.device != "cpu":
            bad("attention 'native' is a CPU kernel; on CUDA use 'auto' or 'torch'")
        if self.linear not in LINEAR_BACKENDS:
            bad(f"linear must be one of {LINEAR_BACKENDS}, got {self.linear!r}")
        if self.linear == "onednn" and self.device != "cpu":
            bad("linear 'onednn' packs weights for CPU; on CUDA use 'auto' or 'torch'")
        if self.linear == "int16" and self.device != "cpu":
            bad("linear 'int16' is for CPU (AVX2); on CUDA use 'auto' or 'torch'")
        if self.prefill_attention not in PREFILL_ATTENTION_DTYPES:
            bad(
                f"prefill_attention must be one of {PREFILL_ATTENTION_DTYPES}, "
                f"got {self.prefill_attention!r}"
            )
        if self.prefill_attention in ("native", "flash") and (
            self.device != "cpu" or self.attention == "torch"
        ):
            bad(
                f"prefill_attention {self.prefill_attention!r} runs prompt rows through a C "
                "attention kernel: it needs device 'cpu' and attention 'auto' or 'native'"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            bad(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.key_layout not in KEY_LAYOUTS:
            bad(f"key_layout must be one of {KEY_LAYOUTS}, got {self.key_layout!r}")
        if self.decode_graphs not in DECODE_GRAPHS:
            bad(f"decode_graphs must be one of {DECODE_GRAPHS}, got {self.decode_graphs!r}")
        if self.decode_graphs == "eager" and self.device == "cpu" and self.attention != "torch":
            bad(
                "decode_graphs 'eager' runs the graphs' torch attention path: on CPU it "
                "needs attention 'torch'"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> EngineConfig:
        """Build from KVFLOW_* environment variables; explicit overrides win."""
        env = os.environ if env is None else env
        fields: dict[str, object] = {}
        for name, conv in _ENV_FIELDS.items():
            raw = env.get("KVFLOW_" + name.upper())
            if raw is not None and raw != "":
                try:
                    fields[name] = conv(raw)
                except ValueError as e:
                    raise ValueError(f"KVFLOW_{name.upper()}={raw!r} is not valid: {e}") from e
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**fields)  # type: ignore[arg-type]


def parse_size(text: str) -> int:
    """'512M', '2G', '1.5GiB' or a plain byte count -> bytes."""
    s = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(s[-1:], 1)
    if mult != 1:
        s = s[:-1]
    try:
        value = float(s)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (use e.g. 512M or 2G)") from None
    if value <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return int(value * mult)


def parse_weights(text: str) -> tuple[tuple[str, float], ...]:
    """'search=3,batch=1' -> (('search', 3.0), ('batch', 1.0)); a name alone weighs 1."""
    out: list[tuple[str, float]] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, _, weight = part.partition("=")
        try:
            value = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"not a weight: {part!r} (use name=weight, e.g. search=3)") from None
        if not name.strip():
            raise ValueError(f"a client needs a name: {part!r}")
        out.append((name.strip(), value))
    return tuple(out)


def _bool(raw: str) -> bool:
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


_ENV_FIELDS: dict[str, Callable[[str], object]] = {
    "model": str,
    "dtype": str,
    "device": str,
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "max_model_len": int,
    "block_size": int,
    "num_kv_blocks": int,
    "kv_cache_bytes": parse_size,
    "enable_prefix_caching": _bool,
    "policy": str,
    "client_weights": parse_weights,
    "client_max_running": int,
    "prefill_mix": str,
    "prefill_budget": int,
    "scheduling": str,
    "aging_s": float,
    "max_tokens_cap": int,
    "cache_dir": str,
    "num_threads": int,
    "attention": str,
    "kv_cache_dtype": str,
    "key_layout": str,
    "prefill_attention": str,
    "linear": str,
    "tune_batch": _bool,
    "decode_graphs": str,
}


@dataclass(frozen=True)
class ServiceConfig:
    """The queue worker: where it connects and how it pulls, drains and records."""

    amqp_url: str = "amqp://guest:guest@localhost:5672/"
    database_url: str = "postgresql://postgres@127.0.0.1:5432/postgres"
    queue: str = "kvflow.requests"
    worker_id: str | None = None  # default: host:pid:random
    # Unstarted messages the worker may hold beyond what its batch can take, so a
    # freed slot is refilled at the next step without a broker round trip.
    lookahead: int = 2
    # Pull only while this many KV blocks stay free beyond the waiting prompts.
    reserve_blocks: int = 4
    default_max_tokens: int = QUEUE_DEFAULT_MAX_TOKENS
    max_message_bytes: int = 1 << 20
    delivery_limit: int = 5
    drain_timeout_s: float = 60.0
    # RabbitMQ closes a channel that holds a delivery unacked past its consumer_timeout
    # (30 min by default, node-wide on 3.10) and redelivers everything on it: a request
    # runs at most this long, then ends with finish reason 'deadline'.
    max_request_s: float = 1500.0
    # Admission control. Fair mode (engine policy 'fair'): a client with this many
    # prompt tokens waiting in a worker is not taken from until they shrink. Any mode:
    # a request that waited longer than `max_queue_delay_s` since it was enqueued is
    # answered 'expired' instead of being run late.
    client_max_queued_tokens: int | None = None
    max_queue_delay_s: float | None = None
    heartbeat_s: float = 2.0
    poll_max_s: float = 0.05  # longest pause between pulls while the queue is empty
    metrics_port: int | None = None
    metrics_host: str = "0.0.0.0"
    burst: bool = False  # exit once the queue is empty and nothing is in flight

    def __post_init__(self) -> None:
        for name in ("lookahead", "reserve_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("default_max_tokens", "max_message_bytes", "delivery_limit"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("drain_timeout_s", "heartbeat_s", "poll_max_s", "max_request_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.queue:
            raise ValueError("queue must be a non-empty name")
        for name in ("client_max_queued_tokens", "max_queue_delay_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be a TCP port, got {self.metrics_port}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> ServiceConfig:
        """KVFLOW_AMQP_URL, KVFLOW_DATABASE_URL, KVFLOW_QUEUE, ...; explicit overrides win."""
        env = os.environ if env is None else env
        fields: dict[str, object] = {}
        for name, conv in _SERVICE_ENV.items():
            raw = env.get("KVFLOW_" + name.upper())
            if raw:
                try:
                    fields[name] = conv(raw)
                except ValueError as e:
                    raise ValueError(f"KVFLOW_{name.upper()} is not valid: {e}") from e
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**fields)  # type: ignore[arg-type]


_SERVICE_ENV: dict[str, Callable[[str], object]] = {
    "amqp_url": str,
    "database_url": str,
    "queue": str,
    "worker_id": str,
    "lookahead": int,
    "reserve_blocks": int,
    "default_max_tokens": int,
    "max_message_bytes": int,
    "delivery_limit": int,
    "drain_timeout_s": float,
    "max_request_s": float,
    "client_max_queued_tokens": int,
    "max_queue_delay_s": float,
    "heartbeat_s": float,
    "metrics_port": int,
    "metrics_host": str,
}
