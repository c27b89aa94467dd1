"""Units with no network: policies, ejection windows, SSE scanning, body shaping."""

from __future__ import annotations

import math
import random
from collections import Counter
from fractions import Fraction

import msgspec
import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from proxy_helpers import make_config

from proxy.assemble import Assembler
from proxy.body import (
    BadRequest,
    OutputBudget,
    Route,
    _lax_bool_or_none,
    _lax_int,
    _lax_int_or_none,
    _vllm_bool,
    _vllm_count,
    _vllm_int,
    check_decode_fields,
    decode_body,
    kv_params_of,
    parse_request,
    prefill_body,
    prefix_key,
)
from proxy.config import EjectionConfig
from proxy.ejection import IntegrityTracker, _concentrated, _Recent
from proxy.flow import Flow
from proxy.instances import Instance, Pool
from proxy.metrics import LoopHistogram
from proxy.policy import least_inflight, power_of_two, prefix_hash, round_robin
from proxy.routing import Router
from proxy.served import context_lens
from proxy.sse import EventReader, First, FirstEventScanner, _event_data
from proxy.state import ProxyState


def insts(
    n: int, role: str = "prefill", weights: list[float] | None = None
) -> list[Instance]:
    weights = weights or [1.0] * n
    return [Instance(f"http://h{i}:1", role, "m", weights[i]) for i in range(n)]  # type: ignore[arg-type]


# ------------------------------------------------------------------ policies


def test_round_robin_honours_weights_evenly():
    cands = insts(3, weights=[1, 2, 3])
    picks = Counter(round_robin(cands, b"").url for _ in range(600))
    assert picks == {"http://h0:1": 100, "http://h1:1": 200, "http://h2:1": 300}


def test_least_inflight_picks_the_least_loaded_per_weight():
    a, b = insts(2, weights=[1, 4])
    a.in_flight, b.in_flight = 2, 4  # loads 2.0 and 1.0
    assert least_inflight([a, b], b"") is b


def test_power_of_two_never_picks_the_busier_of_two():
    a, b = insts(2)
    a.in_flight = 10
    picks = Counter(power_of_two([a, b], b"").url for _ in range(400))
    assert picks == {"http://h1:1": 400}  # two distinct choices: always compared


@settings(deadline=None)  # a loaded 2-core machine stalls examples
@given(st.binary(min_size=1, max_size=64))
def test_prefix_hash_is_stable_and_moves_only_the_removed_instances_keys(key):
    cands = insts(4)
    chosen = prefix_hash(cands, key)
    assert prefix_hash(list(reversed(cands)), key) is chosen
    others = [c for c in cands if c is not cands[0]]
    if chosen is not cands[0]:
        assert prefix_hash(others, key) is chosen


def test_prefix_hash_spreads_keys():
    cands = insts(3)
    picks = Counter(prefix_hash(cands, f"prompt {i}".encode()).url for i in range(300))
    assert min(picks.values()) > 60


# ------------------------------------------------------------------ ejection


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def tracker(clock: Clock, **kw) -> IntegrityTracker:
    cfg = EjectionConfig(
        **{"instance_failures": 3, "pair_failures": 2, "window_s": 60, **kw}
    )
    return IntegrityTracker(cfg, clock)


def test_faulty_prefill_beside_a_good_one_is_ejected_and_the_decode_is_not():
    clock = Clock()
    t = tracker(clock, pair_failures=100)
    (bad, good), (d,) = insts(2), insts(1, "decode")
    for _ in range(20):
        t.record_success(good, d)
    assert t.record_failure(bad, d) == []
    assert t.record_failure(bad, d) == []
    (ejection,) = t.record_failure(bad, d)
    assert ejection.instance is bad and ejection.partner is None
    assert bad.ejected and not d.ejected


def test_failures_before_any_vouching_count_once_the_partner_is_vouched():
    clock = Clock()
    t = tracker(clock, pair_failures=100)
    (bad, good), (d,) = insts(2), insts(1, "decode")
    for _ in range(3):
        assert t.record_failure(bad, d) == []  # no evidence yet: d might be at fault
    # Clean loads with another prefill clear d once three failures out of
    # the pair's three loads could hardly have fallen there by chance.
    out = [e for _ in range(20) for e in t.record_success(good, d)]
    assert [e.instance for e in out] == [bad]


def test_faulty_decode_among_two_is_ejected():
    clock = Clock()
    t = tracker(clock, pair_failures=100)
    (p,), (bad, good) = insts(1), insts(2, "decode")
    for _ in range(20):
        t.record_success(p, good)
    out = [e for _ in range(3) for e in t.record_failure(p, bad)]
    assert [e.instance for e in out] == [bad]
    assert not p.ejected


def run_loads(t, pairs, faulty, rate, rounds, rng, panic=False):
    """Round-robin loads over ``pairs``; those touching ``faulty`` fail at ``rate``.

    ``panic``: ejected instances keep serving, as routing does when their
    pool has no other.
    """
    ejected = []
    for _ in range(rounds):
        for p, d in pairs:
            if not panic and (p.ejected or d.ejected):
                continue
            if faulty in (p, d) and rng.random() < rate:
                ejected += t.record_failure(p, d)
            else:
                ejected += t.record_success(p, d)
    return ejected


@pytest.mark.parametrize("rate", [1.0, 0.5, 0.3])
def test_faulty_only_decode_among_prefills_is_ejected_and_the_prefills_are_not(rate):
    clock = Clock()
    t = tracker(clock, pair_failures=1000)
    prefills, (d,) = insts(3), insts(1, "decode")
    out = run_loads(t, [(p, d) for p in prefills], d, rate, 40, random.Random(1))
    assert [e.instance for e in out] == [d]
    assert not any(p.ejected for p in prefills)


@pytest.mark.parametrize("rate", [1.0, 0.5, 0.3])
def test_faulty_only_prefill_among_decodes_is_ejected_and_the_decodes_are_not(rate):
    clock = Clock()
    t = tracker(clock, pair_failures=1000)
    (p,), decodes = insts(1), insts(3, "decode")
    out = run_loads(t, [(p, d) for d in decodes], p, rate, 40, random.Random(2))
    assert [e.instance for e in out] == [p]
    assert not any(d.ejected for d in decodes)


def test_a_lone_faulty_prefill_still_serving_after_its_ejection_blames_no_decode():
    clock = Clock()
    t = tracker(clock, pair_failures=1000, cooldown_s=10_000)
    (p,), decodes = insts(1), insts(2, "decode")
    pairs = [(p, d) for d in decodes]
    out = run_loads(t, pairs, p, 0.5, 500, random.Random(3), panic=True)
    assert [e.instance for e in out] == [p]


def test_a_good_prefills_rare_failure_does_not_turn_blame_on_the_only_decode():
    clock = Clock()
    t = tracker(clock, pair_failures=1000, instance_failures=3)
    (bad, good), (d,) = insts(2), insts(1, "decode")
    for _ in range(50):
        t.record_success(good, d)
    t.record_failure(good, d)  # noise: one bad load among fifty good ones
    out = [e for _ in range(3) for e in t.record_failure(bad, d)]
    assert [e.instance for e in out] == [bad]
    assert not d.ejected and not good.ejected


def test_with_ejection_off_clean_loads_after_failures_eject_nobody():
    clock = Clock()
    t = tracker(clock, enabled=False, pair_failures=100)
    (bad, good), (d,) = insts(2), insts(1, "decode")
    for _ in range(3):
        assert t.record_failure(bad, d) == []
    # With ejection on, these clean loads clear d and eject bad (above).
    assert [e for _ in range(20) for e in t.record_success(good, d)] == []
    assert not bad.ejected


def test_an_instance_ejection_takes_its_failing_pair_with_it_and_no_pair_ejection():
    clock = Clock()
    t = tracker(clock, pair_failures=3)
    (bad, good), (d,) = insts(2), insts(1, "decode")
    for _ in range(20):
        t.record_success(good, d)
    t.record_failure(bad, d)
    t.record_failure(bad, d)
    # The third failure reaches both thresholds: the prefill goes, and the
    # pair needs no cooldown of its own once the prefill is back.
    (ejection,) = t.record_failure(bad, d)
    assert ejection.instance is bad and ejection.partner is None
    assert not t.has_ejected_pairs()


def test_two_failures_with_other_partners_are_evidence_the_fault_follows():
    clock = Clock()
    t = tracker(clock, pair_failures=100)
    (bad,), (d1, d2) = insts(1), insts(2, "decode")
    # No clean load anywhere: only the pattern says where the fault is.
    assert [t.record_failure(bad, d) for d in (d1, d2, d1)] == [[], [], []]
    (ejection,) = t.record_failure(bad, d2)
    assert ejection.instance is bad and ejection.failures == 4


def test_failures_outside_the_window_are_forgotten():
    clock = Clock()
    t = tracker(clock, pair_failures=100)
    (bad, good), (d,) = insts(2), insts(1, "decode")
    for _ in range(60):
        t.record_success(good, d)
    t.record_failure(bad, d)
    t.record_failure(bad, d)
    assert t.blamed(bad) == 2
    clock.now += 61
    assert t.blamed(bad) == 0
    assert t.record_failure(bad, d) == []


def test_pair_is_ejected_after_pair_failures_and_returns_after_cooldown():
    clock = Clock()
    t = tracker(clock, cooldown_s=30)
    (p,), (d,) = insts(1), insts(1, "decode")
    assert t.record_failure(p, d) == []
    (ejection,) = t.record_failure(p, d)
    assert ejection.partner is d and t.pair_ejected(p, d)
    clock.now += 31
    assert not t.pair_ejected(p, d)


def test_loads_finishing_after_their_instance_left_leave_no_record():
    t = tracker(Clock())
    (p1,) = insts(1)
    (d,) = insts(1, "decode")
    t.record_success(p1, d)
    p1.removed = True  # a reload, an admin DELETE or DNS took it out
    t.forget(p1)
    # Requests in flight on p1 finish afterwards: clean ones and corrupt ones.
    t.record_success(p1, d)
    for _ in range(3):
        assert t.record_failure(p1, d) == []
    assert not t.has_ejected_pairs()
    assert t.blamed(d) == 0
    assert p1 not in t._clean and p1 not in t._clean.get(d, {})


@given(
    st.integers(0, 30),
    st.integers(0, 30),
    st.integers(0, 30),
    st.integers(1, 60),
)
def test_the_chance_of_a_pairs_failures_is_the_hypergeometric_tail(f, n, k, total):
    n, k = min(n, total), min(k, total)
    exact = sum(
        Fraction(math.comb(k, x) * math.comb(total - k, n - x), math.comb(total, n))
        for x in range(max(f, 1), min(n, k) + 1)
    )
    chance = _concentrated(f, n, k, total)
    assert chance == 1.0 if f <= 0 else chance == pytest.approx(float(exact), rel=1e-9)


class _JudgingEveryone(IntegrityTracker):
    """The tracker as it was: a clean load re-judges every failed pair's side."""

    def _changed_by_clean(self, prefill: Instance, decode: Instance) -> set[Instance]:
        return {p for _, p, _ in self._failures} | {d for _, _, d in self._failures}


@given(
    gaps=st.lists(st.floats(0, 25, allow_nan=False), max_size=12),
    wait=st.floats(0, 25, allow_nan=False),
)
def test_recent_counts_weigh_the_previous_window_by_what_is_still_inside(
    gaps: list[float], wait: float
) -> None:
    # Clean loads are counted in two window-wide buckets (10 s here): the
    # current one whole, the previous one by the share of it the window
    # ending now still holds; older ones not at all.
    width, now, times = 10.0, 0.0, []
    recent = _Recent()
    for gap in gaps:
        now += gap
        recent.add(now, width)
        times.append(now)
    now += wait
    bucket = now // width
    inside = 1.0 - (now / width - bucket)
    expected = sum(
        1.0 if t // width == bucket else inside if t // width == bucket - 1 else 0.0
        for t in times
    )
    assert recent.count(now, width) == pytest.approx(expected)


def test_clean_loads_elsewhere_complete_the_case_against_a_failed_partner():
    t = tracker(Clock(), pair_failures=100)
    (p,) = insts(1)
    bad, good = insts(2, "decode")
    for _ in range(3):
        assert t.record_failure(p, bad) == []  # a lone pair: nobody to blame yet
    ejected = []
    for _ in range(40):
        ejected += t.record_success(p, good)  # p loads cleanly elsewhere
    assert [e.instance for e in ejected] == [bad]


@settings(deadline=None, max_examples=200)
@given(
    st.lists(
        # Mostly clean loads, as in service: a case builds over many.
        st.tuples(st.integers(0, 2), st.integers(0, 1), st.sampled_from("cccf")),
        min_size=10,
        max_size=60,
    )
)
def test_a_clean_load_rejudges_every_case_it_can_change(loads):
    """Only its pair's instances and their failed partners: the same
    ejections as judging every instance with failures (at one instant)."""
    ejected = []
    for kind in (IntegrityTracker, _JudgingEveryone):
        t = kind(
            EjectionConfig(instance_failures=3, pair_failures=50, window_s=60), Clock()
        )
        ps, ds = insts(3), insts(2, "decode")
        out = []
        for p, d, outcome in loads:
            record = t.record_success if outcome == "c" else t.record_failure
            out.append(sorted(e.instance.url for e in record(ps[p], ds[d])))
        ejected.append(out)
    assert ejected[0] == ejected[1]


def test_an_instance_that_leaves_takes_its_metric_series_with_it():
    state = ProxyState(
        make_config(["http://p:1"], ["http://d1:1", "http://d2:1"], health={})
    )
    (p,) = state.pools_for(None).prefill.instances
    d1, d2 = state.pools_for(None).decode.instances
    m = state.metrics
    for d in (d1, d2):
        m.upstream_failures.labels("decode", d.url, "decode_5xx").inc()
        m.integrity_failures.labels(p.url, d.url).inc()
        m.ejections.labels("decode", d.url, "instance").inc()
    state.remove_instances({d2})  # as DNS reaping and the admin API do
    text = generate_latest(m.registry).decode()
    assert "http://d2:1" not in text
    for name in ("upstream_failures", "kv_integrity_failures", "ejections"):
        assert any(  # the other decode's series stay
            line.startswith(f"kvguard_proxy_{name}_total{{") and "http://d1:1" in line
            for line in text.splitlines()
        )
    # A reload that drops an instance does the same.
    state.apply(make_config(["http://p:1"], ["http://d2:1"], health={}))
    assert "http://d1:1" not in generate_latest(m.registry).decode()


def test_router_avoids_ejected_pairs_and_tried_instances_but_never_runs_dry():
    clock = Clock()
    t = tracker(clock)
    router = Router(t, clock)
    (p,) = insts(1)
    d1, d2 = insts(2, "decode")
    pool = Pool("decode", "round_robin", [d1, d2])
    t.record_failure(p, d1)
    t.record_failure(p, d1)  # pair (p, d1) ejected
    assert {router.pick(pool, partner=p).url for _ in range(4)} == {d2.url}
    assert router.pick(pool, avoid={d2}, partner=p) is d2  # tried beats ejected pair
    d2.healthy = False
    assert router.pick(pool, partner=p) is d1  # panic: only an ejected pair is left
    d1.drained = True
    assert router.pick(pool, partner=p) is None


def test_a_retry_avoids_the_tried_instance_in_every_tier():
    router = Router(tracker(Clock()))
    d1, d2 = insts(2, "decode")
    for d in (d1, d2):  # every decode ejected: the pool keeps serving
        d.ejected_until = 1e12
    pool = Pool("decode", "prefix_hash", [d1, d2])
    first = router.pick(pool, b"key")
    assert router.pick(pool, b"key", avoid={first}) is not first
    assert router.pick(pool, b"key", avoid={d1, d2}) is first  # all tried


def test_ejected_instance_returns_after_cooldown_without_probes():
    clock = Clock()
    router = Router(tracker(clock), clock)
    a, b = insts(2)
    a.ejected_until = clock.now + 10
    pool = Pool("prefill", "round_robin", [a, b])
    assert {router.pick(pool, probing=False).url for _ in range(4)} == {b.url}
    clock.now += 11
    assert {router.pick(pool, probing=False).url for _ in range(4)} == {a.url, b.url}


# ----------------------------------------------------------------------- SSE


def test_scanner_holds_comments_and_waits_for_a_whole_event():
    s = FirstEventScanner()
    assert s.feed(b": ping\n\n") is None
    assert s.feed(b'data: {"choices": [{"te') is None
    verdict = s.feed(b'xt": "a"}]}\n\n')
    assert verdict is not None and verdict.kind is First.DATA
    assert s.held.startswith(b": ping")


def test_scanner_spots_error_events_and_empty_streams():
    err = FirstEventScanner().feed(
        b'data: {"error": {"message": "KV checksum mismatch"}}\r\n\r\n'
    )
    assert err is not None and err.kind is First.ERROR and "mismatch" in err.message
    empty = FirstEventScanner().feed(b"data: [DONE]\n\n")
    assert empty is not None and empty.kind is First.EMPTY
    assert FirstEventScanner().at_eof().kind is First.EMPTY


@pytest.mark.parametrize(
    ("last", "kind"),
    [
        (b'data: {"choices": [{"text": "a"}]}', First.DATA),
        (b'data: {"error": {"message": "KV checksum mismatch"}}', First.ERROR),
        (b"data: [DONE]", First.EMPTY),
    ],
)
def test_an_event_the_stream_ends_without_its_blank_line_is_still_read(last, kind):
    s = FirstEventScanner()
    assert s.feed(last) is None
    assert s.at_eof().kind is kind


def test_a_finish_reason_named_error_is_data_not_an_error_event():
    verdict = FirstEventScanner().feed(
        b'data: {"choices": [{"finish_reason": "error"}]}\n\n'
    )
    assert verdict is not None and verdict.kind is First.DATA


ROLE_CHUNK = (
    b'data: {"object": "chat.completion.chunk", "choices": [{"index": 0, '
    b'"delta": {"role": "assistant", "content": ""}, "finish_reason": null}]}\n\n'
)


def test_a_chat_streams_role_chunk_is_held_until_its_first_output():
    s = FirstEventScanner()
    assert s.feed(ROLE_CHUNK) is None
    verdict = s.feed(
        b'data: {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}\n\n'
    )
    assert verdict is not None and verdict.kind is First.DATA
    assert s.held.startswith(ROLE_CHUNK)


def test_an_error_after_a_chat_streams_role_chunk_is_an_error_before_output():
    verdict = FirstEventScanner().feed(
        ROLE_CHUNK + b'data: {"error": {"message": "KV checksum mismatch"}}\n\n'
    )
    assert verdict is not None and verdict.kind is First.ERROR
    scanner = FirstEventScanner()
    assert scanner.feed(ROLE_CHUNK) is None
    assert scanner.at_eof().kind is First.EMPTY


@pytest.mark.parametrize(
    "event",
    [
        b'{"choices": [{"index": 0, "text": "", "finish_reason": "abort"}]}',
        b'{"choices": [{"index": 0, "delta": {}, "finish_reason": "abort"}]}',
    ],
)
def test_an_abort_before_any_output_is_aborted_not_data(event):
    verdict = FirstEventScanner().feed(ROLE_CHUNK + b"data: " + event + b"\n\n")
    assert verdict is not None and verdict.kind is First.ABORTED


@pytest.mark.parametrize(
    "event",
    [
        # An empty completion (EOS first) is an answer.
        b'{"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}',
        b'{"choices": [{"index": 0, "delta": {"role": "assistant", "content": "a"}}]}',
        b'{"choices": [{"index": 0, "delta": {"role": "assistant", '
        b'"tool_calls": [{"id": "t"}]}}]}',
        b'{"choices": [{"index": 0, "text": "a", "finish_reason": "abort"}]}',
        b'{"choices": [{"index": 0, "text": ""}]}',
        # Read whole (a token is "role"), still an empty completion chunk.
        b'{"choices": [{"index": 0, "text": "", "logprobs": {"tokens": ["role"]}}]}',
        b'{"role": [1], "choices": "x"}',
        b'{"role": "assistant", "choices": []}',
    ],
)
def test_any_output_or_unknown_shape_is_data(event):
    verdict = FirstEventScanner().feed(b"data: " + event + b"\n\n")
    assert verdict is not None and verdict.kind is First.DATA


@settings(deadline=None)
@given(st.binary(max_size=200), st.integers(min_value=1, max_value=50))
def test_scanner_verdict_does_not_depend_on_chunking(payload, size):
    stream = b"data: " + msgspec.json.encode(payload.hex()) + b"\n\ndata: [DONE]\n\n"
    whole = FirstEventScanner().feed(stream)
    s = FirstEventScanner()
    verdict = None
    for i in range(0, len(stream), size):
        verdict = verdict or s.feed(stream[i : i + size])
    assert whole is not None and verdict is not None and verdict.kind is whole.kind


# ---------------------------------------------------------------------- body


@pytest.mark.parametrize(
    ("raw", "route", "why"),
    [
        (b"{", Route.COMPLETIONS, "not valid JSON"),
        (b"[1]", Route.COMPLETIONS, "JSON object"),
        (b'{"prompt": 5}', Route.COMPLETIONS, "'prompt'"),
        (b'{"messages": []}', Route.CHAT, "'messages'"),
        (b'{"prompt": "x", "stream": "maybe"}', Route.COMPLETIONS, "'stream'"),
        (b'{"prompt": "x", "model": 3}', Route.COMPLETIONS, "'model'"),
        (
            b'{"prompt": "x", "structured_outputs": []}',
            Route.COMPLETIONS,
            "'structured_outputs'",
        ),
        (
            b'{"messages": [{"role": "user", "content": "x"}], '
            b'"structured_outputs": "json"}',
            Route.CHAT,
            "'structured_outputs'",
        ),
    ],
)
def test_bodies_the_flow_cannot_use_are_bad_requests(raw, route, why):
    with pytest.raises(BadRequest, match=why):
        parse_request(raw, route)


@pytest.mark.parametrize("value", [None, {"regex": "a"}, {}])
def test_structured_outputs_that_are_an_object_or_null_are_left_to_vllm(value):
    raw = msgspec.json.encode({"prompt": "x", "structured_outputs": value})
    assert parse_request(raw, Route.COMPLETIONS).obj["structured_outputs"] == value


_JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.sampled_from(["true", "yes", "off", "0", "1", "2", " 3 ", "1.0", "x", ""]),
    st.text(max_size=5),
    st.lists(st.integers(), max_size=2),
)


def _outcome(read, value):
    """What ``read`` makes of ``value``: its result with its type, or the
    refusal."""
    try:
        result = read(value)
    except pydantic.ValidationError:
        return "refused"
    return type(result), result


@given(_JSON_SCALARS)
def test_the_flows_field_reads_equal_pydantics_lax_reads_for_any_json_value(value):
    for fast, lax in (
        (_vllm_bool, _lax_bool_or_none),
        (_vllm_int, _lax_int_or_none),
        (_vllm_count, _lax_int),
    ):
        assert _outcome(fast, value) == _outcome(lax, value), (fast, value)


def test_decode_body_splices_params_byte_for_byte():
    raw = b'{"prompt": "x",  "n": 1.50} \n'
    req = parse_request(raw, Route.COMPLETIONS)
    assert decode_body(req.raw, None) is raw
    kv = b'{"remote_block_ids": [[1]], "kv_checksums": "Zm9v", "new": null}'
    out = decode_body(req.raw, kv)
    assert out == b'{"prompt": "x",  "n": 1.50,"kv_transfer_params":' + kv + b"}"
    assert msgspec.json.decode(out)["kv_transfer_params"]["kv_checksums"] == "Zm9v"


def test_prefill_reply_params_are_kept_raw_and_must_be_an_object():
    reply = b'{"id": "x", "kv_transfer_params": {"b": 1,  "a": [2]}}'
    assert kv_params_of(reply) == b'{"b": 1,  "a": [2]}'
    assert kv_params_of(b'{"kv_transfer_params": null}') is None
    assert kv_params_of(b'{"id": 1}') is None
    for bad in (b"[1]", b"{", b'{"kv_transfer_params": true}'):
        with pytest.raises(ValueError):
            kv_params_of(bad)


def test_prefill_body_caps_tokens_only_where_the_client_had_them():
    req = parse_request(
        b'{"prompt": "x", "max_tokens": 50, "min_tokens": 5}', Route.COMPLETIONS
    )
    body = msgspec.json.decode(prefill_body(req))
    assert body["max_tokens"] == 1 and "max_completion_tokens" not in body
    assert "min_tokens" not in body
    assert req.obj["min_tokens"] == 5  # the decode still gets it


CHAT_MESSAGES = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("route", "fields", "param", "message"),
    [
        (
            Route.COMPLETIONS,
            {"stream_options": {"include_usage": False}},
            "stream_options",
            None,
        ),
        (
            Route.CHAT,
            {"stream_options": {"include_usage": True}, "stream": False},
            "stream_options",
            "only be defined when `stream=True`",
        ),
        (
            Route.COMPLETIONS,
            {"stream": True, "stream_options": {"include_usage": "often"}},
            "stream_options",
            "object of booleans",
        ),
        (Route.COMPLETIONS, {"max_tokens": "many"}, "max_tokens", "an integer"),
        (Route.COMPLETIONS, {"max_tokens": 1.5}, "max_tokens", "an integer"),
        (Route.COMPLETIONS, {"max_tokens": 0}, "max_tokens", "at least 1, got 0"),
        (Route.COMPLETIONS, {"max_tokens": -3}, "max_tokens", "at least 1, got -3"),
        (Route.CHAT, {"max_completion_tokens": 0}, "max_tokens", "got 0"),
        # vLLM reads max_tokens on chat even when max_completion_tokens wins.
        (
            Route.CHAT,
            {"max_completion_tokens": 5, "max_tokens": "x"},
            "max_tokens",
            "an integer",
        ),
        (Route.COMPLETIONS, {"min_tokens": None}, "min_tokens", "an integer"),
        (Route.COMPLETIONS, {"min_tokens": -1}, "min_tokens", "got -1"),
        (
            Route.COMPLETIONS,
            {"max_tokens": 4, "min_tokens": 5},
            "min_tokens",
            "less than or equal to max_tokens=4, got 5",
        ),
        # Completions default to 16 tokens, absent or null.
        (
            Route.COMPLETIONS,
            {"max_tokens": None, "min_tokens": 17},
            "min_tokens",
            "=16",
        ),
        (
            Route.COMPLETIONS,
            {"echo": True, "max_tokens": 0, "min_tokens": 2},
            "min_tokens",
            "max_tokens=1, got 2",
        ),
    ],
)
def test_fields_only_the_decode_reads_are_refused_as_vllm_refuses_them(
    route, fields, param, message
):
    base = {"prompt": "x"} if route is Route.COMPLETIONS else CHAT_MESSAGES
    req = parse_request(msgspec.json.encode({**base, **fields}), route)
    with pytest.raises(BadRequest) as caught:
        check_decode_fields(req, route)
    assert caught.value.param == param
    assert message is None or message in caught.value.message


@pytest.mark.parametrize(
    ("route", "fields", "budget"),
    [
        (Route.COMPLETIONS, {}, OutputBudget("max_tokens", 16)),
        (Route.COMPLETIONS, {"max_tokens": "7"}, OutputBudget("max_tokens", 7)),
        (Route.COMPLETIONS, {"max_tokens": 2.0}, OutputBudget("max_tokens", 2)),
        # Echo without generation: vLLM echoes the prompt, samples one token.
        (
            Route.COMPLETIONS,
            {"echo": True, "max_tokens": 0},
            OutputBudget("max_tokens", 0),
        ),
        (Route.CHAT, {}, OutputBudget("max_tokens", None)),
        (Route.CHAT, {"max_tokens": 9}, OutputBudget("max_tokens", 9)),
        (
            Route.CHAT,
            {"max_tokens": 9, "max_completion_tokens": 3},
            OutputBudget("max_completion_tokens", 3),
        ),
        (
            Route.COMPLETIONS,
            {"stream": True, "stream_options": {"include_usage": 1, "x": 2}},
            OutputBudget("max_tokens", 16),
        ),
        # vLLM compares raw values: a truthy stream string lets options by.
        (
            Route.COMPLETIONS,
            {"stream": "false", "stream_options": {"include_usage": True}},
            OutputBudget("max_tokens", 16),
        ),
        # An empty object is falsy: vLLM's raw check lets it by.
        (Route.COMPLETIONS, {"stream_options": {}}, OutputBudget("max_tokens", 16)),
        (
            Route.COMPLETIONS,
            {"stream_options": None, "min_tokens": "3"},
            OutputBudget("max_tokens", 16),
        ),
        (
            Route.COMPLETIONS,
            {"echo": True, "max_tokens": 0, "min_tokens": 1},
            OutputBudget("max_tokens", 0),
        ),
    ],
)
def test_fields_vllm_accepts_pass_and_give_the_output_budget(route, fields, budget):
    base = {"prompt": "x"} if route is Route.COMPLETIONS else CHAT_MESSAGES
    req = parse_request(msgspec.json.encode({**base, **fields}), route)
    assert check_decode_fields(req, route) == budget


def test_context_lens_are_read_from_vllms_model_cards_loras_from_their_parent():
    # vLLM 0.32's /v1/models: base models with max_model_len, LoRA adapters
    # without it but with their parent (OpenAIServingModels).
    entries = [
        {"id": "llama", "max_model_len": 4096, "parent": None},
        {"id": "llama-alias", "max_model_len": 4096},
        {"id": "sql-lora", "max_model_len": None, "parent": "llama"},
        {"id": "orphan-lora", "parent": "gone"},
        {"id": "odd", "max_model_len": True},
        {"id": "negative", "max_model_len": -1},
        {"id": "text", "max_model_len": "4096"},
    ]
    assert context_lens(entries) == {
        "llama": 4096,
        "llama-alias": 4096,
        "sql-lora": 4096,
    }
    assert context_lens([]) == {}


def test_an_instances_context_length_is_its_models_or_its_only_one():
    (inst,) = insts(1)
    inst.context_lens = {"a": 100, "b": 200}
    assert (inst.max_model_len("a"), inst.max_model_len("b")) == (100, 200)
    assert inst.max_model_len("c") is None
    assert inst.max_model_len(None) is None  # "*": which of the two is unknown
    inst.context_lens = {"a": 100, "a-alias": 100}
    assert inst.max_model_len(None) == 100


def test_the_admin_view_gives_an_ejections_time_left():
    (inst,) = insts(1)
    inst.ejected_until = 1012.5
    assert inst.describe(1000.0)["ejected_for_s"] == 12.5
    assert inst.describe(1013.0)["ejected_for_s"] == 0.0


def test_prefix_key_reads_the_prompt_or_messages():
    req = parse_request(b'{"prompt": "abcdef"}', Route.COMPLETIONS)
    assert prefix_key(req, Route.COMPLETIONS, 3) == b"abc"
    chat = parse_request(
        b'{"messages": [{"role": "user", "content": "hi"}]}', Route.CHAT
    )
    assert prefix_key(chat, Route.CHAT, 100).startswith(b'[{"role":"user"')


def test_a_completion_may_give_prompt_embeds_instead_of_a_prompt():
    # As vLLM takes it: one of the two, non-empty.
    req = parse_request(b'{"prompt_embeds": "QUJDREVG"}', Route.COMPLETIONS)
    assert prefix_key(req, Route.COMPLETIONS, 4) == b"QUJD"
    for raw in (b'{"prompt_embeds": []}', b'{"prompt": "", "prompt_embeds": null}'):
        with pytest.raises(BadRequest, match="'prompt_embeds'"):
            parse_request(raw, Route.COMPLETIONS)


def test_router_steers_prefills_away_from_a_pair_ejected_with_the_only_decode():
    clock = Clock()
    t = tracker(clock, pair_failures=2)
    router = Router(t, clock)
    bad, good = insts(2)
    (d,) = insts(1, "decode")
    prefills = Pool("prefill", "round_robin", [bad, good])
    decodes = Pool("decode", "round_robin", [d])
    t.record_failure(bad, d)
    t.record_failure(bad, d)
    picks = {router.pick(prefills, partners=decodes).url for _ in range(4)}
    assert picks == {good.url}


# ------------------------------------------------------------------ assembly


def test_assembler_joins_completion_chunks_per_choice_with_usage():
    a = Assembler()
    for chunk in (
        {"id": "c", "object": "text_completion", "created": 1, "model": "m",
         "choices": [{"index": 1, "text": "B", "logprobs": {"tokens": ["B"]},
                      "finish_reason": None, "token_ids": [2]}], "usage": None},
        {"id": "c", "object": "text_completion", "created": 1, "model": "m",
         "choices": [{"index": 0, "text": "a", "finish_reason": None,
                      "prompt_token_ids": [7, 8], "token_ids": [1]}]},
        {"id": "c", "object": "text_completion", "created": 1, "model": "m",
         "choices": [{"index": 1, "text": "b", "logprobs": {"tokens": ["b"]},
                      "finish_reason": "length", "stop_reason": None,
                      "token_ids": [3]},
                     {"index": 0, "text": "z", "finish_reason": "stop",
                      "stop_reason": "zz", "token_ids": [4]}]},
        {"id": "c", "object": "text_completion", "created": 1, "model": "m",
         "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 4}},
    ):  # fmt: skip
        a.feed(chunk)
    reply = a.result()
    assert reply["object"] == "text_completion"
    assert list(reply)[-1] == "usage"
    assert reply["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 4,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    first, second = reply["choices"]
    assert first == {
        "index": 0,
        "text": "az",
        "finish_reason": "stop",
        "prompt_token_ids": [7, 8],
        "token_ids": [1, 4],
        "stop_reason": "zz",
        "prompt_logprobs": None,
        "routed_experts": None,
    }
    assert second["text"] == "Bb" and second["logprobs"] == {"tokens": ["B", "b"]}
    assert second["finish_reason"] == "length" and second["token_ids"] == [2, 3]


def test_assembler_keeps_prompt_token_ids_only_where_the_client_asked():
    # vLLM's completions stream sends them for an echo too, its JSON does not.
    choice = {"index": 0, "text": "a", "prompt_token_ids": [7, 8]}
    chunk = {"object": "text_completion", "choices": [choice]}
    for asked, want in ((True, [7, 8]), (False, None)):
        a = Assembler(prompt_token_ids=asked)
        a.feed(chunk)
        assert a.result()["choices"][0]["prompt_token_ids"] == want


def test_assembled_replies_carry_the_null_fields_only_vllms_json_has():
    # vLLM 0.32's stream leaves them out; its JSON reply has them, as null.
    for chunk, want in (
        (
            {"object": "text_completion", "choices": [{"index": 0, "text": "a"}]},
            {"top": {"service_tier", "kv_transfer_params", "ec_transfer_params",
                     "metrics"},
             "choice": {"prompt_logprobs", "routed_experts"}, "message": set()},
        ),
        (
            {"object": "chat.completion.chunk",
             "choices": [{"index": 0, "delta": {"content": "a"}}]},
            {"top": {"service_tier", "prompt_logprobs", "kv_transfer_params",
                     "ec_transfer_params", "metrics"},
             "choice": {"routed_experts"},
             "message": {"refusal", "annotations", "audio", "function_call",
                         "reasoning"}},
        ),
    ):  # fmt: skip
        a = Assembler()
        a.feed(chunk)
        a.feed({**chunk, "choices": [], "usage": {"prompt_tokens": 1}})
        reply = a.result()
        (choice,) = reply["choices"]
        added = {
            "top": {k for k, v in reply.items() if v is None},
            "choice": {k for k, v in choice.items() if v is None},
            "message": {k for k, v in choice.get("message", {}).items() if v is None},
        }
        assert added == want
        assert reply["usage"] == {
            "prompt_tokens": 1,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        }
        assert list(reply)[-1] == "usage"
    # A value the stream sent is kept.
    a = Assembler()
    a.feed({"object": "text_completion", "service_tier": "default", "choices": []})
    assert a.result()["service_tier"] == "default"


def test_assembler_builds_a_chat_message_with_tool_calls():
    a = Assembler()
    deltas = [
        {"role": "assistant", "content": ""},
        {"reasoning": "think"},
        {"reasoning": "ing", "content": "Hi"},
        {"tool_calls": [{"index": 0, "id": "t0", "type": "function",
                         "function": {"name": "f", "arguments": '{"a"'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}},
                        {"index": 1, "id": "t1", "function": {"name": "g",
                                                             "arguments": "{}"}}]},
        # A whole value given again is kept, not joined; a call without an
        # index continues none.
        {"tool_calls": [{"index": 0, "type": "function"},
                        {"id": "t2", "function": {"name": "h"}}]},
    ]  # fmt: skip
    for i, delta in enumerate(deltas):
        a.feed(
            {
                "id": "x",
                "object": "chat.completion.chunk",
                "choices": [
                    {
                        "index": 0,
                        "delta": delta,
                        "logprobs": {"content": [{"token": str(i)}]},
                        "finish_reason": "tool_calls" if i == 5 else None,
                    }
                ],
            }
        )
    (choice,) = a.result()["choices"]
    assert a.result()["object"] == "chat.completion"
    assert choice["message"] == {
        "role": "assistant",
        "content": "Hi",
        "reasoning": "thinking",
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "tool_calls": [
            {
                "index": 0,
                "id": "t0",
                "type": "function",
                "function": {"name": "f", "arguments": '{"a": 1}'},
            },
            {"index": 1, "id": "t1", "function": {"name": "g", "arguments": "{}"}},
            {"id": "t2", "function": {"name": "h"}},
        ],
    }
    assert [t["token"] for t in choice["logprobs"]["content"]] == list("012345")
    assert choice["finish_reason"] == "tool_calls"


@settings(deadline=None)
@given(st.integers(min_value=1, max_value=40))
def test_event_reader_splits_events_however_the_bytes_are_cut(size):
    stream = (
        b': keep-alive\r\n\r\ndata: {"a": 1}\r\n\r\n'
        b"data: line1\r\ndata: line2\r\n\r\ndata: [DONE]\n\n"
    )
    reader = EventReader()
    events = []
    for i in range(0, len(stream), size):
        events += reader.feed(stream[i : i + size])
    assert events == [b'{"a": 1}', b"line1\nline2", b"[DONE]"]


def _split_whole(stream: bytes) -> list[bytes]:
    """The events' payloads, splitting the whole stream at once: SSE's line
    endings are \\n, \\r\\n or \\r, and a blank line ends an event."""
    text = stream.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    return [d for e in text.split(b"\n\n")[:-1] if (d := _event_data(e)) is not None]


_LINE = st.tuples(
    st.sampled_from([b"data: ", b"data:", b": ", b"event: x", b""]),
    st.binary(max_size=12).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")),
    st.sampled_from([b"\n", b"\r\n", b"\r"]),
).map(b"".join)


@settings(deadline=None)
@given(
    lines=st.lists(_LINE, max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=10),
)
def test_event_reader_gives_each_event_once_wherever_the_reads_cut_it(lines, cuts):
    stream = b"".join(lines) + b"\n\n"
    reader = EventReader()
    events: list[bytes] = []
    start = 0
    for cut in [*sorted(cuts), len(stream)]:
        events += reader.feed(stream[start:cut])
        start = max(start, cut)
    assert events == _split_whole(stream)


# ------------------------------------------------------------------- metrics


def test_a_single_instance_pool_is_picked_while_usable_ejected_or_not():
    clock = Clock()
    router = Router(tracker(clock), clock)
    (only,) = insts(1)
    pool = Pool("prefill", "round_robin", [only])
    assert router.pick(pool, avoid={only}) is only
    only.ejected_until = clock.now + 10
    assert router.pick(pool) is only  # checksums still guard each load
    clock.now += 11
    assert router.pick(pool, probing=False) is only and not only.ejected
    only.healthy = False
    assert router.pick(pool) is None


_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.1, 1, 5)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.sampled_from(_GAP_BUCKETS),  # on a bound: in that bucket
            st.floats(min_value=0, max_value=20, allow_nan=False),
        ),
        max_size=50,
    )
)
def test_loop_histogram_exposes_what_prometheus_histogram_does(values):
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    loop = LoopHistogram("gap_seconds", "Gaps", _GAP_BUCKETS, ours)
    reference = Histogram("gap_seconds", "Gaps", buckets=_GAP_BUCKETS, registry=theirs)
    for value in values:
        loop.observe(value)
        reference.observe(value)
    expected = [
        line
        for line in generate_latest(theirs).decode().splitlines()
        if "_created" not in line  # a series of its own; nothing reads it
    ]
    assert generate_latest(ours).decode().splitlines() == expected


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["completions", "chat", 'a "quoted"\\label']),
            st.one_of(
                st.sampled_from(_GAP_BUCKETS),
                st.floats(min_value=0, max_value=20, allow_nan=False),
            ),
        ),
        max_size=50,
    )
)
def test_a_labelled_loop_histogram_exposes_what_prometheus_histogram_does(
    observations,
):
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    loop = LoopHistogram("ttft_seconds", "TTFT", _GAP_BUCKETS, ours, ["route"])
    reference = Histogram(
        "ttft_seconds", "TTFT", ["route"], buckets=_GAP_BUCKETS, registry=theirs
    )
    for route, value in observations:
        loop.labels(route).observe(value)
        reference.labels(route).observe(value)
    expected = [
        line
        for line in generate_latest(theirs).decode().splitlines()
        if "_created" not in line
    ]
    assert generate_latest(ours).decode().splitlines() == expected


def test_a_loop_histogram_refuses_the_wrong_labels():
    registry = CollectorRegistry()
    labelled = LoopHistogram("a_seconds", "A", _GAP_BUCKETS, registry, ["route"])
    with pytest.raises(ValueError, match="takes labels"):
        labelled.observe(1.0)
    with pytest.raises(ValueError, match="takes labels"):
        labelled.labels("chat", "extra")
    plain = LoopHistogram("b_seconds", "B", _GAP_BUCKETS, registry)
    with pytest.raises(ValueError, match="takes labels"):
        plain.labels("chat")


@pytest.mark.parametrize(
    ("attempt", "low", "high"),
    [
        (1, 0.005, 0.01),
        (2, 0.01, 0.02),
        (3, 0.02, 0.04),
        (6, 0.125, 0.25),
        (9, 0.125, 0.25),
    ],
)
def test_the_backoff_before_a_retry_doubles_with_jitter_up_to_its_ceiling(
    attempt, low, high
):
    cfg = make_config(
        ["http://p:8000"],
        ["http://d:8000"],
        retry={"backoff_base_s": 0.01, "backoff_max_s": 0.25},
    )
    waits = [Flow._backoff(attempt, cfg) for _ in range(200)]
    assert low <= min(waits) and max(waits) <= high
    assert max(waits) - min(waits) > (high - low) / 2  # jittered over the range
