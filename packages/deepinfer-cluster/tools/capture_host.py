"""Record a host's probe inputs as test fixtures: `nvidia-smi` / `lscpu` outputs and the sysfs /
procfs files the probes read, copied into DEST/tree with their paths kept.

    python capture_host.py DEST

Run on a GPU host; the copied tree can be handed to the probes as `root=DEST/tree`.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
from pathlib import Path

COMMANDS = {
    "nvidia_smi_topo.txt": ["nvidia-smi", "topo", "-m"],
    "nvidia_smi_query.csv": [
        "nvidia-smi",
        "--query-gpu=index,name,memory.total,compute_cap,pci.bus_id",
        "--format=csv,noheader,nounits",
    ],
    "lscpu_p.txt": ["lscpu", "-p=CPU,Core,Socket,Node"],
}

PATTERNS = [
    "/sys/devices/system/node/node*/cpulist",
    "/sys/devices/system/cpu/cpu[0-9]*/topology/core_id",
    "/sys/devices/system/cpu/cpu[0-9]*/topology/physical_package_id",
    "/proc/driver/nvidia/gpus/*/information",
]


def copy_file(src: str, tree: Path) -> None:
    try:
        data = Path(src).read_bytes()
    except OSError:
        return
    dst = tree / src.lstrip("/")
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(data)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dest", type=Path)
    dest = p.parse_args().dest
    tree = dest / "tree"
    tree.mkdir(parents=True, exist_ok=True)
    for name, cmd in COMMANDS.items():
        if shutil.which(cmd[0]):
            res = subprocess.run(cmd, capture_output=True, text=True)
            (dest / name).write_text(res.stdout + res.stderr)
    for pattern in PATTERNS:
        for path in glob.glob(pattern):
            copy_file(path, tree)
    # PCI devices of NVIDIA (0x10de) and Huawei (0x19e5): vendor, class, numa_node.
    for dev in glob.glob("/sys/bus/pci/devices/*"):
        vendor = Path(dev, "vendor").read_text().strip() if os.path.exists(f"{dev}/vendor") else ""
        if vendor in ("0x10de", "0x19e5"):
            for f in ("vendor", "class", "device", "numa_node"):
                copy_file(f"{dev}/{f}", tree)
    # Device nodes: recorded as empty files with the same names.
    for node in glob.glob("/dev/nvidia*") + glob.glob("/dev/davinci*"):
        if os.path.basename(node)[len("nvidia") :].isdigit() or "davinci" in node:
            target = tree / node.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch()
    shutil.make_archive(str(dest / "tree"), "gztar", root_dir=tree)


if __name__ == "__main__":
    main()
