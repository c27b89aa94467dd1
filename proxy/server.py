"""Serving the application so that every error it writes is OpenAI-style JSON.

Routing errors (404, 405) pass through ``json_errors``, a middleware. Errors
aiohttp answers before any handler runs (a request line or header its parser
refuses: an oversized header, a bare CR, a NUL) and unhandled exceptions go to
the connection's ``handle_error``, which ``ProxyRunner`` replaces.
"""

from __future__ import annotations

from http import HTTPStatus

from aiohttp import HttpVersion11, hdrs, web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from proxy.errors import error_body, error_response

_KEEP_HEADERS = (hdrs.ALLOW,)


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answers aiohttp's HTTP exceptions (unknown path, wrong method) in JSON."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        resp = error_response(exc.status, exc.reason)
        for name in _KEEP_HEADERS:
            if name in exc.headers:
                resp.headers[name] = exc.headers[name]
        return resp


async def expect_continue(request: web.Request) -> web.StreamResponse | None:
    """The routes' ``Expect`` handler: ``100-continue`` as aiohttp answers it,
    any other expectation a 417 in JSON (aiohttp's own is plain text)."""
    if request.version != HttpVersion11:
        return None
    expect = request.headers.get(hdrs.EXPECT, "")
    if expect.lower() != "100-continue":
        return error_response(417, f"Unknown Expect: {expect}")
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # the reply's own size starts after it
    return None


def json_route(method: str, path: str, handler: Handler) -> web.RouteDef:
    """A route (a GET one with its HEAD) whose unknown ``Expect`` header is
    answered in JSON: aiohttp has no default for every route."""
    return web.route(method, path, handler, expect_handler=expect_continue)


class _JsonErrorHandler(RequestHandler):
    """A connection whose own error replies are OpenAI JSON, not plain text."""

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        # aiohttp logs the error and checks nothing was sent yet.
        super().handle_error(request, status, exc, message)
        text = HTTPStatus(status).phrase
        if isinstance(exc, HttpProcessingError) and exc.message:
            text = f"{text}: {exc.message}"
        resp = web.Response(
            status=status,
            body=error_body(status, text),
            content_type="application/json",
        )
        resp.force_close()
        return resp


class _JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JsonErrorHandler(self, loop=self._loop, **self._kwargs)


class ProxyRunner(web.AppRunner):
    """``web.AppRunner`` whose connections answer their own errors in JSON."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # aiohttp has no option for the connection class: the Server that
        # builds one per accepted socket becomes one that builds ours.
        server.__class__ = _JsonErrorServer
        return server
