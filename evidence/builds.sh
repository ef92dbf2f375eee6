# Sourced by the GPU run scripts (evidence/run_all.sh, run_validation.sh, run_benchmarks.sh):
# the configurations a run covers, by name, and the commit of the code it measures.
#   system  TE loads the machine's cuDNN 9.14 (affected)      GPU_KIT_CUDNN=system
#   pip     TE loads torch's cuDNN 9.19 via CUDNN_HOME/LD path GPU_KIT_CUDNN=pip
#   route   the system machine with TE_GQA_FIX_CUDNN=auto through te-gqa-fix's installed
#           start-up file (the wheel carried in .whl-mcore/ is installed once)
#   cudnnNNN  the system machine with TE_GQA_FIX_CUDNN=strict:/tmp/cudnn-SHORT/nvidia/cudnn,
#           the folder `evidence/cudnn_kit.sh stage` unpacks (the route to a folder); NNN is
#           SHORT without dots, major 9 and a two-digit minor: cudnn927 -> 9.27, cudnn9281 -> 9.28.1
#           (the route loads 9.18 or newer only: it refuses cudnn916)
# The GPU kit: TE installed from PyPI wheels on the GPU machine, which has no network
# (.gpu-kit/env.sh, staged outside this repository, sets the loader path per GPU_KIT_CUDNN).
use_build() {
  unset TE_GQA_FIX_CUDNN
  case "$1" in
    route)
      ensure_wheel
      export GPU_KIT_CUDNN=system TE_GQA_FIX_CUDNN=auto
      ;;
    cudnn9[0-9][0-9]*)
      ensure_wheel
      local v=${1#cudnn9} && local patch=${v:2}
      export GPU_KIT_CUDNN=system \
        TE_GQA_FIX_CUDNN=strict:/tmp/cudnn-9.${v:0:2}${patch:+.$patch}/nvidia/cudnn
      ;;
    *) export GPU_KIT_CUDNN=$1 ;;
  esac
  # shellcheck disable=SC1091
  source .gpu-kit/env.sh
}

ensure_wheel() {
  python3 -c 'import _te_gqa_fix_autopatch as a, sys; sys.exit(a.find_pth() is None)' 2>/dev/null && return 0
  PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install -q --no-index --no-deps \
    .whl-mcore/te_gqa_fix-*.whl || echo "te-gqa-fix wheel install failed: the route build cannot run"
}

# The code measured, recorded with every block of the run: COMMIT where set (pass it when
# the copy of the tree on the GPU machine has no .git), else git's short hash of HEAD with
# +dirty where tracked files differ from it, else "unknown".
code_commit() {
  if [ -n "${COMMIT:-}" ]; then echo "$COMMIT"; return; fi
  local c
  c=$(git rev-parse --short=7 HEAD 2>/dev/null) || { echo unknown; return; }
  git diff --quiet HEAD -- 2>/dev/null || c="$c+dirty"
  echo "$c"
}
