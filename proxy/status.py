"""GET /status: one server-rendered HTML page for a person at a browser.

Instances with health, ejection and in-flight requests; per model the
prefill × decode matrix of KV integrity failures with failing pairs and
ejected instances highlighted; retries by reason; the last integrity failures
with their request ids. No scripts and no external assets: the page reloads
itself (``<meta http-equiv="refresh">``, ``?refresh=SECONDS``, 0 to stop).

It shows backend URLs and request ids, so when an admin key is configured it
requires that key, as a Bearer token or, for browsers, as the password of
HTTP Basic authentication (any user name).
"""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from html import escape
from typing import Any

from aiohttp import web
from prometheus_client import Counter

from proxy.auth import bearer
from proxy.errors import error_body
from proxy.instances import Instance
from proxy.state import STATE, ProxyState

DEFAULT_REFRESH_S = 5

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#1d232a;background:#fafbfc}
h1{font-size:1.4em;margin:0 0 .2em}h2{font-size:1.1em;margin:1.6em 0 .5em}
.sub{color:#57606a;margin-bottom:1em}
table{border-collapse:collapse;background:#fff;margin-bottom:.5em}
th,td{border:1px solid #d0d7de;padding:.3em .6em;text-align:left;vertical-align:top}
th{background:#f0f3f6;font-weight:600}td.n{text-align:right;font-variant-numeric:tabular-nums}
.ok{background:#dafbe1;color:#116329}.bad{background:#ffd7d5;color:#82071e;font-weight:600}
.warn{background:#fff1c2;color:#7d4e00}.muted{color:#8c959f}
.badge{display:inline-block;padding:0 .5em;border-radius:1em;font-size:.9em}
code{font:12px ui-monospace,monospace}
"""


def _keys_accept(state: ProxyState, request: web.Request) -> bool:
    """True when no admin key is configured, or the request carries it."""
    keys = state.auth.admin
    if not keys.required:
        return True
    token = bearer(request.headers)
    if token is None:
        header = request.headers.get("Authorization", "")
        if header[:6].lower() == "basic ":
            try:
                decoded = base64.b64decode(header[6:].strip(), validate=True)
            except (binascii.Error, ValueError):
                return False
            token = decoded.partition(b":")[2]
    return keys.accepts(token)


async def status_page(request: web.Request) -> web.Response:
    """The page; 401 with a Basic challenge when an admin key is required."""
    state = request.app[STATE]
    if not _keys_accept(state, request):
        return web.Response(
            status=401,
            body=error_body(401, "The status page needs the admin key"),
            content_type="application/json",
            headers={"WWW-Authenticate": 'Basic realm="kvguard status"'},
        )
    try:
        refresh = max(0, int(request.query.get("refresh", DEFAULT_REFRESH_S)))
    except ValueError:
        refresh = DEFAULT_REFRESH_S
    return web.Response(
        text=render(state, refresh),
        content_type="text/html",
        headers={"Cache-Control": "no-store"},
    )


# ------------------------------------------------------------------ reading


def counter_values(counter: Counter) -> dict[tuple[str, ...], float]:
    """A labelled counter's totals by label values, as /metrics shows them."""
    values: dict[tuple[str, ...], float] = {}
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                values[tuple(sample.labels.values())] = sample.value
    return values


def instance_state(inst: Instance, now: float) -> tuple[str, str]:
    """(label, css class) of what routing does with ``inst``."""
    if inst.ejected:
        left = max(0.0, inst.ejected_until - now)
        why = f"ejected ({left:.0f}s left)" if left else "ejected (awaiting probe)"
        return why, "bad"
    if inst.drained:
        return ("draining" if inst.in_flight else "drained"), "warn"
    if not inst.healthy:
        return "unhealthy", "bad"
    return "in rotation", "ok"


# ---------------------------------------------------------------- rendering


def _cell(text: Any, cls: str = "", title: str = "") -> str:
    attrs = f' class="{cls}"' if cls else ""
    if title:
        attrs += f' title="{escape(title)}"'
    return f"<td{attrs}>{escape(str(text))}</td>"


def _instances(state: ProxyState, now: float) -> str:
    rows = []
    for inst in state.all_instances():
        label, cls = instance_state(inst, now)
        found = f"dns {inst.discovered_by}" if inst.discovered_by else "config"
        rows.append(
            f'<tr data-role="{inst.role}" data-url="{escape(inst.url)}"'
            f' data-state="{escape(label.split(" (")[0].replace(" ", "-"))}">'
            + _cell(inst.model)
            + _cell(inst.role)
            + _cell(inst.url)
            + f'<td><span class="badge {cls}">{escape(label)}</span></td>'
            + _cell("yes" if inst.healthy else "no", "" if inst.healthy else "bad")
            + _cell(inst.in_flight, "n")
            + _cell(state.tracker.blamed(inst), "n")
            + _cell(inst.ejections, "n" + (" bad" if inst.ejections else ""))
            + _cell(f"{inst.weight:g}", "n")
            + _cell(found, "muted")
            + "</tr>"
        )
    head = (
        "<tr><th>model</th><th>role</th><th>instance</th><th>state</th>"
        "<th>healthy</th><th>in flight</th><th>failures blamed</th>"
        "<th>ejections</th><th>weight</th><th>found by</th></tr>"
    )
    return f'<table id="instances">{head}{"".join(rows)}</table>'


def _matrix(
    model: str,
    prefills: list[Instance],
    decodes: list[Instance],
    failures: Mapping[tuple[str, ...], float],
    state: ProxyState,
) -> str:
    """Rows: prefills; columns: decodes; cells: integrity failures of the pair.

    A prefill row is highlighted while the prefill is ejected or has failures
    with a decode in the matrix.
    """
    now = time.monotonic()
    head = "<tr><th>prefill \\ decode</th>" + "".join(
        f"<th>{escape(d.url)}</th>" for d in decodes
    )
    head += "</tr>"
    rows = []
    for prefill in prefills:
        p = prefill.url
        row_failures = sum(failures.get((p, d.url), 0.0) for d in decodes)
        label, _ = instance_state(prefill, now)
        faulty = prefill.ejected or row_failures > 0
        cells = [
            f'<th class="{"bad" if faulty else ""}" data-prefill="{escape(p)}">'
            f'{escape(p)}<br><span class="muted">{escape(label)}</span></th>'
        ]
        for decode in decodes:
            count = failures.get((p, decode.url), 0.0)
            pair_out = state.tracker.has_ejected_pairs() and state.tracker.pair_ejected(
                prefill, decode
            )
            text = f"{count:.0f}" + (" (pair ejected)" if pair_out else "")
            cells.append(
                f'<td class="n {"bad" if count else "ok"}" data-pair="{escape(p)} '
                f'{escape(decode.url)}" data-failures="{count:.0f}">{escape(text)}</td>'
            )
        rows.append(f'<tr class="{"failing" if faulty else ""}">{"".join(cells)}</tr>')
    return (
        f'<table class="matrix" data-model="{escape(model)}">{head}'
        f"{''.join(rows)}</table>"
    )


def _matrices(state: ProxyState) -> str:
    failures = counter_values(state.metrics.integrity_failures)
    parts = []
    for name, pools in state.models.items():
        parts.append(f"<h3>model {escape(name)}</h3>")
        parts.append(
            _matrix(
                name,
                list(pools.prefill.instances),
                list(pools.decode.instances),
                failures,
                state,
            )
        )
    return "".join(parts)


def _retries(state: ProxyState) -> str:
    values = counter_values(state.metrics.retries)
    if not values:
        return '<p class="muted" id="retries">No retries.</p>'
    rows = "".join(
        f"<tr>{_cell(reason[0])}{_cell(f'{count:.0f}', 'n')}</tr>"
        for reason, count in sorted(values.items(), key=lambda kv: -kv[1])
    )
    return (
        '<table id="retries"><tr><th>reason</th><th>retried attempts</th></tr>'
        f"{rows}</table>"
    )


def _recent(entries: Iterable[dict[str, Any]]) -> str:
    rows = []
    for entry in reversed(list(entries)):
        when = datetime.fromtimestamp(entry.get("ts", 0), UTC).strftime("%H:%M:%S")
        rows.append(
            "<tr>"
            + _cell(when + " UTC")
            + f"<td><code>{escape(str(entry.get('request_id', '')))}</code></td>"
            + f"<td><code>{escape(str(entry.get('attempt_id', '')))}</code></td>"
            + _cell(entry.get("prefill", ""), "bad")
            + _cell(entry.get("decode", ""))
            + _cell(str(entry.get("error", ""))[:200])
            + "</tr>"
        )
    if not rows:
        return '<p class="muted" id="recent">No KV integrity failure yet.</p>'
    return (
        '<table id="recent"><tr><th>time</th><th>request id</th><th>attempt id</th>'
        "<th>prefill</th><th>decode</th><th>error</th></tr>"
        f"{''.join(rows)}</table>"
    )


def _summary(state: ProxyState) -> str:
    problems = []
    for name, pools in state.models.items():
        for pool in (pools.prefill, pools.decode):
            if not any(i.usable() for i in pool.instances):
                problems.append(f"model {name}: no healthy {pool.role} instance")
    failures = sum(counter_values(state.metrics.integrity_failures).values())
    ejected = sum(1 for i in state.all_instances() if i.ejected)
    health = (
        '<span class="badge ok">serving</span>'
        if not problems
        else '<span class="badge bad">' + escape("; ".join(problems)) + "</span>"
    )
    return (
        f'<div class="sub" id="summary">{health} · {state.in_flight} requests in '
        f"flight · {failures:.0f} KV integrity failures caught · "
        f"ejected instances: {ejected}</div>"
    )


def render(state: ProxyState, refresh: int = DEFAULT_REFRESH_S) -> str:
    """The whole page for the state as it is now."""
    now = time.monotonic()
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    meta = f'<meta http-equiv="refresh" content="{refresh}">' if refresh else ""
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"{meta}<title>KVGuard proxy status</title><style>{_CSS}</style></head>"
        f"<body><h1>KVGuard proxy</h1>{_summary(state)}"
        f'<div class="muted">{stamp}'
        + (f" · refreshes every {refresh}s" if refresh else "")
        + "</div>"
        + "<h2>Instances</h2>"
        + _instances(state, now)
        + "<h2>KV integrity failures, prefill × decode</h2>"
        + _matrices(state)
        + "<h2>Retries by reason</h2>"
        + _retries(state)
        + f"<h2>Last KV integrity failures (up to {state.recent_failures.maxlen})"
        "</h2>" + _recent(state.recent_failures) + "</body></html>"
    )
