"""Operations: API keys, the reference router's flags as a drop-in, logs without secrets."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess

import httpx
import openai
import pytest

from tests.budget import scaled

from .harness import HOST, ROUTER, RouterProc, SimEngine, free_port, http_ok, router_config, wait_until

KEY = "sk-test-0123456789abcdef"


@pytest.fixture(scope="module")
def engines(ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("ops")
    ve = SimEngine("ve", "epd-ve-0", ckpt, d).start()
    pd = SimEngine("pd", "epd-pd-0", ckpt, d).start()
    try:
        ve.wait_healthy()
        pd.wait_healthy()
        yield ve, pd, d
    finally:
        ve.stop()
        pd.stop()


def test_api_keys(engines, ckpt, oracle):
    ve, pd, d = engines
    keys = d / "keys"
    keys.write_text(f"# client keys\n{KEY}\nsk-other\n")
    keys.chmod(0o600)
    router = RouterProc(d / "auth.yaml", d / "auth.log", free_port())
    router.write_config(router_config(ckpt, [ve], [pd], router.port, auth={"api_keys_file": str(keys)}))
    router.start()
    try:
        url = router.url
        for path in ("/health", "/ready", "/healthcheck"):
            assert httpx.get(url + path).status_code == 200, path
        for path in ("/pools", "/metrics", "/v1/models"):
            r = httpx.get(url + path)
            assert r.status_code == 401 and "missing API key" in r.json()["error"]["message"]
            assert httpx.get(url + path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        r = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["message"] == "invalid API key"
        assert r.headers["www-authenticate"] == "Bearer"
        r = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": "Basic abc"})
        assert r.status_code == 401 and "Bearer" in r.json()["error"]["message"]
        c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        resp = c.chat.completions.create(model="m", messages=body["messages"], max_tokens=4)
        assert resp.choices[0].token_ids == oracle.expect(body["messages"], 4)[1]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
    finally:
        router.stop()
    assert KEY not in router.log() and "sk-other" not in router.log()


def test_forwarded_headers_never_change_the_peer(engines, ckpt):
    """The peer is the TCP peer (docs/router.md "Operator endpoints"): a loopback client's
    X-Forwarded-For naming another address neither locks it out of the operator endpoints nor
    (from elsewhere) lets it in. uvicorn believes that header from 127.0.0.1 by default."""
    ve, pd, d = engines
    router = RouterProc(d / "xff.yaml", d / "xff.log", free_port())
    router.write_config(router_config(ckpt, [ve], [pd], router.port))
    router.start()
    try:
        for path in ("/pools", "/metrics"):
            for header in ("X-Forwarded-For", "X-Forwarded-Proto"):
                value = "203.0.113.9" if header == "X-Forwarded-For" else "https"
                r = httpx.get(router.url + path, headers={header: value})
                assert r.status_code == 200, (path, header, r.status_code)
    finally:
        router.stop()


def test_world_readable_key_file_refused(engines, ckpt):
    ve, pd, d = engines
    keys = d / "open-keys"
    keys.write_text(KEY + "\n")
    keys.chmod(0o644)
    cfg_path = d / "open.yaml"
    cfg_path.write_text(json.dumps(router_config(ckpt, [ve], [pd], free_port(), auth={"api_keys_file": str(keys)})))
    proc = subprocess.run(
        [ROUTER, "serve", "--config", str(cfg_path)], check=False, capture_output=True, text=True, timeout=scaled(60)
    )
    assert proc.returncode == 2
    assert "chmod 600" in proc.stderr and KEY not in proc.stderr + proc.stdout


def test_reference_flags_drop_in(engines, ckpt, oracle):
    ve, pd, d = engines
    port = free_port()
    log = open(d / "flags.log", "wb")  # noqa: SIM115 (closed once the child has it)
    proc = subprocess.Popen(
        [
            ROUTER,
            "--model",
            str(ckpt),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--ve-timeout-s",
            "30",
            "--pd-timeout-s",
            "30",
            "--ve-endpoint",
            f"127.0.0.1:{ve.port}",
            "--pd-endpoint",
            f"127.0.0.1:{pd.port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: http_ok(url + "/ready"), 60, "router from flags")
        assert httpx.get(url + "/healthcheck").json()["ve_instances"] == 1
        assert {e["id"] for e in httpx.get(url + "/pools").json()["engines"]} == {"ve-0", "pd-0"}
        messages = [{"role": "user", "content": "The quick brown fox"}]
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        resp = c.chat.completions.create(model="m", messages=messages, max_tokens=6)
        assert resp.choices[0].token_ids == oracle.expect(messages, 6)[1]
        # SIGHUP without a config file is logged and ignored, the router keeps serving
        proc.send_signal(1)
        wait_until(lambda: b"reload requested" in (d / "flags.log").read_bytes(), 5, "reload log")
        assert http_ok(url + "/ready")
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0
        log.close()


def test_saturation_429_and_upstream_timeout_504(engines, ckpt):
    ve, _, d = engines
    hung = SimEngine("pd", "epd-pd-hung", ckpt, d, {"EPD_SIM_HANG_AFTER": "0"}).start()
    try:
        hung.wait_healthy()
        router = RouterProc(d / "hang.yaml", d / "hang.log", free_port())
        router.write_config(
            router_config(
                ckpt,
                [ve],
                [hung],
                router.port,
                timeouts={"pd_s": 4},  # holds the slot long enough to see the 429 on a loaded machine
                placement={"pd_max_inflight": 1, "queue_size": 0},
                health={"failure_threshold": 10},
            )
        )  # keep it in rotation
        router.start()
        try:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                first = pool.submit(httpx.post, router.url + "/v1/chat/completions", json=body, timeout=20)
                wait_until(lambda: router.pools()["epd-pd-hung"]["inflight"] == 1, 10, "PD slot taken")
                busy = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=20)
                assert busy.status_code == 429 and int(busy.headers["retry-after"]) >= 1
                assert "wait queue is full" in busy.json()["error"]["message"]
                assert first.result(timeout=20).status_code == 504
            for stream in (False, True):
                r = httpx.post(router.url + "/v1/chat/completions", json={**body, "stream": stream}, timeout=20)
                assert r.status_code == 504, r.text
                msg = r.json()["error"]["message"]
                # the client learns what happened, not which engine at which address (issue
                # 33); the router's log has both
                assert "the engine did not answer within" in msg and "(generate)" in msg, msg
                assert hung.engine_id not in msg and f"{HOST}:{hung.port}" not in msg, msg
                assert r.json()["request_id"] == r.headers["x-request-id"]
            assert f"generate on PD epd-pd-hung (http://{HOST}:{hung.port}) timed out" in router.log()
        finally:
            router.stop()
    finally:
        hung.stop()


def test_http_images_only_from_allowed_hosts(engines, ckpt, oracle):
    """`media` reaches the preprocessor: an allow-listed http URL works, anything else is a
    400 before any fetch (the router must not be an SSRF tool)."""
    import http.server
    import threading

    from epd_kit.testing.images import encode_image, image_part, make_image, user_message

    png = encode_image(make_image(300, 220, seed=42))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(png)))
            self.end_headers()
            self.wfile.write(png)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    ve, pd, d = engines
    allowed = f"127.0.0.1:{server.server_port}"
    router = RouterProc(d / "media.yaml", d / "media.log", free_port())
    router.write_config(
        router_config(ckpt, [ve], [pd], router.port, media={"allow_http": True, "allowed_hosts": [allowed]})
    )
    router.start()
    try:
        c = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
        fetched = [user_message("What is it?", image_part(f"http://{allowed}/cat.png"))]
        inline = [
            user_message(
                "What is it?", image_part("data:image/png;base64," + __import__("base64").b64encode(png).decode())
            )
        ]
        resp = c.chat.completions.create(model="m", messages=fetched, max_tokens=8)
        # same pixels by URL or inline: the same content hash, so the same answer
        assert resp.choices[0].token_ids == oracle.expect(inline, 8)[1]
        for url in ("http://127.0.0.2:9/x.png", "http://localhost:1/x.png", "file:///etc/passwd"):
            body = {"messages": [user_message("x", image_part(url))], "max_tokens": 4}
            r = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=20)
            assert r.status_code == 400, (url, r.text)
            assert "messages[0].content[1]" in r.json()["error"]["message"]
    finally:
        router.stop()
        server.shutdown()
