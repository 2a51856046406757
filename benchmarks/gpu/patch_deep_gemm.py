"""Work around DeepGEMM 2.8.2's first-call segfault on the GPU machine (build-time source patch).

Seen on an H200 (faulthandler + DeepGEMM's own symbolised trace): the crash is inside
`deep_jit::CUDA::get_compiler_info()` (third-party/deep_jit/.../backend/cuda/backend.hpp), in the
`std::regex` that parses `nvcc --version`: the first thing the JIT runtime does on any GEMM call.
This rewrites that parse with `std::string::find` + `sscanf` (same result) before the build.

    python3 patch_deep_gemm.py path/to/deepinfer_gemm-2.8.2
"""

from __future__ import annotations

import sys
from pathlib import Path

OLD = """        std::smatch match;
        DJ_HOST_ASSERT(std::regex_search(version, match, std::regex(R"(release (\\d+)\\.(\\d+))")),
                       "failed to parse NVCC version from:\\n{}", version);
        const int major = std::stoi(match[1].str());
        const int minor = std::stoi(match[2].str());
"""
NEW = """        // patched by deepinfer (benchmarks/gpu/patch_deep_gemm.py): std::regex crashed here
        const auto release_pos = version.find("release ");
        int major = 0, minor = 0;
        DJ_HOST_ASSERT(release_pos != std::string::npos and
                       std::sscanf(version.c_str() + release_pos + 8, "%d.%d", &major, &minor) == 2,
                       "failed to parse NVCC version from:\\n{}", version);
"""


def main() -> None:
    path = Path(sys.argv[1]) / "third-party/deep_jit/include/deep_jit/backend/cuda/backend.hpp"
    text = path.read_text()
    if NEW in text:
        print("already patched")
        return
    if OLD not in text:
        raise SystemExit(f"patch_deep_gemm: expected code not found in {path}")
    path.write_text(text.replace(OLD, NEW).replace("#include <regex>", "#include <regex>\n#include <cstdio>"))
    print(f"patched {path}")


if __name__ == "__main__":
    main()
