"""benchmarks/bench_vllm_pd.py still starts (it imports the real-vLLM test
helpers, ``vllm_servers`` and ``vllm_client``, and parses its options), and
its in-process scheduler measurements run."""

from __future__ import annotations

import gc
import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.support import REPO
from tests.support.scripts import run_script, script_help

pytestmark = pytest.mark.vllm


def test_bench_vllm_pd_starts() -> None:
    usage = script_help("benchmarks/bench_vllm_pd.py")
    assert "--scheduler-cost" in usage
    assert "--pollers" in usage
    assert "--combine" in usage


def test_scheduler_breakdown_times_each_call_of_both_roles() -> None:
    out = run_script("benchmarks/bench_vllm_pd.py", "--scheduler-breakdown")
    for role in ("producer", "consumer"):
        for per_step in (1, 16):
            line = rf"^{role}, 64 blocks, {per_step} per step: [\d.]+ us per request"
            assert re.search(line, out, re.M), (role, per_step)
    for call in (
        "KVGuardSchedulerSide._flush",
        "KVChecksumComparer.payload",
        "KVGuardSchedulerSide._on_alloc",
        "KVChecksumComparer.compare",
    ):
        assert re.search(rf"^  {re.escape(call)} +[\d.]+ us/request", out, re.M), call


def test_scheduler_cost_is_measured_with_requests_sharing_steps(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bench = _load_bench()
    # Whether the cyclic collector ran, per batch of KVGuard's requests.
    collecting: list[bool] = []
    run_requests = bench._run_requests

    def run_noting_the_collector(*args: Any) -> float:
        if len(args) < 7:  # KVGuard's, not plain NIXL's
            collecting.append(gc.isenabled())
        return run_requests(*args)

    monkeypatch.setattr(bench, "_run_requests", run_noting_the_collector)
    # 8-block prompts in chunks of 4 blocks: two steps each.
    bench.scheduler_cost([4, 8], [1, 3], requests=6, batches=2, chunk_tokens=64)
    assert gc.isenabled()
    # Each batch with collections, then without: 2 per-step levels x 3
    # flows x 2 block counts x 2 batches.
    assert collecting == [True, False] * 24
    out = capsys.readouterr().out
    for role in ("producer", "consumer", "producer, chunked"):
        for per_step in (1, 3):
            for blocks in (4, 8):
                line = (
                    rf"^{role} +{blocks} blocks, +{per_step} per step: +[\d.]+ "
                    r"us/request without collections \(best of 2 batches; median "
                    r"[\d.]+\), median [\d.]+ with; "
                    r"vLLM's step calls [\d.]+ us/request, [\d.]+ with plain NIXL "
                    r"\(x[\d.]+ without collections, x[\d.]+ with\)$"
                )
                assert re.search(line, out, re.M), (role, per_step, blocks)
            fit = rf"^{role}, {per_step} per step: [\d.-]+ us \+ [\d.-]+ ns per block"
            assert re.search(fit, out, re.M), (role, per_step)
    assert re.search(r"^idle step: KVGuardConnector's calls", out, re.M)


def test_scheduler_cost_refuses_a_run_whose_requests_were_not_all_checksummed() -> None:
    bench = _load_bench()

    def flow_counting(role: str, counts: dict[str, Any]) -> Any:
        return bench.SchedulerFlow(
            role, role, lambda scheduler, req_ids, num_tokens, kvguard: counts
        )

    done = flow_counting("consumer", {"verified": 3, "scheduler_seconds": 0.25})
    assert bench._run_requests(None, done, 8, 3, 2, "r") == 0.5
    # Plain NIXL's scheduler checksums nothing: its runs are not checked.
    plain = flow_counting("consumer", {})
    assert bench._run_requests(None, plain, 8, 3, 1, "p", False) == 0.0
    with pytest.raises(RuntimeError, match="verified 2 of 3"):
        bench._run_requests(
            None, flow_counting("consumer", {"verified": 2}), 8, 3, 1, "r"
        )
    with pytest.raises(RuntimeError, match="sent 0 of 1"):
        bench._run_requests(
            None, flow_counting("producer", {"verified": 1}), 8, 1, 1, "r"
        )


def test_combine_pools_the_rounds_of_several_runs(tmp_path: Path) -> None:
    bench = _load_bench()

    def run(ratio: float, rounds: int, steps: int) -> Path:
        """A run whose on+scheduler takes ``ratio`` times off's time."""
        samples = {
            phase: [
                [
                    {
                        k: (i + 1) * 0.01 * (ratio if phase != "off" else 1.0)
                        for k in bench.KEYS
                    }
                    for i in range(4)
                ]
                for _ in range(rounds)
            ]
            for phase in ("off", "on+scheduler")
        }
        own = {
            "off": [{}],
            "on+scheduler": [{"producer_checksum_ms": ratio, "other": 9.0}],
        }
        load_steps = {"off": [1] * steps, "on+scheduler": [1] * steps}
        path = tmp_path / f"run-{ratio}.json"
        path.write_text(
            json.dumps(bench.summarize(list(samples), samples, own, load_steps))
        )
        return path

    paths = [run(1.0, 2, 3), run(1.5, 1, 2), run(2.0, 2, 1)]
    summary, phases = bench.combine(paths)
    assert phases == ["off", "on+scheduler"]
    entry = summary["on+scheduler"]
    assert len(entry["samples_ms"]) == 5
    # Round ratios 1.0, 1.0, 1.5, 2.0, 2.0; per prompt the same, four each.
    assert entry["prefill_s_median_ratio"] == pytest.approx(1.5)
    assert entry["prefill_s_median_ratio_spread"] == pytest.approx([1.0, 2.0])
    assert entry["decode_ttft_s_paired_ratio"] == pytest.approx(1.5)
    assert entry["steps_load_to_first_token"] == {1: 6}
    assert entry["producer_checksum_ms"] == pytest.approx(1.5)
    assert "other" not in entry

    only_off = tmp_path / "only-off.json"
    summary = json.loads(paths[0].read_text())
    del summary["on+scheduler"]
    only_off.write_text(json.dumps(summary))
    with pytest.raises(ValueError, match="share no phase but off"):
        bench.combine([paths[0], only_off])
    # Runs with other phases besides: those all of them measured.
    summary = json.loads(paths[1].read_text())
    summary["on+scheduler+unchecked"] = summary["on+scheduler"]
    with_more = tmp_path / "with-more.json"
    with_more.write_text(json.dumps(summary))
    _, phases = bench.combine([with_more, paths[0]])
    assert phases == ["off", "on+scheduler"]
    _, phases = bench.combine([with_more, with_more])
    assert phases == ["off", "on+scheduler", "on+scheduler+unchecked"]


def test_the_share_of_decodes_in_the_slow_mode_is_reported() -> None:
    bench = _load_bench()
    fast = [0.025, 0.026, 0.027, 0.028, 0.029, 0.030]
    ttfts = {"off": [*fast, 0.2, 0.9], "on+scheduler": [*fast, 0.031, 0.045]}
    samples = {
        phase: [[{**dict.fromkeys(bench.KEYS, 0.02), "decode_ttft_s": t} for t in ts]]
        for phase, ts in ttfts.items()
    }
    summary = bench.summarize(
        list(samples),
        samples,
        {"off": [{}], "on+scheduler": [{}]},
        {"off": [1], "on+scheduler": [1]},
    )
    # Slow: over twice the phase's p25 TTFT (about 26 ms in both).
    assert summary["off"]["decode_slow_share"] == pytest.approx(2 / 8)
    assert summary["on+scheduler"]["decode_slow_share"] == 0.0


def test_every_round_sends_each_prompt_at_the_warm_up_rounds_token_count() -> None:
    # An engine's first prefill of a prompt length is slow: a measured round
    # must send only lengths the warm-up round sent, even past round 9.
    from transformers import AutoTokenizer

    bench = _load_bench()
    tokenizer = AutoTokenizer.from_pretrained(bench.ensure_model())
    for prompt in bench.prompts(3, seed=7, words=(170, 180)):
        counts = {
            len(tokenizer(bench.labelled(prompt, r))["input_ids"])
            for r in (0, 1, 9, 10, 11, 99, 100, 101)
        }
        assert len(counts) == 1, counts
    first, second = (bench.labelled("same prompt", r) for r in (0, 1))
    assert first != second  # new to the prefix cache


def _load_bench() -> ModuleType:
    """benchmarks/bench_vllm_pd.py as a module (benchmarks/ is no package)."""
    spec = importlib.util.spec_from_file_location(
        "bench_vllm_pd", REPO / "benchmarks/bench_vllm_pd.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
