"""The declaration of every variable the kit reads: its default, type, bounds, scope and readers.

One entry per variable (`VARIABLES`). From it come the planner's defaults (defaults.py), the
names the inventory check knows (checks.py), the per-value, per-key and per-scope checks
(validate.py), and the router's own defaults that repeat an inventory default (the listen port,
images per prompt). The roles' argument specs, their defaults/main.yml and the variable tables of
docs/architecture.md are checked against it by tests/unit/plan/test_variables.py, whose
failures print the exact line to add or change here. Adding a variable is one `Var(...)` line.

Scopes say where a value is read, so a value set where nothing reads it is refused:
  fleet         one value for the whole fleet (group_vars/all or -e); must agree on every host
  epd_engines   read on each engine host (host_vars or group_vars/epd_engines)
  epd_router    read on each router host
  epd_loadbalancer, epd_monitoring   read on each host of that group
  host          read on every kit host (paths, the service user, the bind address)
  run           an option of one playbook run (-e), never the inventory's
  internal      set by the kit itself while it runs; never set it
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .neuron_releases import DEFAULT_RELEASE, RELEASES, VLLM_CPU_VERSIONS

# kinds: how a value is checked (validate.py)
STR, PATH, BOOL, LIST, DICT, ANY = "str", "path", "bool", "list", "dict", "any"
INT, FLOAT, PORT = "int", "float", "port"
SECONDS, MILLISECONDS, MINUTES = "seconds", "milliseconds", "minutes"  # whole numbers, no unit suffix
AMOUNT = "amount"  # a count or a percentage of a pool, "25%" (rollout batches and floors)
DURATION_UNITS = {SECONDS: "s", MILLISECONDS: "ms", MINUTES: "m"}
# forms: what a string (or each item of a list, each value of a mapping) must look like beyond
# its kind, checked on the controller (validate.py form_problem) so a malformed one never reaches a
# unit, an environment file or a host. An empty string passes where the default is empty (unset).
VERSION, SHA256, FINGERPRINT, URL, ABSOLUTE, NAME, ADDRESS, AUTO_BOOL = (
    "version",
    "sha256",
    "fingerprint",
    "url",
    "absolute path",
    "unix name",
    "address",
    "auto or a boolean",
)

FLEET, HOST, RUN, INTERNAL = "fleet", "host", "run", "internal"
ENGINE, ROUTER, LOADBALANCER, MONITORING = "epd_engines", "epd_router", "epd_loadbalancer", "epd_monitoring"
GROUP_SCOPES = (ENGINE, ROUTER, LOADBALANCER, MONITORING)

# The playbooks that run each role (directly, through playbooks/tasks or import_playbook);
# a variable declared for a role is read by these plays (checked by the drift test).
ROLE_PLAYS: dict[str, tuple[str, ...]] = {
    "epd_common": (
        "deploy",
        "loadbalancer",
        "observability",
        "plan",
        "precompile",
        "provision",
        "render",
        "restart",
        "rolling_restart",
        "start",
        "status",
        "stop",
        "teardown",
    ),
    "epd_deps": ("deploy", "precompile"),
    "epd_engines": ("deploy", "precompile", "render", "restart", "start"),
    "epd_firewall": ("deploy", "render", "teardown"),
    "epd_haproxy": ("deploy", "loadbalancer"),
    "epd_observability": ("deploy", "observability", "teardown"),
    "epd_preflight": ("deploy",),
    "epd_provision": ("provision", "status"),
    "epd_router": ("deploy", "render", "rolling_restart"),
}
ROLLOUT_PLAYS = ("deploy", "rolling_restart")


@dataclass(frozen=True)
class Var:
    """One variable: default (None: unset), kind, scope, the argument spec listing it ("role.entry")."""

    name: str
    default: Any
    kind: str
    scope: str
    spec: str | None = None
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    keys: str | None = None  # a dict variable's allowed keys: a name in DICT_KEYS
    form: str | None = None  # VERSION, SHA256, URL, ...: the shape of the value (PATH kinds are ABSOLUTE)
    schemes: tuple[str, ...] = ()  # a URL's allowed schemes
    plays: tuple[str, ...] = field(default=())  # readers when no spec says it (playbook-level variables)

    @property
    def role(self) -> str | None:
        return self.spec.split(".", 1)[0] if self.spec else None

    @property
    def readers(self) -> tuple[str, ...]:
        return self.plays or ROLE_PLAYS.get(self.role or "", ())


def _v(name: str, default: Any, kind: str, scope: str, spec: str | None = None, **rules: Any) -> Var:
    return Var(name, default, kind, scope, spec, **rules)


ROUTER_PORT, IMAGES_PER_PROMPT = 18800, 30
C, P, CH, EN, RO, HA, OB, PF, PV = (
    "epd_common.main",
    "epd_common.plan",
    "epd_preflight.controller",
    "epd_engines.main",
    "epd_router.main",
    "epd_haproxy.main",
    "epd_observability.main",
    "epd_preflight.host",
    "epd_provision.main",
)
DEPS = "epd_deps.main"
VLLM_CPU_REQUIREMENTS = (
    "{{ epd_deps_repo_dir }}/roles/epd_deps/files/vllm-cpu/requirements-vllm-"
    "{{ epd_vllm_cpu_vllm | default((epd_neuron_release | epd.kit.epd_neuron_release).vllm, true) }}.txt"
)
FW = "epd_firewall.main"
MAX_PORT = 65535
# URL schemes: apt's (file: a local mirror), a download's, pip's index (pip reads file: indexes too)
APT_SCHEMES, DOWNLOAD_SCHEMES, INDEX_SCHEMES = ("http", "https", "file"), ("https", "http"), ("https", "http", "file")

_DECLARED: tuple[Var, ...] = (
    # epd_common: the service user and host paths
    _v("epd_user", "epd", STR, HOST, C, form=NAME),
    _v("epd_kit_venv", "/opt/epd/venv", PATH, HOST, C),
    _v("epd_etc_dir", "/etc/epd", PATH, HOST, C),
    _v("epd_engine_env_dir", "/etc/epd/engines", PATH, HOST, C),
    _v("epd_cache_dir", "/var/cache/epd", PATH, HOST, C),
    _v("epd_compile_cache_dir", "{{ epd_cache_dir }}/neuron-compile-cache", STR, HOST, C, form=ABSOLUTE),
    # the compile cache's shared tier: one directory (a shared filesystem) for the whole fleet
    _v("epd_compile_cache_shared_dir", "", STR, FLEET, C, form=ABSOLUTE),
    _v("epd_compile_cache_strict", False, BOOL, FLEET, C),
    _v("epd_compile_cache_local_dir", "{{ epd_compile_cache_dir }}/neuron/compile_cache", STR, INTERNAL, C),
    _v("epd_compile_cache_promote_command", "{{ epd_etc_dir }}/promote-compile-cache", STR, HOST, C, form=ABSOLUTE),
    # the promotion's arguments (epd_common's compile_cache_promote entry point), set by the rollout
    _v("epd_common_promote_hosts", [], LIST, INTERNAL, "epd_common.compile_cache_promote"),
    _v("epd_common_promote_require", False, BOOL, INTERNAL, "epd_common.compile_cache_promote"),
    _v(
        "epd_engine_library_path",
        ["/opt/amazon/efa/lib64", "/opt/amazon/efa/lib", "/usr/local/cuda-12.6/targets/x86_64-linux/lib"],
        LIST,
        HOST,
        C,
        form=ABSOLUTE,
    ),
    _v("epd_engine_bin_path", ["/opt/amazon/efa/bin", "/opt/aws/neuron/bin"], LIST, HOST, C, form=ABSOLUTE),
    _v("epd_router_config_file", "/etc/epd/router.yaml", PATH, HOST, C),
    _v("epd_router_env_file", "/etc/epd/router.env", PATH, HOST, C),
    _v("epd_secrets_env_file", "/etc/epd/secrets.env", PATH, HOST, C),
    # the fleet's engine key (docs/security.md "Engine keys"): the router's copy (root:epd 0640) and
    # the engines' VLLM_API_KEY (root 0600); the admin token of /metrics and /pools (root:epd 0640)
    _v("epd_engine_key_file", "/etc/epd/engine-key", PATH, HOST, C),
    _v("epd_engine_key_env_file", "/etc/epd/engine-key.env", PATH, HOST, C),
    _v("epd_admin_token_file", "/etc/epd/admin-token", PATH, HOST, C),
    # who may read /metrics and /pools without the admin token (CIDRs); unset: the monitoring hosts
    _v("epd_admin_networks", None, LIST, FLEET, C),
    _v("epd_rotate_engine_key", False, BOOL, RUN, "epd_common.secrets", plays=("deploy",)),
    _v("epd_systemd_dir", "/etc/systemd/system", PATH, HOST, C),
    _v("epd_engine_venv", "", STR, HOST, C, form=ABSOLUTE),
    # vllm-cpu: the venv of vLLM's CPU build and the kit's vLLM plugin (epd_engine_venv: Neuron's)
    _v("epd_vllm_cpu_venv", "/opt/epd/vllm-cpu", PATH, HOST, C),
    # the Neuron release whose table (neuron_releases.py) provision.yml installs
    _v("epd_neuron_release", DEFAULT_RELEASE, STR, FLEET, C, choices=tuple(RELEASES)),
    _v("epd_dlami_venv_glob", "/opt/aws_neuronx_venv_pytorch_inference_vllm_*", STR, HOST, C, form=ABSOLUTE),
    _v("epd_hf_token", "{{ lookup('ansible.builtin.env', 'HF_TOKEN') }}", STR, HOST, C),
    _v("epd_templates_dir", "{{ 'templates' | epd.kit.epd_kit_path }}", PATH, HOST, C),
    # the planner (epd_common's plan entry point): fleet-wide pool settings, checked by settings.py
    _v("epd_plan_faulted", {}, DICT, RUN, P),
    _v("epd_common_replan", False, BOOL, INTERNAL, P),
    _v("epd_common_inventory_only", False, BOOL, INTERNAL, P),
    _v("epd_model", None, STR, FLEET, P),
    # the models served beside epd_model, each its own checkpoint, pools and settings (models.py)
    _v("epd_models", [], LIST, FLEET, P),
    _v("epd_quantization", "bf16", STR, FLEET, P, choices=("bf16", "mxfp8")),
    _v("epd_modules_to_not_convert", [], LIST, FLEET, P),
    # vllm: vLLM Neuron on trn2; vllm-cpu: vLLM's CPU build (the sandbox's real engines); sim: epd-sim
    _v("epd_engine_backend", "vllm", STR, FLEET, P, choices=("vllm", "vllm-cpu", "sim")),
    # vllm-cpu: the directory of the encoder cache's shared-storage connector (VE writes, PD reads)
    _v("epd_vllm_cpu_ec_dir", "/var/cache/epd/ec-store", STR, FLEET, P, form=ABSOLUTE),
    # vllm-cpu: the vLLM version its engines run (unset: the Neuron release's); one with a lock list
    _v("epd_vllm_cpu_vllm", None, STR, FLEET, P, choices=VLLM_CPU_VERSIONS),
    # vllm-cpu: how encoder outputs reach the PDs: shared-dir (vLLM's ECExampleConnector, one engine
    # host) or nixl (the kit's NIXL connector, engine_plugin's nixl_connector.py: VEs and PDs on any hosts)
    _v("epd_vllm_cpu_ec_transport", "shared-dir", STR, FLEET, P, choices=("shared-dir", "nixl")),
    # ... nixl: the ports UCX's TCP listeners take on every engine host ("first-last"; UCX_TCP_PORT_RANGE),
    # opened from the PD hosts to the VE hosts (firewall.py)
    _v("epd_vllm_cpu_ucx_port_range", "14700-14763", STR, FLEET, P),
    # an OTLP/HTTP collector's traces URL: the router and every engine export their spans there
    # (docs/router.md "Tracing"); unset: no traces
    _v("epd_otlp_traces_endpoint", "", STR, FLEET, P, form=URL, schemes=("http", "https")),
    _v("epd_ve_tp", 4, INT, FLEET, P, minimum=1, maximum=64),
    _v("epd_ve_dp", 4, INT, FLEET, P, minimum=1),
    _v("epd_pd_tp", 8, INT, FLEET, P, minimum=1, maximum=64),
    # sizes beyond these maxima are typos (an extra zero), not plans: 1 Mi tokens of context,
    # 1024 sequences per PD
    _v("epd_max_model_len", 8192, INT, FLEET, P, minimum=1, maximum=1_048_576),
    _v("epd_max_num_seqs", 8, INT, FLEET, P, minimum=1, maximum=1024),
    _v("epd_images_per_prompt", IMAGES_PER_PROMPT, INT, FLEET, P, minimum=1),
    _v("epd_image_edge", 512, INT, FLEET, P, minimum=1),
    _v("epd_patch_size", 16, INT, FLEET, P, minimum=1),
    _v("epd_encoder_cache_num_blocks", 128, INT, FLEET, P, minimum=2),
    _v("epd_ve_port_base", 18300, PORT, FLEET, P, minimum=1024, maximum=MAX_PORT),
    _v("epd_pd_port_base", 18100, PORT, FLEET, P, minimum=1024, maximum=MAX_PORT),
    _v("epd_side_channel_port_base", 14600, PORT, FLEET, P, minimum=1024, maximum=MAX_PORT),
    _v("epd_router_port", ROUTER_PORT, PORT, FLEET, P, minimum=1024, maximum=MAX_PORT),
    _v("epd_engine_id_prefix", "epd", STR, FLEET, P),
    _v("epd_start_stagger_s", 10, SECONDS, FLEET, P, minimum=0),
    _v("epd_compilation_timeout_s", 6000, SECONDS, FLEET, P, minimum=1),
    _v("epd_start_timeout_s", None, SECONDS, FLEET, P, minimum=1),
    _v("epd_extra_args", [], LIST, FLEET, P),
    _v("epd_engine_environment", {}, DICT, FLEET, P),
    # the front door's TLS (HAProxy when epd_loadbalancer has hosts, else each router; plan/tls.py
    # checks the files on the controller): a PEM chain + key, or one PEM bundle; the names clients use
    _v("epd_tls_certificate", None, PATH, FLEET, CH),
    _v("epd_tls_key", None, PATH, FLEET, CH),
    _v("epd_tls_bundle", None, PATH, FLEET, CH),
    _v("epd_tls_names", [], LIST, FLEET, CH),
    # the planner: per engine host, checked by hosts.py
    _v("epd_num_ve", 0, INT, ENGINE, P, minimum=0),
    _v("epd_num_pd", 0, INT, ENGINE, P, minimum=0),
    _v("epd_core_count", 64, INT, ENGINE, P, minimum=1, maximum=4096),
    _v("epd_excluded_cores", [], LIST, ENGINE, P),
    _v("epd_slices", None, DICT, ENGINE, P),
    # also the router's and HAProxy's default listen address, so read on every host
    _v("epd_bind_address", "127.0.0.1", STR, HOST, P, form=ADDRESS),
    _v("epd_engine_id_label", None, STR, ENGINE, P),
    # the inventory check
    _v("epd_text_only", False, BOOL, FLEET, CH),
    # epd_deps
    _v("epd_deps_python", "/usr/bin/python3", PATH, HOST, DEPS),
    _v("epd_deps_repo_dir", "{{ '.' | epd.kit.epd_kit_path }}", PATH, HOST, DEPS),
    _v("epd_deps_wheelhouse_cache", "{{ epd_deps_repo_dir }}/.cache/wheelhouse", PATH, HOST, DEPS),
    _v("epd_deps_host_wheelhouse_dir", "/var/cache/epd/wheelhouse", PATH, HOST, DEPS),
    # vllm-cpu: the pinned closure of vLLM's CPU build for the engines' vLLM (epd_vllm_cpu_vllm, unset the
    # release's: Settings.engine_vllm), and its wheelhouse cache
    _v("epd_deps_vllm_cpu_requirements_file", VLLM_CPU_REQUIREMENTS, PATH, HOST, DEPS),
    _v("epd_deps_vllm_cpu_wheelhouse_cache", "{{ epd_deps_repo_dir }}/.cache/engine-wheelhouse", PATH, HOST, DEPS),
    _v("epd_deps_sim_pins", ["nixl==1.5.1", "nixl-cu12==1.5.1"], LIST, HOST, DEPS),
    _v("epd_deps_user_groups", [], LIST, HOST, DEPS),
    # epd_engines
    _v("epd_engines_stop_timeout_s", 120, SECONDS, ENGINE, EN, minimum=1),
    _v("epd_engines_restart_sec", 10, SECONDS, ENGINE, EN, minimum=0),
    _v("epd_engines_start_limit_burst", 5, INT, ENGINE, EN, minimum=1),
    _v("epd_engines_start_limit_interval_s", 7200, SECONDS, ENGINE, EN, minimum=0),
    _v("epd_engines_limit_nofile", 65536, INT, ENGINE, EN, minimum=1024),
    _v("epd_engines_supplementary_groups", [], LIST, ENGINE, EN),
    _v("epd_engines_poll_delay_s", 5, SECONDS, ENGINE, EN, minimum=1),
    _v("epd_engines_render_venv", "/opt/aws_neuronx_venv_pytorch_inference_vllm", PATH, ENGINE, EN),
    _v("epd_engines_progress_report_s", 60, SECONDS, ENGINE, EN, minimum=1),
    # epd_firewall (firewall.py): the kit's nftables table on every engine, router and load-balancer
    # host; false = no rules (security groups only). Client networks: CIDRs allowed to the router's
    # and HAProxy's port (unset: anyone in a one-machine fleet, refused in a fleet of several)
    _v("epd_firewall", True, BOOL, FLEET, FW),
    _v("epd_client_networks", None, LIST, FLEET, FW),
    # epd_haproxy
    _v("epd_haproxy_bind_address", "{{ epd_bind_address | default('0.0.0.0') }}", STR, LOADBALANCER, HA, form=ADDRESS),
    _v("epd_haproxy_port", 8080, PORT, LOADBALANCER, HA, minimum=1, maximum=MAX_PORT),
    _v("epd_haproxy_check_inter_ms", 1000, MILLISECONDS, LOADBALANCER, HA, minimum=100),  # as the role's preflight
    _v("epd_haproxy_check_fall", 2, INT, LOADBALANCER, HA, minimum=1),
    _v("epd_haproxy_check_rise", 2, INT, LOADBALANCER, HA, minimum=1),
    _v("epd_haproxy_check_timeout_ms", 1000, MILLISECONDS, LOADBALANCER, HA, minimum=1),
    _v("epd_haproxy_maxconn", 4096, INT, LOADBALANCER, HA, minimum=1),
    _v("epd_haproxy_timeout_connect_ms", 2000, MILLISECONDS, LOADBALANCER, HA, minimum=1),
    _v("epd_haproxy_timeout_client_s", 960, SECONDS, LOADBALANCER, HA, minimum=1),
    _v("epd_haproxy_timeout_server_s", 960, SECONDS, LOADBALANCER, HA, minimum=1),
    _v("epd_haproxy_timeout_keep_alive_s", 60, SECONDS, LOADBALANCER, HA, minimum=1),
    _v("epd_haproxy_stats_port", 8404, PORT, LOADBALANCER, HA, minimum=1, maximum=MAX_PORT),
    _v("epd_haproxy_deb_dir", None, PATH, LOADBALANCER, HA),
    _v("epd_haproxy_host_deb_dir", "/var/cache/epd/haproxy-debs", PATH, LOADBALANCER, HA),
    _v("epd_haproxy_http_redirect_port", None, PORT, LOADBALANCER, HA, minimum=1, maximum=MAX_PORT),
    # epd_observability
    _v("epd_observability_dir", "/etc/prometheus/epd", PATH, MONITORING, OB),
    _v("epd_observability_prometheus_config", "", STR, MONITORING, OB, form=ABSOLUTE),
    _v("epd_observability_scrape_interval_s", 15, SECONDS, MONITORING, OB, minimum=1),
    _v("epd_observability_router_bearer_token_file", "", STR, MONITORING, OB, form=ABSOLUTE),
    _v("epd_observability_prometheus_service", "", STR, MONITORING, OB),
    _v("epd_observability_promtool", "", STR, MONITORING, OB, form=ABSOLUTE),
    _v("epd_observability_grafana_dir", "", STR, MONITORING, OB, form=ABSOLUTE),
    _v("epd_observability_runbook_base", "docs/observability.md", STR, MONITORING, OB),
    # the trace store on a monitoring host (Phoenix, docs/observability.md "Trace store"): auto runs
    # it on the first monitoring host reached over SSH with an address the fleet sees; the store is
    # epd_otlp_traces_endpoint's default (plan/trace_store.py)
    _v("epd_trace_store", "auto", STR, MONITORING, OB, choices=("auto", "phoenix", "none")),
    _v("epd_trace_store_port", 6006, PORT, MONITORING, OB, minimum=1, maximum=MAX_PORT),
    _v("epd_trace_store_grpc_port", 4317, PORT, MONITORING, OB, minimum=1, maximum=MAX_PORT),
    _v("epd_trace_store_retention_days", 7, INT, MONITORING, OB, minimum=0),
    _v("epd_observability_pool_floor_ratio", 0.5, FLOAT, MONITORING, OB, minimum=0, maximum=1),
    _v("epd_observability_ejected_for_m", 10, MINUTES, MONITORING, OB, minimum=1),
    _v("epd_observability_error_ratio", 0.05, FLOAT, MONITORING, OB, minimum=0, maximum=1),
    # float seconds: a bucket bound of the TTFT histogram, never "5s"
    _v("epd_observability_ttft_slo_s", 5.0, FLOAT, MONITORING, OB, minimum=0),
    _v("epd_observability_ttft_objective", 0.99, FLOAT, MONITORING, OB, minimum=0, maximum=1),
    _v("epd_observability_ttft_burn_rate", 14.4, FLOAT, MONITORING, OB, minimum=0),
    _v("epd_observability_pd_waiting_max", 8, INT, MONITORING, OB, minimum=1),
    # epd_preflight's host checks
    _v("epd_preflight_vl_architecture_pattern", "(VL|Vision|Llava|ForConditionalGeneration)", STR, HOST, PF),
    _v("epd_preflight_check_ports", True, BOOL, HOST, PF),
    _v("epd_preflight_require_efa", True, BOOL, HOST, PF),
    # epd_provision (provision.yml runs on the engine hosts)
    _v("epd_provision_neuron", True, BOOL, ENGINE, PV),
    _v("epd_provision_allow_downgrade", False, BOOL, ENGINE, PV),
    _v(
        "epd_provision_neuron_apt_repository",
        "https://apt.repos.neuron.amazonaws.com",
        STR,
        ENGINE,
        PV,
        form=URL,
        schemes=APT_SCHEMES,
    ),
    _v("epd_provision_neuron_apt_suite", "", STR, ENGINE, PV),
    _v(
        "epd_provision_neuron_apt_key_url",
        "{{ epd_provision_neuron_apt_repository }}/GPG-PUB-KEY-AMAZON-AWS-NEURON.PUB",
        STR,
        ENGINE,
        PV,
        form=URL,
        schemes=APT_SCHEMES,
    ),
    _v("epd_provision_neuron_driver_version", "", STR, ENGINE, PV, form=VERSION),
    _v("epd_provision_neuron_runtime_version", "", STR, ENGINE, PV, form=VERSION),
    _v("epd_provision_neuron_collectives_version", "", STR, ENGINE, PV, form=VERSION),
    _v("epd_provision_neuron_tools_version", "", STR, ENGINE, PV, form=VERSION),
    _v("epd_provision_neuron_group", "neuron", STR, ENGINE, PV, form=NAME),
    _v("epd_provision_neuron_kernel_headers", True, BOOL, ENGINE, PV),
    _v("epd_provision_neuron_check_devices", True, BOOL, ENGINE, PV),
    _v("epd_provision_efa", True, BOOL, ENGINE, PV),
    _v("epd_provision_efa_installer_version", "", STR, ENGINE, PV, form=VERSION),
    _v(
        "epd_provision_efa_installer_url",
        "https://efa-installer.amazonaws.com/aws-efa-installer-{{ epd_provision_efa_version }}.tar.gz",
        STR,
        ENGINE,
        PV,
        form=URL,
        schemes=DOWNLOAD_SCHEMES,
    ),
    _v(
        "epd_provision_efa_installer_key_url",
        "https://efa-installer.amazonaws.com/aws-efa-installer.key",
        STR,
        ENGINE,
        PV,
        form=URL,
        schemes=DOWNLOAD_SCHEMES,
    ),
    _v(
        "epd_provision_efa_installer_key_fingerprint",
        "4E90 91BC BB97 A96B 26B1 5E59 A054 80B1 DD2D 3CCC",
        STR,
        ENGINE,
        PV,
        form=FINGERPRINT,
    ),
    _v("epd_provision_efa_installer_sha256", "", STR, ENGINE, PV, form=SHA256),
    _v("epd_provision_efa_installer_archive", "", STR, ENGINE, PV, form=ABSOLUTE),
    _v("epd_provision_efa_installer_options", ["--yes"], LIST, ENGINE, PV),
    _v("epd_provision_extra_os", [], LIST, ENGINE, PV),
    _v("epd_provision_efa_skip_kmod", False, ANY, ENGINE, PV, form=AUTO_BOOL),
    _v("epd_provision_efa_check_provider", True, BOOL, ENGINE, PV),
    _v("epd_provision_cuda_stub", True, BOOL, ENGINE, PV),
    _v("epd_provision_cuda_stub_package", "cuda-cudart-dev-12-6", STR, ENGINE, PV),
    _v(
        "epd_provision_cuda_keyring_url",
        "https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2204/x86_64/cuda-keyring_1.0-1_all.deb",
        STR,
        ENGINE,
        PV,
    ),
    _v(
        "epd_provision_cuda_stub_library",
        "/usr/local/cuda-12.6/targets/x86_64-linux/lib/stubs/libcuda.so",
        PATH,
        ENGINE,
        PV,
    ),
    _v("epd_provision_hwloc_package", "", STR, ENGINE, PV),
    _v("epd_provision_engine_venv_enabled", True, BOOL, ENGINE, PV),
    _v("epd_provision_engine_venv", "", PATH, ENGINE, PV),
    _v("epd_provision_engine_venvs_dir", "/opt/epd/engine-venvs", PATH, ENGINE, PV),
    _v("epd_provision_engine_pins", {}, DICT, ENGINE, PV, form=VERSION),
    _v("epd_provision_engine_extra_requirements", [], LIST, ENGINE, PV),
    _v("epd_provision_engine_resolve_dependencies", True, BOOL, ENGINE, PV),
    _v(
        "epd_provision_engine_pip_index_url",
        "https://pypi.org/simple",
        STR,
        ENGINE,
        PV,
        form=URL,
        schemes=INDEX_SCHEMES,
    ),
    _v(
        "epd_provision_engine_pip_extra_index_urls",
        ["https://pip.repos.neuron.amazonaws.com"],
        LIST,
        ENGINE,
        PV,
        form=URL,
        schemes=INDEX_SCHEMES,
    ),
    _v("epd_provision_engine_pip_find_links", [], LIST, ENGINE, PV),
    _v("epd_provision_engine_python", "/usr/bin/python3", PATH, ENGINE, PV),
    _v(
        "epd_provision_engine_wheelhouse_cache",
        "{{ '.' | epd.kit.epd_kit_path }}/.cache/engine-wheelhouse",
        PATH,
        ENGINE,
        PV,
    ),
    _v("epd_provision_host_cache_dir", "/var/cache/epd/provision", PATH, ENGINE, PV),
    _v("epd_provision_batch", "100%", AMOUNT, RUN, plays=("provision",)),
    # epd_router
    _v("epd_router_listen_host", "{{ epd_bind_address | default('127.0.0.1') }}", STR, ROUTER, RO, form=ADDRESS),
    _v("epd_router_served_model_name", None, STR, ROUTER, RO),
    _v("epd_router_timeouts", {}, DICT, ROUTER, RO, keys="timeouts"),
    _v("epd_router_limits", {}, DICT, ROUTER, RO, keys="limits"),
    _v("epd_router_media", {}, DICT, ROUTER, RO, keys="media"),
    _v("epd_router_health", {}, DICT, ROUTER, RO, keys="health"),
    _v("epd_router_placement", {}, DICT, ROUTER, RO, keys="placement"),
    _v("epd_router_retries", {}, DICT, ROUTER, RO, keys="retries"),
    _v("epd_router_api_keys_file", None, PATH, ROUTER, RO),
    _v("epd_router_tenants", {}, DICT, ROUTER, RO),
    # kind "any": its shape is checked by plan/tenants.py, which never prints a value (the keys)
    _v("epd_router_tenant_keys", [], ANY, ROUTER, RO),
    _v("epd_router_tenants_file", "/etc/epd/tenants", PATH, ROUTER, RO),
    _v("epd_router_extra_config", {}, DICT, ROUTER, RO, keys="router.yaml"),
    _v("epd_router_draining", [], LIST, ROUTER, RO),
    _v("epd_router_endpoints_only", False, BOOL, INTERNAL, RO),
    _v("epd_router_retiring", [], LIST, INTERNAL, RO),
    _v("epd_router_environment", {}, DICT, ROUTER, RO, keys="environment"),
    _v("epd_router_workers", 1, INT, ROUTER, RO, minimum=1, maximum=256),
    _v("epd_router_restart_sec", 2, SECONDS, ROUTER, RO, minimum=0),
    _v("epd_router_stop_timeout_s", 60, SECONDS, ROUTER, RO, minimum=1),
    _v("epd_router_limit_nofile", 65536, INT, ROUTER, RO, minimum=1024),
    _v("epd_router_validate_config", True, BOOL, ROUTER, RO),
    # router.yaml tracing.trust_parent_sampled: a client's sampled flag decides (behind a gateway that samples)
    _v("epd_router_trust_parent_sampled", False, BOOL, ROUTER, RO),
    _v("epd_router_wait_timeout_s", 120, SECONDS, ROUTER, RO, minimum=1),
    # rollouts (playbooks/tasks/rollout.yml; rollout.py resolves counts and percentages per pool)
    _v("epd_rollout_batch_ve", 1, AMOUNT, FLEET, plays=ROLLOUT_PLAYS),
    _v("epd_rollout_batch_pd", 1, AMOUNT, FLEET, plays=ROLLOUT_PLAYS),
    _v("epd_rollout_min_available_ve", None, AMOUNT, FLEET, plays=ROLLOUT_PLAYS),
    _v("epd_rollout_min_available_pd", None, AMOUNT, FLEET, plays=ROLLOUT_PLAYS),
    # canaries: one engine per distinct configuration first, alone (docs/operations.md "Compile cache");
    # the expected times of a compile, a shared-tier fetch and a warm start, shown in the batch lines
    _v("epd_rollout_canary", None, BOOL, RUN, plays=ROLLOUT_PLAYS),
    _v("epd_rollout_expected_compile_s", 1800, SECONDS, RUN, minimum=0, plays=ROLLOUT_PLAYS),
    _v("epd_rollout_expected_fetch_s", 300, SECONDS, RUN, minimum=0, plays=ROLLOUT_PLAYS),
    _v("epd_rollout_expected_warm_s", 120, SECONDS, RUN, minimum=0, plays=ROLLOUT_PLAYS),
    _v("epd_rr_drain_timeout_s", 600, SECONDS, FLEET, minimum=1, plays=ROLLOUT_PLAYS),
    _v("epd_rr_healthy_timeout_s", 300, SECONDS, FLEET, minimum=1, plays=ROLLOUT_PLAYS),
    _v("epd_router_api_key", None, STR, FLEET, plays=(*ROLLOUT_PLAYS, "status")),
    # ops playbooks' run options
    _v("epd_ops_wait_timeout_s", None, SECONDS, RUN, minimum=1, plays=("restart", "start")),
    _v("epd_teardown_purge_cache", False, BOOL, RUN, plays=("teardown",)),
    _v("epd_precompile_target", "trn2", STR, RUN, plays=("precompile",)),
    _v("epd_precompile_root", "{{ epd_cache_dir }}/precompile", STR, RUN, plays=("precompile",), form=ABSOLUTE),
    # set by the kit while it runs
    *(
        _v(name, None, ANY, INTERNAL, plays=plays)
        for name, plays in (
            ("epd_fleet_plan", ("deploy", "plan", "render")),
            ("epd_deps_kit_install", ("deploy",)),
            ("epd_deps_vllm_cpu_changed", ("deploy",)),  # a new vllm-cpu venv or plugin rolls the engines
            ("epd_common_engine_keys", ("deploy",)),  # the engine key(s), current first (epd_common secrets)
            ("epd_firewall_applied", ("deploy",)),  # the rules deploy's first firewall pass applied
            ("epd_rr_headers", ROLLOUT_PLAYS),
            ("epd_rr_wait_healthy", ROLLOUT_PLAYS),  # false: a failed batch returns without waiting
            ("epd_render_root", ("render",)),
            ("epd_ops_component", ("restart", "start", "stop")),
            ("epd_ops_engines_selected", ("restart", "start", "stop")),
            ("epd_ops_router_selected", ("restart", "start", "stop")),
            ("epd_status_is_router", ("status",)),
            ("epd_td_remove_venvs", ("teardown",)),
            ("epd_td_units", ("teardown",)),
            ("epd_td_router_units", ("teardown",)),
            ("epd_provision_reboot_reasons", ("provision",)),
        )
    ),
)
VARIABLES: dict[str, Var] = {var.name: var for var in _DECLARED}
assert len(VARIABLES) == len(_DECLARED), "a variable is declared twice"

# The keys of each dict variable. The router sections are the router's own models
# (epd_kit/router_yaml.py, epd_kit/preprocess/settings.py; the drift test compares them):
# key -> kind. Keys the plan writes itself map to the variable to change instead.
ROUTER_SECTIONS: dict[str, dict[str, str]] = {
    "listen": {
        "host": STR,
        "port": INT,
        "max_connections": INT,
        "header_timeout_s": FLOAT,
        "body_timeout_s": FLOAT,
        "idle_timeout_s": FLOAT,
        "backlog": INT,
        "tls": DICT,
    },
    "timeouts": {
        "connect_s": FLOAT,
        "ve_s": FLOAT,
        "pd_s": FLOAT,
        "stream_gap_s": FLOAT,
        "total_s": FLOAT,
        "shutdown_grace_s": FLOAT,
        "encode_base_s": FLOAT,
        "encode_per_1k_tokens_s": FLOAT,
        "first_token_base_s": FLOAT,
        "first_token_per_1k_tokens_s": FLOAT,
        "per_token_s": FLOAT,
    },
    "limits": {
        "images_per_prompt": INT,
        "max_image_patches": INT,
        "oversized_image": STR,
        "max_body_bytes": INT,
        "max_text_bytes": INT,
        "max_json_depth": INT,
        "max_json_values": INT,
        "max_requests_preprocessing": INT,
        "text_workers": INT,
        "image_workers": INT,
        "max_image_bytes": INT,
        "max_image_pixels": INT,
        "max_image_frames": INT,
        "max_jpeg_scans": INT,
        "image_decode_timeout_s": FLOAT,
        "image_decode_inline_pixels": INT,
        "image_formats": LIST,
        "image_jobs_per_client": INT,
        "image_cache_items": INT,
        "image_cache_bytes": INT,
    },
    "media": {"allow_http": BOOL, "allowed_hosts": LIST, "fetch_timeout_s": FLOAT, "max_redirects": INT},
    "health": {
        "interval_s": FLOAT,
        "timeout_s": FLOAT,
        "failure_threshold": INT,
        "success_threshold": INT,
        "failure_ratio": FLOAT,
        "ratio_window": INT,
    },
    "placement": {
        "ve_load_bound": FLOAT,
        "ve_load_slack_items": FLOAT,
        "pd_max_inflight": INT,
        "queue_size": INT,
        "queue_timeout_s": FLOAT,
    },
    "retries": {"max_attempts": INT},
    "auth": {
        "enabled": BOOL,
        "api_keys_file": PATH,
        "tenants_file": PATH,
        "protect_metrics": BOOL,
        "protect_pools": BOOL,
    },
    "engine_auth": {"key_file": PATH},
    "admin": {"networks": LIST, "token_file": PATH},
    "tracing": {"otlp_traces_endpoint": STR, "sample_ratio": FLOAT, "trust_parent_sampled": BOOL},
}
# router.yaml keys the kit writes from other variables: set those instead (a second value
# would disagree with the socket unit, the engines or the plan). `model`, `served_model_name`,
# `quantization` and `endpoints` are the shape of the release before (router_shape.py
# OLD_SHAPE_KEYS): the kit writes them as `models`, and one of them in epd_router_extra_config
# would mix the shapes
PLANNED_KEYS: dict[str, str] = {
    "model": "epd_model",
    "models": "epd_model and epd_models (each model's endpoints from its engine counts)",
    "served_model_name": "epd_router_served_model_name",
    "quantization": "epd_quantization",
    "dtype": "nothing: the kit sets the engines' dtype",
    "handoff": "epd_neuron_release's vLLM, or epd_vllm_cpu_vllm on vllm-cpu (settings.py Settings.handoff)",
    "front_checks": "epd_neuron_release's vLLM, or epd_vllm_cpu_vllm on vllm-cpu (settings.py Settings.front_checks)",
    "ec_read_failure": "epd_engine_backend and epd_vllm_cpu_ec_transport (settings.py Settings.ec_read_failure)",
    "endpoints": "the engine counts (epd_num_ve / epd_num_pd); draining ids: epd_router_draining",
    "listen.host": "epd_router_listen_host (the socket unit binds it)",
    "listen.port": "epd_router_port (the socket unit binds it)",
    "listen.tls": "epd_tls_certificate + epd_tls_key or epd_tls_bundle (the kit installs the files)",
    "limits.images_per_prompt": "epd_images_per_prompt",
    "limits.max_image_patches": "epd_image_edge / epd_patch_size",
    "auth.enabled": "epd_router_api_keys_file",
    "auth.api_keys_file": "epd_router_api_keys_file",
    "auth.tenants_file": "epd_router_tenants and epd_router_tenant_keys (epd_router_tenants_file)",
    "engine_auth.key_file": "epd_engine_key_file",
    "admin.networks": "epd_admin_networks",
    "admin.token_file": "epd_admin_token_file",
    "tracing.otlp_traces_endpoint": "epd_otlp_traces_endpoint",
    "tracing.trust_parent_sampled": "epd_router_trust_parent_sampled",
}


def default(name: str) -> Any:
    """The declared default of `name` (the router and the planner read theirs from here)."""
    return VARIABLES[name].default


def defaults_of(spec: str, scopes: tuple[str, ...] | None = None) -> dict[str, Any]:
    """{name: default} of the variables an argument spec entry point lists, in declaration order."""
    return {v.name: v.default for v in _DECLARED if v.spec == spec and (scopes is None or v.scope in scopes)}


def declared(scopes: tuple[str, ...] | None = None) -> Mapping[str, Var]:
    return {n: v for n, v in VARIABLES.items() if scopes is None or v.scope in scopes}
