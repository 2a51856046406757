"""Zero the GPU code of every architecture but one in a shared library's fatbins, so that it compresses.

Why: DeepEP 2.5 needs NCCL >= 2.32.3, the CUDA machine has torch's NCCL 2.28.9 and no network, and the
NCCL wheel's libnccl.so.2 (344 MB, code for many GPU generations) does not fit the 64 MiB that a call can
carry. The driver reads only the entry it picks for the running GPU, so the other entries' payloads can be
zeroed in place (headers, offsets and the ELF layout stay as they were); the result compresses to a few
tens of MB (strip the debug sections too: `strip --strip-debug`). Entries are kept for ``--keep-arch`` (default 90, Hopper) in both SASS and PTX form.

    python prune_fatbin.py libnccl.so.2 pruned/libnccl.so.2 [--keep-arch 90]
"""

from __future__ import annotations

import argparse
import collections
import struct

FATBIN_MAGIC = 0xBA55ED50


def sections(data: bytes) -> dict[str, tuple[int, int]]:
    """ELF64 section name -> (file offset, size)."""
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    str_off = headers[shstrndx][4]
    out = {}
    for name_off, _type, _flags, _addr, offset, size, *_ in headers:
        end = data.index(b"\0", str_off + name_off)
        out[data[str_off + name_off : end].decode()] = (offset, size)
    return out


def prune(data: bytearray, keep_arch: int) -> collections.Counter:
    seen = collections.Counter()
    for name, (start, size) in sections(data).items():
        if name in (".nv_fatbin", "__nv_relfatbin"):  # loadable and relocatable (device-link) fatbins
            _prune_section(data, start, start + size, keep_arch, seen)
    return seen


def _prune_section(data: bytearray, pos: int, end: int, keep_arch: int, seen: collections.Counter) -> None:
    while pos + 16 <= end:
        magic, _version, header_size, fat_size = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:  # containers are 8-byte aligned; skip padding
            pos += 8
            continue
        entry, container_end = pos + header_size, pos + header_size + fat_size
        while entry < container_end:
            kind, _u, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            (arch,) = struct.unpack_from("<I", data, entry + 28)
            body = entry + entry_header
            kept = arch == keep_arch
            seen[(("ptx" if kind == 1 else "sass"), arch, kept)] += payload
            if not kept:
                data[body : body + payload] = bytes(payload)
            entry = body + payload
        pos = container_end


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument(
        "--keep-arch", type=int, default=90, help="SM version whose code is kept (default 90)"
    )
    args = parser.parse_args()
    with open(args.src, "rb") as f:
        data = bytearray(f.read())
    seen = prune(data, args.keep_arch)
    with open(args.dst, "wb") as f:
        f.write(data)
    for (kind, arch, kept), n in sorted(seen.items()):
        print(f"{kind:4} sm_{arch:<4} {n / 2**20:8.1f} MiB {'kept' if kept else 'zeroed'}")


if __name__ == "__main__":
    main()
