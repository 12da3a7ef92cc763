"""The kit's vLLM plugin (engine_plugin/) against each vLLM's own scheduler: its guard finds
every internal it reads (and refuses a vLLM without one, naming the version), and the locator
scheduler, built as vLLM builds a scheduler, answers a finished VE request with its items'
locators and ends a PD request whose encoder outputs could not be read with an error.

The scheduler is vLLM's own (`Scheduler`, with a KV cache config as vLLM's tests/v1/core/utils.py
create_scheduler makes one) on the tier's tiny checkpoint; only the model runner's output is
written by the test (the step's sampled token), and, for the failed load, the connector's
`take_load_failures` (the kit's NIXL connector's hook; vLLM's ECExampleConnector has none).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import vllm
from vllm import SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from tests.compat.vllm_api import VLLM_SERIES

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "engine_plugin" / "src"))
from epd_vllm_plugin import compat
from epd_vllm_plugin.scheduler import ECLocatorScheduler

UPSTREAM_NIXL = tuple(int(part) for part in VLLM_SERIES.split(".")) >= (0, 30)
BLOCK = 16
SIDE_CHANNEL = {"side_channel_host": "127.0.0.1", "side_channel_port": 18300}


@pytest.fixture(scope="module")
def ve_config(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    """A VE's VllmConfig as `vllm serve --mm-encoder-only --ec-transfer-config ...` builds it."""
    store = tmp_path_factory.mktemp("ec")
    args = EngineArgs(
        model=str(checkpoint),
        mm_encoder_only=True,
        max_model_len=512,
        enforce_eager=True,
        # the test's requests carry no block hasher (EngineCore gives them one only with prefix
        # caching on, v1/engine/core.py), so no full block may be cached
        enable_prefix_caching=False,
        ec_transfer_config={
            "ec_connector": "ECExampleConnector",
            "ec_role": "ec_producer",
            "engine_id": "ve-0",
            "ec_connector_extra_config": {"shared_storage_path": str(store), **SIDE_CHANNEL},
        },
    )
    config = args.create_engine_config()
    config.cache_config.num_gpu_blocks = 64  # what the engine core sets after profiling
    return config


def scheduler(config) -> ECLocatorScheduler:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=16, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return ECLocatorScheduler(
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )


def image_request(request_id: str, items: dict[str, tuple[int, int]]) -> Request:
    """A request whose prompt holds one placeholder run per item (offset, length)."""
    features = [
        MultiModalFeatureSpec(data=None, modality="image", identifier=mm_hash, mm_position=PlaceholderRange(*at))
        for mm_hash, at in items.items()
    ]
    length = max(offset + size for offset, size in items.values()) + 2
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(1, length + 1)),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        mm_features=features,
    )


def runner_output(request_ids: list[str]) -> ModelRunnerOutput:
    """The step's model output: one sampled token per scheduled request (a VE's placeholder 0)."""
    return ModelRunnerOutput(
        req_ids=request_ids,
        req_id_to_index={rid: index for index, rid in enumerate(request_ids)},
        sampled_token_ids=[[0] for _ in request_ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )


def outputs_of(engine_outputs) -> dict[str, object]:
    return {output.request_id: output for batch in engine_outputs.values() for output in batch.outputs}


def test_this_vllm_has_every_internal_the_plugin_reads():
    assert compat.missing(compat.SCHEDULER_INTERNALS) == []
    assert compat.missing(compat.CONNECTOR_INTERNALS) == []
    assert vllm.__version__ in compat.READ_VLLM
    compat.check_version("test", vllm.__version__)  # inside the declared range: no error
    absent = compat.missing(compat.UPSTREAM_NIXL_INTERNALS)
    if UPSTREAM_NIXL:
        assert absent == []
    else:  # vLLM < 0.30 has no ECCPUConnector's NIXL path: upstream_nixl's import refuses it
        assert absent, "upstream_nixl's internals on a vLLM < 0.30"


def test_a_finished_ve_request_carries_each_items_locator(ve_config):
    sched = scheduler(ve_config)
    sched.add_request(image_request("r1", {"h1": (2, 4), "h2": (8, 6)}))
    step = sched.schedule()
    assert step.num_scheduled_tokens == {"r1": 16}
    (output,) = outputs_of(sched.update_from_output(step, runner_output(["r1"]))).values()
    base = {"engine_id": "ve-0", "host": "127.0.0.1", "port": 18300, "remote_block_ids": [0]}
    assert output.finish_reason is not None
    assert output.kv_transfer_params["ec_locator"] == {"h1": {**base, "num_tokens": 4}, "h2": {**base, "num_tokens": 6}}
    assert "r1" not in sched.requests  # vLLM freed it: the locators were read before


def test_a_producer_without_a_side_channel_is_refused_at_start(ve_config):
    config = copy.deepcopy(ve_config)
    config.ec_transfer_config.ec_connector_extra_config = {"shared_storage_path": "/nonexistent"}
    with pytest.raises(ValueError, match="needs side_channel_host and an integer side_channel_port"):
        scheduler(config)


def test_a_pd_request_whose_load_failed_ends_with_an_error(ve_config, monkeypatch):
    config = copy.deepcopy(ve_config)
    config.ec_transfer_config.ec_role = "ec_consumer"
    sched = scheduler(config)
    assert sched._locator_base is None  # not a producer: no locators
    idle = sched.schedule()  # a step before the request came
    sched.add_request(image_request("r2", {"h3": (2, 4)}))
    message = "ECLoadFailure: Encoder-cache load failed for mm_hashes: ['h3']: stale"
    failures = iter([{"r2": message}])
    monkeypatch.setattr(sched.ec_connector, "take_load_failures", lambda: next(failures, {}), raising=False)
    output = outputs_of(sched.update_from_output(idle, runner_output([])))["r2"]
    assert str(output.finish_reason) in ("error", "FinishReason.ERROR") or output.finish_reason.name == "ERROR"
    assert output.kv_transfer_params == {"ec_load_failure": message}
    assert "r2" not in sched.requests  # finished: the engine core serves on


def test_a_vllm_without_an_internal_is_refused_at_start_naming_its_version(ve_config, monkeypatch):
    monkeypatch.delattr(Request, "take_events")
    with pytest.raises(RuntimeError, match=rf"cannot run on vLLM {vllm.__version__}: .*Request\.take_events"):
        scheduler(ve_config)


def test_a_vllm_outside_the_declared_range_is_refused(ve_config, monkeypatch):
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(RuntimeError, match=r"vLLM 0\.33\.0 is outside the plugin's range >=0\.24\.0,<0\.33"):
        scheduler(ve_config)


def test_the_scheduler_state_vllm_sets_is_checked(ve_config, monkeypatch):
    original = Scheduler.__init__

    def without_requests(self, *args, **kwargs):
        original(self, *args, **kwargs)
        del self.requests

    monkeypatch.setattr(Scheduler, "__init__", without_requests)
    with pytest.raises(RuntimeError, match=r"ECLocatorScheduler\.requests \(set by vLLM's __init__\)"):
        scheduler(ve_config)


@pytest.mark.skipif(not UPSTREAM_NIXL, reason=f"upstream_nixl is for vLLM >= 0.30, this run is {VLLM_SERIES}")
def test_upstream_nixl_refuses_a_vllm_that_renamed_a_hook_it_overrides(monkeypatch):
    from epd_vllm_plugin.upstream_nixl import CPUNixlECConnector
    from vllm.distributed.ec_transfer.ec_connector.cpu.session import ProducerSession

    monkeypatch.delattr(ProducerSession, "_grant_or_nack")
    with pytest.raises(
        RuntimeError, match=rf"CPUNixlECConnector cannot run on vLLM {vllm.__version__}: .*_grant_or_nack"
    ):
        CPUNixlECConnector(None, None)  # the guard runs before anything of the config is read
