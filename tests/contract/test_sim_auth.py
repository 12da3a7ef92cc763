"""The simulated engine checks API keys as `vllm serve` 0.24.0 does (epd_kit/sim/auth.py cites
vLLM's code): --api-key (one or more values, the last flag wins) before VLLM_API_KEY, only the
/v1, /v2 and /inference paths (0.29.0: and /cohere), never OPTIONS, 401 {"error": "Unauthorized"}."""

from __future__ import annotations

import httpx
import pytest
from sim_harness import PD_CORES, Launcher, engine_env, free_port, pd_argv

from epd_kit.sim.auth import engine_tokens, split_api_key_flag

BODY = {
    "request_id": "auth-1",
    "token_ids": [5, 6, 7, 8],
    "features": {"mm_hashes": {}, "mm_placeholders": {}, "kwargs_data": {}},
    "sampling_params": {"max_tokens": 2, "ignore_eos": True},
    "stream": False,
}


def _start(launcher: Launcher, checkpoint, flags: list[str], env_key: str | None):
    env = engine_env(PD_CORES)
    if env_key is not None:
        env["VLLM_API_KEY"] = env_key
    argv = pd_argv(str(checkpoint.path), free_port()) + flags
    return launcher.start(argv, env, "pd").wait_ready()


def _generate(url: str, authorization: str | None) -> httpx.Response:
    headers = {"Authorization": authorization} if authorization is not None else {}
    return httpx.post(url + "/inference/v1/generate", json=BODY, headers=headers, timeout=10)


def test_flag_keys_win_over_the_environment_and_only_guarded_paths_are_checked(launcher: Launcher, checkpoint) -> None:
    pd = _start(launcher, checkpoint, ["--api-key", "k-one", "k-two"], env_key="k-env")
    refused = _generate(pd.url, None)
    assert refused.status_code == 401 and refused.json() == {"error": "Unauthorized"}
    assert _generate(pd.url, "Bearer k-one").status_code == 200
    assert _generate(pd.url, "bearer k-two").status_code == 200  # the scheme without case
    assert _generate(pd.url, "Bearer k-env").status_code == 401  # the flag replaced the environment
    assert _generate(pd.url, "Bearer  k-one").status_code == 401  # the key is not stripped
    assert _generate(pd.url, "Basic k-one").status_code == 401
    assert httpx.get(pd.url + "/v1/models", timeout=5).status_code == 401
    assert httpx.get(pd.url + "/v1/models", headers={"Authorization": "Bearer k-two"}, timeout=5).status_code == 200
    for open_path in ("/health", "/metrics", "/version"):
        assert httpx.get(pd.url + open_path, timeout=5).status_code == 200, open_path
    # OPTIONS is never checked: the app's own answer (405 here), not the 401
    assert httpx.request("OPTIONS", pd.url + "/inference/v1/generate", timeout=5).status_code != 401


def test_the_environment_key_alone(launcher: Launcher, checkpoint) -> None:
    pd = _start(launcher, checkpoint, [], env_key="k-env")
    assert _generate(pd.url, None).status_code == 401
    assert _generate(pd.url, "Bearer k-env").status_code == 200


@pytest.mark.parametrize(
    ("args", "env", "rest", "tokens"),
    [
        (["m", "--port", "1"], {}, ["m", "--port", "1"], []),
        (["m", "--api-key", "a", "b", "--port", "1"], {"VLLM_API_KEY": "e"}, ["m", "--port", "1"], ["a", "b"]),
        (["--api-key", "a", "--api-key", "c"], {}, [], ["c"]),  # argparse's store: the last flag
        (["--api-key=a"], {"VLLM_API_KEY": "e"}, [], ["a"]),
        ([], {"VLLM_API_KEY": "e"}, [], ["e"]),
        ([], {"VLLM_API_KEY": ""}, [], []),
        # "" is None (optional_type): the flag still wins, so no key is checked at all
        (["--api-key", ""], {"VLLM_API_KEY": "e"}, [], []),
    ],
)
def test_flag_parsing_and_precedence(args, env, rest, tokens) -> None:
    left, api_key = split_api_key_flag(args)
    assert left == rest
    assert engine_tokens(api_key, env) == tokens


def test_a_flag_without_a_value_is_an_error() -> None:
    with pytest.raises(ValueError, match="expected at least one argument"):
        split_api_key_flag(["--api-key", "--port", "1"])


@pytest.mark.parametrize(("vllm", "cohere_without_key"), [("0.24", 404), ("0.29", 401)])
def test_the_guarded_paths_follow_the_vllm_the_sim_answers_as(
    launcher: Launcher, checkpoint, vllm: str, cohere_without_key: int
) -> None:
    """vllm 0.29.0 guards /cohere too (entrypoints/serve/middleware/authenticate.py:11); 0.24.0
    does not, so there the path is the app's own 404."""
    env = engine_env(PD_CORES) | {"VLLM_API_KEY": "k-env", "EPD_SIM_VLLM": vllm}
    pd = launcher.start(pd_argv(str(checkpoint.path), free_port()), env, "pd").wait_ready()
    assert httpx.post(pd.url + "/cohere/v2/rerank", json={}, timeout=5).status_code == cohere_without_key
    assert _generate(pd.url, None).status_code == 401
    assert _generate(pd.url, "Bearer k-env").status_code == 200
