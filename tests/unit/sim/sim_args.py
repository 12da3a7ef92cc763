"""ServeArgs/EngineConfig builders for the tutorial's VE and PD commands (unit tier)."""

from __future__ import annotations

from epd_kit.plan import EFA_ENVIRONMENT
from epd_kit.sim.config import EngineConfig, ServeArgs, build_engine_config

EFA = dict(EFA_ENVIRONMENT)


def ve_args(model: str | None, **kw: object) -> ServeArgs:
    base: dict = {
        "tensor_parallel_size": 4,
        "host": "127.0.0.1",
        "port": 18300,
        "max_model_len": 8192,
        "max_num_batched_tokens": 8192,
        "max_num_seqs": 1,
        "dtype": "bfloat16",
        "limit_mm_per_prompt": {"image": 30},
        "enable_prefix_caching": False,
        "mm_encoder_only": True,
        "additional_config": {
            "vision_neuron_config": {
                "num_vision_tokens_buckets": [30720],
                "vision_attention_block_size": 1024,
                "dp_size": 4,
                "encoder_cache_num_blocks": 128,
            }
        },
        "ec_transfer_config": {
            "ec_connector": "NeuronNixlECConnector",
            "ec_role": "ec_producer",
            "engine_id": "epd-ve-0",
            "ec_connector_extra_config": {"side_channel_host": "127.0.0.1", "side_channel_port": 14600},
        },
    }
    base.update(kw)
    return ServeArgs(model=model, **base)


def pd_args(model: str | None, **kw: object) -> ServeArgs:
    base: dict = {
        "tensor_parallel_size": 8,
        "host": "127.0.0.1",
        "port": 18100,
        "max_model_len": 8192,
        "max_num_batched_tokens": 8192,
        "max_num_seqs": 8,
        "dtype": "bfloat16",
        "limit_mm_per_prompt": {"image": 30},
        "enable_prefix_caching": False,
        "additional_config": {
            "vision_neuron_config": {
                "num_vision_tokens_buckets": [30720],
                "vision_attention_block_size": 1024,
                "dp_size": 1,
                "encoder_cache_num_blocks": 128,
            },
            "mm_language_model_only": True,
        },
        "ec_transfer_config": {
            "ec_connector": "NeuronNixlECConnector",
            "ec_role": "ec_consumer",
            "engine_id": "epd-pd-0",
        },
    }
    base.update(kw)
    return ServeArgs(model=model, **base)


def config(args: ServeArgs, cores: str, **env: str) -> EngineConfig:
    return build_engine_config(args, {"NEURON_VISIBLE_DEVICES": cores, **EFA, **env})
