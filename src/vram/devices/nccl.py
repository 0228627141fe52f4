"""NCCL's device memory outside the caching allocator, per rank (what nvidia-smi adds to
``memory_reserved()`` besides the CUDA context).

NCCL ``cuMemCreate``s its own buffers; the caching allocator never sees them. The figures below
follow NCCL's source (NVIDIA/nccl 2.30.7, commit 5067397c; the rules quoted have been the same
since cuMem became the default in 2.19):

* **Connection buffers** (``src/transport/p2p.cc`` ``p2pSendSetup``/``p2pRecvSetup``). Every
  connector between two GPUs of a node allocates on its own GPU: a send connector
  ``ALIGN(sizeof(ncclSendMem) + (read ? BUFFSIZE : 0), CUDA_IPC_MIN)``, a receive connector
  ``ALIGN(sizeof(ncclRecvMem) + LL + LL128 + (read ? 0 : BUFFSIZE), CUDA_IPC_MIN)``, where
  ``sizeof(ncclSendMem) == sizeof(ncclRecvMem) == MEM_ALIGN`` (4096, ``src/include/comm.h``),
  ``CUDA_IPC_MIN`` = 2 MiB and the protocol sizes are ``comm->buffSizes`` (``src/init.cc``
  ``computeBuffSizes``: ``NCCL_LL_BUFFSIZE``, ``NCCL_LL128_BUFFSIZE``, ``NCCL_BUFFSIZE``, defaults
  ``DEFAULT_LL_BUFFSIZE`` = 8 lines x 512 threads x 8 steps x 16 B = 512 KiB,
  ``DEFAULT_LL128_BUFFSIZE`` = 120 x 640 x 8 x 8 B = 4.6875 MiB, ``DEFAULT_BUFFSIZE`` = 4 MiB).
  ``read`` (P2P read, ``src/graph/paths.cc`` ``ncclTopoCheckP2p``) is on for two sm_80 GPUs
  joined by NVLink; ``NCCL_P2P_READ_ENABLE`` overrides. Every protocol's buffer is allocated
  whatever ``NCCL_PROTO`` allows. The ring (``ncclTransportRingConnect``) gives each rank one send
  and one receive connector per channel, set up at the communicator's first collective
  (``NCCL_RUNTIME_CONNECT=1``, the default); point-to-point operations connect
  ``p2pnChannelsPerPeer`` channels per peer and direction on first use.
* **Channel bookkeeping** (``src/channel.cc`` ``initChannel``, ``src/init.cc`` ``devCommSetup``):
  three ``ncclCudaCallocAsync`` per initialised channel (the shared ``devPeers``, the channel's
  ``devPeers``, ``devRingUserRanks``) and two per communicator (``devCommAndChans``,
  ``rankToLocalRank``); under cuMem each is its own ``cuMemCreate`` rounded up to the allocation
  granularity (2 MiB assumed: ``cuMemGetAllocationGranularity`` is read from the driver, 2 MiB on
  every NVIDIA data-centre GPU to date). Channels initialised: ``max(nChannels, p2pnChannels)``.
* **Channel counts** come from NCCL's topology search, which needs the real machine. For an
  NVSwitch node (H100/H200/A100 SXM) `nvswitch_ring_channels` replays the search's arithmetic
  (``src/graph/search.cc`` ``ncclTopoCompute`` and ``ncclTopoDupChannels``, then the doubling in
  ``src/graph/connect.cc`` ``ncclTopoPostset``); it gives 16 for H800's 8 NVLinks, which is what
  NCCL printed on an H800 node (github.com/NVIDIA/nccl/issues/892: "16 coll channels, 16 p2p
  channels, 16 p2p channels per peer"). ``NCCL_MIN_NCHANNELS``/``NCCL_MAX_NCHANNELS`` then clamp
  the count as ``ncclTopoPostset`` does. Other machines (PCIe cards, whose count depends on the
  PCIe switches and sockets; GeForce cards, which may lack P2P; communicators spanning nodes,
  which use the network transport) are not derived: the report says so, unless the environment
  pins the count (``NCCL_MIN_NCHANNELS`` = ``NCCL_MAX_NCHANNELS``), in which case the P2P rules
  above are used for PCIe peers.

Not counted, and said so: NVLS (NVLink SHARP) buffers on H100/H200 NVSwitch nodes
(``NCCL_NVLS_ENABLE``, on by default there: its size depends on the multicast granularity the
driver reports), the network transport's buffers, the proxy's and symmetric-memory windows.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["VERSION", "NcclEnv", "Node", "Communicator", "NcclMemory", "node_for", "nvswitch_ring_channels",
           "connector_bytes", "nccl_memory", "with_nccl"]

MIB = 1 << 20
VERSION = (2, 30, 7)            # the release whose source the rules here follow
CUDA_IPC_MIN = 2 * MIB          # src/include/comm.h
MEM_ALIGN = 4096                # sizeof(ncclSendMem) == sizeof(ncclRecvMem)
GRANULARITY = 2 * MIB           # cuMemGetAllocationGranularity(MINIMUM), assumed
NCCL_STEPS = 8
DEFAULT_LL_BUFFSIZE = 8 * 512 * NCCL_STEPS * 16            # NCCL_LL_LINES_PER_THREAD x NCCL_LL_MAX_NTHREADS
DEFAULT_LL128_BUFFSIZE = 120 * 640 * NCCL_STEPS * 8        # NCCL_LL128_ELEMS_PER_THREAD x NCCL_LL128_MAX_NTHREADS
DEFAULT_BUFFSIZE = 1 << 22
MAXCHANNELS = 64                # src/include/device.h
NVLINK_BW = {80: 20.0, 90: 20.6, 100: 40.1}                 # src/graph/topo.h SMxx_NVLINK_BW, GB/s per link
#: src/graph/search.cc speedArrayIntra / sm90SpeedArrayIntra
SPEEDS_INTRA = (40.0, 30.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0)
SPEEDS_INTRA_SM90 = (60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 11.0, 6.0, 3.0)
RING_MAX_CHANNELS = MAXCHANNELS // 2   # graph->maxChannels for the ring search (src/init.cc)


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def _pow2_up(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


@dataclass(frozen=True)
class NcclEnv:
    """The NCCL environment variables that change its memory (None: NCCL's default)."""

    ll: int = DEFAULT_LL_BUFFSIZE
    ll128: int = DEFAULT_LL128_BUFFSIZE
    simple: int = DEFAULT_BUFFSIZE
    p2p_read: int | None = None          #: NCCL_P2P_READ_ENABLE
    min_channels: int | None = None      #: NCCL_MIN_NCHANNELS (or NCCL_MIN_NRINGS)
    max_channels: int | None = None      #: NCCL_MAX_NCHANNELS (or NCCL_MAX_NRINGS)
    min_p2p: int = 1                     #: NCCL_MIN_P2P_NCHANNELS
    max_p2p: int = MAXCHANNELS           #: NCCL_MAX_P2P_NCHANNELS
    cumem: bool = True                   #: NCCL_CUMEM_ENABLE (auto: on with a CUDA 12 driver)
    nvls: bool = True                    #: NCCL_NVLS_ENABLE (0 turns NVLS off)
    set_by_env: tuple[str, ...] = ()

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> NcclEnv:
        """Read ``NCCL_*`` as NCCL's ``NCCL_PARAM`` does (integers); a bad value is a one-line error."""
        def num(name: str) -> int | None:
            raw = environ.get(name)
            if raw is None or raw.strip() == "":
                return None
            try:
                return int(raw.strip(), 0)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not an integer") from None
        got = {n: num(n) for n in ("NCCL_LL_BUFFSIZE", "NCCL_LL128_BUFFSIZE", "NCCL_BUFFSIZE",
                                   "NCCL_P2P_READ_ENABLE", "NCCL_MIN_NRINGS", "NCCL_MIN_NCHANNELS",
                                   "NCCL_MAX_NRINGS", "NCCL_MAX_NCHANNELS", "NCCL_MIN_P2P_NCHANNELS",
                                   "NCCL_MAX_P2P_NCHANNELS", "NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE")}
        for n in ("NCCL_LL_BUFFSIZE", "NCCL_LL128_BUFFSIZE", "NCCL_BUFFSIZE"):
            v = got[n]
            if v is not None and v < 0:
                raise ValueError(f"{n}={v} is negative")

        def pick(*names: str) -> int | None:   # the later name wins, as in ncclMin/MaxNchannels
            vals = [got[n] for n in names if got[n] is not None]
            return vals[-1] if vals else None
        d = cls()
        return cls(
            ll=d.ll if got["NCCL_LL_BUFFSIZE"] is None else got["NCCL_LL_BUFFSIZE"],
            ll128=d.ll128 if got["NCCL_LL128_BUFFSIZE"] is None else got["NCCL_LL128_BUFFSIZE"],
            simple=d.simple if got["NCCL_BUFFSIZE"] is None else got["NCCL_BUFFSIZE"],
            p2p_read=got["NCCL_P2P_READ_ENABLE"],
            min_channels=pick("NCCL_MIN_NRINGS", "NCCL_MIN_NCHANNELS"),
            max_channels=pick("NCCL_MAX_NRINGS", "NCCL_MAX_NCHANNELS"),
            min_p2p=d.min_p2p if got["NCCL_MIN_P2P_NCHANNELS"] is None else got["NCCL_MIN_P2P_NCHANNELS"],
            max_p2p=d.max_p2p if got["NCCL_MAX_P2P_NCHANNELS"] is None else got["NCCL_MAX_P2P_NCHANNELS"],
            cumem=got["NCCL_CUMEM_ENABLE"] != 0,
            nvls=got["NCCL_NVLS_ENABLE"] != 0,
            set_by_env=tuple(n for n, v in got.items() if v is not None))

    def clamp(self, n: int) -> int:
        """``ncclTopoPostset``: ``min(ncclMaxNchannels(), n)`` then raised to ``ncclMinNchannels()``
        (each limited to MAXCHANNELS; a maximum below 1 is 1)."""
        hi = max(1, min(MAXCHANNELS, self.max_channels)) if self.max_channels is not None else MAXCHANNELS
        lo = max(0, min(MAXCHANNELS, self.min_channels)) if self.min_channels is not None else 0
        return max(min(hi, n), lo)

    def pinned(self) -> int | None:
        """The channel count the environment fixes whatever the search found, else None."""
        if self.min_channels is not None and self.max_channels is not None \
                and self.clamp(1) == self.clamp(MAXCHANNELS):
            return self.clamp(1)
        return None


@dataclass(frozen=True)
class Node:
    """What NCCL's topology detection would find between the GPUs of one node."""

    kind: str               #: "nvswitch", or "unknown" (not derived)
    cc: int                 #: compute capability x 10
    links: int = 0          #: NVLinks per GPU
    why: str = ""


def node_for(name: str, major: int, minor: int) -> Node:
    """The node a simulated GPU stands for: SXM cards sit on an NVSwitch (DGX/HGX), a size-only
    GPU is an H100 (as `vram.devices.gpus.resolve_gpu` says); anything else is not derived."""
    cc = major * 10 + minor
    n = name.upper()
    if cc == 90 and ("H100" in n or "H200" in n) and "PCIE" not in n:
        return Node("nvswitch", cc, 18, "H100/H200 SXM: 18 NVLink4 links per GPU to the NVSwitches (HGX)")
    if cc == 80 and "SXM4" in n:
        return Node("nvswitch", cc, 12, "A100 SXM4: 12 NVLink3 links per GPU to the NVSwitches (HGX/DGX A100)")
    return Node("unknown", cc, 0, f"{name} (sm_{cc}): NCCL's topology for it (PCIe switches, sockets, "
                "P2P support) is not modelled")


def nvswitch_ring_channels(links: int, cc: int) -> int:
    """NCCL's ring channel count on an NVSwitch node whose GPUs each have `links` NVLinks.

    ``ncclTopoCompute`` pass 1: from the fastest speed not above the GPU's bandwidth
    (``links x NVLINK_BW``), each speed fits ``floor(bw / speed)`` channels; it stops once
    channels x speed reaches the GPU's bandwidth, else tries slower speeds while the next is above
    0.49 of the best so far, keeping the largest channels x speed (the first on ties).
    ``ncclTopoDupChannels`` doubles it (halving the speed) unless the speed is below 25 GB/s, or
    the GPU is newer than sm_80 with a speed below 50 and more than 4 channels; pass 2 tries a
    faster speed with as many channels, which cannot fit here. ``ncclTopoPostset`` doubles again."""
    bw = links * NVLINK_BW[90 if cc >= 90 else 80]
    speeds = SPEEDS_INTRA_SM90 if cc >= 90 else SPEEDS_INTRA
    i = next((k for k, s in enumerate(speeds) if s <= bw), len(speeds) - 1)
    best_n, best_s = 0, 0.0
    while True:
        s = speeds[i]
        n = min(int(bw // s), RING_MAX_CHANNELS)
        if n * s > best_n * best_s:
            best_n, best_s = n, s
        if best_n * best_s >= bw or i + 1 >= len(speeds) or speeds[i + 1] / best_s <= .49:
            break
        i += 1
    if not (best_s < 25.0 or (cc > 80 and best_s < 50.0 and best_n > 4)):
        best_n = min(best_n * 2, RING_MAX_CHANNELS)
    return min(MAXCHANNELS, best_n * 2)


def connector_bytes(env: NcclEnv, read: bool) -> tuple[int, int]:
    """(send, receive) connector sizes of the P2P transport (``p2pSendSetup``/``p2pRecvSetup``)."""
    send = _align(MEM_ALIGN + (env.simple if read else 0), CUDA_IPC_MIN)
    recv = _align(MEM_ALIGN + env.ll + env.ll128 + (0 if read else env.simple), CUDA_IPC_MIN)
    return send, recv


@dataclass
class Communicator:
    """One NCCL communicator of this rank: its size, whether a collective ran on it (ring
    connected), and the point-to-point peers it sent to / received from."""

    name: str
    nranks: int
    one_node: bool = True
    ring: bool = False
    sends: set[int] = field(default_factory=set)
    recvs: set[int] = field(default_factory=set)


@dataclass
class NcclMemory:
    """This rank's NCCL device memory: ``bytes`` (None when not derived) and how each part was got."""

    bytes: int | None
    lines: list[str]


def with_nccl(device_used: int, nccl: int | None) -> int | None:
    """nvidia-smi's figure for a process: its device memory outside NCCL (reserved + CUDA context
    + whatever else the caller counts) plus NCCL's (`nccl_memory`); None when NCCL's is not derived."""
    return None if nccl is None else device_used + nccl


def _fmt(n: int) -> str:
    return f"{n / MIB:,.1f} MiB" if n % MIB else f"{n // MIB:,} MiB"


def nccl_memory(comms: list[Communicator], node: Node, env: NcclEnv) -> NcclMemory:
    """Sum the parts the module doc lists over this rank's communicators (one-rank ones hold no
    connections and are not counted)."""
    comms = [c for c in comms if c.nranks > 1]
    if not comms:
        return NcclMemory(0, ["no NCCL communicator of two or more ranks: nothing outside the allocator from NCCL"])
    pinned = env.pinned()
    if node.kind == "nvswitch":
        coll = env.clamp(nvswitch_ring_channels(node.links, node.cc))
        how = (f"{node.why}; NCCL's ring search gives {nvswitch_ring_channels(node.links, node.cc)} channels"
               + (f", {coll} after NCCL_MIN/MAX_NCHANNELS" if coll != nvswitch_ring_channels(node.links, node.cc)
                  else ""))
        per_peer_max = _pow2_up(2 * node.links)   # ncclTopoGetNchannels: 2 x max(1, path bw / link bw)
    elif pinned is not None:
        coll, how = pinned, f"{node.why}; channels pinned by NCCL_MIN_NCHANNELS=NCCL_MAX_NCHANNELS={pinned}"
        per_peer_max = 2                            # ncclTopoGetNchannels: a PCIe peer gets 2
    else:
        return NcclMemory(None, [f"not derived: {node.why}; set NCCL_MIN_NCHANNELS=NCCL_MAX_NCHANNELS=N to the "
                                 "'N coll channels' NCCL_DEBUG=INFO prints on the real machine"])
    spread = [c.name for c in comms if not c.one_node]
    if spread:
        return NcclMemory(None, [f"not derived: communicator(s) {', '.join(spread)} span nodes (NCCL's network "
                                 "transport and inter-node channel search are not modelled)"])
    read = node.kind == "nvswitch" and node.cc == 80 if env.p2p_read is None else env.p2p_read > 0
    send, recv = connector_bytes(env, read)
    # ncclTopoComputeP2pChannels: p2pnChannels = pow2Up(max(min(nChannels, MAX_P2P), MIN_P2P))
    p2p_n = _pow2_up(max(min(coll, env.max_p2p), env.min_p2p))
    per_peer = min(p2p_n, per_peer_max)
    gran = GRANULARITY if env.cumem else 0
    book_each = (2 + 3 * max(coll, p2p_n)) * gran
    lines = [f"channels: {coll} per communicator ({how}); P2P {'read' if read else 'write'}; "
             f"send connector {_fmt(send)}, receive connector {_fmt(recv)} (LL {env.ll:,} + LL128 {env.ll128:,}"
             f" + Simple {env.simple:,} B, each connector rounded up to 2 MiB: src/transport/p2p.cc)"]
    if gran:
        lines.append(f"bookkeeping: (2 + 3 x {max(coll, p2p_n)} channels) cuMem allocations of 2 MiB = "
                     f"{_fmt(book_each)} per communicator (src/init.cc devCommSetup, src/channel.cc initChannel)")
    else:
        lines.append("bookkeeping: NCCL_CUMEM_ENABLE=0, cudaMalloc'd bookkeeping (a few KiB) not counted")
    total = 0
    for c in comms:
        part = book_each
        what = []
        if c.ring:
            part += coll * (send + recv)
            what.append(f"ring {coll} x {_fmt(send + recv)}")
        if c.sends or c.recvs:
            part += per_peer * (len(c.sends) * send + len(c.recvs) * recv)
            what.append(f"p2p {per_peer} channels per peer: sending to {len(c.sends)} peer(s), "
                        f"receiving from {len(c.recvs)}")
        total += part
        lines.append(f"communicator {c.name} ({c.nranks} ranks): {_fmt(part)}"
                     + (f" ({'; '.join(what)})" if what else " (no collective yet: bookkeeping only)"))
    if node.kind == "nvswitch" and node.cc >= 90 and env.nvls:
        lines.append("not counted: NVLS buffers (NVSwitch multicast, on by default on H100/H200 nodes; their size "
                     "depends on the driver's multicast granularity): set NCCL_NVLS_ENABLE=0 for a complete figure")
    return NcclMemory(total, lines)
