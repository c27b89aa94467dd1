"""``kvguard fake-engine``: one fake vLLM engine per process."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal

import torch

from engine_patch.log import get_logger
from fake_engine.config import (
    DTYPES,
    EngineConfig,
    FaultConfig,
    FaultKind,
    FaultSide,
    KVLoadFailurePolicy,
    Role,
)
from fake_engine.engine import Engine
from fake_engine.server import EngineServer

logger = get_logger("fake_engine")

# More intra-op threads than any CPU here has cores; each is an OS thread.
MAX_TORCH_THREADS = 1024


def _on_off(value: str) -> bool:
    if value not in ("on", "off"):
        raise argparse.ArgumentTypeError("expected on or off")
    return value == "on"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvguard fake-engine",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description=(
            "A CPU stand-in for a vLLM OpenAI server in a P/D deployment "
            "(NixlConnector pull mode) that checksums and verifies its KV "
            "with KVGuard's engine patch, with fault injection."
        ),
    )
    add = parser.add_argument
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=8000)
    add("--advertise-host", default=None, help="host consumers pull KV from")
    add("--role", type=Role, choices=list(Role), default=Role.BOTH)
    add("--model", default="kvguard/fake-model", help="the served model name")
    shape = parser.add_argument_group("model shape")
    shape.add_argument("--layers", type=int, default=4)
    shape.add_argument("--kv-heads", type=int, default=4)
    shape.add_argument("--head-size", type=int, default=64)
    shape.add_argument("--dtype", choices=list(DTYPES), default="float16")
    cache = parser.add_argument_group("parallelism and KV cache")
    cache.add_argument("--tp-size", type=int, default=1)
    cache.add_argument("--block-size", type=int, default=16)
    cache.add_argument("--num-blocks", type=int, default=1024)
    cache.add_argument("--max-model-len", type=int, default=8192)
    cache.add_argument("--max-num-batched-tokens", type=int, default=8192)
    checks = parser.add_argument_group("KV checksums")
    checks.add_argument("--kv-checksums", type=_on_off, default=True, metavar="on|off")
    fail_mode = checks.add_mutually_exclusive_group()
    fail_mode.add_argument(
        "--fail-open",
        dest="fail_closed",
        action="store_false",
        default=True,
        help="opt-in for rollouts: log and count loads that mismatch or cannot "
        "be verified and use them (default: fail them)",
    )
    fail_mode.add_argument(
        "--fail-closed",
        dest="fail_closed",
        action="store_true",
        help="fail loads that mismatch or cannot be verified (the default)",
    )
    checks.add_argument(
        "--kv-load-failure-policy",
        type=KVLoadFailurePolicy,
        choices=list(KVLoadFailurePolicy),
        default=KVLoadFailurePolicy.FAIL,
    )
    checks.add_argument(
        "--lease-s",
        type=float,
        default=30.0,
        help="seconds a producer holds KV for its consumer",
    )
    checks.add_argument("--engine-id", default=None)
    faults = parser.add_argument_group("fault injection")
    faults.add_argument(
        "--fault", type=FaultKind, choices=list(FaultKind), default=FaultKind.NONE
    )
    faults.add_argument(
        "--fault-side",
        type=FaultSide,
        choices=list(FaultSide),
        default=FaultSide.PRODUCER,
    )
    faults.add_argument("--fault-rate", type=float, default=1.0)
    faults.add_argument("--fault-count", type=int, default=None)
    faults.add_argument("--fault-delay-s", type=float, default=1.0, help="for slow")
    faults.add_argument("--fault-seed", type=int, default=0)
    faults.add_argument(
        "--enable-fault-admin",
        action="store_true",
        help="serve POST /kvguard/faults to change the fault at run time",
    )
    speed = parser.add_argument_group("simulated speed (default: instant)")
    speed.add_argument("--prefill-tokens-per-s", type=float, default=None)
    speed.add_argument(
        "--decode-tokens-per-s", type=float, default=None, help="per request"
    )
    add(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads (the engine's tensors are tiny: more "
        "threads only contend for cores)",
    )
    add("--log-level", default="INFO")
    return parser


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Raises:
    ValueError: For inconsistent settings.
    """
    return EngineConfig(
        model=args.model,
        role=args.role,
        layers=args.layers,
        kv_heads=args.kv_heads,
        head_size=args.head_size,
        dtype=args.dtype,
        tp_size=args.tp_size,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_checksums=args.kv_checksums,
        fail_closed=args.fail_closed,
        kv_load_failure_policy=args.kv_load_failure_policy,
        lease_s=args.lease_s,
        fault=FaultConfig(
            fault=args.fault,
            side=args.fault_side,
            rate=args.fault_rate,
            count=args.fault_count,
            delay_s=args.fault_delay_s,
        ),
        fault_seed=args.fault_seed,
        enable_fault_admin=args.enable_fault_admin,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        decode_tokens_per_s=args.decode_tokens_per_s,
        engine_id=args.engine_id,
    )


async def serve(
    config: EngineConfig, host: str, port: int, advertise_host: str | None = None
) -> None:
    """Serve one engine until SIGINT or SIGTERM."""
    server = EngineServer(Engine(config))
    bound = await server.start(host, port, advertise_host)
    logger.info(
        "Fake engine %s (%s, TP %d, block size %d, checksums %s) on http://%s:%d",
        server.engine.engine_id,
        config.role,
        config.tp_size,
        config.block_size,
        "on" if config.kv_checksums else "off",
        host,
        bound,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await server.stop()


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    # Checked here: binding raised OverflowError, torch ValueError, and a
    # million threads took the machine's thread limit (then a segfault).
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in 0..65535, got {args.port}")
    if not 1 <= args.torch_threads <= MAX_TORCH_THREADS:
        parser.error(
            f"--torch-threads must be in 1..{MAX_TORCH_THREADS}, "
            f"got {args.torch_threads}"
        )
    torch.set_num_threads(args.torch_threads)
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(config, args.host, args.port, args.advertise_host))
    else:
        uvloop.run(serve(config, args.host, args.port, args.advertise_host))
    return 0
