"""Sandbox helpers for scripts/demo.sh and the end-to-end tests: read a sandbox inventory,
talk to the deployed router with the real `openai` client, print a status table.

    python tests/hosts/sandbox.py hosts INVENTORY_DIR      NAME:IP per host (for hosts.sh up)
    python tests/hosts/sandbox.py router INVENTORY_DIR     http://IP:PORT of the router
    python tests/hosts/sandbox.py request INVENTORY_DIR    one chat request: generated image + text
                                                           (text only, and the image's 400, for epd_text_only);
                                                           with epd_models, one per model and an unknown one's 404
    python tests/hosts/sandbox.py status INVENTORY_DIR     units per host + the router's /pools
    python tests/hosts/sandbox.py engine-vllm INVENTORY_DIR  the vLLM of a vllm-cpu inventory's engines
                                                           (its Neuron release's), nothing for another backend

Must run inside the kithub network namespace (the router lives on a test host); hosts, router
and engine-vllm read the inventory alone.
"""

from __future__ import annotations

import base64
import io
import json
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from epd_kit.plan.variables import ROUTER_PORT as DEFAULT_ROUTER_PORT  # epd_router_port's default
from tests.hosts.harness import NET_PREFIX, run


@dataclass(frozen=True)
class SandboxInventory:
    directory: Path
    hosts: dict[str, str]  # name -> address, every host
    engine_hosts: list[str]
    router_hosts: list[str]
    group_vars: dict

    @classmethod
    def load(cls, directory: Path | str) -> SandboxInventory:
        directory = Path(directory)
        doc = yaml.safe_load((directory / "hosts.yml").read_text())
        children = doc["all"]["children"]
        hosts: dict[str, str] = {}
        groups: dict[str, list[str]] = {}
        for group, body in children.items():
            members = (body or {}).get("hosts") or {}
            groups[group] = list(members)
            for name, host_vars in members.items():
                address = (host_vars or {}).get("ansible_host")
                if address:
                    hosts[name] = address
        missing = [n for g in groups.values() for n in g if n not in hosts]
        if missing:
            raise SystemExit(f"{directory}: no ansible_host for {sorted(set(missing))}")
        outside = {n: a for n, a in hosts.items() if not a.startswith(NET_PREFIX + ".")}
        if outside:
            raise SystemExit(f"{directory}: sandbox hosts must live in {NET_PREFIX}.0/24, got {outside}")
        group_vars: dict = {}
        for path in sorted((directory / "group_vars").glob("all*")):
            files = sorted(path.glob("*.yml")) if path.is_dir() else [path]
            for f in files:
                group_vars.update(yaml.safe_load(f.read_text()) or {})
        return cls(directory, hosts, groups.get("epd_engines", []), groups.get("epd_router", []), group_vars)

    @property
    def router_url(self) -> str:
        if not self.router_hosts:
            raise SystemExit(f"{self.directory}: no host in group epd_router")
        port = self.group_vars.get("epd_router_port", DEFAULT_ROUTER_PORT)
        return f"http://{self.hosts[self.router_hosts[0]]}:{port}"


def demo_image_png(edge: int = 224) -> bytes:
    """A generated picture: a sky gradient, a green field, a red sun."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (edge, edge))
    draw = ImageDraw.Draw(image)
    for y in range(edge):
        shade = int(255 * y / edge)
        draw.line([(0, y), (edge, y)], fill=(shade // 3, 120 + shade // 3, 255 - shade // 2))
    draw.rectangle([0, edge * 2 // 3, edge, edge], fill=(40, 160, 60))
    draw.ellipse([edge // 2, edge // 8, edge // 2 + edge // 4, edge // 8 + edge // 4], fill=(230, 40, 30))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def chat_request(
    router_url: str,
    text: str = "Describe this image in one sentence.",
    max_tokens: int = 24,
    *,
    image: bool = True,
    model: str | None = None,
) -> tuple[str, object]:
    """One request through the router with the official openai client; returns (model, response).
    `image`: the generated picture goes with the text (a text-only fleet refuses it with a 400).
    `model`: the model to ask (None: the first /v1/models lists)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{router_url}/v1", api_key="sandbox", timeout=60, max_retries=0)
    model = model or client.models.list().data[0].id
    content: list[dict] = [{"type": "text", "text": text}]
    if image:
        data_url = "data:image/png;base64," + base64.b64encode(demo_image_png()).decode()
        content.insert(0, {"type": "image_url", "image_url": {"url": data_url}})
    response = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=max_tokens
    )
    return model, response


def served_models(router_url: str) -> list[str]:
    """The router's /v1/models, through the openai client."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{router_url}/v1", api_key="sandbox", timeout=60, max_retries=0)
    return [m.id for m in client.models.list().data]


def unknown_model_refused(router_url: str, model: str = "no-such-model") -> str:
    """The router's answer to a model it does not serve: the 404's OpenAI error (raises if it answers)."""
    from openai import NotFoundError

    try:
        chat_request(router_url, "hello", image=False, model=model)
    except NotFoundError as error:
        return f"{error.status_code} {error.body}"
    raise SystemExit(f"{router_url}: the router answered a request for {model!r} instead of a 404")


def image_refused(router_url: str, model: str | None = None) -> str:
    """A text-only fleet's answer to an image request: the 400's OpenAI error message (raises if it answers)."""
    from openai import BadRequestError

    try:
        chat_request(router_url, model=model)
    except BadRequestError as error:
        return f"{error.status_code} {error.body}"
    raise SystemExit(f"{router_url}: a text-only fleet answered an image request instead of refusing it")


def get_json(url: str, timeout: float = 5) -> object:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return json.load(reply)


def status_table(inventory: SandboxInventory) -> str:
    rows = [("host", "address", "unit", "active", "sub")]
    for name in inventory.hosts:
        out = run(
            ["systemctl", "-M", name, "list-units", "--all", "--plain", "--no-legend", "--no-pager", "epd*"],
            check=False,
        ).stdout
        units = [line.split() for line in out.splitlines() if line.strip()]
        if not units:
            rows.append((name, inventory.hosts[name], "(no epd units)", "-", "-"))
        for fields in units:
            rows.append((name, inventory.hosts[name], fields[0], fields[2], fields[3]))
    return format_rows(rows)


def pools_table(pools: object) -> str:
    engines = pools.get("engines", []) if isinstance(pools, dict) else []
    columns = ("id", "role", "url", "state", "healthy", "inflight", "served", "failures")
    if any("model" in e for e in engines):
        columns = ("model", *columns)
    rows = [columns] + [tuple(str(e.get(c, "-")) for c in columns) for e in engines]
    return format_rows(rows) if engines else json.dumps(pools, indent=2)[:2000]


def format_rows(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)).rstrip() for r in rows)


def engine_vllm(inventory: SandboxInventory) -> str | None:
    """The vLLM a vllm-cpu inventory's engines run (epd_vllm_cpu_vllm, else its Neuron release's,
    as plan/settings.py Settings.engine_vllm); None for another backend."""
    if inventory.group_vars.get("epd_engine_backend") != "vllm-cpu":
        return None
    from epd_kit.plan.neuron_releases import DEFAULT_RELEASE, vllm_version

    if pinned := inventory.group_vars.get("epd_vllm_cpu_vllm"):
        return str(pinned)
    return vllm_version(inventory.group_vars.get("epd_neuron_release", DEFAULT_RELEASE))


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    command, directory = argv
    inventory = SandboxInventory.load(directory)
    if command == "hosts":
        print(" ".join(f"{n}:{a}" for n, a in inventory.hosts.items()))
    elif command == "router":
        print(inventory.router_url)
    elif command == "request" and inventory.group_vars.get("epd_models"):
        text_only = {entry["name"]: entry.get("text_only") is True for entry in inventory.group_vars["epd_models"]}
        for number, model in enumerate(served_models(inventory.router_url)):
            vision = not (inventory.group_vars.get("epd_text_only") is True if number == 0 else text_only.get(model))
            if not vision:
                print(f"{model}: image refused, {image_refused(inventory.router_url, model)}")
            text = "Describe this image in one sentence." if vision else "Say hello in one sentence."
            _, response = chat_request(inventory.router_url, text, image=vision, model=model)
            choice = response.choices[0]
            print(f"{model}: model {response.model}, {'image + text' if vision else 'text'}")
            print(f"{model}: answer {choice.message.content!r}")
            print(
                f"{model}: finish {choice.finish_reason}; usage: {response.usage.prompt_tokens} prompt + "
                f"{response.usage.completion_tokens} completion tokens"
            )
        print(f"unknown model: {unknown_model_refused(inventory.router_url)}")
    elif command == "request":
        text_only = inventory.group_vars.get("epd_text_only") is True
        if text_only:  # no VE: a text request, then the image request's 400
            print(f"image:    refused, {image_refused(inventory.router_url)}")
        text = "Say hello in one sentence." if text_only else "Describe this image in one sentence."
        model, response = chat_request(inventory.router_url, text, image=not text_only)
        choice = response.choices[0]
        print(f"model:    {model}")
        print(f"answer:   {choice.message.content!r}")
        print(
            f"finish:   {choice.finish_reason}; usage: {response.usage.prompt_tokens} prompt + "
            f"{response.usage.completion_tokens} completion tokens"
        )
    elif command == "engine-vllm":
        if vllm := engine_vllm(inventory):
            print(vllm)
    elif command == "status":
        print(status_table(inventory))
        try:
            print(f"\nrouter {inventory.router_url}/pools:\n{pools_table(get_json(f'{inventory.router_url}/pools'))}")
        except OSError as exc:
            print(f"\nrouter {inventory.router_url}/pools: unreachable ({exc})")
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
