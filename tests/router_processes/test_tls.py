"""The router serving TLS itself (listen.tls; docs/router.md "TLS"): HTTPS verified against a CA
made here, plain HTTP refused, a renewal on SIGHUP under load that fails no request and keeps
open connections, a bad new pair kept out, a bad pair at start refused with its file names."""

from __future__ import annotations

import re
import socket
import subprocess
import threading
import time

import httpx
import pytest

from tests.budget import scaled
from tests.hosts.certs import SandboxCa, served_serial, trust
from tests.vllm_dist import bench_argv, bench_summary

from .harness import HOST, ROUTER, RouterProc, Stack, free_port, wait_until


@pytest.fixture(scope="module")
def ca(sandbox_ca) -> SandboxCa:
    """The session's CA (conftest.py): the vLLM process trusts it from its start."""
    return sandbox_ca


@pytest.fixture(scope="module")
def stack(ckpt, tmp_path_factory, ca):
    """One TLS stack for the module (a stack is ~2 CPU-s to start): the tests that renew its
    pair leave it serving a valid certificate of `ca`, and each reads only the log lines it caused."""
    issued = ca.issue("router", [HOST])
    s = Stack.start(
        ckpt,
        tmp_path_factory.mktemp("tls-stack"),
        1,
        1,
        ca=ca.path,
        listen={"tls": {"certificate": str(issued.certificate), "key": str(issued.key)}},
    )
    yield s
    s.stop()


def chat(n: int) -> dict:
    return {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": f"request {n}"}]}


def renew(ca: SandboxCa, stack: Stack, stem: str, **kwargs) -> int:
    """A new pair written over the files the router reads (each by rename, as an operator's
    tool or the role writes them), then SIGHUP; the new certificate's serial."""
    issued = ca.issue(stem, [HOST], **kwargs)
    tls = stack.config["listen"]["tls"]
    for source, target in ((issued.certificate, tls["certificate"]), (issued.key, tls["key"])):
        tmp = f"{target}.new"
        with open(tmp, "wb") as out:
            out.write(source.read_bytes())
        subprocess.run(["mv", tmp, target], check=True)
    stack.router.reload()
    return issued.serial


def test_https_with_the_ca_answers_and_plain_http_is_refused(stack, ca):
    with httpx.Client(base_url=stack.router.url, verify=trust(ca), timeout=10) as client:
        assert client.post("/v1/chat/completions", json=chat(0)).status_code == 200
    # plain HTTP on the TLS port: the TLS layer rejects the bytes, no HTTP answer comes back
    with socket.create_connection((HOST, stack.router.port), timeout=5) as raw:
        raw.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        try:
            while chunk := raw.recv(4096):
                answer += chunk
        except ConnectionResetError:
            pass
    assert b"HTTP/1.1 200" not in answer, answer
    with pytest.raises(httpx.HTTPError):
        httpx.get(stack.router.url.replace("https", "http") + "/health", timeout=5)
    # a client that does not trust the CA is refused by its own check
    with pytest.raises(httpx.ConnectError):
        httpx.get(stack.router.url + "/health", timeout=5)


def test_a_renewal_under_load_fails_no_request_and_keeps_open_connections(stack, ca):
    first = served_serial(HOST, stack.router.port, ca.path)
    reloads = stack.router.log().count("TLS certificate reloaded")  # the module's stack: earlier tests' lines
    results: list[int | str] = []
    stop = threading.Event()

    def load(keep_alive: bool) -> None:
        deadline = time.monotonic() + 20  # bounded in time and count
        with httpx.Client(base_url=stack.router.url, verify=trust(ca), timeout=10) as kept:
            for n in range(400):
                if stop.is_set() or time.monotonic() > deadline:
                    return
                try:
                    if keep_alive:
                        status = kept.post("/v1/chat/completions", json=chat(n)).status_code
                    else:  # a new connection, so a new handshake, each time
                        with httpx.Client(base_url=stack.router.url, verify=trust(ca), timeout=10) as fresh:
                            status = fresh.post("/v1/chat/completions", json=chat(n)).status_code
                    results.append(status)
                except httpx.HTTPError as exc:
                    results.append(repr(exc))
                time.sleep(0.02)

    threads = [threading.Thread(target=load, args=(keep,)) for keep in (True, True, False, False)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(1)
        second = renew(ca, stack, "renewed")
        wait_until(lambda: served_serial(HOST, stack.router.port, ca.path) == second, 10, "the new certificate")
        time.sleep(1)
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert second != first
    assert len(results) > 40, results
    assert set(results) == {200}, [r for r in results if r != 200][:10]
    assert stack.router.log().count("TLS certificate reloaded") > reloads


def test_a_bad_new_pair_keeps_the_running_certificate(stack, ca):
    before = served_serial(HOST, stack.router.port, ca.path)
    failures = stack.router.log().count("TLS certificate reload failed")  # the module's stack: earlier lines
    other = ca.issue("other", [HOST])
    renew(ca, stack, "mismatched", key_of=other)  # a certificate with another pair's key
    wait_until(lambda: stack.router.log().count("TLS certificate reload failed") > failures, 10, "the reload error")
    assert served_serial(HOST, stack.router.port, ca.path) == before
    with httpx.Client(base_url=stack.router.url, verify=trust(ca), timeout=10) as client:
        assert client.post("/v1/chat/completions", json=chat(1)).status_code == 200
    assert "PRIVATE KEY" not in stack.router.log()


def test_a_bad_pair_at_start_is_refused_naming_the_files(ckpt, tmp_path, ca):
    good, other = ca.issue("good", [HOST]), ca.issue("other", [HOST])
    port = free_port()
    config = tmp_path / "router.yaml"
    router = RouterProc(config, tmp_path / "router.log", port, ca=ca.path)
    router.write_config(
        {
            "model": str(ckpt),
            "listen": {
                "host": HOST,
                "port": port,
                "tls": {"certificate": str(good.certificate), "key": str(other.key)},
            },
            "endpoints": {
                "ve": [{"id": "ve-0", "url": "http://127.0.0.1:9"}],
                "pd": [{"id": "pd-0", "url": "http://127.0.0.1:9"}],
            },
        }
    )
    done = subprocess.run(
        [ROUTER, "serve", "--config", str(config)], check=False, capture_output=True, text=True, timeout=scaled(60)
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"listen.tls.certificate {good.certificate}" in done.stderr and str(other.key) in done.stderr, done.stderr
    assert "PRIVATE KEY" not in done.stderr + done.stdout


def test_the_openai_sdk_over_tls_streaming_and_not_with_images(stack, ca):
    import openai

    from epd_kit.testing.images import image_part, png_data_url, user_message

    client = openai.OpenAI(
        base_url=stack.router.url + "/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.Client(verify=trust(ca), timeout=30),
    )
    messages = [user_message("Describe this image.", image_part(png_data_url(320, 200, seed=1)))]
    answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert answer.choices[0].message.content and streamed == answer.choices[0].message.content
    print(f"openai SDK over TLS: {answer.usage}; stream of {len(chunks)} chunks, same text")


VLLM_BENCH_PROMPTS = 30


def test_vllms_own_benchmark_client_over_tls(stack, ca, ckpt, vllm_process):
    """`vllm bench serve --backend openai-chat --dataset-name random-mm` from the vLLM-compat venv
    (vllm 0.24.0, scripts/compat-env.sh) through the router's TLS listener, trusting the sandbox
    CA through SSL_CERT_FILE: vllm 0.24.0's benchmarks/serve.py gives aiohttp `ssl=True` for an
    https base URL (no CA option besides --insecure), and aiohttp's verified context is
    ssl.create_default_context(), whose default verify paths OpenSSL takes from SSL_CERT_FILE
    (the session's vLLM process has `ca` there from its start, conftest.py `vllm_process`)."""
    vllm = vllm_process()
    if vllm is None:
        pytest.skip("the vLLM-compat venv is not built (yet): scripts/compat-env.sh --vllm 0.24.0 builds it")
    argv = bench_argv(stack.router.url, str(ckpt), "tiny", VLLM_BENCH_PROMPTS, images=True)
    status, out, err = vllm.run(argv, stack.workdir, timeout=240)
    summary = bench_summary(out)
    print(f"vllm bench serve over TLS (exit {status}):\n{summary}")
    assert status == 0, err[-3000:]
    assert re.search(rf"Successful requests:\s+{VLLM_BENCH_PROMPTS}\b", out), summary
    assert re.search(r"Failed requests:\s+0\b", out), summary
