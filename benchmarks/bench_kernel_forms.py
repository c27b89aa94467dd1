"""Forms of the fused checksum kernel for devices, side by side: which one
reads large KV nearest ``torch.sum``'s speed (issue 8 asks 1.2 TB/s of an
H200; the form the workers run reached 706 GB/s on an H100, where
``torch.sum`` read 3075).

    python benchmarks/bench_kernel_forms.py --device cuda    # one GPU call
    python benchmarks/bench_kernel_forms.py --device cpu --kv-gib 0.05

Each form is a function of the worker's kernel signature
(``checksum_kernel.RowSums``) and runs inside a real worker (the device
path: on a CPU without the numpy host pass). Its values are checked first,
by ``bench_checksum.device_failures`` (the CPU's eager values over every
layout and a mixed pass, no host sync on CUDA); a form that differs, or
fails, is reported and not timed. Its GB/s are measured interleaved with
``torch.sum`` of the same bytes. Forms:

- ``now``: the workers' kernel, ``torch.compile`` with every dim dynamic.
  Inductor's Triton code for it splits each element's reduction index into
  part and piece by a division by a runtime size, inside its inner loop
  (``TORCH_LOGS=output_code`` shows the code; ``gpu_check.sh`` brings it
  back).
- ``static rows``: the same function with only the block and row counts
  dynamic (``maybe_mark_dynamic``): a row's dims are constants, and the
  divisions are by constants.
- ``by span``: one weighted sum per block and span (the CPU package's form,
  ``block_row_sums``), rows static.
- ``pieces first``: every dim dynamic, but a cell's pieces summed before its
  parts (two reductions over one dim each, as the eager pass): the inner
  loop reads contiguous pieces and divides by nothing.
- ``triton``: a hand-written Triton kernel, one program per block, member
  and span (only where Triton is installed; under ``TRITON_INTERPRET=1`` it
  runs on a CPU, slowly, for its values).

A ceiling is printed too: the compiled mix and sum of each layer's bytes in
place, with no gather and no weights.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_checksum as bc

from engine_patch import checksum_kernel, worker
from engine_patch.worker import KVLayout

RowSums = checksum_kernel.RowSums

# Static forms compile once per row shape: the check's layouts and dtypes
# alone are more than dynamo's default limit of 8.
torch._dynamo.config.recompile_limit = 64


def _rows_dynamic(kernel: RowSums) -> RowSums:
    """``kernel`` with only the source's rows, the row ids and the blocks
    (arguments 0, 1 and 4) dynamic."""

    def call(*args: Any) -> torch.Tensor:
        for tensor in (args[0], args[1], args[4]):
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
        return kernel(*args)

    return call


def by_span(
    src: torch.Tensor,
    rows: torch.Tensor,
    piece_weights: torch.Tensor,
    head_weights: torch.Tensor,
    positions: torch.Tensor,
    spans: int,
    dims: tuple[int, int, int, int],
) -> torch.Tensor:
    """:func:`checksum_kernel.row_sums` as one weighted sum per block and
    span."""
    blocks = src[rows].view(positions.shape[0], head_weights.shape[0], *src.shape[1:])
    return checksum_kernel.block_row_sums(
        blocks, piece_weights, head_weights, positions, spans, dims
    )


def pieces_first(
    src: torch.Tensor,
    rows: torch.Tensor,
    piece_weights: torch.Tensor,
    head_weights: torch.Tensor,
    positions: torch.Tensor,
    spans: int,
    dims: tuple[int, int, int, int],
) -> torch.Tensor:
    """:func:`checksum_kernel.row_sums` summing a cell's pieces, then its
    parts, as the eager pass does: the reduced dim is contiguous, so with
    every dim dynamic the inner loop still divides by no runtime size."""
    parts, tokens, heads, pieces = dims
    weighted = checksum_kernel.mix(src[rows]) * piece_weights
    per_cell = weighted.sum(dim=max(parts, pieces)).sum(dim=min(parts, pieces))
    return checksum_kernel._block_sums(
        per_cell, head_weights, positions, spans, tokens > heads
    )


def form_now() -> RowSums:
    """The workers' own kernel, built afresh."""
    checksum_kernel._compiled = None
    kernel = checksum_kernel.compiled_row_sums()
    assert kernel is not None
    return kernel


def form_static_rows() -> RowSums:
    return _rows_dynamic(torch.compile(checksum_kernel.row_sums))


def form_by_span() -> RowSums:
    return _rows_dynamic(torch.compile(by_span))


def form_pieces_first() -> RowSums:
    return torch.compile(pieces_first, dynamic=True)


FORMS: dict[str, Callable[[], RowSums]] = {
    "now": form_now,
    "static rows": form_static_rows,
    "by span": form_by_span,
    "pieces first": form_pieces_first,
}

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
else:

    @triton.jit  # type: ignore[misc]
    def _span_sums(  # type: ignore[no-untyped-def]
        src,
        rows,
        piece_weights,
        head_weights,
        positions,
        out,
        row_stride,
        stride1,
        stride2,
        stride3,
        c1,
        c2,
        E1: tl.constexpr,
        E2: tl.constexpr,
        E3: tl.constexpr,
        PIECES: tl.constexpr,
        PIECES_P2: tl.constexpr,
        PART_DIM: tl.constexpr,
        TOKEN_DIM: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        MEMBERS: tl.constexpr,
        HEADS: tl.constexpr,
        TOKENS: tl.constexpr,
        SPANS: tl.constexpr,
        CELLS: tl.constexpr,
    ):
        # One program per block, member and span: the span's cells
        # (E1 x E2 x E3, the token dim cut to the span) CELLS at a time,
        # each cell's pieces contiguous.
        pid = tl.program_id(0)
        span = pid % SPANS
        member_row = pid // SPANS
        member = member_row % MEMBERS
        block = member_row // MEMBERS
        base = src + tl.load(rows + member_row) * row_stride
        span_tokens: tl.constexpr = TOKENS // SPANS
        num_cells: tl.constexpr = E1 * E2 * E3
        q = tl.arange(0, PIECES_P2)
        acc = tl.zeros([CELLS], dtype=tl.int64)
        for first in range(0, num_cells, CELLS):
            c = first + tl.arange(0, CELLS)
            in_span = c < num_cells
            i3 = c % E3
            i2 = (c // E3) % E2
            i1 = c // (E2 * E3)
            if TOKEN_DIM == 1:
                i1 = i1 + span * span_tokens
            elif TOKEN_DIM == 2:
                i2 = i2 + span * span_tokens
            else:
                i3 = i3 + span * span_tokens
            if PART_DIM == 1:
                part = i1
            elif PART_DIM == 2:
                part = i2
            else:
                part = i3
            if TOKEN_DIM == 1:
                token = i1
            elif TOKEN_DIM == 2:
                token = i2
            else:
                token = i3
            if HEAD_DIM == 1:
                head = i1
            elif HEAD_DIM == 2:
                head = i2
            else:
                head = i3
            offsets = (
                i1.to(tl.int64) * stride1
                + i2.to(tl.int64) * stride2
                + i3.to(tl.int64) * stride3
            )
            mask = in_span[:, None] & (q < PIECES)[None, :]
            x = tl.load(base + offsets[:, None] + q[None, :], mask=mask, other=0)
            x = x ^ ((x >> 33) & 0x7FFFFFFF)
            x = x * c1
            x = x ^ ((x >> 33) & 0x7FFFFFFF)
            x = x * c2
            x = x ^ ((x >> 33) & 0x7FFFFFFF)
            weights = tl.load(
                piece_weights + part[:, None] * PIECES + q[None, :], mask=mask, other=0
            )
            cells = tl.sum(x * weights, axis=1)
            cell_weights = tl.load(
                head_weights + member * HEADS + head, mask=in_span, other=0
            ) * tl.load(positions + block * TOKENS + token, mask=in_span, other=0)
            acc += cells * cell_weights
        tl.store(out + pid, tl.sum(acc, axis=0))

    def triton_row_sums(
        src: torch.Tensor,
        rows: torch.Tensor,
        piece_weights: torch.Tensor,
        head_weights: torch.Tensor,
        positions: torch.Tensor,
        spans: int,
        dims: tuple[int, int, int, int],
    ) -> torch.Tensor:
        """:func:`checksum_kernel.row_sums` by :func:`_span_sums`.

        Raises:
            ValueError: If a row's pieces are not its last, contiguous dim.
        """
        if dims[3] != 4 or src.stride(4) != 1:
            raise ValueError("the Triton form reads pieces as a row's last dim")
        num_blocks, tokens = positions.shape
        members, heads = head_weights.shape
        sizes = list(src.shape[1:4])
        sizes[dims[1] - 1] = tokens // spans
        pieces = src.shape[4]
        pieces_p2 = triton.next_power_of_2(pieces)
        out = torch.empty(
            num_blocks * members * spans, dtype=torch.int64, device=src.device
        )
        _span_sums[(len(out),)](
            src,
            rows,
            piece_weights.reshape(-1).contiguous(),
            head_weights.contiguous(),
            positions.contiguous(),
            out,
            src.stride(0),
            src.stride(1),
            src.stride(2),
            src.stride(3),
            checksum_kernel._C1,
            checksum_kernel._C2,
            E1=sizes[0],
            E2=sizes[1],
            E3=sizes[2],
            PIECES=pieces,
            PIECES_P2=pieces_p2,
            PART_DIM=dims[0],
            TOKEN_DIM=dims[1],
            HEAD_DIM=dims[2],
            MEMBERS=members,
            HEADS=heads,
            TOKENS=tokens,
            SPANS=spans,
            CELLS=max(
                1, min(4096 // pieces_p2, triton.next_power_of_2(int(np.prod(sizes))))
            ),
        )
        return out.view(num_blocks, members, spans).sum(1)

    FORMS["triton"] = lambda: triton_row_sums


def use_form(form: RowSums) -> None:
    """Make ``form`` the kernel every compiled worker on a device runs."""
    checksum_kernel._compiled = form
    checksum_kernel._compile_failed = False


# A compiled worker on the device path (on a CPU, no numpy host pass).
FORM = bc.Variant("form", worker, compile=True, host_pass=False)


def small_ms(device: torch.device, reps: int) -> dict[int, float]:
    """Median ms of a step loading 1 and 16 of the tiny model's requests."""
    per_request = -(-bc.SMALL_PROMPT // bc.SMALL_BLOCK)
    num_blocks = per_request * 16 + 1
    checksums = FORM.worker(bc.small_layers(device, num_blocks))
    ids = np.random.default_rng(0).permutation(np.arange(1, num_blocks)).tolist()
    medians = {}
    for batch in (1, 16):
        step = bc.step_fn(checksums, bc.small_requests(ids, batch), send=False)
        (times,) = bc.interleaved_times([step], device, reps)
        medians[batch] = 1e3 * statistics.median(times)
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--kv-gib", type=float, default=16.0, help="large KV")
    parser.add_argument("--reps", type=int, default=5, help="large-KV runs")
    parser.add_argument("--small-reps", type=int, default=100)
    parser.add_argument(
        "--forms", default=",".join(FORMS), help=f"of: {', '.join(FORMS)}"
    )
    parser.add_argument(
        "--dtypes", default="bfloat16,float32,uint8", help="checked dtypes"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    names = args.forms.split(",")
    if unknown := [name for name in names if name not in FORMS]:
        parser.error(f"unknown forms {unknown} (known: {', '.join(FORMS)})")
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    layers = bc.make_layers(device, int(args.kv_gib * (1 << 30)), 8, KVLayout.SPLIT)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    pieces = [layer.kv.view(torch.int64) for layer in layers]
    flat = torch.compile(lambda x: (checksum_kernel.mix(x) * 3).sum())
    (ceiling_s,) = bc.best_times([lambda: [flat(p) for p in pieces]], device, args.reps)
    gbytes = sum(piece.numel() * 8 for piece in pieces) / 1e9
    print(
        f"{where}: {gbytes:.2f} GB of KV (8 layers, SPLIT, bf16); compiled mix "
        f"and sum in place (a ceiling): {gbytes / ceiling_s:.0f} GB/s"
    )
    print(
        f"{'form':<12} {'values':>7} {'GB/s':>7} {'sum GB/s':>9} {'x now':>6} "
        f"{'step ms':>8} {'1 load ms':>10} {'16 loads ms':>12}"
    )
    reference: bc.WorkerFigures | None = None
    for name in names:
        start = time.perf_counter()
        try:
            use_form(FORMS[name]())
            failures = bc.device_failures(device, [True], dtypes, host_pass=False)
            if failures:
                print(f"{name:<12} {'DIFFER':>7}: " + "; ".join(failures))
                continue
            figures = bc.bench_worker(layers, device, FORM, args.reps)
            if reference is None:
                reference = figures
            elif not np.array_equal(figures.values, reference.values):
                print(f"{name:<12} {'DIFFER':>7}: large KV")
                continue
            small = small_ms(device, args.small_reps)
            print(
                f"{name:<12} {'same':>7} {figures.worker_gbs:>7.0f} "
                f"{figures.sum_gbs:>9.0f} "
                f"{figures.worker_gbs / reference.worker_gbs:>6.2f} "
                f"{figures.step_ms:>8.2f} {small[1]:>10.3f} {small[16]:>12.3f}"
                f"   ({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
        except Exception:
            print(f"{name:<12} FAILED ({time.perf_counter() - start:.0f} s)")
            traceback.print_exc()
    print("goal: >= 1200 GB/s on an H200 (issue 8)")


if __name__ == "__main__":
    main()
