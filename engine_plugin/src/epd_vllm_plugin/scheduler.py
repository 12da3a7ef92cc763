"""A VE scheduler that answers with encoder-cache locators (docs/contract.md §2.4).

vllm-neuron's scheduler puts one locator per item of a finished VE request into the
response's `kv_transfer_params` under `ec_locator` (its `_free_request` override merges them
into the dict the base scheduler returns; the stock scheduler of vLLM 0.24 and 0.29 never
asks the EC connector for params). Upstream vLLM has no such step, so a stock VE answers
without locators and the router refuses the answer (502 "no EC locator"). This subclass adds
the same field through the scheduler's public interface only (`update_from_output`, whose
`EngineCoreOutput.kv_transfer_params` reaches the API response), selected with vLLM's public
`--scheduler-cls` option; on a non-producer engine it does nothing.

A locator names the VE as the Neuron connector does: `engine_id` and the side channel
(`side_channel_host`, `side_channel_port`) from `--ec-transfer-config`, the item's embedding
rows as `num_tokens`. Where the embeddings live is the connector's business: vLLM's
`ECExampleConnector` (CPU) keeps one file per item hash in a directory both engines share and
has no blocks, so `remote_block_ids` is `[0]`, the one "block" (file) of the item; the kit's
NIXL connector (nixl_connector.py) names the blocks of its region that hold the item.

On a PD with the kit's NIXL connector, this scheduler also ends the requests whose encoder
outputs could not be read (the connector's `take_load_failures`): finish_reason "error" and
ECLoadFailure's message in the answer's `kv_transfer_params`, as vLLM ends a request whose KV
load failed (`v1/core/sched/scheduler.py` update_from_output, `failed_kv_load_req_ids`, 0.24.0
and 0.29.0), so the engine core serves on.

The vLLM internals it reads are listed in compat.py (SCHEDULER_INTERNALS); a vLLM without one
refuses to start, naming its version (compat.require, called when vLLM builds the scheduler).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

# ending a request with an error, as vLLM's own failed-KV-load path does at 0.24.0 and 0.29.0:
# EngineCoreOutput(request_id, new_token_ids, finish_reason, events, kv_transfer_params,
# trace_headers) and EngineCoreOutputs(outputs) (v1/engine/__init__.py), RequestStatus.FINISHED_ERROR,
# whose finish reason is FinishReason.ERROR (v1/request.py), Scheduler.finish_requests
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import RequestStatus

from .compat import ENGINE_CORE_OUTPUT_FIELDS, SCHEDULER_INTERNALS, SCHEDULER_STATE, require

# ECExampleConnector stores an item as one file: its single "block"
FILE_STORE_BLOCK = 0


class ECLocatorScheduler(Scheduler):
    """vLLM's scheduler; on an EC producer each finished request carries its items' locators."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        require("ECLocatorScheduler", SCHEDULER_INTERNALS, fields=(EngineCoreOutput, ENGINE_CORE_OUTPUT_FIELDS))
        super().__init__(*args, **kwargs)
        require("ECLocatorScheduler", (), instance=self, state=SCHEDULER_STATE)
        config = self.vllm_config.ec_transfer_config
        self._locator_base: dict[str, Any] | None = None
        if config is not None and config.is_ec_producer:
            host = config.get_from_extra_config("side_channel_host", None)
            port = config.get_from_extra_config("side_channel_port", None)
            if not host or not isinstance(port, int):
                raise ValueError(
                    "ECLocatorScheduler: --ec-transfer-config's ec_connector_extra_config needs "
                    f"side_channel_host and an integer side_channel_port (got {host!r}, {port!r})"
                )
            self._locator_base = {"engine_id": config.engine_id, "host": host, "port": port}

    def _blocks(self, mm_hash: str) -> list[int]:
        item_blocks = getattr(self.ec_connector, "item_blocks", None)  # the kit's NIXL connector
        return item_blocks(mm_hash) if item_blocks is not None else [FILE_STORE_BLOCK]

    def _locators(self, request_id: str) -> dict[str, dict[str, Any]]:
        request = self.requests[request_id]
        assert self._locator_base is not None
        return {
            feature.identifier: {
                **self._locator_base,
                "remote_block_ids": self._blocks(feature.identifier),
                "num_tokens": request.get_num_encoder_embeds(index),
            }
            for index, feature in enumerate(request.mm_features)
        }

    def _end_failed_loads(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        """The requests the EC connector could not load end with an error, as a failed KV load
        ends (`failed_kv_load_req_ids` in vLLM's update_from_output): the outputs built the
        same way, plus the connector's message under kv_transfer_params."""
        take = getattr(self.ec_connector, "take_load_failures", None)
        failures = take() if take is not None else {}
        requests = [self.requests[rid] for rid in failures if rid in self.requests]
        if not requests:
            return
        # finish_requests returns (id, client) pairs at 0.24.0 and requests at 0.29.0: not used
        self.finish_requests([r.request_id for r in requests], RequestStatus.FINISHED_ERROR)
        for request in requests:
            output = EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason=request.get_finished_reason(),
                events=request.take_events(),
                kv_transfer_params={"ec_load_failure": failures[request.request_id]},
                trace_headers=request.trace_headers,
            )
            if request.client_index in outputs:
                outputs[request.client_index].outputs.append(output)
            else:
                outputs[request.client_index] = EngineCoreOutputs(outputs=[output])

    def update_from_output(self, scheduler_output, model_runner_output):  # type: ignore[no-untyped-def]
        if self._locator_base is None:
            outputs = super().update_from_output(scheduler_output, model_runner_output)
            self._end_failed_loads(outputs)
            return outputs
        # read before the base class frees the requests that finish in this step
        locators = {
            request_id: self._locators(request_id)
            for request_id in scheduler_output.num_scheduled_tokens
            if request_id in self.requests
        }
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for engine_outputs in outputs.values():
            for output in engine_outputs.outputs:
                if output.finish_reason is not None and locators.get(output.request_id):
                    params = dict(output.kv_transfer_params or {})
                    params["ec_locator"] = locators[output.request_id]
                    output.kv_transfer_params = params
        return outputs
