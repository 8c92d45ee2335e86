"""Traffic accounting and a fabric model for expert-parallel dispatch: flat vs rail-aligned hierarchical.

Run `python -m mx_jax.fabric [--out benchmarks/]` for the table (benchmarks/fabric_table.md) and plot
(~4 min on 2 CPU cores at the default 4096 tokens per GPU; `--tokens-per-gpu 1024` takes ~1 min). After measuring,
re-run with `--nvlink-gbps <NVLink all-to-all bus bandwidth per GPU> --nic-gbps <inter-node all-to-all per GPU>`.

Placement (the convention mx_jax's expert-parallel dispatch follows)
    EP group of P = n_nodes * g GPUs (g = gpus_per_node). Device d sits on node d // g with local index d % g;
    local index i of every node hangs off rail i. E experts:
      E >= P (E % P == 0): expert e lives on device e // (E/P), contiguously.
      E <  P (P % E == 0): expert e has R = P/E replicas on devices [e*R, (e+1)*R); a token that starts on
        device s uses replica s % R, i.e. device e*R + s % R. Each replica then serves exactly the tokens of the
        E devices s with s % R fixed (balanced), and the rule is one static table per source device. When R is a
        multiple of g (Mixtral top-2 of 8 on >= 8 nodes) the chosen replica sits on the source's own rail.
    A routing is experts[t, j] (T x k expert ids) plus src[t] (the device token t starts on); b = token_bytes =
    d_model * bytes per element.

Dispatch algorithms and their bytes (combine moves the same rows in the opposite direction)
    Flat: one row per (t, j) from src[t] to dev(t, j); free when dev == src.
        cross-node bytes = b * #{(t, j): node(dev) != node(src)}; "same rail" when local(dev) == local(src).
    Hierarchical: stage 1 sends token t once per distinct destination node m != node(src) to the relay
        r(t, m) = m * g + local(src) (same rail, one leaf hop); stage 2 forwards one row per (t, j) over NVLink
        from r (or from src for experts on the source node) to dev(t, j), free when r == dev. Combine: expert
        outputs go dev -> r over NVLink, r sums them (one partial sum per (t, m)), one row per (t, m) goes back.
        cross-node bytes = b * #{distinct (t, m): m != node(src)}, all on the source's rail.
    Hence flat / hierarchical cross-node bytes = (mean off-node expert copies per token)
                                               / (mean distinct off-node destination nodes per token).

Fabric model (per stage; every figure below is a Topology field, so measured numbers replace it)
    Each transfer of b bytes from GPU s to GPU r is charged to the links it crosses:
      same node                 -> nvl_out[s] += b, nvl_in[r] += b
      other node, rail fabric, same rail, or PXN off -> nic_out[s] += b, nic_in[r] += b
      other node, rail fabric, cross rail, PXN on    -> NVLink s -> x = node(s) * g + local(r) on the SENDER's
          node, then nic_out[x], nic_in[r]. This is NCCL's p2p path: the sender picks the NIC next to the peer's
          local index and proxies through the GPU that owns it; the receiver uses its own NIC (NCCL
          src/graph/search.cc ncclTopoGetNetDev, NCCL_P2P_PXN_LEVEL=2 default; src/transport/net.cc recvSetup).
      NIC leaf: rail fabric -> leaf (rail i, block node // leaf_down_ports); fat tree (all 8 NICs of a node on
          one leaf) -> leaf node // (leaf_down_ports // g). Different leaves -> spine: up[leaf(src NIC)] += b,
          down[leaf(dst NIC)] += b, capacity per leaf = (NICs under it) * nic_gbps / spine_oversubscription.
    stage time = collective_overhead_us + max path latency + max over link classes of (max load / capacity)
      path latency: NVLink nvlink_latency_us; NIC-leaf-NIC leaf_latency_us; + spine_latency_us via the spine;
      + nvlink_latency_us for a PXN relay.
    flat                    = t(dispatch) + t(combine)                       (one all-to-all each way)
    hierarchical            = t(stage 1) + t(stage 2) each way               (two collectives in sequence: what
                                                                              the JAX shard_map version does)
    hierarchical_pipelined  = one overhead + both latencies + bandwidth term of the summed loads each way
                              (stages streamed inside one kernel, as DeepEP does: an upper bound for us)

Figures (defaults)
    nic_gbps = 50 GB/s per direction: ConnectX-7 at 400 Gb/s line rate, one per GPU (DGX H100/H200 compute
        fabric). Line rate, so optimistic for both algorithms alike.
    nvlink_gbps = 240 GB/s per GPU per direction: NCCL all_to_all bus bandwidth measured on 4 x H200 at 64 MB
        per GPU (benchmarks/JAX_NOTES.md; 102 at 8 MB, 305 at 512 MB; JAX lax.all_to_all reached 134 at 64 MB). Bus
        bandwidth = bytes leaving a GPU for other GPUs / time, which is what nvl_out is charged with.
        Nominal H200 NVLink is 450 GB/s per direction; 240 is conservative for the hierarchical path.
    leaf_down_ports = 32: NVIDIA DGX SuperPOD reference architecture (B200/H100): scalable units of 32 nodes,
        one leaf per rail per SU, node-leaf cables = leaf-spine cables (non-blocking), so
        spine_oversubscription = 1 by default.
    nvlink_latency_us = 1, leaf_latency_us = 2 (NIC + PCIe + one switch, one way), spine_latency_us = 0.6 (two
        more switch traversals; third-party figures for NDR Quantum-2 quote ~0.13-0.33 us per switch),
        collective_overhead_us = 20 (launch + handshake per collective call; the 4 x H200 NCCL curve above
        implies a few tens of us): ASSUMPTIONS. They are <= 3 % of every time in the default table (tens to hundreds
        of MB per GPU), but they alone decide Mixtral's 0.98x where both paths move the same bytes.
    Routing figures: Mixtral 8x7B d_model 4096 (top-2 of 8); DeepSeek-V3 d_model 7168, top-8 of 256 routed
    experts, node-limited to M = 4 nodes by the sum of the top k/M affinities per node (DeepSeek-V3 report,
    section 2.1.2); bf16 rows; 4096 tokens per GPU (DeepEP's README benchmarks the "DeepSeek-V3/R1 pretraining
    setting": 4096 tokens per batch, hidden 7168, top-4 groups, top-8 experts). Router scores are
    seeded N(0, 1) logits (sigmoid affinities for DeepSeek), optionally plus a Zipf popularity bias per expert.

What the model leaves out (trade-off: a bandwidth/latency bound, not a simulator)
    Message-count effects (flat talks to P-1 peers, stage 1 to n_nodes-1: favours hierarchical at scale),
    ECMP/adaptive-routing collisions, incast, NIC efficiency below line rate, padding of capacity buffers, and
    the copy/sum kernels between the two stages (HBM at ~4.8 TB/s on H200 makes them small next to NVLink).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time
from collections.abc import Iterable, Iterator

import numpy as np

NIC_CX7_400G_GBPS = 50.0  # GB/s per direction: 400 Gb/s ConnectX-7 line rate
# GB/s per GPU: NCCL all_to_all bus bandwidth, 4 x H200, 64 MB/GPU (benchmarks/JAX_NOTES.md)
NVLINK_A2A_4XH200_GBPS = 240.0
DGX_SUPERPOD_LEAF_DOWN_PORTS = 32  # nodes per rail leaf in a DGX SuperPOD scalable unit


# ----------------------------------------------------------------------------------------------- placement
def _check_routing(experts: np.ndarray, src: np.ndarray, n_experts: int,
                   n_devices: int) -> tuple[np.ndarray, np.ndarray]:
    experts, src = np.asarray(experts), np.asarray(src)
    if experts.ndim != 2 or not np.issubdtype(experts.dtype, np.integer):
        raise ValueError(f"experts must be an integer array [tokens, top_k]; "
                         f"got shape {experts.shape}, dtype {experts.dtype}")
    if src.shape != experts.shape[:1] or not np.issubdtype(src.dtype, np.integer):
        raise ValueError(f"src must be an integer array [tokens] matching experts {experts.shape}; "
                         f"got shape {src.shape}, dtype {src.dtype}")
    if experts.size and (experts.min() < 0 or experts.max() >= n_experts):
        raise ValueError(f"experts ids must lie in [0, {n_experts}); got [{experts.min()}, {experts.max()}]")
    if src.size and (src.min() < 0 or src.max() >= n_devices):
        raise ValueError(f"src devices must lie in [0, {n_devices}); got [{src.min()}, {src.max()}]")
    if n_experts % n_devices and n_devices % n_experts:
        raise ValueError(f"n_experts={n_experts} and n_devices={n_devices}: one must divide the other")
    return experts.astype(np.int64), src.astype(np.int64)


def expert_device(experts: np.ndarray, src: np.ndarray, n_experts: int, n_devices: int) -> np.ndarray:
    """Device that serves each (token, expert) assignment: [T, k] int64 (placement rule in the module docstring)."""
    experts, src = _check_routing(experts, src, n_experts, n_devices)
    if n_experts >= n_devices:
        return experts // (n_experts // n_devices)
    replicas = n_devices // n_experts
    return experts * replicas + (src % replicas)[:, None]


# ------------------------------------------------------------------------------------------------ topology
@dataclasses.dataclass(frozen=True, kw_only=True)
class Topology:
    n_nodes: int
    gpus_per_node: int = 8
    nvlink_gbps: float = NVLINK_A2A_4XH200_GBPS
    nic_gbps: float = NIC_CX7_400G_GBPS
    fabric: str = "rail"  # "rail": GPU i of every node on rail i | "fat_tree": all NICs of a node on one leaf
    pxn: bool = True  # NCCL default (NCCL_PXN_DISABLE=0); only changes the rail fabric
    spine_oversubscription: float = 1.0
    leaf_down_ports: int = DGX_SUPERPOD_LEAF_DOWN_PORTS
    nvlink_latency_us: float = 1.0
    leaf_latency_us: float = 2.0
    spine_latency_us: float = 0.6
    collective_overhead_us: float = 20.0

    def __post_init__(self) -> None:
        if self.fabric not in ("rail", "fat_tree"):
            raise ValueError(f"fabric must be 'rail' or 'fat_tree'; got {self.fabric!r}")
        for name in ("n_nodes", "gpus_per_node", "leaf_down_ports"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        for name in ("nvlink_gbps", "nic_gbps", "spine_oversubscription"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0; got {getattr(self, name)}")

    @property
    def n_devices(self) -> int:
        return self.n_nodes * self.gpus_per_node

    @property
    def n_leaves(self) -> int:
        return int(self.leaf_of(np.arange(self.n_devices)).max()) + 1

    def leaf_of(self, nic: np.ndarray) -> np.ndarray:
        """Leaf switch of each GPU's NIC (NIC index = GPU index)."""
        g = self.gpus_per_node
        node, local = nic // g, nic % g
        if self.fabric == "rail":
            blocks = -(-self.n_nodes // self.leaf_down_ports)
            return local * blocks + node // self.leaf_down_ports
        return node // max(1, self.leaf_down_ports // g)


# ------------------------------------------------------------------------------------------ accumulation
_LINKS = ("nic_out", "nic_in", "nvl_out", "nvl_in", "spine_up", "spine_down")
_STAGES = ("flat_dispatch", "flat_combine", "hier1_dispatch", "hier2_dispatch", "hier2_combine", "hier1_combine")


class _Loads:
    """Bytes per link of one stage: per-GPU NIC/NVLink arrays [P], per-leaf spine arrays [n_leaves]."""

    def __init__(self, n_devices: int, n_leaves: int):
        self.arrays = {k: np.zeros(n_leaves if k.startswith("spine") else n_devices) for k in _LINKS}
        self.latency_us = 0.0

    def add(self, link: str, index: np.ndarray, nbytes: float) -> None:
        if index.size:
            self.arrays[link] += nbytes * np.bincount(index, minlength=self.arrays[link].size)


class _Accumulator:
    """Streams routing chunks; keeps traffic counts (always) and per-stage link loads (with a Topology)."""

    def __init__(self, n_experts: int, n_nodes: int, gpus_per_node: int, token_bytes: float, topo: Topology | None):
        self.E, self.n, self.g, self.b, self.topo = n_experts, n_nodes, gpus_per_node, float(token_bytes), topo
        self.P = n_nodes * gpus_per_node
        self.count = dict.fromkeys(("tokens", "flat_cross", "flat_cross_same_rail", "flat_intra", "hier_cross",
                                    "hier_intra"), 0)
        if topo is not None:
            self.leaves = topo.leaf_of(np.arange(self.P))
            self.loads = {s: _Loads(self.P, topo.n_leaves) for s in _STAGES}

    def add(self, experts: np.ndarray, src: np.ndarray) -> None:
        dev = expert_device(experts, src, self.E, self.P)  # [T, k]
        src = np.asarray(src, dtype=np.int64)
        g = self.g
        s = np.broadcast_to(src[:, None], dev.shape)  # [T, k]
        node_s, node_d = s // g, dev // g
        off = node_d != node_s
        # Distinct off-node destination nodes per token: sort each row, keep first occurrences.
        nodes = np.sort(np.where(off, node_d, -1), axis=1)  # [T, k]
        first = np.ones(nodes.shape, bool)
        first[:, 1:] = nodes[:, 1:] != nodes[:, :-1]
        first &= nodes >= 0
        relay = np.where(off, node_d * g + s % g, s)  # [T, k] stage-2 sender
        c = self.count
        c["tokens"] += len(src)
        c["flat_cross"] += int(off.sum())
        c["flat_cross_same_rail"] += int((off & (dev % g == s % g)).sum())
        c["flat_intra"] += int((~off & (dev != s)).sum())
        c["hier_cross"] += int(first.sum())
        c["hier_intra"] += int((relay != dev).sum())
        if self.topo is None:
            return
        s1_src = np.broadcast_to(src[:, None], nodes.shape)[first]
        s1_dst = nodes[first] * g + s1_src % g
        s, dev, relay = s.ravel(), dev.ravel(), relay.ravel()
        self._route("flat_dispatch", s, dev)
        self._route("flat_combine", dev, s)
        self._route("hier1_dispatch", s1_src, s1_dst)
        self._route("hier2_dispatch", relay, dev)
        self._route("hier2_combine", dev, relay)
        self._route("hier1_combine", s1_dst, s1_src)

    def _route(self, stage: str, snd: np.ndarray, rcv: np.ndarray) -> None:
        topo, L, g, b = self.topo, self.loads[stage], self.g, self.b
        keep = snd != rcv
        snd, rcv = snd[keep], rcv[keep]
        intra = snd // g == rcv // g
        L.add("nvl_out", snd[intra], b)
        L.add("nvl_in", rcv[intra], b)
        if intra.any():
            L.latency_us = max(L.latency_us, topo.nvlink_latency_us)
        xs, xr = snd[~intra], rcv[~intra]
        if not xs.size:
            return
        relayed = np.zeros(xs.shape, bool)
        nic_src = xs
        if topo.fabric == "rail" and topo.pxn:
            relayed = xs % g != xr % g
            proxy = (xs // g) * g + xr % g  # GPU on the sender's node that owns the destination's rail
            L.add("nvl_out", xs[relayed], b)
            L.add("nvl_in", proxy[relayed], b)
            nic_src = np.where(relayed, proxy, xs)
        L.add("nic_out", nic_src, b)
        L.add("nic_in", xr, b)
        leaf_s, leaf_r = self.leaves[nic_src], self.leaves[xr]
        up = leaf_s != leaf_r
        L.add("spine_up", leaf_s[up], b)
        L.add("spine_down", leaf_r[up], b)
        lat = topo.leaf_latency_us + topo.spine_latency_us * up.any() + topo.nvlink_latency_us * relayed.any()
        L.latency_us = max(L.latency_us, float(lat))

    def traffic(self) -> dict:
        c, b = self.count, self.b
        flat = {"cross_node": c["flat_cross"] * b, "cross_node_same_rail": c["flat_cross_same_rail"] * b,
                "cross_node_cross_rail": (c["flat_cross"] - c["flat_cross_same_rail"]) * b,
                "intra_node": c["flat_intra"] * b}
        hier = {"cross_node": c["hier_cross"] * b, "cross_node_same_rail": c["hier_cross"] * b,
                "cross_node_cross_rail": 0.0, "intra_node": c["hier_intra"] * b}
        t = max(c["tokens"], 1)
        return {
            "token_bytes": b, "n_tokens": c["tokens"],
            "flat": {"dispatch": flat, "combine": dict(flat)},
            "hierarchical": {"dispatch": hier, "combine": dict(hier)},
            "mean_off_node_copies": c["flat_cross"] / t,
            "mean_off_node_nodes": c["hier_cross"] / t,
            "cross_node_ratio": c["flat_cross"] / c["hier_cross"] if c["hier_cross"] else float("nan"),
        }

    def _time(self, stages: Iterable[str], topo: Topology) -> tuple[float, str]:
        """One collective carrying the summed loads of `stages`; returns (seconds, bottleneck link)."""
        stages = list(stages)
        arrays = {k: sum(self.loads[s].arrays[k] for s in stages) for k in _LINKS}
        nics_per_leaf = np.bincount(self.leaves, minlength=topo.n_leaves)
        spine_cap = np.maximum(nics_per_leaf, 1) * topo.nic_gbps * 1e9 / topo.spine_oversubscription
        cap = {"nic_out": topo.nic_gbps * 1e9, "nic_in": topo.nic_gbps * 1e9,
               "nvl_out": topo.nvlink_gbps * 1e9, "nvl_in": topo.nvlink_gbps * 1e9,
               "spine_up": spine_cap, "spine_down": spine_cap}
        terms = {k: float(np.max(arrays[k] / cap[k])) for k in _LINKS}
        link = max(terms, key=terms.get)
        latency = sum(self.loads[s].latency_us for s in stages)
        return (topo.collective_overhead_us + latency) * 1e-6 + terms[link], link

    def prediction(self, topo: Topology | None = None) -> dict:
        """Times under `topo` (default: the routing topology); it may change bandwidths and latencies only."""
        topo = topo or self.topo
        routed = ("n_nodes", "gpus_per_node", "fabric", "pxn", "leaf_down_ports")
        if any(getattr(topo, f) != getattr(self.topo, f) for f in routed):
            raise ValueError(f"topo may only change bandwidths/latencies; fields {routed} must match {self.topo}")
        t = {s: self._time([s], topo) for s in _STAGES}
        flat = t["flat_dispatch"][0] + t["flat_combine"][0]
        hier = sum(t[s][0] for s in _STAGES[2:])
        pipe_d, pipe_c = self._time(_STAGES[2:4], topo), self._time(_STAGES[4:6], topo)
        pipe = pipe_d[0] + pipe_c[0]
        return {
            "traffic": self.traffic(),
            "flat": {"dispatch_s": t["flat_dispatch"][0], "combine_s": t["flat_combine"][0], "total_s": flat,
                     "bottleneck": t["flat_dispatch"][1]},
            "hierarchical": {**{f"{s}_s": t[s][0] for s in _STAGES[2:]}, "total_s": hier,
                             "bottleneck": "+".join(t[s][1] for s in _STAGES[2:4])},
            "hierarchical_pipelined": {"dispatch_s": pipe_d[0], "combine_s": pipe_c[0], "total_s": pipe,
                                       "bottleneck": pipe_d[1]},
            "speedup": flat / hier,
            "speedup_pipelined": flat / pipe,
        }


def traffic(experts: np.ndarray, src: np.ndarray, n_experts: int, n_nodes: int, gpus_per_node: int,
            token_bytes: float) -> dict:
    """Bytes moved by flat and hierarchical dispatch/combine for one routing.

    Returns {"flat"|"hierarchical": {"dispatch"|"combine": {"cross_node", "cross_node_same_rail",
    "cross_node_cross_rail", "intra_node"}}, "mean_off_node_copies", "mean_off_node_nodes", "cross_node_ratio",
    "n_tokens", "token_bytes"}; bytes are totals over the EP group.
    """
    acc = _Accumulator(n_experts, n_nodes, gpus_per_node, token_bytes, None)
    acc.add(experts, src)
    return acc.traffic()


def predict(experts: np.ndarray, src: np.ndarray, n_experts: int, topo: Topology, token_bytes: float) -> dict:
    """Predicted seconds of flat, hierarchical and pipelined-hierarchical dispatch+combine (plus `traffic`)."""
    return predict_stream([(experts, src)], n_experts, topo, token_bytes)


def predict_stream(chunks: Iterable[tuple[np.ndarray, np.ndarray]], n_experts: int, topo: Topology,
                   token_bytes: float) -> dict:
    """`predict` over a routing given as (experts, src) chunks, for routings too large to hold at once."""
    acc = _Accumulator(n_experts, topo.n_nodes, topo.gpus_per_node, token_bytes, topo)
    for experts, src in chunks:
        acc.add(experts, src)
    return acc.prediction()


# ------------------------------------------------------------------------------------------------ routings
def zipf_bias(n_experts: int, exponent: float, rng: np.random.Generator) -> np.ndarray:
    """Per-expert logit bias log(popularity), popularity ~ rank^-exponent over a random ranking: [E]."""
    if exponent == 0:
        return np.zeros(n_experts, np.float32)
    rank = rng.permutation(n_experts) + 1
    return (-exponent * np.log(rank)).astype(np.float32)


def mixtral_routing(n_tokens: int, rng: np.random.Generator, bias: np.ndarray | None = None, *, n_experts: int = 8,
                    top_k: int = 2) -> np.ndarray:
    """Top-k of softmax(N(0,1) logits + bias): [T, k] expert ids (softmax is monotone, so top-k of the logits)."""
    logits = rng.standard_normal((n_tokens, n_experts), dtype=np.float32)
    if bias is not None:
        logits += bias
    return np.argpartition(-logits, top_k - 1, axis=1)[:, :top_k]


def deepseek_routing(n_tokens: int, n_nodes: int, rng: np.random.Generator, bias: np.ndarray | None = None, *,
                     n_experts: int = 256, top_k: int = 8, max_nodes: int = 4) -> np.ndarray:
    """DeepSeek-V3 node-limited routing: [T, k] expert ids.

    Affinities sigmoid(N(0,1) logits + bias); experts are contiguous per node (E / n_nodes each). Keep the
    max_nodes nodes with the largest sum of their top (top_k / max_nodes) affinities, then the top_k experts
    inside them (DeepSeek-V3 report, section 2.1.2). When fewer than top_k experts fit in max_nodes nodes (one
    expert per node at 256 nodes), the node limit rises to ceil(top_k / experts_per_node).
    """
    if n_experts % n_nodes:
        raise ValueError(f"n_experts={n_experts} must be divisible by n_nodes={n_nodes} for node-limited routing")
    per_node = n_experts // n_nodes
    m = min(n_nodes, max(max_nodes, -(-top_k // per_node)))
    q = min(per_node, max(1, top_k // m))
    logits = rng.standard_normal((n_tokens, n_experts), dtype=np.float32)
    if bias is not None:
        logits += bias
    if m == n_nodes:
        return np.argpartition(-logits, top_k - 1, axis=1)[:, :top_k]
    by_node = logits.reshape(n_tokens, n_nodes, per_node)
    top = np.sort(by_node, axis=2)[:, :, -q:]  # [T, n, q]
    node_score = (1.0 / (1.0 + np.exp(-top))).sum(axis=2)  # [T, n]
    chosen = np.argpartition(-node_score, m - 1, axis=1)[:, :m]  # [T, m]
    # Top-k among the chosen nodes' experts only (a -inf mask over all E makes argpartition crawl).
    cand = np.take_along_axis(by_node, chosen[:, :, None], axis=1).reshape(n_tokens, m * per_node)
    pick = np.argpartition(-cand, top_k - 1, axis=1)[:, :top_k]  # [T, k] into the m * per_node candidates
    return np.take_along_axis(chosen, pick // per_node, axis=1) * per_node + pick % per_node


ROUTINGS = {  # name -> (n_experts, d_model)
    "mixtral": (8, 4096),
    "deepseek": (256, 7168),
}


def routing_chunks(name: str, n_nodes: int, gpus_per_node: int, tokens_per_gpu: int, *, seed: int = 0,
                   zipf: float = 0.0, chunk_tokens: int = 1 << 17) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Seeded (experts, src) chunks for a named routing; tokens are laid out device by device."""
    n_experts, _ = ROUTINGS[name]
    rng = np.random.default_rng([seed, n_nodes, list(ROUTINGS).index(name)])
    bias = zipf_bias(n_experts, zipf, rng)
    n_devices = n_nodes * gpus_per_node
    per_chunk = max(1, chunk_tokens // tokens_per_gpu)
    for d0 in range(0, n_devices, per_chunk):
        src = np.repeat(np.arange(d0, min(d0 + per_chunk, n_devices)), tokens_per_gpu)
        if name == "mixtral":
            experts = mixtral_routing(len(src), rng, bias)
        else:
            experts = deepseek_routing(len(src), n_nodes, rng, bias)
        yield experts, src


# ------------------------------------------------------------------------------------------ table and plot
def sweep(nodes: Iterable[int], topo_kwargs: dict, *, tokens_per_gpu: int, bytes_per_element: int, seed: int,
          zipf: float, routings: Iterable[str] = tuple(ROUTINGS)) -> list[dict]:
    rows = []
    for name in routings:
        n_experts, d_model = ROUTINGS[name]
        for n in nodes:
            topo = Topology(n_nodes=n, **topo_kwargs)
            chunks = routing_chunks(name, n, topo.gpus_per_node, tokens_per_gpu, seed=seed, zipf=zipf)
            out = predict_stream(chunks, n_experts, topo, d_model * bytes_per_element)
            rows.append({"routing": name, "n_nodes": n, "n_devices": topo.n_devices, **out})
    return rows


def format_table(rows: list[dict]) -> str:
    head = ("| routing | nodes | GPUs | cross-node MB/GPU flat | hier | flat/hier | off-node copies ÷ dest nodes "
            "| flat cross-rail % | t flat ms | t hier ms | speedup | t hier pipelined ms | speedup pipelined "
            "| bottleneck flat / hier (stage 1+2) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        tr, p = r["traffic"], r["n_devices"]
        fd, hd = tr["flat"]["dispatch"], tr["hierarchical"]["dispatch"]
        xr = 100 * fd["cross_node_cross_rail"] / fd["cross_node"] if fd["cross_node"] else 0.0
        lines.append(
            f"| {r['routing']} | {r['n_nodes']} | {p} | {fd['cross_node'] / p / 1e6:.1f} "
            f"| {hd['cross_node'] / p / 1e6:.1f} "
            f"| {tr['cross_node_ratio']:.3f} | {tr['mean_off_node_copies']:.3f} ÷ {tr['mean_off_node_nodes']:.3f} "
            f"| {xr:.0f} | {r['flat']['total_s'] * 1e3:.2f} | {r['hierarchical']['total_s'] * 1e3:.2f} "
            f"| {r['speedup']:.2f} | {r['hierarchical_pipelined']['total_s'] * 1e3:.2f} "
            f"| {r['speedup_pipelined']:.2f} | {r['flat']['bottleneck']} / {r['hierarchical']['bottleneck']} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: pathlib.Path, target: tuple[int, float] = (16, 1.3)) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    fig, axes = plt.subplots(1, 3, figsize=(16, 5.6), constrained_layout=True)
    colors = {"mixtral": "tab:blue", "deepseek": "tab:red"}
    labels = {"mixtral": "Mixtral top-2/8", "deepseek": "DeepSeek top-8/256, ≤4 nodes"}
    for name in dict.fromkeys(r["routing"] for r in rows):
        rr = [r for r in rows if r["routing"] == name]
        n = [r["n_nodes"] for r in rr]
        c = colors.get(name)
        flat = [r["traffic"]["flat"]["dispatch"]["cross_node"] / r["n_devices"] / 1e6 for r in rr]
        hier = [r["traffic"]["hierarchical"]["dispatch"]["cross_node"] / r["n_devices"] / 1e6 for r in rr]
        axes[0].plot(n, flat, "o-", color=c, label=f"{labels[name]}: flat")
        axes[0].plot(n, hier, "s--", color=c, label=f"{labels[name]}: hierarchical")
        axes[1].plot(n, [r["flat"]["total_s"] * 1e3 for r in rr], "o-", color=c, label=f"{labels[name]}: flat")
        axes[1].plot(n, [r["hierarchical"]["total_s"] * 1e3 for r in rr], "s--", color=c,
                     label=f"{labels[name]}: hierarchical")
        axes[2].plot(n, [r["speedup"] for r in rr], "o-", color=c, label=f"{labels[name]}: two collectives")
        axes[2].plot(n, [r["speedup_pipelined"] for r in rr], "^:", color=c, label=f"{labels[name]}: pipelined")
    axes[2].axhline(1.0, color="gray", lw=0.8)
    axes[2].plot([target[0]], [target[1]], "k*", ms=12, label=f"target ≥{target[1]}× at {target[0]} nodes")
    titles = ("Cross-node dispatch MB per GPU", "Predicted dispatch+combine time (ms)",
              "Speedup of hierarchical over flat")
    nodes = sorted({r["n_nodes"] for r in rows})
    axes[0].set_yscale("log")
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_xticks(nodes)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("nodes (8 GPUs each)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    note = None
    if nodes[-1] >= 256 and any(r["routing"] == "deepseek" for r in rows):
        note = "DeepSeek at 256 nodes: one expert per node, nothing to merge (ratio 1)"
    for ax, title in zip(axes, (None, None, note)):  # below the axes, so no curve is hidden
        ax.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, title=title,
                  title_fontsize=7.5)
    fabric_name = {"rail": "Rail-optimized", "fat_tree": "Fat-tree"}[rows[0]["fabric"]]
    fig.suptitle(f"{fabric_name} fabric model (NIC {rows[0]['nic_gbps']:g} GB/s per GPU, NVLink all-to-all "
                 f"{rows[0]['nvlink_gbps']:g} GB/s per GPU, PXN {'on' if rows[0]['pxn'] else 'off'})")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _stage_breakdown(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    f, h = rows[0]["flat"], rows[0]["hierarchical"]
    ms = lambda x: f"{x * 1e3:.2f}"
    return ["| path | dispatch ms | combine ms | total ms |", "|---|---|---|---|",
            f"| flat (one all-to-all each way) | {ms(f['dispatch_s'])} | {ms(f['combine_s'])} | {ms(f['total_s'])} |",
            f"| hierarchical stage 1 (rail, NIC) | {ms(h['hier1_dispatch_s'])} | {ms(h['hier1_combine_s'])} "
            f"| {ms(h['hier1_dispatch_s'] + h['hier1_combine_s'])} |",
            f"| hierarchical stage 2 (NVLink) | {ms(h['hier2_dispatch_s'])} | {ms(h['hier2_combine_s'])} "
            f"| {ms(h['hier2_dispatch_s'] + h['hier2_combine_s'])} |", ""]


def _sensitivity(n_nodes: int, base: dict, args: argparse.Namespace) -> list[str]:
    """The target configuration under other figures: what the speedup hinges on."""
    n_experts, d_model = ROUTINGS["deepseek"]
    token_bytes = d_model * args.bytes_per_element
    cases = [("as above", {}), ("NVLink 134 GB/s (JAX lax.all_to_all, 64 MB)", {"nvlink_gbps": 134.0}),
             ("NVLink 450 GB/s (H200 nominal)", {"nvlink_gbps": 450.0}),
             ("NIC 40 GB/s achieved (80 % of line rate)", {"nic_gbps": 40.0}),
             ("PXN off", {"pxn": False}),
             ("PXN off, spine 2:1 oversubscribed", {"pxn": False, "spine_oversubscription": 2.0}),
             ("fat tree (all NICs of a node on one leaf), 2:1", {"fabric": "fat_tree", "spine_oversubscription": 2.0}),
             ("Zipf-skewed experts (exponent 1)", {"zipf": 1.0})]
    lines = ["| case | t flat ms | t hier ms | speedup | speedup pipelined |", "|---|---|---|---|---|"]
    accs: dict[tuple, _Accumulator] = {}
    for label, change in cases:
        zipf = change.pop("zipf", args.zipf)
        topo = Topology(n_nodes=n_nodes, **{**base, **change})
        key = (topo.fabric, topo.pxn, zipf)
        if key not in accs:  # link loads depend on the routing and the fabric layout, not on bandwidths
            accs[key] = _Accumulator(n_experts, n_nodes, topo.gpus_per_node, token_bytes, topo)
            for experts, src in routing_chunks("deepseek", n_nodes, topo.gpus_per_node, args.tokens_per_gpu,
                                               seed=args.seed, zipf=zipf):
                accs[key].add(experts, src)
        r = accs[key].prediction(topo)
        lines.append(f"| {label} | {r['flat']['total_s'] * 1e3:.2f} | {r['hierarchical']['total_s'] * 1e3:.2f} "
                     f"| {r['speedup']:.2f} | {r['speedup_pipelined']:.2f} |")
    # NVLink bandwidth at which two sequential collectives reach 1.3x (bisection; the speedup rises with it).
    topo = Topology(n_nodes=n_nodes, **base)
    acc = accs[(topo.fabric, topo.pxn, args.zipf)]
    speedup = lambda bw: acc.prediction(dataclasses.replace(topo, nvlink_gbps=bw))["speedup"]
    lo, hi = 10.0, 10000.0
    if speedup(hi) < 1.3:
        lines.append("\nNo NVLink bandwidth up to 10 TB/s gets two sequential collectives to 1.3x here.")
    else:
        for _ in range(40):
            mid = (lo * hi) ** 0.5
            lo, hi = (mid, hi) if speedup(mid) < 1.3 else (lo, mid)
        lines.append(f"\nBreak-even for the target: two sequential collectives reach 1.3x once the NVLink "
                     f"all-to-all bandwidth exceeds ~{hi:.0f} GB/s per GPU (other figures as above).")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m mx_jax.fabric", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=pathlib.Path, help="directory for fabric_table.md and fabric.png")
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64, 128, 256])
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--tokens-per-gpu", type=int, default=4096)
    ap.add_argument("--bytes-per-element", type=int, default=2, help="2 = bf16 rows")
    ap.add_argument("--nvlink-gbps", type=float, default=NVLINK_A2A_4XH200_GBPS,
                    help="measured NVLink all-to-all bus bandwidth per GPU (GB/s)")
    ap.add_argument("--nic-gbps", type=float, default=NIC_CX7_400G_GBPS)
    ap.add_argument("--fabric", choices=("rail", "fat_tree"), default="rail")
    ap.add_argument("--no-pxn", action="store_true")
    ap.add_argument("--oversubscription", type=float, default=1.0)
    ap.add_argument("--zipf", type=float, default=0.0, help="Zipf exponent of expert popularity (0 = uniform)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-nodes", type=int, default=16)
    args = ap.parse_args(argv)
    for flag, values, low in (("--nodes", args.nodes, 1), ("--gpus-per-node", [args.gpus_per_node], 1),
                              ("--tokens-per-gpu", [args.tokens_per_gpu], 1),
                              ("--bytes-per-element", [args.bytes_per_element], 1),
                              ("--target-nodes", [args.target_nodes], 1)):
        if min(values) < low:
            ap.error(f"{flag} must be >= {low}, got {min(values)}")
    for flag, value in (("--nvlink-gbps", args.nvlink_gbps), ("--nic-gbps", args.nic_gbps),
                        ("--oversubscription", args.oversubscription)):
        if not value > 0:
            ap.error(f"{flag} must be > 0, got {value}")
    if args.target_nodes not in args.nodes:
        ap.error(f"--target-nodes {args.target_nodes} is not among --nodes {args.nodes}: its breakdown needs it")
    if args.out and args.out.exists() and not args.out.is_dir():
        ap.error(f"--out {args.out} exists and is not a directory")

    t0 = time.perf_counter()
    base = {"gpus_per_node": args.gpus_per_node, "nvlink_gbps": args.nvlink_gbps, "nic_gbps": args.nic_gbps,
            "fabric": args.fabric, "pxn": not args.no_pxn, "spine_oversubscription": args.oversubscription}
    try:  # what the model itself refuses (e.g. a node count the experts cannot be spread over)
        rows = sweep(args.nodes, base, tokens_per_gpu=args.tokens_per_gpu, bytes_per_element=args.bytes_per_element,
                     seed=args.seed, zipf=args.zipf)
    except ValueError as e:
        ap.error(str(e))
    for r in rows:
        r.update(nvlink_gbps=args.nvlink_gbps, nic_gbps=args.nic_gbps, pxn=not args.no_pxn, fabric=args.fabric)
    topo = Topology(n_nodes=args.target_nodes, **base)
    command = "python -m mx_jax.fabric " + " ".join(sys.argv[1:] if argv is None else argv)
    text = [
        "# Fabric model: flat vs rail-aligned hierarchical MoE dispatch+combine",
        "",
        f"Generated by `{command}` (mx_jax/fabric.py; formulas and sources in its docstring).",
        "",
        f"Topology: {args.fabric}, PXN {'on' if topo.pxn else 'off'}, NIC {topo.nic_gbps:g} GB/s/direction per GPU, "
        f"NVLink all-to-all {topo.nvlink_gbps:g} GB/s per GPU, leaf {topo.leaf_down_ports} nodes, spine "
        f"{topo.spine_oversubscription:g}:1, latencies NVLink {topo.nvlink_latency_us:g} / leaf "
        f"{topo.leaf_latency_us:g} / spine +{topo.spine_latency_us:g} us, {topo.collective_overhead_us:g} us per "
        f"collective. {args.tokens_per_gpu} tokens per GPU, {args.bytes_per_element}-byte elements, Mixtral d_model "
        f"{ROUTINGS['mixtral'][1]}, DeepSeek d_model {ROUTINGS['deepseek'][1]}, seed {args.seed}, Zipf {args.zipf:g}.",
        "Mixtral: 8 experts replicated P/8 times, replica = src % (P/8). DeepSeek: 256 experts, contiguous, "
        "≤ 4 nodes per token (≤ 8 at 256 nodes, where a node holds one expert).",
        "Speedup = t flat / t hierarchical, the hierarchical path as two collectives in sequence each way; "
        "'pipelined' streams both stages at once (DeepEP-style, an upper bound). Bottleneck names: nic_out/nic_in "
        "= a GPU's NIC, nvl_out/nvl_in = its NVLink, spine_up/down = a leaf's uplinks.",
        "",
        format_table(rows),
        "",
        f"## Target: DeepSeek-style, {args.target_nodes} nodes x {args.gpus_per_node} GPUs",
        "",
        *_stage_breakdown([r for r in rows if r["routing"] == "deepseek" and r["n_nodes"] == args.target_nodes]),
        "Sensitivity of the target to the assumed figures:",
        "",
        *_sensitivity(args.target_nodes, base, args),
    ]
    page = "\n".join(text) + "\n"
    print(page)
    print(f"(model time {time.perf_counter() - t0:.0f} s)")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fabric_table.md").write_text(page)
        plot(rows, args.out / "fabric.png")
        print(f"wrote {args.out / 'fabric_table.md'} and {args.out / 'fabric.png'}")


if __name__ == "__main__":
    main()
