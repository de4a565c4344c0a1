"""Device profiles a plan is held against: memory, peak FLOP/s, memory bandwidth, the links
inside and between servers, and achieved efficiencies; one YAML file per device in
`device_profiles/` (`--device KEY`). Each file says where its numbers come from."""

import os
from dataclasses import dataclass, field
from typing import Dict, List

import yaml

from model_zoo.errors import UserInputError

PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "device_profiles")
DEVICE_KEYS = sorted(name[:-5] for name in os.listdir(PROFILE_DIR) if name.endswith(".yaml"))


@dataclass
class Link:
    bandwidth: float   # bytes/s one device sends over all its links together
    latency: float     # seconds per message
    peers: int = 0     # 0: a switch, any group reaches `bandwidth`; else a full mesh of
                       # this many peer links (Ascend's HCCS), one link to each peer

    def bandwidth_for(self, size: int) -> float:
        """Bytes/s a device of a collective over `size` ranks sends: on a full mesh a group
        of n uses only its n - 1 links to the others."""
        if not self.peers:
            return self.bandwidth
        return self.bandwidth * min(size - 1, self.peers) / self.peers


@dataclass
class DeviceProfile:
    key: str
    name: str
    memory: int                     # bytes
    usable_memory: int              # bytes a run may fill: the device's less what the
                                    # runtime keeps (MindFormers' max_device_memory)
    peak_flops: Dict[str, float]    # FLOP/s per compute dtype ("fp16", "fp32")
    memory_bandwidth: float         # bytes/s
    devices_per_server: int
    inside_server: Link
    between_servers: Link
    matmul_efficiency: float        # achieved fraction of peak in MatMul
    attention_efficiency: float     # ... in attention's BatchMatMul / FlashAttentionScore
    memory_efficiency: float        # achieved fraction of memory bandwidth, other operators
    kernel_overhead: float          # seconds per operator launch (forward or backward)
    fitted: List[str] = field(default_factory=list)   # constants fitted to measurements
    # the measured runs they are fitted on: "all", or "data_parallel" (runs with no model
    # or pipeline parallel: compute without the links, which are then datasheet values
    # that the other runs check)
    fitted_on: str = "all"

    def peak(self, precision: str) -> float:
        return self.peak_flops["fp32" if precision == "fp32" else "fp16"]


def load_profile(key: str, devices_per_server: int = 0) -> DeviceProfile:
    """The profile `device_profiles/<key>.yaml`; `devices_per_server` (> 0) overrides its
    server size."""
    if key not in DEVICE_KEYS:
        raise UserInputError(f"--device {key!r} is not a known device; choose from "
                             f"{', '.join(DEVICE_KEYS)}")
    with open(os.path.join(PROFILE_DIR, f"{key}.yaml"), encoding="utf-8") as handle:
        raw = yaml.safe_load(handle)
    links, efficiency = raw["links"], raw["efficiency"]
    return DeviceProfile(
        key=key, name=raw["name"], memory=int(raw["memory_gib"] * 2 ** 30),
        usable_memory=int(raw.get("usable_memory_gib", raw["memory_gib"]) * 2 ** 30),
        peak_flops={dtype: tflops * 1e12 for dtype, tflops in raw["peak_tflops"].items()},
        memory_bandwidth=raw["memory_bandwidth_gbs"] * 1e9,
        devices_per_server=devices_per_server or raw["devices_per_server"],
        inside_server=_link(links["inside_server"]),
        between_servers=_link(links["between_servers"]),
        matmul_efficiency=efficiency["matmul"], attention_efficiency=efficiency["attention"],
        memory_efficiency=efficiency["memory_bound"],
        kernel_overhead=efficiency["kernel_overhead_us"] * 1e-6,
        fitted=list(raw.get("fitted", [])), fitted_on=raw.get("fitted_on", "all"))


def _link(raw: dict) -> Link:
    return Link(raw["bandwidth_gbs"] * 1e9, raw["latency_us"] * 1e-6, raw.get("peers", 0))

