"""The vLLM names the tier uses, from where the installed vLLM keeps them.

vLLM 0.29 moved the API server's pieces to `entrypoints/launchers/` and the disaggregated
generate route (models, serving, `mm_serde`) from `entrypoints/serve/disagg/` to
`entrypoints/scale_out/token_in_token_out/` (docs/compat.md "vLLM 0.29"); 0.24 has them at
the old places. The objects are the same functions and classes under both names. 0.32 keeps
0.29's places, and moved the engine's multimodal receiver cache factory from a
`MultiModalRegistry` method to `vllm.multimodal.cache` (its v1/engine/core.py imports it from
there; docs/compat.md "vLLM 0.32").
"""

from __future__ import annotations

from importlib.util import find_spec

from vllm.multimodal import MULTIMODAL_REGISTRY

from tests.vllm_dist import installed_vllm

_, VLLM_VERSION = installed_vllm() or ("", "")  # the conftest runs this tier only where it is set
VLLM_SERIES = ".".join(VLLM_VERSION.split(".")[:2])  # "0.24", "0.29", "0.32": EPD_SIM_VLLM's names

if find_spec("vllm.entrypoints.launchers") is not None:  # vLLM 0.29
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client_from_engine_args
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import (
        decode_mm_kwargs_item,
        encode_mm_kwargs_item,
    )
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
        GenerateResponse,
        GenerateStreamResponse,
    )
else:  # vLLM 0.24
    from vllm.entrypoints.openai.api_server import (
        build_app,
        build_async_engine_client_from_engine_args,
        init_app_state,
    )
    from vllm.entrypoints.openai.cli_args import (
        make_arg_parser,
        validate_parsed_serve_args,
    )
    from vllm.entrypoints.serve.disagg.mm_serde import (
        decode_mm_kwargs_item,
        encode_mm_kwargs_item,
    )
    from vllm.entrypoints.serve.disagg.protocol import (
        GenerateResponse,
        GenerateStreamResponse,
    )

if hasattr(MULTIMODAL_REGISTRY, "engine_receiver_cache_from_config"):  # vLLM 0.24, 0.29
    engine_receiver_cache_from_config = MULTIMODAL_REGISTRY.engine_receiver_cache_from_config
else:  # vLLM 0.32
    from vllm.multimodal.cache import engine_receiver_cache_from_config

# vLLM 0.32's API server resolves the EC connector class at start, for its Prometheus metrics
# (v1/metrics/loggers.py PrometheusStatLogger -> ec_connector/metrics.py:152
# ECConnectorFactory.get_connector_class, then the class's build_prom_metrics); 0.24 and 0.29 never
# did. The tutorial's connector, vllm-neuron's NeuronNixlECConnector, is not in a vLLM-only env, so
# the API server would stop with "Unsupported connector type". The tier's engine core is a
# stand-in that moves no embeddings (engine_core.py), so the class stands in too: vLLM's base
# class, whose build_prom_metrics answers None (no connector metrics; ec_connector/base.py).
NEURON_EC_CONNECTOR = "NeuronNixlECConnector"
if tuple(int(part) for part in VLLM_SERIES.split(".")) >= (0, 32):
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    if NEURON_EC_CONNECTOR not in ECConnectorFactory._registry:
        ECConnectorFactory.register_connector(
            NEURON_EC_CONNECTOR, "vllm.distributed.ec_transfer.ec_connector.base", "ECConnectorBase"
        )

__all__ = [
    "VLLM_SERIES",
    "VLLM_VERSION",
    "GenerateResponse",
    "GenerateStreamResponse",
    "build_app",
    "build_async_engine_client_from_engine_args",
    "decode_mm_kwargs_item",
    "encode_mm_kwargs_item",
    "engine_receiver_cache_from_config",
    "init_app_state",
    "make_arg_parser",
    "validate_parsed_serve_args",
]
