#!/usr/bin/env bash
# A cuDNN release from PyPI on the GPU machine, which has no network: `pack` here, then one
# `stage` per carried part there (the way the GPU kit brings Transformer Engine).
#   pack [VERSION]  (a machine with PyPI) download nvidia-cudnn-cu13==VERSION (default
#                   9.27.0.42), keep its libraries but libcudnn_adv (TE does not load it),
#                   as two zips without recompressing: a (all but engines_precompiled),
#                   b (engines_precompiled); split each into parts of 58 MiB, one per folder
#                   .gpu-kit-cudnn/{a0..a3,b0..b3}, with their checksums. Carry one folder
#                   (plus .gpu-kit-cudnn/SHA256) per command.
#   stage           (GPU machine, repository root) collect the carried parts in /tmp; once a
#                   set is whole, check it and unzip it into /tmp/cudnn-9.27: the folder
#                   TE_GQA_FIX_CUDNN=strict:/tmp/cudnn-9.27/nvidia/cudnn names (builds.sh).
set -uo pipefail
kit=.gpu-kit-cudnn parts=/tmp/cudnn-parts out=/tmp/cudnn-9.27
case "${1:-}" in
  pack)
    version=${2:-9.27.0.42} tmp=$(mktemp -d)
    python3 -m pip download -q --no-deps -d "$tmp" "nvidia-cudnn-cu13==$version" || exit 1
    whl=$(ls "$tmp"/nvidia_cudnn_cu13-*.whl) lib=nvidia/cudnn/lib
    zip -q "$whl" --copy nvidia/cudnn/include/cudnn_version.h "$lib/libcudnn.so.9" \
      "$lib/libcudnn_cnn.so.9" "$lib/libcudnn_engines_runtime_compiled.so.9" \
      "$lib/libcudnn_engines_tensor_ir.so.9" "$lib/libcudnn_ext.so.9" "$lib/libcudnn_graph.so.9" \
      "$lib/libcudnn_heuristic.so.9" "$lib/libcudnn_ops.so.9" --out "$tmp/a.zip" || exit 1
    zip -q "$whl" --copy "$lib/libcudnn_engines_precompiled.so.9" --out "$tmp/b.zip" || exit 1
    rm -rf "$kit" && mkdir -p "$kit"
    (cd "$tmp" && sha256sum a.zip b.zip) >"$kit/SHA256"
    for set in a b; do
      split -b 58M -d -a 1 "$tmp/$set.zip" "$tmp/$set."
      for f in "$tmp/$set".[0-9]; do mkdir -p "$kit/$set${f##*.}" && mv "$f" "$kit/$set${f##*.}/"; done
    done
    rm -rf "$tmp"
    ls "$kit"
    ;;
  stage)
    mkdir -p "$parts" "$out"
    for d in "$kit"/[ab][0-9]; do [ -d "$d" ] && cp -n "$d"/* "$parts"/ 2>/dev/null; done
    for set in a b; do
      [ -f "$out/.$set" ] && continue
      want=$(grep " $set.zip\$" "$kit/SHA256" | cut -d' ' -f1)
      cat "$parts/$set".[0-9] >"/tmp/$set.zip" 2>/dev/null
      if [ -n "$want" ] && echo "$want  /tmp/$set.zip" | sha256sum -c --quiet - 2>/dev/null; then
        python3 -m zipfile -e "/tmp/$set.zip" "$out" && touch "$out/.$set" && rm -f "$parts/$set".[0-9]
      fi
      rm -f "/tmp/$set.zip"
    done
    # The wheel's RUNPATH names its siblings ($ORIGIN/../../cu13/lib: NVRTC, cuBLAS): link
    # the ones torch's CUDA wheels installed beside the folder, as a pip install would have.
    nv=$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null)
    [ -d "$out/nvidia" ] && for d in "${nv:-/nonexistent}"/*/; do
      name=$(basename "$d"); [ "$name" = cudnn ] || [ -e "$out/nvidia/$name" ] || ln -s "$d" "$out/nvidia/$name"
    done
    state() { [ -f "$out/.$1" ] && echo ready || echo "$(ls "$parts/$1".[0-9] 2>/dev/null | wc -l) parts"; }
    echo "cuDNN kit: a $(state a), b $(state b); $(ls "$out/nvidia/cudnn/lib" 2>/dev/null | wc -l) libraries in $out"
    ;;
  *) echo "usage: $0 pack [VERSION] | stage" >&2; exit 2 ;;
esac
