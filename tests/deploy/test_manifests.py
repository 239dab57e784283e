"""The Kubernetes manifests of ``deploy/k8s``: every overlay renders with kustomize, every resource it renders is
valid for every supported Kubernetes release in strict mode, and the parts that must agree do (GPUs and processes,
nodes and pods, the rendezvous and its Service, the collector's ports, the exported model and the server)."""

from __future__ import annotations

import copy
import re
import shlex
from urllib.parse import urlsplit

import pytest
import yaml
from _render import (
    DEPLOY,
    OVERLAYS,
    ROOT,
    env_of,
    expand,
    kubernetes_versions,
    named,
    of_kind,
    pod_spec,
    render,
    validate_strictly,
)

WORKLOADS = ("Deployment", "Job")


def overlay(name: str):
    return render(DEPLOY / "k8s" / "overlays" / name)


def containers(resource: dict) -> list[dict]:
    spec = pod_spec(resource)
    return [*spec.get("initContainers", []), *spec["containers"]]


def test_the_overlays_are_the_documented_ones():
    assert [o.name for o in OVERLAYS] == ["serve", "train-multi-node", "train-single-node"]


@pytest.mark.parametrize("path", OVERLAYS, ids=lambda p: p.name)
def test_every_rendered_resource_is_valid_in_strict_mode_for_every_supported_release(path):
    resources = render(path)
    assert {r["kind"] for r in resources} >= {
        "Namespace",
        "PersistentVolumeClaim",
        "ConfigMap",
        "Service",
        "Deployment",
    }
    failures = []
    for version in kubernetes_versions():
        for resource in resources:
            try:
                validate_strictly(resource, version)
            except Exception as err:  # a kind without a schema fails here too: SchemaNotFoundError
                first = str(err).strip().splitlines()[0]
                failures.append(
                    f"{version} {resource['kind']}/{resource['metadata']['name']}: {type(err).__name__}: {first}"
                )
    assert not failures, "\n".join(failures)


def test_the_validation_fails_on_a_kind_without_a_schema_and_on_an_unknown_field():
    from kubernetes_validate.utils import SchemaNotFoundError, ValidationError

    custom = {
        "apiVersion": "opentelemetry.io/v1beta1",
        "kind": "OpenTelemetryCollector",
        "metadata": {"name": "otel"},
        "spec": {},
    }
    with pytest.raises(SchemaNotFoundError):
        validate_strictly(custom, "1.37")
    job = copy.deepcopy(named(overlay("train-single-node"), "Job", "align-train"))
    validate_strictly(job, "1.37")
    job["spec"]["template"]["spec"]["containers"][0]["gpus"] = 8
    with pytest.raises(ValidationError):
        validate_strictly(job, "1.37")


@pytest.mark.parametrize("path", OVERLAYS, ids=lambda p: p.name)
def test_workloads_run_as_non_root_with_pinned_images_and_bounded_memory(path):
    workloads = [r for r in render(path) if r["kind"] in WORKLOADS]
    assert workloads
    for workload in workloads:
        where = f"{path.name}: {workload['kind']}/{workload['metadata']['name']}"
        assert pod_spec(workload)["securityContext"]["runAsNonRoot"] is True, where
        for container in containers(workload):
            image = container["image"]
            tag = image.rpartition("/")[2].partition(":")[2]
            assert "@sha256:" in image or (tag and tag != "latest"), f"{where}: image {image} has no pinned tag"
            resources = container["resources"]
            assert resources["requests"]["memory"] and resources["limits"]["memory"], where
            assert resources["limits"].get("nvidia.com/gpu") == resources["requests"].get("nvidia.com/gpu"), where
            assert container["securityContext"]["allowPrivilegeEscalation"] is False, where


@pytest.mark.parametrize("path", OVERLAYS, ids=lambda p: p.name)
def test_services_volumes_and_config_maps_point_at_rendered_objects(path):
    resources = render(path)
    workloads = [r for r in resources if r["kind"] in WORKLOADS]
    for service in of_kind(resources, "Service"):
        selector = service["spec"]["selector"]
        pods = [
            w
            for w in workloads
            if selector.items()
            <= {
                **w["spec"]["template"]["metadata"]["labels"],
                # the Job controller labels its pods with the Job's name
                **({"batch.kubernetes.io/job-name": w["metadata"]["name"]} if w["kind"] == "Job" else {}),
            }.items()
        ]
        assert pods, f"Service/{service['metadata']['name']} selects no rendered pod"
        ports = {p["name"] for w in pods for c in containers(w) for p in c.get("ports", [])}
        ports |= {p["containerPort"] for w in pods for c in containers(w) for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, f"Service/{service['metadata']['name']}: {port}"
    for workload in workloads:
        volumes = pod_spec(workload)["volumes"]
        for volume in volumes:
            if "configMap" in volume:
                named(resources, "ConfigMap", volume["configMap"]["name"])
            if "persistentVolumeClaim" in volume:
                named(resources, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
        for container in containers(workload):
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in {v["name"] for v in volumes}, mount


# ----------------------------------------------------------------------------------------------- the collector


def collector(resources) -> tuple[dict, dict, dict]:
    """The collector's Deployment, Service and parsed config."""
    deployment = named(resources, "Deployment", "otel-collector")
    volume = next(v for v in pod_spec(deployment)["volumes"] if "configMap" in v)
    config_map = named(resources, "ConfigMap", volume["configMap"]["name"])
    return deployment, named(resources, "Service", "otel-collector"), yaml.safe_load(config_map["data"]["config.yaml"])


def port_of(endpoint: str) -> int:
    return int(endpoint.rpartition(":")[2])


def test_the_collector_takes_otlp_in_and_gives_a_debug_log_and_a_prometheus_endpoint_out():
    deployment, service, config = collector(overlay("train-single-node"))
    container = pod_spec(deployment)["containers"][0]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    assert f"--config={mount['mountPath']}/config.yaml" in container["args"]
    for kind in ("receivers", "processors", "exporters"):  # a pipeline names only components that are defined
        for name, pipeline in config["service"]["pipelines"].items():
            assert set(pipeline[kind]) <= set(config[kind]), (name, kind)
    assert set(config["service"]["extensions"]) <= set(config["extensions"])
    pipelines = config["service"]["pipelines"]
    assert pipelines["metrics"]["receivers"] == ["otlp"] and pipelines["traces"]["receivers"] == ["otlp"]
    assert {"debug", "prometheus"} <= set(pipelines["metrics"]["exporters"])
    assert "debug" in pipelines["traces"]["exporters"]
    container_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    service_ports = {p["port"]: container_ports[p["targetPort"]] for p in service["spec"]["ports"]}
    otlp = config["receivers"]["otlp"]["protocols"]
    assert service_ports[4317] == port_of(otlp["grpc"]["endpoint"])
    assert service_ports[4318] == port_of(otlp["http"]["endpoint"])
    assert port_of(config["exporters"]["prometheus"]["endpoint"]) in service_ports.values()
    health = port_of(config["extensions"]["health_check"]["endpoint"])
    for probe in ("readinessProbe", "livenessProbe"):
        assert container_ports[container[probe]["httpGet"]["port"]] == health


def otlp_target(resources, container: dict) -> None:
    """The container's OTEL_EXPORTER_OTLP_ENDPOINT is the collector's Service, on its OTLP gRPC port."""
    endpoint = urlsplit(env_of(container)["OTEL_EXPORTER_OTLP_ENDPOINT"])
    _, service, config = collector(resources)
    assert endpoint.scheme == "http" and endpoint.hostname == service["metadata"]["name"]
    assert endpoint.port in {p["port"] for p in service["spec"]["ports"]}
    assert endpoint.port == port_of(config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"])


# ------------------------------------------------------------------------------------------------ training jobs

TRAINING = {"train-single-node": "align-train", "train-multi-node": "align-train-multinode"}


def training(name: str):
    """The overlay's resources, its Job, the Job's container, torchrun's parsed arguments and align's."""
    from torch.distributed.run import get_args_parser

    resources = overlay(name)
    job = named(resources, "Job", TRAINING[name])
    container = pod_spec(job)["containers"][0]
    assert container["command"] == ["torchrun"]
    env = {**env_of(container), "NODE_RANK": "0"}
    torchrun = get_args_parser().parse_args([expand(a, env) for a in container["args"]])
    assert torchrun.no_python and torchrun.training_script == "align"
    fit = torchrun.training_script_args
    assert fit[0] == "fit"
    return resources, job, container, torchrun, dict(a.removeprefix("--").split("=", 1) for a in fit[1:])


def mounted(job: dict, container: dict, path: str, source: str) -> dict:
    """The volume (of kind ``source``) mounted at the folder holding ``path``."""
    volumes = {v["name"]: v for v in pod_spec(job)["volumes"]}
    mounts = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert len(mounts) == 1, f"{path}: not on one mounted volume"
    return volumes[mounts[0]["name"]][source]


def train_config(resources, job, container, settings) -> dict:
    config_map = named(resources, "ConfigMap", mounted(job, container, settings["config"], "configMap")["name"])
    return yaml.safe_load(config_map["data"][settings["config"].rpartition("/")[2]])


@pytest.mark.parametrize("name", TRAINING)
def test_a_training_job_resumes_from_the_volume_and_survives_eviction(name):
    resources, job, container, _, settings = training(name)
    assert settings["resume"] == "auto"
    claim = mounted(job, container, settings["trainer.default_root_dir"], "persistentVolumeClaim")["claimName"]
    assert "ReadWriteMany" in named(resources, "PersistentVolumeClaim", claim)["spec"]["accessModes"]
    train_config(resources, job, container, settings)  # the config is a key of the mounted ConfigMap
    assert pod_spec(job)["restartPolicy"] == "Never" and job["spec"]["backoffLimit"] >= 1
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
    assert mounted(job, container, "/dev/shm/x", "emptyDir")["medium"] == "Memory"


@pytest.mark.parametrize("name", TRAINING)
def test_a_training_job_runs_one_process_per_gpu_and_sends_telemetry_to_the_collector(name):
    resources, job, container, torchrun, settings = training(name)
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert torchrun.nproc_per_node == settings["trainer.devices"] == str(gpus)
    otlp_target(resources, container)
    attributes = dict(
        kv.split("=", 1) for kv in expand(env_of(container)["OTEL_RESOURCE_ATTRIBUTES"], env_of(container)).split(",")
    )
    config = train_config(resources, job, container, settings)
    module = config["model"]["class_path"].rpartition(".")[2]
    assert attributes["align.algorithm"] == module.removesuffix("Module").lower()
    assert attributes["align.run_name"] == settings["trainer.default_root_dir"].rpartition("/")[2]
    assert {"align.observability.OTLPLogger"} == {lg["class_path"] for lg in config["trainer"]["logger"]}
    assert "align.observability.OTelTracingCallback" in {c["class_path"] for c in config["trainer"]["callbacks"]}


def test_the_single_node_job_is_standalone():
    _, job, _, torchrun, settings = training("train-single-node")
    assert torchrun.standalone and torchrun.nnodes == "1:1" and settings["trainer.num_nodes"] == "1"
    assert "completionMode" not in job["spec"]


def test_the_multi_node_job_is_indexed_one_pod_per_node_with_node_zero_as_rendezvous():
    resources, job, container, torchrun, settings = training("train-multi-node")
    spec = job["spec"]
    nodes = int(env_of(container)["NNODES"])
    assert nodes > 1 and spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == nodes
    assert torchrun.nnodes == settings["trainer.num_nodes"] == str(nodes) and not torchrun.standalone
    node_rank = next(e for e in container["env"] if e["name"] == "NODE_RANK")
    assert (
        node_rank["valueFrom"]["fieldRef"]["fieldPath"]
        == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    assert "--node_rank=$(NODE_RANK)" in container["args"]
    pods = pod_spec(job)
    service = named(resources, "Service", pods["subdomain"])
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert torchrun.master_addr == f"{job['metadata']['name']}-0.{pods['subdomain']}"
    assert int(torchrun.master_port) in {p["port"] for p in service["spec"]["ports"]}
    (term,) = pods["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}


@pytest.mark.parametrize("name", TRAINING)
def test_the_job_s_config_and_arguments_build_the_run(name, tiny_model_dir, tmp_path):
    """``align fit`` as the Job runs it (its config, its arguments), with the hub model swapped for the tiny one and
    the run on one CPU process."""
    from align.cli.arguments import resolve_config_args
    from align.cli.lightning_cli import AlignCLI
    from align.models.export import ExportCallback
    from align.observability import OTLPLogger

    resources, job, container, _, settings = training(name)
    config = train_config(resources, job, container, settings)
    config["model"]["init_args"]["policy"]["init_args"]["model"] = tiny_model_dir
    local = tmp_path / "config.yaml"
    local.write_text(yaml.safe_dump(config))
    settings.update({"config": str(local), "trainer.default_root_dir": str(tmp_path / "runs")})
    args = resolve_config_args([f"--{key}={value}" for key, value in settings.items()])
    cli = AlignCLI(args=[*args, "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.num_nodes=1"], run=False)
    assert cli.config["resume"] == "auto" and cli.trainer.max_steps > 0
    assert any(isinstance(lg, OTLPLogger) for lg in cli.trainer.loggers)
    assert any(isinstance(cb, ExportCallback) for cb in cli.trainer.callbacks)


# ------------------------------------------------------------------------------------------------------ serving


def test_the_server_serves_the_model_the_single_node_run_exports_with_probes_and_resources():
    resources = overlay("serve")
    deployment = named(resources, "Deployment", "align-serve")
    (server,) = pod_spec(deployment)["containers"]
    env = env_of(server)
    assert server["command"] == ["vllm", "serve"]
    args = [expand(a, env) for a in server["args"]]
    model_dir = args[0]
    claim = mounted(deployment, server, model_dir + "/config.json", "persistentVolumeClaim")["claimName"]
    named(resources, "PersistentVolumeClaim", claim)
    assert f"--served-model-name={env['SERVED_NAME']}" in args

    training_resources, job, container, _, settings = training("train-single-node")
    config = train_config(training_resources, job, container, settings)
    exports = [
        c["init_args"]["output_dir"]
        for c in config["trainer"]["callbacks"]
        if c["class_path"] == "align.models.export.ExportCallback"
    ]
    assert exports == [model_dir]
    assert mounted(job, container, model_dir + "/config.json", "persistentVolumeClaim")["claimName"] == claim

    (wait,) = pod_spec(deployment)["initContainers"]
    assert f"{model_dir}/tokenizer_config.json" in expand(" ".join(wait["args"]), env_of(wait))

    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    assert f"--port={ports['http']}" in args
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    assert server["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert named(resources, "Service", "align-serve")["spec"]["ports"][0]["targetPort"] == "http"
    assert f"--otlp-traces-endpoint={env['OTEL_EXPORTER_OTLP_ENDPOINT']}" in args
    otlp_target(resources, server)


# ------------------------------------------------------------------------------------------------------- the docs


def documented(program: str) -> list[str]:
    """The words of the command line that starts with ``program`` in docs/deployment.md (continuations joined)."""
    text = (ROOT / "docs" / "deployment.md").read_text()
    match = re.search(rf"^{re.escape(program)} (?:.*\\\n)*.*$", text, flags=re.MULTILINE)
    assert match, f"docs/deployment.md shows no '{program} ...' line"
    return shlex.split(match.group(0).replace("\\\n", " "))


def test_the_docs_show_the_commands_the_pods_run():
    _, _, container, _, _ = training("train-single-node")
    env = env_of(container)
    assert documented("torchrun --standalone") == [*container["command"], *(expand(a, env) for a in container["args"])]
    server = pod_spec(named(overlay("serve"), "Deployment", "align-serve"))["containers"][0]
    env = env_of(server)
    assert documented("vllm serve") == [*server["command"], *(expand(a, env) for a in server["args"])]


def test_the_docs_overlay_of_your_own_names_your_image_and_storage_class(tmp_path):
    text = (ROOT / "docs" / "deployment.md").read_text()
    (example,) = re.findall(r"^# my-cluster/train/kustomization.yaml\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    (tmp_path / "align").symlink_to(ROOT)
    mine = tmp_path / "my-cluster" / "train"
    mine.mkdir(parents=True)
    (mine / "kustomization.yaml").write_text(example)
    resources = render(mine)
    settings = yaml.safe_load(example)
    (image,) = settings["images"]
    container = pod_spec(named(resources, "Job", "align-train"))["containers"][0]
    assert container["image"] == f"{image['newName']}:{image['newTag']}"
    claim = named(resources, "PersistentVolumeClaim", "align-runs")
    assert claim["spec"]["storageClassName"] == yaml.safe_load(settings["patches"][0]["patch"])[0]["value"]


@pytest.mark.parametrize("path", OVERLAYS, ids=lambda p: p.name)
def test_pods_of_the_align_image_run_as_the_image_s_user(path):
    (uid, gid) = re.findall(r"^USER (\d+):(\d+)$", (DEPLOY / "Containerfile.cuda").read_text(), flags=re.MULTILINE)[-1]
    pods = [pod_spec(r) for r in render(path) if r["kind"] in WORKLOADS and r["metadata"]["name"] != "otel-collector"]
    assert pods
    for pod in pods:
        assert all("align-cuda" in c["image"] for c in [*pod.get("initContainers", []), *pod["containers"]])
        context = pod["securityContext"]
        assert (context["runAsUser"], context["runAsGroup"], context["fsGroup"]) == (int(uid), int(gid), int(gid))
