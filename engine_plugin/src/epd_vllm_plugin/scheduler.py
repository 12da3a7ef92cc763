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
has no blocks, so `remote_block_ids` is `[0]`, the one "block" (file) of the item.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

# ECExampleConnector stores an item as one file: its single "block"
FILE_STORE_BLOCK = 0


class ECLocatorScheduler(Scheduler):
    """vLLM's scheduler; on an EC producer each finished request carries its items' locators."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
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

    def _locators(self, request_id: str) -> dict[str, dict[str, Any]]:
        request = self.requests[request_id]
        assert self._locator_base is not None
        return {
            feature.identifier: {
                **self._locator_base,
                "remote_block_ids": [FILE_STORE_BLOCK],
                "num_tokens": request.get_num_encoder_embeds(index),
            }
            for index, feature in enumerate(request.mm_features)
        }

    def update_from_output(self, scheduler_output, model_runner_output):  # type: ignore[no-untyped-def]
        if self._locator_base is None:
            return super().update_from_output(scheduler_output, model_runner_output)
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
