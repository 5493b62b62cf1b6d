"""The engine's bearer-key gate, SGLang's rules (sglang/srt/utils/auth.py `decide_request_auth`): `--api-key` guards
every route, `--admin-api-key` the admin ones (which then refuse the plain api key); health probes stay open. Runs
before any handler, so a refused request never reaches the body parser or the model."""
from __future__ import annotations

import hmac
from typing import Awaitable, Callable

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ALWAYS_OPEN_PREFIXES = ("/health", "/ready", "/metrics")  # k8s probes and scrapers carry no secrets (as SGLang)


def required_key(*, method: str, path: str, is_admin_route: bool, api_key: str | None,
                 admin_api_key: str | None) -> str | None:
    """The key a request must present, or None when it may pass without one. Admin routes are SGLang's
    `AuthLevel.ADMIN_OPTIONAL`: the admin key when the server has one, else the api key, else open. Every other
    route (unknown paths included) needs the api key when there is one; the admin key does not open them."""
    if method == "OPTIONS" or path.startswith(ALWAYS_OPEN_PREFIXES):
        return None
    if is_admin_route:
        return admin_api_key or api_key or None
    return api_key or None


def presents_key(authorization: str | None, key: str) -> bool:
    """Whether an `Authorization` header is `Bearer <key>` (scheme case-insensitive, constant-time comparison)."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    # surrogatepass: a header aiohttp decoded from odd bytes must compare as unequal, never raise
    return hmac.compare_digest(token.encode("utf-8", "surrogatepass"), key.encode("utf-8", "surrogatepass"))


def key_gate(*, api_key: str | None, admin_api_key: str | None, admin_paths: frozenset[str]):
    """aiohttp middleware: 401 `{"error": "Unauthorized"}` (SGLang's status and body) unless the request carries
    the key its route needs. `admin_paths` are the route paths at SGLang's admin level."""

    @web.middleware
    async def gate(request: web.Request, handler: Handler) -> web.StreamResponse:
        resource = request.match_info.route.resource  # None when no route matched (404 / 405): SGLang's NORMAL
        key = required_key(method=request.method, path=request.path,
                           is_admin_route=resource is not None and resource.canonical in admin_paths,
                           api_key=api_key, admin_api_key=admin_api_key)
        if key is not None and not presents_key(request.headers.get("Authorization"), key):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return gate
