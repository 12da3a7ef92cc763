"""/metrics and /pools answer only a peer in admin.networks or a request with the admin token;
anyone else gets the 404 of a path that does not exist (docs/security.md "Operator endpoints").
The peer is the TCP peer: X-Forwarded-For is never believed."""

from __future__ import annotations

import httpx
import pytest

from epd_kit.router.app import create_app
from epd_kit.router_yaml import ConfigError, parse_config

TOKEN = "adm-3c9f1e77"
OPERATOR = ("/metrics", "/pools")


@pytest.fixture
def make_app(config, char_renderer, tmp_path):
    def make(**admin):
        token = tmp_path / "admin-token"
        token.write_text(TOKEN + "\n")
        token.chmod(0o640)
        return create_app(parse_config(config(admin={"token_file": str(token), **admin})), char_renderer())

    return make


def client(app, peer: str) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, client=(peer, 40000))
    return httpx.AsyncClient(transport=transport, base_url="http://router")


@pytest.mark.parametrize("path", OPERATOR)
async def test_a_client_outside_the_admin_networks_is_told_there_is_no_such_route(make_app, path):
    app = make_app()
    async with client(app, "10.9.9.9") as c:
        unknown = await c.get("/no-such-path")
        for headers in ({}, {"X-Forwarded-For": "127.0.0.1"}, {"Authorization": "Bearer not-the-token"}):
            r = await c.get(path, headers=headers)
            assert r.status_code == 404, headers
            # the body of any missing path: nothing says the route exists
            assert r.json()["error"] == {**unknown.json()["error"], "message": f"no route {path}"}
        assert (await c.get(path, headers={"Authorization": f"Bearer {TOKEN}"})).status_code == 200
        for open_path in ("/health", "/healthcheck"):
            assert (await c.get(open_path)).status_code == 200, open_path


@pytest.mark.parametrize("path", OPERATOR)
async def test_loopback_and_the_configured_networks_are_admitted(make_app, path):
    app = make_app(networks=["127.0.0.0/8", "::1/128", "10.9.0.0/16"])
    for peer in ("127.0.0.1", "::1", "10.9.9.9", "::ffff:10.9.1.2"):
        async with client(app, peer) as c:
            assert (await c.get(path)).status_code == 200, peer
    for peer in ("10.8.0.1", "fe80::1", "testclient"):
        async with client(app, peer) as c:
            assert (await c.get(path)).status_code == 404, peer


async def test_the_default_admits_loopback_only(config, char_renderer):
    app = create_app(parse_config(config()), char_renderer())
    async with client(app, "127.0.0.1") as c:
        assert (await c.get("/pools")).status_code == 200
    async with client(app, "192.168.1.5") as c:
        assert (await c.get("/pools")).status_code == 404


def test_a_bad_network_is_refused_with_its_key(config):
    with pytest.raises(ConfigError, match=r"admin.networks: .*'10.0.0.0/33' is not an address or network"):
        parse_config(config(admin={"networks": ["10.0.0.0/33"]}))
