"""Derive tests/data/mpijob-v2beta1.crd-excerpt.yaml from the MPI Operator's CRD.

    git clone https://github.com/kubeflow/mpi-operator && \\
    python tests/data/mpijob_crd_excerpt.py mpi-operator/manifests/base/kubeflow.org_mpijobs.yaml \\
        caa3c47fc42eb762635f78045ec0fcd1a89eb038 > tests/data/mpijob-v2beta1.crd-excerpt.yaml

The excerpt is the CRD's v2beta1 openAPIV3Schema with its descriptions removed, its status
left open, and, inside the pod template, the object-valued fields mpilearn never renders
left open (their names stay, so a misspelt field is still refused); every field mpilearn
renders keeps the CRD's own schema.
"""
import sys

import yaml

# pod-spec, container and volume fields whose full schema is kept (the rest: names only)
KEEP_POD = {"containers", "initContainers", "volumes", "securityContext", "tolerations",
            "imagePullSecrets", "nodeSelector"}
KEEP_CONTAINER = {"command", "args", "env", "resources", "volumeMounts", "securityContext"}
KEEP_VOLUME = {"persistentVolumeClaim", "configMap", "emptyDir"}


def strip(node):
    if isinstance(node, dict):
        return {k: strip(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [strip(v) for v in node]
    return node


def open_up(schema: dict) -> dict:
    """The field's type (and Kubernetes flags) without its properties."""
    return {k: v for k, v in schema.items() if k == "type" or k.startswith("x-kubernetes-")}


def prune(properties: dict, keep: set) -> None:
    for name, schema in properties.items():
        nested = schema.get("properties") or schema.get("items", {}).get("properties")
        if nested and name not in keep:
            properties[name] = open_up(schema)


def main(path: str, commit: str) -> None:
    crd = yaml.safe_load(open(path))
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v2beta1"]
    schema = strip(version["schema"]["openAPIV3Schema"])
    schema["properties"]["status"] = {"type": "object"}
    replica = schema["properties"]["spec"]["properties"]["mpiReplicaSpecs"]["additionalProperties"]
    pod = replica["properties"]["template"]["properties"]["spec"]["properties"]
    prune(pod, KEEP_POD)
    for key in ("containers", "initContainers"):
        prune(pod[key]["items"]["properties"], KEEP_CONTAINER)
    prune(pod["volumes"]["items"]["properties"], KEEP_VOLUME)
    sys.stdout.write(
        "# An excerpt of the MPIJob (kubeflow.org/v2beta1) CustomResourceDefinition's schema, from\n"
        "# kubeflow/mpi-operator manifests/base/kubeflow.org_mpijobs.yaml at commit\n"
        f"# {commit} (v0.8.2), Copyright The Kubeflow Authors, Apache License 2.0\n"
        "# (https://www.apache.org/licenses/LICENSE-2.0). Derived by tests/data/mpijob_crd_excerpt.py:\n"
        "# descriptions removed, status and the pod-template fields mpilearn never renders left\n"
        "# open (names kept). tests/test_kubernetes.py validates every rendered MPIJob against it.\n")
    yaml.safe_dump(schema, sys.stdout, sort_keys=True, width=100)


if __name__ == "__main__":
    main(*sys.argv[1:3])
