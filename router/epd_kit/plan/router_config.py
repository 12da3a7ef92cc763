"""The router's configuration file (/etc/epd/router.yaml) from the fleet plan and the router role's overrides.

Model, quantization, engine dtype, listen port, image limits, auth and endpoints come from the plan; every other
section is the role's overrides of the router's own defaults (the router is the one place they
live, docs/router.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .command import ENGINE_DTYPE, merge
from .fleet import router_endpoints
from .settings import Settings

OVERRIDABLE_SECTIONS = ("timeouts", "limits", "media", "health", "placement", "retries")


def router_config(
    plan: Mapping[str, Mapping[str, Any]],
    settings: Settings,
    *,
    listen_host: str,
    served_model_name: str | None = None,
    sections: Mapping[str, Mapping[str, Any]] | None = None,
    api_keys_file: str | None = None,
    draining: Sequence[str] = (),
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """router.yaml as a mapping; `extra` is merged last, recursively."""
    sections = sections or {}
    config: dict[str, Any] = {
        "model": settings.model,
        "served_model_name": served_model_name,
        "quantization": None if settings.quantization == "bf16" else settings.quantization,
        "listen": {"host": listen_host, "port": settings.router_port},
        # the engines' --dtype: the router sends VE pixel values in it
        "dtype": ENGINE_DTYPE,
    }
    for name in OVERRIDABLE_SECTIONS:
        config[name] = dict(sections.get(name) or {})
    config["limits"].update(
        {
            "images_per_prompt": settings.images_per_prompt,
            "max_image_patches": settings.vision_attention_block_size,
        }
    )
    # without keys, say "off" outright: a reload only drops the keys of a running router when told so
    config["auth"] = {"api_keys_file": api_keys_file} if api_keys_file else {"enabled": False}
    config["endpoints"] = router_endpoints(plan, draining)
    return merge(config, extra or {})
