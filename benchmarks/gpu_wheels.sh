#!/usr/bin/env bash
# `make gpu-wheels`: fill DEST (default .gpu-wheels/, git-ignored) with every wheel that
# `make test-gpu` installs on the GPU machine, which has Python 3.12 and no network:
# requirements/gpu-wheels.txt for Python 3.12 / manylinux x86_64, and DeepSpeed 0.19.8
# built here from its sdist without its compiled ops (a py3-none-any wheel; its ops are
# built just in time there, as in the cuda tests). The device tool carries DEST (64 MiB
# per call for the whole tree): the size is printed and checked.
# Usage: benchmarks/gpu_wheels.sh [DEST]   (PY: a python with torch, for DeepSpeed's build)
set -euo pipefail
dest=${1:-.gpu-wheels}
py=${PY:-.venv/bin/python}
mkdir -p "$dest"
rm -f "$dest"/*.whl
"$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --dest "$dest" --requirement requirements/gpu-wheels.txt
# --no-build-isolation: DeepSpeed's setup.py imports torch (the one in this venv).
DS_BUILD_OPS=0 "$py" -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$dest" \
    deepspeed==0.19.8
ls "$dest"
size=$(du -sk "$dest" | cut -f1)
echo "$dest: $(ls "$dest"/*.whl | wc -l) wheels, $((size / 1024)) MiB"
if [ "$size" -gt $((32 * 1024)) ]; then
    echo "more than 32 MiB: the device tool carries at most 64 MiB with the whole tree" >&2
    exit 1
fi
