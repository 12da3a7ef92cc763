"""The vLLM names the tier uses, from where the installed vLLM keeps them.

vLLM 0.29 moved the API server's pieces to `entrypoints/launchers/` and the disaggregated
generate route (models, serving, `mm_serde`) from `entrypoints/serve/disagg/` to
`entrypoints/scale_out/token_in_token_out/` (docs/compat.md "vLLM 0.29"); 0.24 has them at
the old places. The objects are the same functions and classes under both names.
"""

from __future__ import annotations

from importlib.util import find_spec

from tests.vllm_dist import installed_vllm

_, VLLM_VERSION = installed_vllm() or ("", "")  # the conftest runs this tier only where it is set
VLLM_SERIES = ".".join(VLLM_VERSION.split(".")[:2])  # "0.24" or "0.29", as EPD_SIM_VLLM names it

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

__all__ = [
    "VLLM_SERIES",
    "VLLM_VERSION",
    "GenerateResponse",
    "GenerateStreamResponse",
    "build_app",
    "build_async_engine_client_from_engine_args",
    "decode_mm_kwargs_item",
    "encode_mm_kwargs_item",
    "init_app_state",
    "make_arg_parser",
    "validate_parsed_serve_args",
]
