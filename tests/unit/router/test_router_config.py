"""Router config file + reference flags + `epd-router check-config` (exit codes, messages)."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from pydantic import ValidationError

from epd_kit.preprocess import ImageDimensionsRejected, Limits, Media
from epd_kit.router.app import build_renderer
from epd_kit.router.cli import main
from epd_kit.router_yaml import ConfigError, config_from_flags, load_config, parse_config
from epd_kit.testing.checkpoint import build_tiny_checkpoint
from epd_kit.testing.images import image_part, png_data_url, user_message
from tests.budget import scaled

ARCHITECTURE = Path(__file__).resolve().parents[3] / "docs" / "architecture.md"


def architecture_example() -> str:
    """The documented example config: the yaml block under "Router config file" in docs/architecture.md."""
    text = ARCHITECTURE.read_text()
    section = text[text.index("## Router config file") :]
    start = section.index("```yaml\n") + len("```yaml\n")
    return section[start : section.index("```", start)]


ARCH_EXAMPLE = architecture_example()


def minimal(**endpoints):
    return {
        "model": "/m",
        "endpoints": endpoints
        or {
            "ve": [{"id": "epd-ve-0", "url": "http://127.0.0.1:18300"}],
            "pd": [{"id": "epd-pd-0", "url": "http://127.0.0.1:18100"}],
        },
    }


def test_architecture_example_parses_with_documented_defaults(tmp_path):
    path = tmp_path / "router.yaml"
    path.write_text(ARCH_EXAMPLE)
    cfg = load_config(path)
    assert cfg.endpoints.pd[0].state.value == "draining"
    # a file with only the required keys gets exactly the documented defaults
    defaults = parse_config(minimal())
    full = yaml.safe_load(ARCH_EXAMPLE)
    for section in ("listen", "timeouts", "limits", "media", "health", "placement", "retries"):
        documented = full[section]
        got = getattr(defaults, section).model_dump()
        assert {k: got[k] for k in documented} == documented, section
    assert defaults.auth.api_keys_file is None
    assert defaults.endpoints.ve[0].state.value == "active"


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda d: d.update(bogus=1), "bogus: unknown key"),
        (
            lambda d: d["endpoints"]["ve"].append({"id": "epd-ve-0", "url": "http://127.0.0.1:1"}),
            "duplicate engine id 'epd-ve-0'",
        ),
        (
            lambda d: d["endpoints"]["pd"].append({"id": "epd-ve-0", "url": "http://127.0.0.1:1"}),
            "duplicate engine id 'epd-ve-0'",
        ),
        (lambda d: d["endpoints"]["ve"][0].update(url="127.0.0.1:18300"), "must start with http://"),
        (lambda d: d["endpoints"]["ve"][0].update(url="http://127.0.0.1"), "explicit port"),
        (lambda d: d["endpoints"]["ve"][0].update(url="http://127.0.0.1:99999"), "bad port"),
        (lambda d: d["endpoints"]["ve"][0].update(url="http://h:1/x"), "no path"),
        (lambda d: d["endpoints"]["ve"][0].update(state="paused"), "endpoints.ve.0.state"),
        (lambda d: d["endpoints"].update(pd=[]), "endpoints.pd"),
        (
            lambda d: d["endpoints"].update(ve=[]),
            "endpoints.ve: empty: list at least one VE, or set endpoints.text_only: true",
        ),
        (lambda d: d["endpoints"].update(text_only=True), "endpoints.ve: epd-ve-0 active with text_only: true"),
        (lambda d: d.pop("model"), "model: required key is missing"),
        (lambda d: d.update(placement={"ve_load_bound": 0.5}), "placement.ve_load_bound"),
        (lambda d: d.update(limits={"oversized_image": "crop"}), "limits.oversized_image"),
    ],
)
def test_bad_configs_are_rejected_readably(mutate, expected):
    data = minimal()
    mutate(data)
    with pytest.raises(ConfigError) as info:
        parse_config(data, "router.yaml")
    assert expected in str(info.value)
    assert str(info.value).startswith("router.yaml")


def test_reference_flags_map_to_positional_ids():
    cfg = config_from_flags(
        model="/m",
        ve_endpoints=["127.0.0.1:18300", "localhost:18301"],
        pd_endpoints=["127.0.0.1:18100"],
        ve_timeout_s=7,
        quantization="mxfp8",
    )
    assert [(e.id, e.url) for e in cfg.endpoints.ve] == [
        ("ve-0", "http://127.0.0.1:18300"),
        ("ve-1", "http://localhost:18301"),
    ]
    assert cfg.endpoints.pd[0].id == "pd-0"
    assert cfg.listen.port == 8000 and cfg.timeouts.ve_s == 7 and cfg.timeouts.pd_s == 600
    assert cfg.quantization == "mxfp8"
    with pytest.raises(ConfigError, match="expected host:port"):
        config_from_flags(model="/m", ve_endpoints=["nohost"], pd_endpoints=["h:1"])


def test_check_config_cli(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text(ARCH_EXAMPLE)
    runner = CliRunner()
    res = runner.invoke(main, ["check-config", str(good)])
    assert res.exit_code == 0, res.output
    assert "OK" in res.output and "epd-pd-0(draining)" in res.output

    bad = tmp_path / "bad.yaml"
    bad.write_text(
        ARCH_EXAMPLE.replace("epd-pd-0", "epd-ve-0").replace("state: draining", "state: off") + "extra_key: 1\n"
    )
    res = runner.invoke(main, ["check-config", str(bad)])
    assert res.exit_code == 1
    assert "extra_key: unknown key" in res.output
    assert "endpoints.pd.0.state" in res.output

    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed\n")
    res = runner.invoke(main, ["check-config", str(broken)])
    assert res.exit_code == 1 and "not valid YAML" in res.output
    res = runner.invoke(main, ["check-config", str(tmp_path / "missing.yaml")])
    assert res.exit_code == 1 and "cannot read" in res.output


def test_check_config_refuses_world_readable_key_file(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("secret-key-1\n")
    keys.chmod(0o644)
    cfg = tmp_path / "r.yaml"
    cfg.write_text(ARCH_EXAMPLE.replace("api_keys_file: null", f"api_keys_file: {keys}"))
    res = CliRunner().invoke(main, ["check-config", str(cfg)])
    assert res.exit_code == 1 and "chmod 600" in res.output
    assert "secret-key-1" not in res.output
    keys.chmod(0o600)
    assert CliRunner().invoke(main, ["check-config", str(cfg)]).exit_code == 0


def test_a_text_only_fleet_has_no_ve_and_says_so():
    cfg = parse_config(minimal(text_only=True, ve=[], pd=[{"id": "epd-pd-0", "url": "http://127.0.0.1:18100"}]))
    assert cfg.endpoints.text_only and cfg.endpoints.ve == []
    assert parse_config(minimal()).endpoints.text_only is False
    # a deploy that turns the fleet text-only drains its VEs with the new file before stopping them
    draining = [{"id": "epd-ve-0", "url": "http://127.0.0.1:18300", "state": "draining"}]
    cfg = parse_config(minimal(text_only=True, ve=draining, pd=[{"id": "epd-pd-0", "url": "http://127.0.0.1:18100"}]))
    assert [e.id for e in cfg.endpoints.ve] == ["epd-ve-0"]


def test_console_script_check_config_exit_code(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: /m\nendpoints: {ve: [], pd: []}\n")
    exe = Path(sys.executable).parent / "epd-router"
    proc = subprocess.run(
        [str(exe), "check-config", str(bad)], check=False, capture_output=True, text=True, timeout=scaled(60)
    )
    assert proc.returncode != 0
    assert "endpoints.ve" in proc.stderr


def test_serve_flags_usage_errors():
    runner = CliRunner()
    res = runner.invoke(main, ["--model", "/m"])
    assert res.exit_code == 2 and "missing --ve-endpoint, --pd-endpoint" in res.output
    res = runner.invoke(main, ["serve", "--config", "x.yaml", "--model", "/m"])
    assert res.exit_code == 2 and "not both" in res.output


def test_limits_and_media_are_the_preprocessors_settings_set_from_the_file():
    data = minimal()
    data["limits"] = {"max_image_pixels": 4096, "image_cache_items": 0, "image_cache_bytes": 1000}
    data["media"] = {"max_redirects": 0, "allowed_hosts": [" Images.Example.COM:8443 "]}
    cfg = parse_config(data)
    assert isinstance(cfg.limits, Limits) and isinstance(cfg.media, Media)
    assert (cfg.limits.max_image_pixels, cfg.limits.image_cache_items, cfg.limits.image_cache_bytes) == (4096, 0, 1000)
    assert cfg.media.max_redirects == 0 and cfg.media.allowed_hosts == ["images.example.com:8443"]


@pytest.mark.parametrize(
    ("section", "value", "expected"),
    [
        ("limits", {"max_image_pixel": 1}, "limits.max_image_pixel: unknown key"),
        ("limits", {"image_cache_items": -1}, "limits.image_cache_items"),
        ("media", {"max_redirect": 1}, "media.max_redirect: unknown key"),
        ("media", {"max_redirects": 11}, "media.max_redirects"),
    ],
)
def test_limits_and_media_refuse_unknown_keys_and_bad_values(section, value, expected):
    data = minimal()
    data[section] = value
    with pytest.raises(ConfigError, match=expected):
        parse_config(data)
    with pytest.raises(ValidationError):  # the same model, used directly by the preprocessor
        (Limits if section == "limits" else Media).model_validate(value)


async def test_the_production_renderer_applies_the_files_limits(tmp_path):
    data = minimal()
    data["model"] = str(build_tiny_checkpoint(tmp_path / "ckpt"))
    data["limits"] = {"max_image_pixels": 48 * 48, "image_cache_items": 0}
    cfg = parse_config(data)
    pre = build_renderer(cfg)
    try:
        assert pre.limits is cfg.limits and pre.media is cfg.media
        await pre.render([user_message(image_part(png_data_url(32, 32)))])
        assert pre.stats.cache_entries == 0  # image_cache_items: 0 disables the cache
        with pytest.raises(ImageDimensionsRejected, match=r"limits\.max_image_pixels"):
            await pre.render([user_message(image_part(png_data_url(64, 64)))])
    finally:
        await pre.aclose()


@pytest.mark.parametrize(
    ("dtype", "pixel_dtype"), [("auto", "bfloat16"), ("float16", "float16"), ("float32", "float32")]
)
async def test_the_production_renderer_sends_pixels_in_the_files_dtype(tmp_path, dtype, pixel_dtype):
    """router.yaml `dtype` is the engines' --dtype: VE pixel values travel in what it resolves to
    (auto on the bf16 tiny checkpoint = bfloat16, as vLLM resolves it)."""
    data = minimal()
    data["model"] = str(build_tiny_checkpoint(tmp_path / "ckpt"))
    data["dtype"] = dtype
    pre = build_renderer(parse_config(data))
    try:
        assert pre.vision.pixel_dtype == pixel_dtype
    finally:
        await pre.aclose()


def test_the_cli_and_config_load_without_the_preprocessors_heavy_imports():
    """`epd-router` installs its early signal handlers before the slow imports, and
    check-config stays quick: the shared settings model must not pull the preprocessor in."""
    code = "import sys, epd_kit.router.cli; print([m for m in ('numpy', 'PIL', 'tokenizers') if m in sys.modules])"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(60), check=True)
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("section", "value", "expected"),
    [
        ("auth", {"enabled": True}, "auth: enabled: true needs api_keys_file"),
        ("auth", {"enabled": False, "api_keys_file": "/k"}, "remove one of them"),
        ("media", {"allowed_hosts": ["::1"]}, "write IPv6 addresses in brackets"),
        ("listen", {"header_timeout_s": 0}, "listen.header_timeout_s"),
        ("listen", {"max_connection": 5}, "listen.max_connection: unknown key"),
        ("limits", {"max_json_depth": 1}, "limits.max_json_depth"),
        ("health", {"failure_ratio": 0}, "health.failure_ratio"),
    ],
)
def test_hardening_settings_are_validated(section, value, expected):
    data = minimal()
    data[section] = value
    with pytest.raises(ConfigError, match=expected):
        parse_config(data)


async def test_the_listener_gets_its_limits_from_the_file(char_renderer):
    """The listen section reaches uvicorn: its keep-alive and our protocol's timeouts and cap."""
    from epd_kit.router.server import make_server

    data = minimal()
    data["listen"] = {"port": 0, "max_connections": 7, "header_timeout_s": 2, "body_timeout_s": 3, "idle_timeout_s": 4}
    server = make_server(parse_config(data), renderer=char_renderer())
    server.config.load()
    assert server.config.timeout_keep_alive == 4
    protocol = server.config.http_protocol_class(config=server.config, server_state=server.server_state, app_state={})
    listen = protocol._listen
    assert (listen.max_connections, listen.header_timeout_s, listen.body_timeout_s) == (7, 2, 3)
