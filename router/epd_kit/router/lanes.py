"""Lanes: one per model the router serves (docs/router.md "Several models").

A lane is a model's own request path: its config (the model's name, checkpoint, limits and
pools), its pool snapshot, its renderer (the model's tokenizer and image processor), and the
parts that read them: the engine client (calls, health, probes), PD admission, the encoder
and generation. Each model of the config's `models` gets one, built from
`RouterConfig.lane_config`; the one listed first is also the service's own (service.state,
service.engines, ...: a request without `model` gets it). What is the client's, not a model's, stays the service's:
keys and tenants, the intake gate, metrics, tracing, the admin gate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from epd_kit.router.admission import PdAdmission
from epd_kit.router.encode import Encoder
from epd_kit.router.engine_client import EngineClient
from epd_kit.router.errors import RouterError
from epd_kit.router.generation import Generation
from epd_kit.router.metrics import RouterMetrics
from epd_kit.router.pools import Pools, build_pools
from epd_kit.router.probes import ServingProbes
from epd_kit.router.rendering import Renderer
from epd_kit.router.state import RouterState
from epd_kit.router_yaml import RouterConfig


@dataclass
class Lane:
    name: str  # the served name: what a request's `model` says
    state: RouterState
    renderer: Renderer
    engines: EngineClient
    admission: PdAdmission
    encoder: Encoder
    generation: Generation

    @classmethod
    def build(cls, name: str, cfg: RouterConfig, renderer: Renderer, metrics: RouterMetrics) -> Lane:
        state = RouterState(cfg, build_pools(cfg)[0])
        engines = EngineClient(state, metrics)
        admission = PdAdmission(state, metrics)
        encoder = Encoder(state, engines, metrics)
        generation = Generation(state, renderer, engines, encoder, admission, metrics)
        return cls(name, state, renderer, engines, admission, encoder, generation)

    async def start(self) -> None:
        await self.engines.start(await ServingProbes.build(self.renderer))

    def card(self) -> dict:
        """Its entry in /v1/models."""
        cfg = self.state.cfg
        return {"id": self.name, "object": "model", "created": 0, "owned_by": "epd-kit", "root": cfg.model}


def combined_pools(lanes: Callable[[], list[Lane]]) -> Pools:
    """Every lane's engines in one snapshot (ids are unique across models: the config's rule)."""
    all_lanes = lanes()
    if len(all_lanes) == 1:
        return all_lanes[0].state.pools
    return Pools(
        ve=tuple(e for lane in all_lanes for e in lane.state.pools.ve),
        pd=tuple(e for lane in all_lanes for e in lane.state.pools.pd),
    )


def unknown_model(model: str, served: list[str]) -> RouterError:
    """OpenAI's answer to a model it does not serve: 404, type invalid_request_error, code
    model_not_found, param null (as the OpenAI API answers, e.g. Aider-AI/aider#2030,
    shobrook/wut#14), with the names this router serves."""
    return RouterError(
        404,
        f"The model `{model}` does not exist: this router serves {', '.join(served)}",
        type_="invalid_request_error",
        code="model_not_found",
    )
