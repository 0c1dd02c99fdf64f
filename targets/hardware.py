"""Catalog of known device kinds: the numbers a target spec starts from (a spec may override any).

Units are the ones people read on spec sheets, with two readings made explicit:

* memory (``memory_gb``, ``host_memory_gb``) is in binary gigabytes, 2**30 bytes (``GIB``), as memory is
  built and as a vendor's "80 GB" is meant: an H100 SXM5 reports 81,559 MiB (79.6 GiB, 85.5e9 bytes),
  an H200 143,771 MiB (140.4 GiB), an H20 97,871 MiB (95.6 GiB): each within 0.5% of its figure read in
  GiB, and 6-7% above it read in 1e9 bytes;
* link bandwidths (``*_bandwidth_gbs``) are per direction, in 1e9 bytes a second: what one transfer
  (a weight shard, a ring collective's step) gets. NVLink's datasheet figure counts both directions
  (900 GB/s on an H100 is 18 links of 25 GB/s each way), so the catalog lists half of it.

Sources (public vendor datasheets, dense figures, SXM form factor):

* H100 SXM5 — NVIDIA H100 Tensor Core GPU datasheet: 80 GB HBM3, 3.35 TB/s, 989 TFLOP/s bf16
  dense (1979 with sparsity), NVLink 900 GB/s both directions, PCIe Gen5 x16 64 GB/s per direction.
* H800 SXM5 — NVIDIA H800 product brief (export variant of H100): same memory, bandwidth and
  compute as H100 SXM5, NVLink reduced to 400 GB/s both directions.
* H20 — NVIDIA HGX H20 spec: 96 GB HBM3, 4.0 TB/s, 148 TFLOP/s bf16 dense, NVLink 900 GB/s both
  directions.
* H200 SXM — NVIDIA H200 Tensor Core GPU datasheet: 141 GB HBM3e, 4.8 TB/s, 989 TFLOP/s bf16
  dense, NVLink 900 GB/s both directions.
* Inter-node bandwidth for all GPU kinds: one 400 Gb/s InfiniBand NDR NIC per GPU = 50 GB/s,
  the common HGX configuration.
* Host memory for all GPU kinds: 2 TB a node of 8 GPUs (256 GB a device), the common HGX
  configuration; what a host tier of KV (the ``kv_host_tier`` skill) may fill at most.
* ``cpu`` — a logical device on a 2-core developer machine (one core each): rough, measured-order
  numbers (AVX2 fp32 ~50 GFLOP/s per core, DRAM ~10 GB/s per core); only the simulator uses them.
"""

from __future__ import annotations

GIB = 2**30  # bytes in one of the catalog's (and a spec's) memory gigabytes

HARDWARE_CATALOG: dict[str, dict[str, float]] = {
    "cpu": {
        "memory_gb": 8.0,
        "bf16_tflops": 0.05,
        "hbm_bandwidth_gbs": 10.0,
        "intra_node_bandwidth_gbs": 10.0,
        "inter_node_bandwidth_gbs": 1.0,
        "host_link_bandwidth_gbs": 10.0,
        "host_memory_gb": 8.0,
        "devices_per_node": 2,
    },
    "h100": {
        "memory_gb": 80.0,
        "bf16_tflops": 989.0,
        "hbm_bandwidth_gbs": 3350.0,
        "intra_node_bandwidth_gbs": 450.0,
        "inter_node_bandwidth_gbs": 50.0,
        "host_link_bandwidth_gbs": 64.0,
        "host_memory_gb": 256.0,
        "devices_per_node": 8,
    },
    "h800": {
        "memory_gb": 80.0,
        "bf16_tflops": 989.0,
        "hbm_bandwidth_gbs": 3350.0,
        "intra_node_bandwidth_gbs": 200.0,
        "inter_node_bandwidth_gbs": 50.0,
        "host_link_bandwidth_gbs": 64.0,
        "host_memory_gb": 256.0,
        "devices_per_node": 8,
    },
    "h20": {
        "memory_gb": 96.0,
        "bf16_tflops": 148.0,
        "hbm_bandwidth_gbs": 4000.0,
        "intra_node_bandwidth_gbs": 450.0,
        "inter_node_bandwidth_gbs": 50.0,
        "host_link_bandwidth_gbs": 64.0,
        "host_memory_gb": 256.0,
        "devices_per_node": 8,
    },
    "h200": {
        "memory_gb": 141.0,
        "bf16_tflops": 989.0,
        "hbm_bandwidth_gbs": 4800.0,
        "intra_node_bandwidth_gbs": 450.0,
        "inter_node_bandwidth_gbs": 50.0,
        "host_link_bandwidth_gbs": 64.0,
        "host_memory_gb": 256.0,
        "devices_per_node": 8,
    },
}

# What ``torch.cuda.get_device_name`` prints for the cards whose figures are the catalog's (SXM form
# factor, lower case), and their kind. Other form factors of the same chip (PCIe, NVL) have less
# bandwidth and compute (an H100 PCIe: 2.0 TB/s, 756 TFLOP/s): they are not listed, so nothing
# measures them against an SXM's figures.
CARD_KINDS: dict[str, str] = {
    "nvidia h100 80gb hbm3": "h100",
    "nvidia h800": "h800",
    "nvidia h20": "h20",
    "nvidia h200": "h200",
}


def card_kind(device_name: str) -> str | None:
    """The catalog kind of a card by the name its driver gives, or None for a card not in CARD_KINDS."""
    return CARD_KINDS.get(" ".join(device_name.lower().split()))
