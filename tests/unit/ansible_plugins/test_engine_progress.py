"""plugins/modules/epd_engine_progress.py and its action plugin: the phase an engine's log names,
and the end-of-wait summary."""

from pathlib import Path

from epd_kit.sim import server
from epd_kit.sim.config import VLLM_VERSION
from tests import repo_modules

progress = repo_modules.module("epd_engine_progress")
action = repo_modules.load("plugins/action/epd_engine_progress.py", "epd_engine_progress_action")


def test_the_sim_log_walks_through_every_phase():
    """epd-sim logs what vLLM logs at each step (docs/sim.md "Lifecycle"); each step names its phase."""
    steps = [
        (f"vLLM API server version {VLLM_VERSION}", None),
        ("Loading weights and compiling for Neuron (simulated, 0.5 s)...", "compiling"),
        ("Compilation finished.", "warming up"),
        ("Warming up prefill bucket 8192...", "warming up"),
        ("Uvicorn running on http://127.0.0.1:18100 (Press CTRL+C to quit)", "health check"),
    ]
    lines: list[str] = []
    for line, phase in steps:
        lines.append(line)
        assert progress.log_phase(lines)[0] == phase, line
    weights = "Loading model weights took 12.3 GiB"
    assert progress.log_phase([weights]) == ("loading", weights)
    assert progress.log_phase([]) == (None, "")


def test_the_sim_still_logs_the_lines_the_phases_match():
    source = Path(server.__file__).read_text()
    for text in ("Loading weights and compiling", "Compilation finished.", "Warming up"):
        assert text in source, text


def test_summary_names_the_slowest_engines_first():
    engines = [
        {"instance": "ve-0", "phase": "ready", "done": True, "elapsed_s": 30.2},
        {"instance": "pd-0", "phase": "ready", "done": True, "elapsed_s": 412.0},
        {"instance": "pd-1", "phase": "compiling", "done": False, "elapsed_s": 75.0},
    ]
    assert action.summary(engines, 2, timed_out=True) == [
        "pd-0: ready after 6m52s",
        "pd-1: compiling after 1m15s",
        "ve-0: ready after 30 s",
        "slowest: pd-0 6m52s, pd-1 1m15s",
        "timed out waiting: pd-1",
    ]
