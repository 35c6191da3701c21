"""deploy/kubernetes/ (issue 15, item 5), checked offline: every object is valid Kubernetes
(kubernetes-validate, strict, at the oldest and newest version we support), and the manifests
agree with the code they run: each `meshlm` container's arguments parse with the CLI's own
parser, each port a Service, a probe or a flag names is one a container listens on, each file a
flag names is on a volume, no Secret or API access is granted. Then the control plane runs with
the manifest's own arguments (ports, paths and etcd swapped for local ones) and its probes pass."""

from __future__ import annotations

import argparse
import copy
import importlib.util
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import kubernetes_validate
import pytest
import yaml

from mesh_common.ports import free_port
from meshlm.cli import command_parser
from meshlm.commands.sidecar import _registration_problem
from sidecar.registration import Registration
from sidecar.supervisor import Supervisor
from tests.etcd_support import EtcdCluster, wait_for
from xds_server.mesh import parse_mesh
from xds_server.registry import request as registration_request

ROOT = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
# The oldest Kubernetes these manifests need (native sidecars: 1.29 beta, on by default) and
# the newest kubernetes-validate knows.
K8S_VERSIONS = ("1.30.0", "1.37.0")
LOOPBACK = "127.0.0.1"
# Values Kubernetes puts in $(VAR) at run time, for parsing the arguments here.
SAMPLE_ENV = {
    "POD_NAME": "meshlm-xds-5d8f-abcde",
    "POD_IP": "10.244.1.7",
    "SERVICE_HOST": "10.96.0.10",
}


def files() -> list[Path]:
    return sorted(p for p in ROOT.glob("*.yaml") if p.name != "kustomization.yaml")


def objects() -> list[dict[str, Any]]:
    return [d for p in files() for d in yaml.safe_load_all(p.read_text()) if d]


def named(kind: str, name: str) -> dict[str, Any]:
    (obj,) = [o for o in objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def workloads() -> list[dict[str, Any]]:
    return [o for o in objects() if o["kind"] in ("Deployment", "StatefulSet")]


def containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return pod.get("initContainers", []) + pod["containers"]


def expand(text: str, container: dict[str, Any]) -> str:
    """`text` with each $(VAR) replaced as kubelet would: the container's env, or a Service's
    MESHLM_XDS_SERVICE_HOST-style variable (the Service must exist in the manifests)."""
    own = {e["name"] for e in container.get("env", [])}

    def value(m: re.Match) -> str:
        var = m.group(1)
        if var in own:
            return SAMPLE_ENV.get(var, "x")
        service = var.removesuffix("_SERVICE_HOST")
        assert service != var, f"{container['name']}: $({var}) is not set"
        names = {o["metadata"]["name"] for o in objects() if o["kind"] == "Service"}
        assert service.lower().replace("_", "-") in names, f"no Service for $({var})"
        return SAMPLE_ENV["SERVICE_HOST"]

    return re.sub(r"\$\(([A-Z0-9_]+)\)", value, text)


def meshlm_args(container: dict[str, Any]) -> tuple[str, argparse.Namespace]:
    """(subcommand, its arguments parsed by the CLI's own parser); fails on a bad flag."""
    command, args = container["command"], container.get("args", [])
    assert command[0] == "meshlm", container["name"]
    argv = [expand(a, container) for a in [*command[1:], *args]]
    try:
        return argv[0], command_parser(argv[0]).parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"{container['name']}: meshlm does not take {argv}")


def listens(container: dict[str, Any]) -> dict[int, str]:
    """port -> address, for what the container's command listens on."""
    if container["command"][0] != "meshlm":  # etcd: its --listen-*-urls
        urls = [a.split("=", 1)[1] for a in container["args"] if a.startswith("--listen-")]
        return {urlsplit(u).port: urlsplit(u).hostname for u in urls}
    name, a = meshlm_args(container)
    if name == "xds-server":
        return {a.grpc_port: a.grpc_host, a.admin_port: LOOPBACK}
    if name == "serve":
        ports = {a.port: a.host, a.metrics_port: LOOPBACK, a.http_port: a.host}
        return {p: h for p, h in ports.items() if p is not None}
    if name == "sidecar":  # Envoy's admin; the inbound listener callers reach; the hook's port
        ports = {a.admin_port: LOOPBACK, a.inbound_port: a.listen_host}
        if a.deregister_port is not None:
            ports[a.deregister_port] = LOOPBACK
        return ports
    return {}


def mesh_of_configmap():
    return parse_mesh(yaml.safe_load(named("ConfigMap", "meshlm-mesh")["data"]["mesh.yaml"]))


def probe_urls(container: dict[str, Any]) -> list[str]:
    out = []
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container.get(kind)
        if probe and "exec" in probe:
            cmd = probe["exec"]["command"]
            assert cmd[:3] == ["python", "-m", "meshlm.probe"] and len(cmd) == 4, cmd
            out.append(cmd[3])
    return out


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_is_valid_kubernetes(version):
    docs = objects()
    assert {d["kind"] for d in docs} >= {
        "Namespace", "ConfigMap", "ServiceAccount", "Deployment", "StatefulSet", "Service",
        "PodDisruptionBudget", "NetworkPolicy",
    }  # fmt: skip
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)
    # The check can fail: a misspelt field is refused.
    bad = copy.deepcopy(named("Deployment", "meshlm-xds"))
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, version, strict=True)


def test_kustomization_applies_every_file_in_the_namespace():
    kustomization = yaml.safe_load((ROOT / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in files())
    for doc in objects():
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "meshlm", doc["metadata"]


def test_every_meshlm_container_passes_only_flags_the_cli_takes():
    seen = set()
    for w in workloads():
        for c in containers(w["spec"]["template"]["spec"]):
            if c["command"][0] == "meshlm":
                seen.add(meshlm_args(c)[0])
    assert seen == {"xds-server", "serve", "sidecar"}
    # The check can fail: a flag the CLI does not have, or an abbreviated one.
    for wrong in (["--grpc-prot=1"], ["--leader=30"]):
        c = {"name": "x", "command": ["meshlm", "xds-server", "--mesh=m", *wrong]}
        with pytest.raises(pytest.fail.Exception):
            meshlm_args(c)


def test_every_service_and_probe_port_is_one_its_container_listens_on():
    for svc in (o for o in objects() if o["kind"] == "Service"):
        selector = svc["spec"]["selector"]
        pods = [
            w["spec"]["template"]
            for w in workloads()
            if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert pods, f"Service {svc['metadata']['name']} selects no pod"
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            found = [
                (c, p)
                for pod in pods
                for c in containers(pod["spec"])
                for p in c.get("ports", [])
                if target in (p.get("name"), p["containerPort"])
            ]
            assert found, f"Service {svc['metadata']['name']}: no container port {target}"
            for c, p in found:  # reachable from other pods: not on loopback
                address = listens(c).get(p["containerPort"])
                assert address not in (None, LOOPBACK), (c["name"], p, listens(c))
    for w in workloads():
        for c in containers(w["spec"]["template"]["spec"]):
            for p in c.get("ports", []):
                assert p["containerPort"] in listens(c), (c["name"], p)
            for url in probe_urls(c):
                u = urlsplit(url)
                assert u.hostname == LOOPBACK and listens(c).get(u.port) == LOOPBACK, url
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                http = c.get(kind, {}).get("httpGet")
                if http:
                    names = {p.get("name"): p["containerPort"] for p in c["ports"]}
                    assert names.get(http["port"], http["port"]) in listens(c), (c["name"], http)


def test_the_sidecar_reaches_the_control_plane_and_fronts_its_runtime():
    xds = named("Deployment", "meshlm-xds")["spec"]["template"]["spec"]
    (server,) = [c for c in xds["containers"] if c["name"] == "xds-server"]
    _, cp = meshlm_args(server)
    service_ports = {p["port"] for p in named("Service", "meshlm-xds")["spec"]["ports"]}
    pod = named("Deployment", "llm-v1")["spec"]["template"]["spec"]
    (sidecar,) = [c for c in containers(pod) if c["name"] == "sidecar"]
    (runtime,) = [c for c in containers(pod) if c["name"] == "runtime"]
    _, sc = meshlm_args(sidecar)
    _, rt = meshlm_args(runtime)
    assert sc.xds == [(SAMPLE_ENV["SERVICE_HOST"], cp.grpc_port)]
    assert cp.grpc_port in service_ports
    assert sc.local_endpoint == f"{rt.host}:{rt.port}" and rt.host == LOOPBACK
    assert sidecar.get("restartPolicy") == "Always"  # a native sidecar: outlives the runtime
    mesh = mesh_of_configmap()
    assert sc.version in mesh.services[sc.service].versions


def runtime_pod() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(pod spec, sidecar container, runtime container) of the llm-v1 Deployment."""
    pod = named("Deployment", "llm-v1")["spec"]["template"]["spec"]
    (sidecar,) = [c for c in containers(pod) if c["name"] == "sidecar"]
    (runtime,) = [c for c in containers(pod) if c["name"] == "runtime"]
    return pod, sidecar, runtime


def test_the_mesh_lists_no_endpoint_and_takes_registrations_across_hosts():
    """Pods come and go with their IPs: the mesh names none, so scaling the Deployment never
    touches the ConfigMap; registration is on, and loopback addresses are refused."""
    text = named("ConfigMap", "meshlm-mesh")["data"]["mesh.yaml"]
    assert not re.search(r"\b\d{1,3}(\.\d{1,3}){3}\b", text), "an IP address in the mesh"
    mesh = mesh_of_configmap()
    for svc in mesh.services.values():
        for version in svc.versions.values():
            assert version.endpoints == (), (svc.name, version.name)
    registration = mesh.control_plane.registration
    assert registration.enabled is True and registration.multi_host is True
    assert registration.max_per_service >= named("Deployment", "llm-v1")["spec"]["replicas"]


def test_the_sidecar_registers_its_pod_ip_with_the_argv_meshlm_sidecar_takes():
    _, sidecar, runtime = runtime_pod()
    env = {e["name"]: e for e in sidecar["env"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    _, sc = meshlm_args(sidecar)
    _, rt = meshlm_args(runtime)
    assert "--register=$(POD_IP):15101" in sidecar["args"]
    assert "--listen-host=$(POD_IP)" in sidecar["args"]
    assert sc.register == (SAMPLE_ENV["POD_IP"], sc.inbound_port)
    assert sc.listen_host == SAMPLE_ENV["POD_IP"]
    assert sc.local_endpoint == f"{LOOPBACK}:{rt.port}"  # the runtime stays on loopback
    assert {p["containerPort"] for p in sidecar["ports"]} == {sc.inbound_port}
    # What `meshlm sidecar` checks before it starts anything.
    assert _registration_problem(sc) is None
    # What the control plane checks: the registration the sidecar sends is accepted by the
    # mesh's own rules, and the same from a loopback address is refused (multi_host).
    mesh = mesh_of_configmap()

    def register(address: str) -> bytes:
        body = {"node_id": "llm-v1-abcde-15101", "address": address, "service": sc.service,
                "version": sc.version, "health": "SERVING"}  # fmt: skip
        return json.dumps({"register": body}).encode()

    msg = registration_request.parse(register(f"{sc.register[0]}:{sc.register[1]}"), mesh)
    assert str(msg.endpoint) == f"{SAMPLE_ENV['POD_IP']}:{sc.inbound_port}"
    with pytest.raises(registration_request.Refused, match=r"register\.address"):
        registration_request.parse(register(f"{LOOPBACK}:{sc.inbound_port}"), mesh)


def test_only_mesh_pods_reach_the_port_that_takes_registrations():
    """Without identity the gRPC port is plaintext and registration trusts whoever reaches it:
    a NetworkPolicy lets in this namespace's mesh pods, the runtime pods among them."""
    policy = named("NetworkPolicy", "meshlm-xds")["spec"]
    xds = named("Deployment", "meshlm-xds")["spec"]["template"]
    assert policy["podSelector"]["matchLabels"].items() <= xds["metadata"]["labels"].items()
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    assert [p["port"] for p in rule["ports"]] == ["grpc-xds"]
    (source,) = rule["from"]
    assert set(source) == {"podSelector"}  # this namespace only
    llm = named("Deployment", "llm-v1")["spec"]["template"]["metadata"]["labels"]
    assert source["podSelector"]["matchLabels"].items() <= llm.items()


def test_the_pod_deregisters_before_its_runtime_drains_within_the_grace_period():
    """Kubelet runs the runtime's preStop hook, then stops the runtime, then its native sidecar:
    the hook has the sidecar deregister the pod (answering once the callers hold the removal),
    the runtime drains its streams behind the sidecar's live listener, then Envoy drains, all
    before the grace period ends in SIGKILL."""
    pod, sidecar, runtime = runtime_pod()
    _, rt = meshlm_args(runtime)
    _, sc = meshlm_args(sidecar)
    assert sidecar.get("restartPolicy") == "Always" and sidecar in pod["initContainers"]
    hook = runtime["lifecycle"]["preStop"]["exec"]["command"]
    assert hook == ["python", "-m", "sidecar.deregister_port", str(sc.deregister_port)]
    assert importlib.util.find_spec(hook[2]) is not None
    assert "lifecycle" not in sidecar  # its SIGTERM comes after the runtime's drain
    deregister = inspect.signature(Registration.deregister).parameters["timeout"].default
    envoy_drain = inspect.signature(Supervisor).parameters["drain_time_s"].default
    margin = 5
    assert pod["terminationGracePeriodSeconds"] >= (
        rt.drain_timeout + deregister + envoy_drain + margin
    )
    assert "livenessProbe" not in runtime  # a draining runtime is not killed


def test_the_store_names_every_etcd_member_on_its_client_port():
    etcd = named("StatefulSet", "etcd")
    (member,) = etcd["spec"]["template"]["spec"]["containers"]
    client = next(p for p in member["ports"] if p["name"] == "client")["containerPort"]
    service = etcd["spec"]["serviceName"]
    assert named("Service", service)["spec"]["clusterIP"] == "None"  # per-member DNS names
    server = named("Deployment", "meshlm-xds")["spec"]["template"]["spec"]["containers"][0]
    _, cp = meshlm_args(server)
    url = urlsplit(cp.store)
    assert url.scheme == "etcds", cp.store  # TLS and etcd's auth
    hosts = url.netloc.split(",")
    members = [f"{etcd['metadata']['name']}-{i}.{service}:{client}" for i in range(3)]
    assert etcd["spec"]["replicas"] == 3 and hosts == members
    pdb = named("PodDisruptionBudget", "etcd")["spec"]
    assert pdb["minAvailable"] == 2  # a quorum of three


def test_etcd_takes_only_tls_clients_and_the_control_plane_logs_in_with_files_of_a_secret():
    etcd = named("StatefulSet", "etcd")["spec"]["template"]["spec"]
    (member,) = etcd["containers"]
    flags = dict(a.removeprefix("--").partition("=")[::2] for a in member["args"])
    for name in ("listen-client-urls", "advertise-client-urls", "listen-peer-urls",
                 "initial-advertise-peer-urls"):  # fmt: skip
        assert all(u.startswith("https://") for u in flags[name].split(",")), name
    assert "client-cert-auth" in flags and "peer-client-cert-auth" in flags
    assert flags["initial-cluster"].count("=https://") == 3
    assert urlsplit(flags["listen-metrics-urls"]).port != 2379  # probes: health only
    secrets = {v["name"]: v["secret"]["secretName"] for v in etcd["volumes"] if "secret" in v}
    mounts = {m["mountPath"]: m["name"] for m in member["volumeMounts"]}
    for flag in ("cert-file", "key-file", "trusted-ca-file", "peer-cert-file", "peer-key-file",
                 "peer-trusted-ca-file"):  # fmt: skip
        volume = mounts[str(Path(flags[flag]).parent)]
        assert secrets[volume] == "meshlm-etcd-members", flag

    pod = named("Deployment", "meshlm-xds")["spec"]["template"]["spec"]
    (server,) = [c for c in pod["containers"] if c["name"] == "xds-server"]
    _, cp = meshlm_args(server)
    query = parse_qs(urlsplit(cp.store).query)
    assert set(query) == {"creds"}, query  # files only: no secret in the arguments
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    mounts = {m["mountPath"]: m["name"] for m in server["volumeMounts"]}
    assert secrets[mounts[query["creds"][0]]] == "meshlm-etcd-client"


def test_files_are_on_volumes_and_nothing_secret_or_privileged_is_in_the_manifests():
    assert not [o for o in objects() if o["kind"] in ("Secret", "Role", "ClusterRole")]
    assert not [o for o in objects() if o["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    for w in workloads():
        pod = w["spec"]["template"]["spec"]
        assert pod.get("automountServiceAccountToken") is False, w["metadata"]["name"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in containers(pod):
            assert c["resources"]["requests"] and c["resources"]["limits"]["memory"], c["name"]
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
            assert sc["capabilities"]["drop"] == ["ALL"]
            if c["command"][0] != "meshlm":
                continue
            mounts = [m["mountPath"] for m in c.get("volumeMounts", [])]
            _, a = meshlm_args(c)
            for flag in ("mesh", "token_file", "isolation_store", "lkg_file"):
                path = getattr(a, flag, None)
                if path:  # read-only root: files live on volumes
                    assert any(path.startswith(m + "/") for m in mounts), (c["name"], path)
            for e in c.get("env", []):
                assert "TOKEN" not in e["name"] and "KEY" not in e["name"], e


def test_the_control_plane_runs_with_the_manifests_arguments_and_passes_its_probes(tmp_path):
    """The xds-server container's own argument list, with what a cluster provides swapped for
    local things: ports (free ones), the volumes' paths (tmp_path), the etcd members (one real
    etcd). Then each of its exec probes, as kubelet would run it, answers 0."""
    pod = named("Deployment", "meshlm-xds")["spec"]["template"]["spec"]
    (server,) = [c for c in pod["containers"] if c["name"] == "xds-server"]
    grpc_port, admin_port = free_port(), free_port()
    (tmp_path / "mesh.yaml").write_text(named("ConfigMap", "meshlm-mesh")["data"]["mesh.yaml"])
    (tmp_path / "token").write_text("k8s-manifest-test-token-0123456789\n")
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    with EtcdCluster(1, secure=True) as etcd:
        swap = {
            "/var/lib/meshlm/mesh.yaml": str(tmp_path / "mesh.yaml"),
            "/etc/meshlm/admin/token": str(tmp_path / "token"),
            "/var/lib/meshlm/": f"{tmp_path}/",
            "18000": str(grpc_port),
            "18001": str(admin_port),
        }
        args = []
        for a in server["args"]:
            a = expand(a, server)
            if a.startswith("--store="):  # the manifest's URL, at the local members
                url = urlsplit(a.removeprefix("--store="))
                creds = parse_qs(url.query)["creds"][0]
                query = url.query.replace(creds, str(etcd.pki.client))
                a = f"--store={url.scheme}://{etcd.endpoints[0]}{url.path}?{query}"
            for old, new in swap.items():
                a = a.replace(old, new)
            args.append(a)
        env = {"PATH": str(Path(sys.executable).parent), "XDG_RUNTIME_DIR": str(run)}
        argv = [sys.executable, "-m", "meshlm.cli", *server["command"][1:], *args]
        log = tmp_path / "xds.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            for url in probe_urls(server):
                url = url.replace(":18001/", f":{admin_port}/")
                cmd = [sys.executable, "-m", "meshlm.probe", url]

                def passes(cmd=cmd) -> bool:
                    assert proc.poll() is None, log.read_text()
                    return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0

                wait_for(passes, 60)
        finally:
            proc.terminate()
            proc.wait(20)
    assert "Traceback" not in log.read_text(), log.read_text()


def test_the_image_installs_every_package_and_runs_as_the_manifests_user():
    """deploy/Dockerfile itself is not built here (no container runtime): what can be checked
    offline is that it copies every package pyproject installs and runs as the pods' user."""
    dockerfile = (ROOT.parent / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\w+) \1$", dockerfile, re.M))
    pyproject = (ROOT.parent.parent / "pyproject.toml").read_text()
    include = re.search(r"packages\.find\]\s*include = \[(.*?)\]", pyproject, re.S).group(1)
    assert copied == {p.strip(' "*') for p in include.split(",")}
    user = int(re.search(r"^USER (\d+)$", dockerfile, re.M).group(1))
    for w in workloads():
        pod = w["spec"]["template"]["spec"]
        if any(c["image"] == "meshlm" for c in containers(pod)):
            assert pod["securityContext"]["runAsUser"] == user, w["metadata"]["name"]


# Flags one side sets and the other leaves at the default, each for a reason of its own side:
# the pod adds its drain hook and resource bounds; the harness runs several hosts' runtimes on one
# machine (a unique node id and replica id per namespace, where a pod's node id comes from its
# name) and serves the OpenAI hop the demo drives.
ONLY_THE_POD = {"deregister_port", "max_heap_mb", "metrics_port", "drain_timeout"}
ONLY_THE_HARNESS = {
    "node_id", "local_http_endpoint", "http_port", "served_model_name", "replica_id",
}  # fmt: skip


def test_the_pod_runs_the_command_lines_of_the_multi_host_harness():
    """The runtime and sidecar lines of the llm-v1 pod are meshlm/demo/host_commands.py's for the
    same address and ports, flag by flag as the CLI parses them, but the documented differences."""
    from meshlm.demo.host_commands import runtime_host_commands

    _, sidecar, runtime = runtime_pod()
    _, sc = meshlm_args(sidecar)
    _, rt = meshlm_args(runtime)
    address = SAMPLE_ENV["POD_IP"]
    harness = runtime_host_commands(
        address,
        xds=f"{SAMPLE_ENV['SERVICE_HOST']}:{sc.xds[0][1]}",
        service=sc.service,
        version=sc.version,
        grpc_port=rt.port,
        http_port=8080,
        inbound_port=sc.inbound_port,
        admin_port=sc.admin_port,
        precision=rt.precision,
    )
    for name, pod_args, argv in (
        ("sidecar", sc, harness.sidecar),
        ("runtime", rt, harness.runtime),
    ):
        assert argv[0] == "meshlm"
        ours = command_parser(argv[1]).parse_args(argv[2:])
        defaults = command_parser(argv[1]).parse_args(
            ["--port", "1"] if name == "runtime" else ["--xds", "127.0.0.1:1"]
        )
        pod, harn = vars(pod_args), vars(ours)
        differ = {k for k in pod.keys() | harn.keys() if pod.get(k) != harn.get(k)}
        assert differ <= ONLY_THE_POD | ONLY_THE_HARNESS, f"{name}: {sorted(differ)} differ"
        for k in differ & ONLY_THE_POD:
            assert harn[k] == vars(defaults)[k], f"{name}: the harness sets --{k}"
        for k in differ & ONLY_THE_HARNESS:
            assert pod[k] == vars(defaults)[k], f"{name}: the pod sets --{k}"
