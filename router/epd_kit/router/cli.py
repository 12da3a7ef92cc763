"""`epd-router`: serve from a config file or the reference router's flags, check a config,
show pool status.

    epd-router serve --config /etc/epd/router.yaml
    epd-router serve --config /etc/epd/router.yaml --worker 0        (one of several: epd-router@0)
    epd-router --model M --ve-endpoint 127.0.0.1:18300 --pd-endpoint 127.0.0.1:18100   (drop-in)
    epd-router check-config /etc/epd/router.yaml
    epd-router status --url http://127.0.0.1:18800

`epd-router advise` (docs/advisor.md) joins these in epd_kit/cli.py, the `epd-router` script:
the router does not import the advisor.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from epd_kit.plan.variables import ROUTER_PORT
from epd_kit.router_yaml import ConfigError, RouterConfig, config_from_flags, load_config


def _reference_flags(func):
    """The reference router's flags (docs/contract.md §1.1), plus --config."""
    opts = [
        click.option(
            "--config",
            "config_path",
            type=click.Path(dir_okay=False, path_type=Path),
            help="router YAML config (docs/architecture.md); excludes the flags below",
        ),
        click.option("--model", help="checkpoint directory the router tokenizes with"),
        click.option(
            "--ve-endpoint",
            "ve_endpoints",
            multiple=True,
            metavar="HOST:PORT",
            help="VE engine (repeatable; ids ve-0, ve-1, ... by position)",
        ),
        click.option(
            "--pd-endpoint",
            "pd_endpoints",
            multiple=True,
            metavar="HOST:PORT",
            help="PD engine (repeatable; ids pd-0, pd-1, ...)",
        ),
        click.option("--host", default=None, help="bind address [127.0.0.1]"),
        click.option("--port", type=int, default=None, help="bind port [8000]"),
        click.option("--ve-timeout-s", type=float, default=None, help="VE call timeout [120]"),
        click.option("--pd-timeout-s", type=float, default=None, help="PD call timeout [600]"),
        click.option("--quantization", default=None, help="e.g. mxfp8 (reported only)"),
        click.option("--log-level", default="INFO", show_default=True),
        click.option(
            "--worker",
            default=None,
            metavar="NAME",
            help="this process's name among the host's router processes (epd-router@NAME; names its metrics files)",
        ),
    ]
    for opt in reversed(opts):
        func = opt(func)
    return func


def _resolve(
    config_path, model, ve_endpoints, pd_endpoints, host, port, ve_timeout_s, pd_timeout_s, quantization
) -> RouterConfig:
    flags_given = any([model, ve_endpoints, pd_endpoints, ve_timeout_s, pd_timeout_s, quantization])
    if config_path is not None:
        if flags_given:
            raise click.UsageError("use either --config FILE or the engine flags, not both")
        cfg = load_config(config_path)
        if host is not None or port is not None:  # allow overriding the bind address only
            listen = cfg.listen.model_copy(update={k: v for k, v in (("host", host), ("port", port)) if v is not None})
            cfg = cfg.model_copy(update={"listen": listen})
        return cfg
    missing = [
        n for n, v in (("--model", model), ("--ve-endpoint", ve_endpoints), ("--pd-endpoint", pd_endpoints)) if not v
    ]
    if missing:
        raise click.UsageError(f"missing {', '.join(missing)} (or give --config FILE)")
    kwargs = {"host": host, "port": port, "ve_timeout_s": ve_timeout_s, "pd_timeout_s": pd_timeout_s}
    return config_from_flags(
        model=model,
        ve_endpoints=list(ve_endpoints),
        pd_endpoints=list(pd_endpoints),
        quantization=quantization,
        **{k: v for k, v in kwargs.items() if v is not None},
    )


def _serve(log_level: str, worker: str | None, **kwargs) -> None:
    from epd_kit.router.signals import EarlySignals

    early = EarlySignals().install()  # before the slow imports and checkpoint loading

    from epd_kit.router.logs import setup_logging
    from epd_kit.router.metrics import shared_metrics_dir, use_worker_files
    from epd_kit.router.server import make_server

    setup_logging(log_level.upper())
    worker = worker or str(os.getpid())
    if shared_metrics_dir() is not None:
        use_worker_files(worker)
    try:
        cfg = _resolve(**kwargs)
        server = make_server(cfg, config_path=kwargs["config_path"], early=early, worker=worker)
    except ConfigError as exc:
        click.echo(f"epd-router: {exc}", err=True)
        sys.exit(2)
    except ValueError as exc:  # e.g. key file permissions, checkpoint problems
        click.echo(f"epd-router: {exc}", err=True)
        sys.exit(2)
    server.run()


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@_reference_flags
@click.pass_context
def main(ctx: click.Context, **kwargs) -> None:
    """OpenAI-compatible EPD router. Without a subcommand, serves (reference-router flags)."""
    if ctx.invoked_subcommand is None:
        _serve(**kwargs)


@main.command()
@_reference_flags
def serve(**kwargs) -> None:
    """Serve: `--config FILE`, or the reference flags."""
    _serve(**kwargs)


@main.command("check-config")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
def check_config(path: Path) -> None:
    """Validate a router config file (exit 0 = usable). Ansible's `validate:` runs this."""
    from epd_kit.router.tenants import load_client_keys

    try:
        cfg = load_config(path)
        load_client_keys(cfg.auth.api_keys_file, cfg.auth.tenants_file)
    except ValueError as exc:
        click.echo(f"INVALID {exc}", err=True)
        sys.exit(1)
    lines = []
    for entry in cfg.models:  # each model with its own pools
        ve = ", ".join(f"{e.id}({e.state.value})" for e in entry.endpoints.ve) or "none: text only"
        pd = ", ".join(f"{e.id}({e.state.value})" for e in entry.endpoints.pd)
        named = entry.model if entry.name == entry.model else f"{entry.name} ({entry.model})"
        lines.append(f"model {named}: VE [{ve}]; PD [{pd}]")
    line = f"OK {path}: " + "; ".join(lines)
    click.echo(line)


@main.command()
@click.option("--url", default=f"http://127.0.0.1:{ROUTER_PORT}", show_default=True, help="router base URL")
@click.option("--api-key", envvar="EPD_ROUTER_API_KEY", default=None, help="[env EPD_ROUTER_API_KEY]")
@click.option("--json", "as_json", is_flag=True, help="raw JSON instead of a table")
def status(url: str, api_key: str | None, as_json: bool) -> None:
    """Print the router's engine pools (GET /pools) as a table."""
    import httpx

    from epd_kit.router.status import pools_table

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(url.rstrip("/") + "/pools", headers=headers, timeout=5, trust_env=False)
    except httpx.HTTPError as exc:
        click.echo(f"cannot reach the router at {url}: {exc}", err=True)
        sys.exit(1)
    if resp.status_code != 200:
        click.echo(f"{url}/pools: HTTP {resp.status_code}: {resp.text[:300]}", err=True)
        sys.exit(1)
    doc = resp.json()
    click.echo(json.dumps(doc, indent=2) if as_json else pools_table(doc))


if __name__ == "__main__":
    main()
