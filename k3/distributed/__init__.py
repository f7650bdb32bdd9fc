"""Distributed training applied from outside the single-device model (see docs/distributed.md):
mesh (DeviceMesh and batch sharding), fsdp (FSDP2, sharded Per-Head Muon), ep (expert parallel,
MoonEP balance), cp (context parallel for KDA and MLA), checkpoint (DCP), runtime (`Parallel`,
what the trainer calls). Submodules import torch.distributed; import them explicitly."""
