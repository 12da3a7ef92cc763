"""tests/vllm_dist.py VllmProcess, the one vLLM process that `vllm bench serve` runs share
(tests/router_processes/conftest.py `vllm_process`), on its failure paths. The kit's own venv has
no vLLM: each run's import of vLLM's CLI fails there, which is what these tests use."""

from __future__ import annotations

import os
import sys

from tests.vllm_dist import VllmProcess


def test_a_failed_run_reports_its_error_and_the_process_takes_the_next(tmp_path):
    process = VllmProcess(sys.executable, dict(os.environ), tmp_path)
    try:
        for _ in range(2):
            status, _, err = process.run(["bench", "serve"], tmp_path, timeout=60)
            assert status == 1
            assert "No module named 'vllm'" in err, err
            assert process.alive
    finally:
        process.close()
    assert not process.alive


def test_a_process_that_died_fails_the_run_and_is_no_longer_alive(tmp_path):
    """The fixture replaces a process that is not alive: a killed one must read so, and a run
    sent to it fail at once with what happened, not hang or raise."""
    process = VllmProcess(sys.executable, dict(os.environ), tmp_path)
    process._proc.kill()
    process._proc.wait()
    assert not process.alive
    status, _, err = process.run(["bench", "serve"], tmp_path, timeout=60)
    assert status == 1
    assert "no status within 60 s (scaled), or it died" in err, err
    assert not process.alive
