#!/usr/bin/env bash
# Run on a GPU machine from the repository root: capture fixtures, print the probes' view of the
# host (NVML path), and launch one rank per GPU running an NCCL all-reduce with NUMA binding.
set -u
export PYTHONPATH=packages/deepinfer-cluster/src
OUT=${OUT:-/tmp/capture}
python3 packages/deepinfer-cluster/tools/capture_host.py "$OUT/capture"
python3 - <<'PY'
import deepinfer_cluster as c
print("kind", c.accelerator_kind())
print("nodes", [(n.id, len(n.cpus), len(n.physical_cores)) for n in c.numa_nodes()])
for d in c.probe_devices():
    print("device", d)
    print("  rates", c.lookup_peak_rates(d.name))
t = c.topology_from_nvml()
print("nvml topology", t and t.matrix_text(), t and t.numa_nodes, t and t.nvlink_domain_size())
t2 = c.probe_topology()
print("probe topology domain", t2 and t2.nvlink_domain_size())
import os
print("sysfs devices", c.probe_devices_from_sysfs())
PY
N=$(nvidia-smi -L | wc -l)
python3 -m deepinfer_cluster.launch --nproc "$N" --devices-per-rank 1 --bind-numa -- python3 -c '
import os, torch, torch.distributed as dist
dist.init_process_group("nccl")
t = torch.ones(1024, device="cuda") * (dist.get_rank() + 1)
dist.all_reduce(t)
n = dist.get_world_size()
assert t[0].item() == n * (n + 1) / 2, t[0].item()
print("ok", os.environ["CUDA_VISIBLE_DEVICES"], os.environ["NCCL_NVLS_ENABLE"], sorted(os.sched_getaffinity(0))[:4], len(os.sched_getaffinity(0)))
dist.destroy_process_group()'
echo "launch rc=$?"

# A rank that dies while the other waits in an NCCL all-reduce: the launcher must stop the run.
SECONDS=0
python3 -m deepinfer_cluster.launch --nproc 2 --devices-per-rank 1 -- python3 -c '
import os, sys, torch, torch.distributed as dist
dist.init_process_group("nccl")
t = torch.ones(1, device="cuda")
dist.all_reduce(t); torch.cuda.synchronize()
if dist.get_rank() == 1:
    print("rank 1 leaving on purpose"); sys.exit(3)
dist.all_reduce(t); torch.cuda.synchronize()
print("unreachable")'
echo "crash launch rc=$? after ${SECONDS} s"

# Ranks that see every GPU and pick cuda:LOCAL_RANK, binding themselves (the engine's path).
python3 -m deepinfer_cluster.launch --nproc "$N" -- python3 -c '
import os, torch, torch.distributed as dist
from deepinfer_cluster import bind_local_rank, visible_devices
local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
r = bind_local_rank(device=visible_devices()[torch.cuda.current_device()])
dist.init_process_group("nccl", device_id=torch.device("cuda", local))
t = torch.ones(8, device="cuda"); dist.all_reduce(t)
print("self-bound", r.applied, r.numa_node, r.cpus[0], len(r.cpus), t[0].item())
dist.destroy_process_group()'
echo "self-bind launch rc=$?"
