"""vLLM's API-key check, as `vllm serve` 0.24.0 does it, for the simulated engine.

Read from vllm 0.24.0 (site-packages/vllm):
- entrypoints/openai/cli_args.py:265 `api_key: list[str] | None`, which
  engine/arg_utils.py:223 turns into `--api-key` with `nargs="+"` and argparse's store action:
  `--api-key a b` gives ["a", "b"]; a second `--api-key` replaces the first (argparse_utils.py
  warns "Found duplicate keys"); a value "" or "None" is None (optional_type);
- entrypoints/openai/api_server.py:258 `[key for key in (args.api_key or [envs.VLLM_API_KEY]) if key]`:
  the flag wins over VLLM_API_KEY (envs.py:740) whenever it is given, and falsy keys are dropped;
  no key left means no check at all;
- entrypoints/serve/utils/server_utils.py:41-92 `AuthenticationMiddleware`: only paths starting
  with GUARDED_PREFIX ("/v1", "/v2", "/inference", after removing the root path) are checked,
  (vllm 0.29.0 moved it to entrypoints/serve/middleware/authenticate.py, same checks, and guards
  "/cohere" too: `guarded_prefix` below; the key's precedence is middleware/register.py:33's, the same),
  never OPTIONS; `Authorization` is split on its first space, the scheme compared without
  case, the rest (not stripped) hashed with sha256 and compared to every key's hash with
  `secrets.compare_digest`; a refusal is 401 `{"error": "Unauthorized"}`.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ..wire import KEY_GUARDED_PATHS, KEY_GUARDED_PATHS_0_29

if TYPE_CHECKING:  # the CLI imports this module before it loads the HTTP stack
    from starlette.datastructures import Headers
    from starlette.types import ASGIApp, Receive, Scope, Send

    from .release import AnswerShape


def guarded_prefix(answers: AnswerShape) -> tuple[str, ...]:
    """The paths the key guards in the vLLM the sim answers as."""
    return KEY_GUARDED_PATHS_0_29 if answers.v029 else KEY_GUARDED_PATHS


API_KEY_FLAG = "--api-key"


def split_api_key_flag(args: Sequence[str]) -> tuple[list[str], list[str | None] | None]:
    """`args` without `--api-key` and its values, and the values argparse would keep (the
    last occurrence's: every following argument up to the next one that starts with '-')."""
    rest: list[str] = []
    found: list[str | None] | None = None
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == API_KEY_FLAG:
            values: list[str | None] = []
            i += 1
            while i < len(args) and not args[i].startswith("-"):
                values.append(_optional(args[i]))
                i += 1
            if not values:
                raise ValueError("argument --api-key: expected at least one argument")
            found = values
            continue
        if arg.startswith(API_KEY_FLAG + "="):
            found = [_optional(arg.split("=", 1)[1])]
        else:
            rest.append(arg)
        i += 1
    return rest, found


def _optional(value: str) -> str | None:
    # vllm/utils/argparse_utils.py optional_type: "" and "None" are None
    return None if value in ("", "None") else value


def engine_tokens(api_key: Sequence[str | None] | None, env: Mapping[str, str]) -> list[str]:
    """The keys the engine checks (api_server.py:258)."""
    return [key for key in (api_key or [env.get("VLLM_API_KEY")]) if key]


class AuthenticationMiddleware:
    """vLLM's middleware (server_utils.py:44), same checks and answer."""

    def __init__(self, app: ASGIApp, tokens: Sequence[str], guarded: tuple[str, ...] = KEY_GUARDED_PATHS) -> None:
        from starlette.datastructures import Headers
        from starlette.responses import JSONResponse

        self._headers = Headers
        self._refusal = JSONResponse
        self.app = app
        self.api_tokens = [hashlib.sha256(t.encode("utf-8")).digest() for t in tokens]
        self.guarded = guarded

    def verify_token(self, headers: Headers) -> bool:
        value = headers.get("Authorization")
        if not value:
            return False
        scheme, _, param = value.partition(" ")
        if scheme.lower() != "bearer":
            return False
        param_hash = hashlib.sha256(param.encode("utf-8")).digest()
        match = False
        for token_hash in self.api_tokens:
            match |= secrets.compare_digest(param_hash, token_hash)
        return match

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path.startswith(self.guarded) and not self.verify_token(self._headers(scope=scope)):
            await self._refusal(content={"error": "Unauthorized"}, status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)
