"""Start the parts under test on 127.0.0.1: sim engines (the kit's exact argv, from the
planner), epd-router (a router.yaml like the one Ansible renders), the floor proxy.

Engine argv and env come from `plugins/filter/epd_topology.py` (the one place the kit builds
them), with the `sim` backend and ports from `free_port()`; `--sim-*` flags are appended.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from functools import lru_cache
from pathlib import Path
from types import ModuleType

import yaml

from bench.common import REPO
from bench.procs import VENV_BIN, Proc, free_port


@lru_cache(maxsize=1)
def planner() -> ModuleType:
    path = REPO / "plugins" / "filter" / "epd_topology.py"
    spec = importlib.util.spec_from_file_location("epd_topology", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("epd_topology", module)
    spec.loader.exec_module(module)
    return module


def engine_proc(
    role: str, index: int, checkpoint: Path, work_dir: Path, *, max_num_seqs: int = 8,
    images_per_prompt: int = 4, sim_flags: list[str] | None = None,
    ec_extra: dict | None = None,
) -> Proc:
    """One sim engine exactly as the kit would run it (planner argv + env), on a free port."""
    topo = planner()
    settings = topo.read_settings({
        "epd_model": str(checkpoint),
        "epd_engine_backend": "sim",
        "epd_max_num_seqs": max_num_seqs,
        "epd_images_per_prompt": images_per_prompt,
    })
    port = free_port()
    engine_id = f"{settings.engine_id_prefix}-{role}-{index}"
    side = free_port() if role == "ve" else None
    argv = topo.serve_argv(settings, role, engine_id, "127.0.0.1", port, side)
    argv[0] = str(VENV_BIN / "epd-sim")
    if ec_extra:  # connector knobs (contract §6.3 ec_connector_extra_config), e.g. transfer_timeout_sec
        i = argv.index("--ec-transfer-config") + 1
        ec = json.loads(argv[i])
        ec["ec_connector_extra_config"].update(ec_extra)
        argv[i] = json.dumps(ec)
    argv += ["--disable-uvicorn-access-log", *(sim_flags or ["--sim-profile", "zero"])]
    tp = settings.tp(role)
    env = topo.engine_env(settings, list(range(index * tp, index * tp + tp)))
    return Proc(name=engine_id, argv=argv, port=port, health_path="/health",
                log_path=work_dir / f"{engine_id}.log", extra_env=env)


def router_proc(
    checkpoint: Path, ve: list[Proc], pd: list[Proc], work_dir: Path, *,
    extra: dict | None = None, launcher: list[str] | None = None,
) -> Proc:
    """epd-router serve --config FILE, with a config like the one Ansible renders."""
    port = free_port()
    cfg = {
        "model": str(checkpoint),
        "listen": {"host": "127.0.0.1", "port": port},
        "endpoints": {
            "ve": [{"id": p.name, "url": p.url, "state": "active"} for p in ve],
            "pd": [{"id": p.name, "url": p.url, "state": "active"} for p in pd],
        },
        **(extra or {}),
    }
    path = work_dir / "router.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    argv = (launcher or [str(VENV_BIN / "epd-router")]) + ["serve", "--config", str(path),
                                                          "--log-level", "WARNING"]
    return Proc(name="epd-router", argv=argv, port=port, health_path="/health",
                log_path=work_dir / "router.log")


def floor_proc(ve: Proc, pd: Proc, work_dir: Path) -> Proc:
    port = free_port()
    argv = [sys.executable, "-m", "bench.passthrough_proxy", "--ve-url", ve.url, "--pd-url", pd.url,
            "--port", str(port)]
    return Proc(name="floor-proxy", argv=argv, port=port, health_path="/health",
                log_path=work_dir / "floor.log", extra_env={"PYTHONPATH": str(REPO)})
