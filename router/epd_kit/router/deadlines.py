"""How long an engine call may take before the router holds the engine hung: a deadline
from the call's own work plus the work queued ahead of it on that engine (so a busy engine
is not mistaken for a hung one), capped by `timeouts.ve_s` / `timeouts.pd_s`. A call that
misses it fails as a timeout of the engine (health.py). Pure arithmetic, no clocks.
"""

from __future__ import annotations

from epd_kit.router_yaml import Timeouts


def encode_s(t: Timeouts, tokens_in_flight: int) -> float:
    """An encode call; `tokens_in_flight`: the VE's embedding tokens in flight, this call's included."""
    return min(t.ve_s, t.encode_base_s + t.encode_per_1k_tokens_s * tokens_in_flight / 1000)


def first_token_s(t: Timeouts, prompt_tokens_waiting: int) -> float:
    """A PD call until its first token; `prompt_tokens_waiting`: prompt tokens on that PD not
    yet past their first token, this call's included."""
    return min(t.pd_s, t.first_token_base_s + t.first_token_per_1k_tokens_s * prompt_tokens_waiting / 1000)


def answer_s(t: Timeouts, prompt_tokens_waiting: int, max_tokens: int | None) -> float:
    """A non-streaming PD call, which answers only when every token is out."""
    if max_tokens is None:
        return t.pd_s
    return min(t.pd_s, first_token_s(t, prompt_tokens_waiting) + t.per_token_s * max_tokens)
