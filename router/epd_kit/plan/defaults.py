"""The defaults of every inventory variable the planner reads: the one list of them.

The roles' argument specs, the inventory table of docs/architecture.md and the router's
plan-derived limits are checked against these (tests/ansible/test_lint_syntax.py,
tests/unit/test_planner.py); `epd_settings` exposes them to playbooks.
"""

from __future__ import annotations

from typing import Any

# Fleet-wide pool settings (group_vars/all); each must agree on every engine host.
GLOBAL_DEFAULTS: dict[str, Any] = {
    "epd_model": None,
    "epd_quantization": "bf16",
    "epd_modules_to_not_convert": [],
    "epd_engine_backend": "vllm",
    "epd_ve_tp": 4,
    "epd_ve_dp": 4,
    "epd_pd_tp": 8,
    "epd_max_model_len": 8192,
    "epd_max_num_seqs": 8,
    "epd_images_per_prompt": 30,
    "epd_image_edge": 512,
    "epd_patch_size": 16,
    "epd_encoder_cache_num_blocks": 128,
    "epd_ve_port_base": 18300,
    "epd_pd_port_base": 18100,
    "epd_side_channel_port_base": 14600,
    "epd_router_port": 18800,
    "epd_engine_id_prefix": "epd",
    "epd_start_stagger_s": 10,
    "epd_compilation_timeout_s": 6000,
    # None: derived per host, compile budget + the host's last start delay + a margin (timeouts.py)
    "epd_start_timeout_s": None,
    "epd_extra_args": [],
    "epd_engine_environment": {},
}

# Per engine host (host_vars or the inventory's host line).
HOST_DEFAULTS: dict[str, Any] = {
    "epd_num_ve": 0,
    "epd_num_pd": 0,
    "epd_core_count": 64,
    "epd_excluded_cores": [],
    "epd_slices": None,
    "epd_bind_address": "127.0.0.1",
    # None: the inventory name; the host's part of its engine ids in a fleet of several engine hosts
    "epd_engine_id_label": None,
}

# Read only by the inventory check (checks.py): not part of the plan, so not in the inventory table.
CHECK_DEFAULTS: dict[str, Any] = {
    # true: a fleet without VE engines is intended (text-only requests); false refuses it as a mistake
    "epd_text_only": False,
}
