"""The `kvflow` command: one click group for everything."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from worker.config import DECODE_GRAPHS, EngineConfig, parse_size, parse_weights
from worker.hardware import KEY_LAYOUTS, KV_CACHE_DTYPES

F = TypeVar("F", bound=Callable[..., Any])


def engine_options(fn: F) -> F:
    """The engine's limits as flags; unset flags fall back to KVFLOW_* variables."""
    opts = [
        click.option(
            "--model",
            default=None,
            help="HF model directory or .gguf file (default: bundled SmolLM2-135M-Instruct).",
        ),
        click.option(
            "--dtype",
            type=click.Choice(["auto", "float32", "bfloat16", "float16", "int8"]),
            default=None,
            help="auto (default): bfloat16 where the hardware multiplies it faster than "
            "float32 (AMX; avx512_bf16 except on an Intel core without AMX; CUDA), else "
            "float32 (as int16 products on CPUs with AVX2 only or AVX-512 VNNI); "
            "int8 (CPU): int8 linear layers, activations quantized per call.",
        ),
        click.option("--device", default=None, help="cpu, cuda or cuda:N."),
        click.option(
            "--max-num-seqs", type=int, default=None, help="Sequences per step (default 64)."
        ),
        click.option(
            "--max-num-batched-tokens",
            type=int,
            default=None,
            help="Token budget per step (default 2048).",
        ),
        click.option("--max-model-len", type=int, default=None),
        click.option(
            "--block-size", type=int, default=None, help="Tokens per KV block (default 16)."
        ),
        click.option("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks."),
        click.option(
            "--kv-cache-size",
            default=None,
            help="KV cache size in bytes, e.g. 2G (default: see EngineConfig).",
        ),
        click.option("--prefix-caching/--no-prefix-caching", default=None),
        click.option(
            "--policy",
            type=click.Choice(["fcfs", "priority", "fair"]),
            default=None,
            help="Who is admitted first: fcfs, priority, or fair (share between clients).",
        ),
        click.option(
            "--client-weights",
            default=None,
            help="fair policy: client=weight,... (unlisted clients weigh 1).",
        ),
        click.option(
            "--client-max-running",
            type=int,
            default=None,
            help="fair policy: at most this many running sequences per client.",
        ),
        click.option(
            "--prefill-mix",
            type=click.Choice(["decode-first", "prefill-first", "chunked"]),
            default=None,
            help="How a step mixes new prompts and decodes (default decode-first).",
        ),
        click.option(
            "--prefill-budget",
            type=int,
            default=None,
            help="chunked: prompt tokens per step (default 256).",
        ),
        click.option("--scheduling", type=click.Choice(["continuous", "static"]), default=None),
        click.option(
            "--aging-s",
            type=float,
            default=None,
            help="Seconds of waiting worth one priority level.",
        ),
        click.option("--max-tokens-cap", type=int, default=None),
        click.option("--threads", type=int, default=None, help="torch threads on CPU."),
        click.option(
            "--attention",
            type=click.Choice(["auto", "native", "torch"]),
            default=None,
            help="CPU decode attention: the C kernel reading the paged cache in place "
            "(native), block gather + matmuls (torch), native where it builds (auto).",
        ),
        click.option(
            "--linear",
            type=click.Choice(["auto", "onednn", "torch", "int16"]),
            default=None,
            help="CPU linear layers: weights packed once at load for oneDNN's matmul "
            "(onednn), torch's plain matmul (torch), float32 layers as 16-bit integer "
            "products in C (int16: 14-bit weights, 13-bit inputs); auto takes int16 for "
            "float32 it chose on a CPU with AVX2 and no AVX-512 or with AVX-512 VNNI, "
            "else onednn where torch has it.",
        ),
        click.option(
            "--prefill-attention",
            type=click.Choice(["auto", "float32", "bfloat16", "native", "flash"]),
            default=None,
            help="CPU prefill attention: SDPA on bfloat16 copies of q, k and v, or on "
            "float32 ones, the C decode kernel reading the cache in place (native), or the "
            "C prompt kernel reading it in place (flash; over keys in pairs on bfloat16 "
            "products where the CPU has avx512_bf16); auto takes bfloat16 where the CPU "
            "has AMX behind bfloat16 linear layers, flash over keys in pairs behind "
            "bfloat16 ones where it has avx512_bf16 without AMX (native where the keys are "
            "rows), flash where it has AVX2 without AVX-512 or behind int16 linear layers "
            "over a bfloat16 cache.",
        ),
        click.option(
            "--kv-cache-dtype",
            type=click.Choice(list(KV_CACHE_DTYPES)),
            default=None,
            help="KV cache dtype (CPU): auto is bfloat16 behind bfloat16 or int16 linear "
            "layers where the C decode kernel runs (bfloat16-int8 behind bfloat16 layers on a "
            "CPU with AMX, unless prompts are attended from the cache), else float32; "
            "bfloat16 holds twice float32's blocks in the same "
            "memory, int8 (keys a scale per 16 values, values one per row) 3.5x, "
            "bfloat16-int8 (bfloat16 keys, int8 values) 2.6x.",
        ),
        click.option(
            "--key-layout",
            type=click.Choice(list(KEY_LAYOUTS)),
            default=None,
            help="Layout of a bfloat16 keys' cache block (CPU): rows, or pairs (each pair of "
            "dimensions of the block's keys together, which the C decode kernel scores "
            "without sums across lanes); auto takes pairs on a CPU with AVX-512 where "
            "decode reads bfloat16 keys in place.",
        ),
        click.option(
            "--decode-graphs",
            type=click.Choice(list(DECODE_GRAPHS)),
            default=None,
            help="CUDA: decode steps replayed as CUDA graphs, one per bucket of batch size "
            "and context, captured on first use (auto; off: launched op by op; eager: the "
            "graphs' fixed-shape steps without capture, on any device whose decode "
            "attention is torch's).",
        ),
        click.option(
            "--tune-batch/--no-tune-batch",
            default=None,
            help="Measure decode tok/s by batch size at start-up and run at most the "
            "smallest batch within 5% of the best (max-num-seqs stays the cap).",
        ),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def build_engine_config(kw: dict[str, Any]) -> EngineConfig:
    """EngineConfig from the engine_options flags (popped from kw) and the environment."""
    size = kw.pop("kv_cache_size", None)
    overrides = {
        "model": kw.pop("model", None),
        "dtype": kw.pop("dtype", None),
        "device": kw.pop("device", None),
        "max_num_seqs": kw.pop("max_num_seqs", None),
        "max_num_batched_tokens": kw.pop("max_num_batched_tokens", None),
        "max_model_len": kw.pop("max_model_len", None),
        "block_size": kw.pop("block_size", None),
        "num_kv_blocks": kw.pop("num_kv_blocks", None),
        "kv_cache_bytes": parse_size(size) if size else None,
        "enable_prefix_caching": kw.pop("prefix_caching", None),
        "policy": kw.pop("policy", None),
        "client_weights": kw.pop("client_weights", None),
        "client_max_running": kw.pop("client_max_running", None),
        "prefill_mix": kw.pop("prefill_mix", None),
        "prefill_budget": kw.pop("prefill_budget", None),
        "scheduling": kw.pop("scheduling", None),
        "aging_s": kw.pop("aging_s", None),
        "max_tokens_cap": kw.pop("max_tokens_cap", None),
        "num_threads": kw.pop("threads", None),
        "attention": kw.pop("attention", None),
        "kv_cache_dtype": kw.pop("kv_cache_dtype", None),
        "key_layout": kw.pop("key_layout", None),
        "prefill_attention": kw.pop("prefill_attention", None),
        "linear": kw.pop("linear", None),
        "tune_batch": kw.pop("tune_batch", None),
        "decode_graphs": kw.pop("decode_graphs", None),
    }
    try:
        if overrides["client_weights"]:
            overrides["client_weights"] = parse_weights(overrides["client_weights"])
        return EngineConfig.from_env(**overrides)
    except ValueError as e:
        raise click.UsageError(str(e)) from e


@click.group()
def main() -> None:
    """kvflow: RabbitMQ-driven LLM batch worker with continuous batching."""


@main.command("run-batch")
@click.argument("input_path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "-o",
    "--output",
    "output_path",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Output JSONL ('-' for stdout).",
)
@click.option("--show/--no-show", default=False, help="Print each result's text.")
@click.option("--progress/--no-progress", default=True, help="Progress bar on stderr.")
@click.option(
    "--database-url",
    default=None,
    help="Also record every request in this ledger (as the queue worker does).",
)
@engine_options
def run_batch(
    input_path: Path,
    output_path: Path,
    show: bool,
    progress: bool,
    database_url: str | None,
    **kw: Any,
) -> None:
    """Run an OpenAI batch JSONL file through the engine, in process (no broker)."""
    from worker.batch import run_batch_file
    from worker.engine.engine import LLMEngine

    config = build_engine_config(kw)
    ledger = None
    if database_url:
        from worker.ledger.migrate import DatabaseUnavailable, SchemaError
        from worker.ledger.threaded import ThreadedLedger

        try:
            ledger = ThreadedLedger(database_url)
        except (SchemaError, DatabaseUnavailable) as e:
            raise click.ClickException(str(e)) from None
    try:
        engine = LLMEngine(config)
    except (ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from e
    info = engine.info
    click.echo(
        f"kvflow: {info.model_name} on {info.device} ({info.dtype}: {info.dtype_reason}; "
        f"{info.num_threads} threads; linear layers: {info.linear}; attention: {info.attention}), "
        f"{info.num_blocks} KV blocks "
        f"x {info.block_size} tokens in {info.kv_cache_dtype}, keys as {info.key_layout}, "
        f"{config.scheduling} scheduling"
        + (
            f", decode graphs: {info.decode_graphs}"
            if info.device != "cpu" or config.decode_graphs != "auto"
            else ""
        ),
        err=True,
    )
    if engine.operating_point is not None:
        click.echo(f"kvflow: tuned: {engine.operating_point.describe()}", err=True)
    if str(output_path) == "-":
        items, summary = run_batch_file(engine, input_path, sys.stdout, progress, ledger)
    else:
        with open(output_path, "w", encoding="utf-8") as out:
            items, summary = run_batch_file(engine, input_path, out, progress, ledger)
    if ledger is not None:
        lost = ledger.close()
        if lost:
            raise click.ClickException(f"{lost} ledger records could not be committed")
        click.echo(f"ledger: {summary.requests} requests recorded", err=True)
    if show:
        for item in items:
            text = item.output.text if item.output is not None else f"ERROR: {item.error}"
            click.echo(f"--- {item.custom_id}\n{text.strip()}")
    click.echo(summary.table(), err=True)
    if str(output_path) != "-":
        click.echo(f"results: {output_path}", err=True)


@main.command("worker")
@click.option("--amqp-url", default=None, help="RabbitMQ URL (env KVFLOW_AMQP_URL).")
@click.option("--database-url", default=None, help="Ledger database URL (env KVFLOW_DATABASE_URL).")
@click.option(
    "--queue", default=None, help="Request queue (env KVFLOW_QUEUE, default kvflow.requests)."
)
@click.option("--worker-id", default=None)
@click.option(
    "--lookahead",
    type=int,
    default=None,
    help="Unstarted messages held beyond the batch (default 2).",
)
@click.option(
    "--reserve-blocks", type=int, default=None, help="Free KV blocks kept when pulling (default 4)."
)
@click.option("--default-max-tokens", type=int, default=None)
@click.option(
    "--drain-timeout",
    "drain_timeout_s",
    type=float,
    default=None,
    help="Seconds to finish running work on shutdown (default 60).",
)
@click.option(
    "--max-request-seconds",
    "max_request_s",
    type=float,
    default=None,
    help="Longest a request may run before it ends with finish reason 'deadline' "
    "(default 1500, below RabbitMQ's consumer_timeout of 1800; raise both together).",
)
@click.option(
    "--client-max-queued-tokens",
    type=int,
    default=None,
    help="Fair mode: take no more of a client's requests while this many of its prompt "
    "tokens wait in the worker.",
)
@click.option(
    "--max-queue-delay",
    "max_queue_delay_s",
    type=float,
    default=None,
    help="Answer 'expired' instead of running a request that waited longer (seconds).",
)
@click.option(
    "--delivery-limit",
    type=int,
    default=None,
    help="The request queue's x-delivery-limit (default 5; must match the queue's).",
)
@click.option(
    "--metrics-port", type=int, default=None, help="Serve Prometheus metrics on this port."
)
@click.option("--metrics-host", default=None)
@click.option("--burst", is_flag=True, default=False, help="Exit once the queue is empty.")
@click.option(
    "--log-level", default="INFO", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"])
)
@engine_options
def worker_cmd(log_level: str, **kw: Any) -> None:
    """Serve requests from RabbitMQ with continuous batching; results to replies and the ledger."""
    import asyncio
    import logging

    from worker.config import ServiceConfig
    from worker.ledger.migrate import DatabaseUnavailable, SchemaError
    from worker.service import Service

    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine_config = build_engine_config(kw)
    try:
        config = ServiceConfig.from_env(
            **{k: v for k, v in kw.items() if k != "burst"}, burst=kw["burst"] or None
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    try:
        code = asyncio.run(Service(engine_config, config).run())
    except (SchemaError, DatabaseUnavailable, ConnectionError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None
    sys.exit(code)


from broker.commands import submit  # noqa: E402
from worker.admin.commands import cancel, drain, resume, scale, status, up, workers  # noqa: E402
from worker.admin.data_commands import dlq_group, ledger_group  # noqa: E402
from worker.ledger.commands import db  # noqa: E402

main.add_command(submit)
main.add_command(db)
for admin_command in (workers, status, drain, resume, cancel, scale, up, dlq_group, ledger_group):
    main.add_command(admin_command)

if __name__ == "__main__":
    main()
