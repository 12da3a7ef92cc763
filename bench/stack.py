"""Start the parts under test on 127.0.0.1: sim engines (the kit's exact argv, from the
planner), epd-router (a router.yaml like the one Ansible renders), the floor proxy.

Engine argv and env come from the kit's engine command model (epd_kit.plan, through
epd_kit.sim.launch), with the `sim` backend and ports from `free_port()`; `--sim-*` flags are
appended.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import yaml

from bench.common import REPO
from bench.procs import VENV_BIN, Proc, free_port
from epd_kit.sim import launch


def engine_proc(
    role: str,
    index: int,
    checkpoint: Path,
    work_dir: Path,
    *,
    max_num_seqs: int = 8,
    images_per_prompt: int = 4,
    sim_flags: list[str] | None = None,
    ec_extra: dict | None = None,
) -> Proc:
    """One sim engine exactly as the kit would run it (planner argv + env), on a free port."""
    port = free_port()
    engine_id = f"epd-{role}-{index}"
    command = launch.engine_command(
        role,
        str(checkpoint),
        port,
        side_channel_port=free_port() if role == "ve" else None,
        engine_id=engine_id,
        max_num_seqs=max_num_seqs,
        images=images_per_prompt,
    )
    if ec_extra:  # connector knobs (docs/contract.md §6.3 ec_connector_extra_config), e.g. transfer_timeout_sec
        command = command.merge_json("EPD_EC_TRANSFER_CONFIG", {"ec_connector_extra_config": ec_extra})
    argv = command.argv(str(VENV_BIN / "epd-sim"))
    argv += ["--disable-uvicorn-access-log", *(sim_flags or ["--sim-profile", "zero"])]
    tp = int(command.values["EPD_TENSOR_PARALLEL_SIZE"])
    env = launch.engine_env(",".join(str(core) for core in range(index * tp, index * tp + tp)), base={})
    return Proc(
        name=engine_id,
        argv=argv,
        port=port,
        health_path="/health",
        log_path=work_dir / f"{engine_id}.log",
        extra_env=env,
    )


def router_proc(
    checkpoint: Path,
    ve: list[Proc],
    pd: list[Proc],
    work_dir: Path,
    *,
    extra: dict | None = None,
    listen: dict | None = None,
    launcher: list[str] | None = None,
) -> Proc:
    """epd-router serve --config FILE, with a config like the one Ansible renders; `listen`
    settings join the listen section (host and port stay the bench's)."""
    port = free_port()
    cfg = {
        "model": str(checkpoint),
        "listen": {**(listen or {}), "host": "127.0.0.1", "port": port},
        "endpoints": {
            "ve": [{"id": p.name, "url": p.url, "state": "active"} for p in ve],
            "pd": [{"id": p.name, "url": p.url, "state": "active"} for p in pd],
        },
        **(extra or {}),
    }
    path = work_dir / "router.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    argv = (launcher or [str(VENV_BIN / "epd-router")]) + ["serve", "--config", str(path), "--log-level", "WARNING"]
    return Proc(name="epd-router", argv=argv, port=port, health_path="/health", log_path=work_dir / "router.log")


@contextlib.contextmanager
def tiny_stack(prefix: str, *, listen: dict | None = None) -> Iterator[Proc]:
    """The tiny checkpoint, one VE and one PD sim and a router in front of them, healthy; all
    stopped on exit (the hostile-input and slowloris runs)."""
    from epd_kit.testing.checkpoint import build_tiny_checkpoint

    work = Path(tempfile.mkdtemp(prefix=prefix))
    ckpt = build_tiny_checkpoint(work / "checkpoint")
    procs = [engine_proc("ve", 0, ckpt, work).start(), engine_proc("pd", 0, ckpt, work).start()]
    try:
        for p in procs:
            p.wait_healthy()
        router = router_proc(ckpt, procs[:1], procs[1:], work, listen=listen).start()
        procs.append(router)
        router.wait_healthy()
        yield router
    finally:
        for p in reversed(procs):
            p.stop()


def floor_proc(ve: Proc, pd: Proc, work_dir: Path) -> Proc:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "bench.passthrough_proxy",
        "--ve-url",
        ve.url,
        "--pd-url",
        pd.url,
        "--port",
        str(port),
    ]
    return Proc(
        name="floor-proxy",
        argv=argv,
        port=port,
        health_path="/health",
        log_path=work_dir / "floor.log",
        extra_env={"PYTHONPATH": str(REPO)},
    )
