"""The tutorial's 1E1PD engine commands (tutorial_ve0.sh / tutorial_pd0.sh, verbatim), parsed.

One source for every golden test: the planner's argv (tier 1) and the rendered units (tier 2)."""

from __future__ import annotations

import shlex
from pathlib import Path

GOLDEN = Path(__file__).parent
# "Prepare your environment": exported in every engine terminal (local checkpoint: HF_HUB_OFFLINE=1)
TUTORIAL_EXPORTS = {
    "FI_EFA_ENABLE_SHM_TRANSFER": "0",
    "FI_EFA_USE_DEVICE_RDMA": "1",
    "VLLM_NEURON_COMPILATION_TIMEOUT": "6000",
    "HF_HUB_OFFLINE": "1",
}
# What the kit sets beyond the tutorial, on purpose: the cold-start timeouts the vLLM Neuron docs
# raise for long compiles, derived from the tutorial's compile budget of 6000 s
# (epd_kit.plan.managed.cold_start_timeouts; docs/operations.md "Timeouts")
KIT_EXPORTS = {
    "NEURON_LIBTORCH_COMPILATION_TIMEOUT": "6000",
    "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "6000",
    "VLLM_ENGINE_READY_TIMEOUT_S": "6300",
}
# every flag of the tutorial's two serve commands, in their order (the role flags of each pool in
# their place)
TUTORIAL_FLAGS = (
    "--tensor-parallel-size",
    "--host",
    "--port",
    "--max-model-len",
    "--max-num-batched-tokens",
    "--max-num-seqs",
    "--dtype",
    "--limit-mm-per-prompt",
    "--no-enable-prefix-caching",
    "--mm-encoder-only",
    "--no-async-scheduling",
    "--mm-processor-cache-gb",
    "--additional-config",
    "--ec-transfer-config",
)

FILES = {"ve-0": "tutorial_ve0.sh", "pd-0": "tutorial_pd0.sh"}


def tutorial_command(instance: str, model: str) -> tuple[dict[str, str], list[str]]:
    """(environment prefix, argv) of the tutorial's command for `instance`, parsed as a POSIX shell would."""
    text = (GOLDEN / FILES[instance]).read_text()
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    command = "\n".join(lines).replace("\\\n", " ").replace('"$MODEL"', shlex.quote(model))
    tokens = shlex.split(command)
    env = {}
    while "=" in tokens[0] and not tokens[0].startswith("-"):
        key, _, value = tokens.pop(0).partition("=")
        env[key] = value
    return env, tokens
