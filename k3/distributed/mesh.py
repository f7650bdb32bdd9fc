"""Process groups of k3's distributed training: a (dp_shard, ep, cp) DeviceMesh and the groups
derived from it, plus per-rank batch sharding.

Rank layout: rank = (d * ep + e) * cp + c for mesh coordinates (d, e, c). Ranks that differ only
in c hold contiguous segments of the same packed rows (context parallel); the D = dp_shard * ep
"data ranks" (d, e) read different rows of the global batch (expert parallel borrows its ranks
from data parallel, as usual). Every non-expert parameter is FSDP-sharded over all ranks; expert
parameters are split over `ep` and replicated over the "expert data parallel" group (same e).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

IGNORE_INDEX = -100


@dataclass
class Mesh:
    """The process groups of one run. `device_mesh` has dims ("dp_shard", "ep", "cp");
    `world_mesh` is the 1-D mesh ("fsdp",) over every rank that non-expert parameters are sharded on."""

    device: torch.device
    dp: int
    ep: int
    cp: int
    rank: int
    device_mesh: DeviceMesh
    world_mesh: DeviceMesh
    ep_group: dist.ProcessGroup
    cp_group: dist.ProcessGroup
    edp_group: dist.ProcessGroup  # ranks holding the same experts (same ep coordinate)

    @property
    def world(self) -> int:
        return self.dp * self.ep * self.cp

    @property
    def coords(self) -> tuple[int, int, int]:
        r = self.rank
        return r // (self.ep * self.cp), (r // self.cp) % self.ep, r % self.cp

    @property
    def data_rank(self) -> int:
        d, e, _ = self.coords
        return d * self.ep + e

    @property
    def num_data_ranks(self) -> int:
        return self.dp * self.ep

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _subgroup(groups: list[list[int]], rank: int) -> dist.ProcessGroup:
    """Create every group in `groups` (all ranks must create all of them, in the same order) and
    return the one holding `rank`."""
    mine = None
    for ranks in groups:
        g = dist.new_group(ranks)
        if rank in ranks:
            mine = g
    assert mine is not None
    return mine


def init_mesh(ep: int = 1, cp: int = 1, device: torch.device | str | None = None) -> Mesh:
    """Initialise torch.distributed from the torchrun environment (NCCL on CUDA, gloo on CPU) and
    build the mesh. world = dp_shard * ep * cp; dp_shard is what remains after ep and cp."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if ep < 1 or cp < 1:
        raise ValueError(f"ep={ep} and cp={cp} must be >= 1")
    if world % (ep * cp):
        raise ValueError(f"WORLD_SIZE={world} is not divisible by ep * cp = {ep * cp}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if dist.get_world_size() != world:
        raise ValueError(f"process group has {dist.get_world_size()} ranks but WORLD_SIZE={world}")
    rank = dist.get_rank()
    dp = world // (ep * cp)
    dm = init_device_mesh(device.type, (dp, ep, cp), mesh_dim_names=("dp_shard", "ep", "cp"))
    wm = DeviceMesh(device.type, torch.arange(world), mesh_dim_names=("fsdp",))
    grid = torch.arange(world).reshape(dp, ep, cp)
    ep_groups = [grid[d, :, c].tolist() for d in range(dp) for c in range(cp)]
    cp_groups = [grid[d, e, :].tolist() for d in range(dp) for e in range(ep)]
    edp_groups = [grid[:, e, :].flatten().tolist() for e in range(ep)]
    return Mesh(device, dp, ep, cp, rank, dm, wm, _subgroup(ep_groups, rank), _subgroup(cp_groups, rank),
                _subgroup(edp_groups, rank))


@dataclass
class LocalBatch:
    """This rank's share of a packed global batch.

    input_ids, labels: [1, n] (this rank's CP segment of its rows); cu_seqlens: [m+1] int32, the
    document boundaries inside the segment (a document crossing a segment edge is cut there);
    row_cu_seqlens: boundaries of the whole (pre-CP) local row; seg_start: offset of the segment in it.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    cu_seqlens: torch.Tensor
    row_cu_seqlens: torch.Tensor
    seg_start: int
    seg_len: int


def clip_cu_seqlens(cu: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Boundaries of [start, end) of a packed row: [0, ..., end - start], int32."""
    inner = cu[(cu > start) & (cu < end)].to(torch.long) - start
    edge = torch.tensor([0, end - start], dtype=torch.long, device=cu.device)
    return torch.cat([edge[:1], inner, edge[1:]]).to(torch.int32)


def shard_batch(input_ids: torch.Tensor, labels: torch.Tensor, cu_seqlens: torch.Tensor, seq_len: int,
                data_rank: int, num_data_ranks: int, cp_rank: int = 0, cp: int = 1) -> LocalBatch:
    """Rows [r*b, (r+1)*b) of a packed batch [1, B*T] for data rank r, then the cp_rank-th of `cp`
    contiguous segments of them. Rows are padded (token 0, label -100, own document) to a multiple
    of num_data_ranks so every rank gets the same shapes; b*T must be divisible by cp."""
    n = input_ids.shape[1]
    if n % seq_len:
        raise ValueError(f"seq_len={seq_len} does not divide the packed batch length {n}")
    B = n // seq_len
    b = -(-B // num_data_ranks)
    pad = b * num_data_ranks - B
    cu = cu_seqlens.to(torch.long)
    if pad:
        input_ids = torch.cat([input_ids, input_ids.new_zeros(1, pad * seq_len)], 1)
        labels = torch.cat([labels, labels.new_full((1, pad * seq_len), IGNORE_INDEX)], 1)
        cu = torch.cat([cu[:-1], n + seq_len * torch.arange(pad + 1, device=cu.device)])
    lo, hi = data_rank * b * seq_len, (data_rank + 1) * b * seq_len
    row_cu = clip_cu_seqlens(cu, lo, hi)
    if (hi - lo) % cp:
        raise ValueError(f"local tokens {hi - lo} are not divisible by cp={cp}")
    seg = (hi - lo) // cp
    s0 = cp_rank * seg
    return LocalBatch(input_ids[:, lo + s0: lo + s0 + seg], labels[:, lo + s0: lo + s0 + seg],
                      clip_cu_seqlens(row_cu, s0, s0 + seg), row_cu, s0, seg)
