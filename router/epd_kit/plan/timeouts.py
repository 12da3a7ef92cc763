"""How an engine's start budget fits the compile budget and the stagger (docs/operations.md "Timeouts").

systemd's TimeoutStartSec counts from the start job: the stagger sleep, the model load, the
Neuron compile (bounded by epd_compilation_timeout_s) and the /health gate all run inside it.
A start timeout below compile budget + stagger would kill an engine that is compiling normally.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .errors import EpdPlanError
from .settings import Settings

# after the compile budget: loading weights and NEFFs, warm-up, the first /health answer
START_MARGIN_S = 600


def start_timeout_s(settings: Settings, host: str, engines: Sequence[Mapping[str, Any]]) -> int:
    """The host's TimeoutStartSec: epd_start_timeout_s when set (refused if it does not cover the
    compile budget plus the host's last start delay), else that sum plus START_MARGIN_S."""
    last_delay = max((int(engine["start_delay_s"]) for engine in engines), default=0)
    needed = settings.compilation_timeout_s + last_delay
    if settings.start_timeout_s is None:
        return needed + START_MARGIN_S
    if settings.start_timeout_s < needed:
        raise EpdPlanError(
            f"{host}: epd_start_timeout_s {settings.start_timeout_s} does not cover epd_compilation_timeout_s "
            f"{settings.compilation_timeout_s} plus the last engine's start delay {last_delay} s "
            f"(epd_start_stagger_s): set it to at least {needed + START_MARGIN_S}, or leave it unset to derive it"
        )
    return settings.start_timeout_s
