"""The instance types moerl may run on, and the EFA interface layout each one needs.

One table, read by the config validator (an unknown type is an error) and by the launch
templates (how many EFA interfaces, on which network cards). Figures come from the Amazon EC2
accelerated-computing instance pages and "Maximize network bandwidth on accelerated instances"
in the EC2 user guide (network cards per type: p5/p5e 32, p5en 16, p6-b200 8, p4d/p4de 4).
Local NVMe: the EC2 user guide's "Instance store volume specifications" (p5, p5e, p5en,
p6-b200: 8 x 3840 GB; p4d, p4de: 8 x 1000 GB; the c/m/r types here are EBS-only), converted
from the page's decimal GB to GiB and rounded down.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class InstanceSpec:
    """What the deployment needs to know about one EC2 instance type.

    gpus: accelerators per instance (0 for CPU types).
    gpu_memory_gib: memory of ONE accelerator, GiB.
    efa_interfaces: network cards that carry an EFA interface (0: the type has no EFA).
    vcpus, memory_gib: host size (memory in GiB).
    instance_store_gib: local NVMe instance store, all volumes together, GiB (0: EBS only). The
        node group puts the kubelet's and containerd's storage on it (RAID0), so a pod's
        emptyDir volumes land there.
    arch: CPU architecture, which picks the EKS AMI type.
    """

    gpus: int
    gpu_memory_gib: int
    efa_interfaces: int
    vcpus: int
    memory_gib: int
    instance_store_gib: int = 0
    arch: Literal["x86_64", "arm64"] = "x86_64"

    @property
    def has_efa(self) -> bool:
        return self.efa_interfaces > 0


def _gib(disks: int, gb_each: int) -> int:
    """Instance store of `disks` volumes of `gb_each` decimal GB, in whole GiB."""
    return disks * gb_each * 10**9 // 2**30


INSTANCE_TABLE: dict[str, InstanceSpec] = {
    # GPU training / rollout types.
    "p5.48xlarge": InstanceSpec(gpus=8, gpu_memory_gib=80, efa_interfaces=32, vcpus=192, memory_gib=2048,
        instance_store_gib=_gib(8, 3840)),
    "p5e.48xlarge": InstanceSpec(gpus=8, gpu_memory_gib=141, efa_interfaces=32, vcpus=192, memory_gib=2048,
        instance_store_gib=_gib(8, 3840)),
    "p5en.48xlarge": InstanceSpec(gpus=8, gpu_memory_gib=141, efa_interfaces=16, vcpus=192, memory_gib=2048,
        instance_store_gib=_gib(8, 3840)),
    "p6-b200.48xlarge": InstanceSpec(gpus=8, gpu_memory_gib=179, efa_interfaces=8, vcpus=192, memory_gib=2048,
        instance_store_gib=_gib(8, 3840)),
    "p4d.24xlarge": InstanceSpec(gpus=8, gpu_memory_gib=40, efa_interfaces=4, vcpus=96, memory_gib=1152,
        instance_store_gib=_gib(8, 1000)),
    "p4de.24xlarge": InstanceSpec(gpus=8, gpu_memory_gib=80, efa_interfaces=4, vcpus=96, memory_gib=1152,
        instance_store_gib=_gib(8, 1000)),
    # Environment pool (compute-optimized, Spot): similar size so any of them fits a pod.
    "c7i.4xlarge": InstanceSpec(gpus=0, gpu_memory_gib=0, efa_interfaces=0, vcpus=16, memory_gib=32),
    "c6i.4xlarge": InstanceSpec(gpus=0, gpu_memory_gib=0, efa_interfaces=0, vcpus=16, memory_gib=32),
    "c7a.4xlarge": InstanceSpec(gpus=0, gpu_memory_gib=0, efa_interfaces=0, vcpus=16, memory_gib=32),
    "c6a.4xlarge": InstanceSpec(gpus=0, gpu_memory_gib=0, efa_interfaces=0, vcpus=16, memory_gib=32),
    "c5.4xlarge": InstanceSpec(gpus=0, gpu_memory_gib=0, efa_interfaces=0, vcpus=16, memory_gib=32),
    "m7i.4xlarge": InstanceSpec(gpus=0, gpu_memory_gib=0, efa_interfaces=0, vcpus=16, memory_gib=64),
    # Experience buffer (Redis, memory-optimized).
    "r7i.4xlarge": InstanceSpec(gpus=0, gpu_memory_gib=0, efa_interfaces=0, vcpus=16, memory_gib=128),
    "r6i.4xlarge": InstanceSpec(gpus=0, gpu_memory_gib=0, efa_interfaces=0, vcpus=16, memory_gib=128),
    # System pool (CoreDNS, controllers).
    "m7i.xlarge": InstanceSpec(gpus=0, gpu_memory_gib=0, efa_interfaces=0, vcpus=4, memory_gib=16),
    "m6i.xlarge": InstanceSpec(gpus=0, gpu_memory_gib=0, efa_interfaces=0, vcpus=4, memory_gib=16),
}


def instance_spec(instance_type: str) -> InstanceSpec:
    """Return the table entry for `instance_type`.

    Raises KeyError naming the type and infra/instances.py when it has no entry.
    """
    try:
        return INSTANCE_TABLE[instance_type]
    except KeyError:
        raise KeyError(
            f"instance type {instance_type!r} has no entry in INSTANCE_TABLE (infra/instances.py); "
            "add its GPU count and EFA network-card count there first"
        ) from None
