#!/usr/bin/env bash
# FlashAttention-4 and nvidia-cudnn-frontend for the workplace's lent GPU, whose image reaches no registry and whose
# calls carry 64 MiB each with the working tree (about 9 MiB; README: "What that recipe met"). nvidia-cutlass-dsl's
# CUDA 13 libraries wheel alone is 88 MiB, so it travels in four parts over three calls, and the lent machine keeps
# the carried folders while it is warm (30 s idle and it is a fresh one: run the three calls back to back).
#
#   here:    bash benches/fa4_wheels.sh download   # .whl-fa4a/ .whl-fa4b/ .whl-fa4c/ (about 22 + 49 + 44 MiB)
#   device:  carry [".whl", ".whl-fa4a"]:  true
#            carry [".whl-fa4b"]:          true
#            carry [".whl-fa4c"]:          eval "$(bash benches/fa4_wheels.sh install)" && <your command>
#
# install reassembles the libraries wheel, checks its sha256, installs every wheel (.whl/ and the three folders) with
# one `pip install --no-deps --target /tmp/site` (a second --target install into the same folder skips top-level
# folders already there), and prints the exports to eval: PYTHONPATH with /tmp/site and nvidia-cutlass-dsl's
# dsl_packages (a --target install runs no .pth file), USE_HUB_KERNELS=NO.
set -euo pipefail
cd "$(dirname "$0")/.."
LIBS=nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
WHEELS=(flash-attn-4==4.0.0b40 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
        nvidia-cutlass-dsl-libs-core==4.8.1 "cuda-bindings==13.*" cuda-pathfinder protobuf typing_extensions einops
        "apache-tvm-ffi>=0.1.11,<0.2" torch-c-dlpack-ext "quack-kernels>=0.5.3")
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

download() {
    local tmp
    tmp=$(mktemp -d)
    local pip=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
               "${PLATFORMS[@]}")
    "${pip[@]}" -d "$tmp" nvidia-cutlass-dsl-libs-cu13==4.8.1
    rm -rf .whl-fa4a .whl-fa4b .whl-fa4c
    mkdir -p .whl-fa4a .whl-fa4b .whl-fa4c
    (cd "$tmp" && sha256sum "$LIBS" > libs_cu13.sha256 && split -n 4 -d "$LIBS" libs_cu13.part.)
    mv "$tmp/libs_cu13.part.00" .whl-fa4a/
    mv "$tmp/libs_cu13.part.01" "$tmp/libs_cu13.sha256" .whl-fa4b/
    mv "$tmp/libs_cu13.part.02" "$tmp/libs_cu13.part.03" .whl-fa4c/
    "${pip[@]}" -d .whl-fa4b "${WHEELS[@]}" "nvidia-cudnn-frontend==1.32.0"
    rm -rf "$tmp"
    du -sh .whl .whl-fa4a .whl-fa4b .whl-fa4c 2>/dev/null || true
}

install() {
    local folder
    for folder in .whl .whl-fa4a .whl-fa4b .whl-fa4c; do
        [ -d "$folder" ] || { echo "fa4_wheels: $folder is missing (carry it in its call, back to back)" >&2; exit 2; }
    done
    cat .whl-fa4a/libs_cu13.part.00 .whl-fa4b/libs_cu13.part.01 .whl-fa4c/libs_cu13.part.0[23] > ".whl-fa4c/$LIBS"
    (cd .whl-fa4c && sha256sum -c ../.whl-fa4b/libs_cu13.sha256 >&2)
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
        .whl/*.whl .whl-fa4b/*.whl .whl-fa4c/*.whl >&2
    echo "export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD\${PYTHONPATH:+:\$PYTHONPATH} USE_HUB_KERNELS=NO PATH=/tmp/site/bin:\$PATH"
}

case "${1:-}" in
    download) download ;;
    install) install ;;
    *) echo "usage: bash benches/fa4_wheels.sh download|install" >&2; exit 2 ;;
esac
