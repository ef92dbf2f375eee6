"""What the two evidence pages share: the data layout, merging a run into a data file, the
commit of the code measured, the stack in words, tables and figure files.

Data layout (``docs/data/validation.jsonl`` and ``docs/data/performance.jsonl``): one JSON
record a line, every record tagged with ``build`` (the cuDNN configuration, e.g. ``system``)
and ``suite`` (what was measured on it, e.g. ``tests`` or ``step``). The records of one
(build, suite) pair form a block, opened by one ``{"kind": "block", ...}`` record that says
where they came from: ``date`` (ISO, UTC), ``commit`` (short hash of the code measured),
``command``, ``gpu``, ``gpu_count`` and ``stack`` (driver, torch, CUDA, TE, the cuDNN TE
runs, ...); the block's other records (its rows) follow it. A GPU run writes a file of the
blocks it measured. For validation, ``merge`` replaces exactly those blocks in the data file
and keeps every other block, with its own date and commit. For performance,
``merge_rows`` replaces rows, not blocks: a new block's rows replace only the earlier rows
of the same (build, suite) with the same row key (``tokens``, ``offsets`` and ``mode`` of a
training step, ...), and the rest of the earlier block stays with its own block record, so
one (build, suite) may then have several blocks, newest first.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import subprocess
from pathlib import Path
from typing import Any, Callable, Dict, Hashable, Iterable, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
Rec = Dict[str, Any]
Key = Tuple[str, str]
BLOCK = "block"
# The stack fields a block keeps (the rest of a stack line is per-process detail).
STACK_KEYS = (
    "capability", "driver", "torch", "cuda", "te", "cudnn_te", "cudnn_torch", "triton",
    "sm_count", "cpu", "gpu_kit_cudnn", "te_gqa_fix_cudnn", "megatron_core",
)  # fmt: skip
COUNT_WORDS = {1: "one", 2: "two", 3: "three", 4: "four", 8: "eight"}


# ----------------------------------------------------------------------------- data files


def compact(v: Any) -> Any:
    """Floats to 4 significant digits, recursively: the pages show 3."""
    if isinstance(v, float) and math.isfinite(v):
        return float(f"{v:.4g}")
    if isinstance(v, dict):
        return {k: compact(x) for k, x in v.items()}
    if isinstance(v, list):
        return [compact(x) for x in v]
    return v


def read_jsonl(path: Path) -> List[Rec]:
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def write_jsonl(recs: Iterable[Rec], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def key(rec: Rec) -> Key:
    return rec["build"], rec["suite"]


def block_head(
    build: str,
    suite: str,
    *,
    date: Optional[str],
    commit: Optional[str],
    command: Optional[str],
    stack: Optional[Rec] = None,
    **extra: Any,
) -> Rec:
    """The record that opens a block: where its rows come from."""
    stack = stack or {}
    return {
        "kind": BLOCK,
        "build": build,
        "suite": suite,
        "date": date or stack.get("date"),
        "commit": commit,
        "command": command,
        "gpu": stack.get("gpu"),
        "gpu_count": stack.get("gpu_count") or stack.get("world_size"),
        "stack": {k: stack[k] for k in STACK_KEYS if stack.get(k) is not None},
        **extra,
    }


def blocks(recs: Sequence[Rec]) -> Dict[Key, Rec]:
    """``{(build, suite): block record}`` in file order."""
    return {key(r): r for r in recs if r.get("kind") == BLOCK}


def split_blocks(recs: Sequence[Rec]) -> List[Tuple[Rec, List[Rec]]]:
    """``[(block record, its rows)]`` in file order: a row belongs to the block record before
    it, which must be of the row's (build, suite)."""
    out: List[Tuple[Rec, List[Rec]]] = []
    for r in recs:
        if "build" not in r or "suite" not in r:
            raise ValueError(f"a record without build and suite: {json.dumps(r)[:200]}")
        if r.get("kind") == BLOCK:
            out.append((r, []))
        elif out and key(out[-1][0]) == key(r):
            out[-1][1].append(r)
        else:
            raise ValueError(f"a record not after a block record of its build and suite: "
                             f"{json.dumps(r)[:200]}")  # fmt: skip
    return out


def heads(recs: Sequence[Rec]) -> List[Rec]:
    """Every block record, in file order (several of one (build, suite) where rows merge)."""
    return [r for r in recs if r.get("kind") == BLOCK]


def check_blocks(recs: Sequence[Rec], one_per_key: bool = True) -> None:
    """Every record has a build and a suite, and every (build, suite) one block record; or,
    not ``one_per_key`` (data merged by rows), every row follows a block record of its
    (build, suite) and no block record is there twice."""
    if not one_per_key:
        seen: List[Rec] = []
        for h, _ in split_blocks(recs):
            if h in seen:
                raise ValueError(f"a block twice: {key(h)} of {h.get('date')}")
            seen.append(h)
        return
    heads: Dict[Key, int] = {}
    for r in recs:
        if "build" not in r or "suite" not in r:
            raise ValueError(f"a record without build and suite: {json.dumps(r)[:200]}")
        if r.get("kind") == BLOCK:
            heads[key(r)] = heads.get(key(r), 0) + 1
    twice = sorted(k for k, n in heads.items() if n > 1)
    bare = sorted({key(r) for r in recs} - set(heads))
    if twice or bare:
        raise ValueError(f"blocks opened twice: {twice}; records without a block: {bare}")


def sort_blocks(recs: Sequence[Rec], suites: Sequence[str], builds: Sequence[str]) -> List[Rec]:
    """Blocks in page order (suite, then build; unknown names last, by name); each block's
    own records keep their order, its block record first."""

    def rank(order: Sequence[str], name: str) -> Tuple[int, str]:
        return (order.index(name) if name in order else len(order), name)

    groups: Dict[Key, List[Rec]] = {}
    for r in recs:
        groups.setdefault(key(r), []).append(r)
    out: List[Rec] = []
    for k in sorted(groups, key=lambda k: (rank(suites, k[1]), rank(builds, k[0]))):
        g = groups[k]
        out += [r for r in g if r.get("kind") == BLOCK] + [r for r in g if r.get("kind") != BLOCK]
    return out


def merge(
    old: Sequence[Rec], new: Sequence[Rec], suites: Sequence[str], builds: Sequence[str]
) -> List[Rec]:
    """``old`` with the (build, suite) blocks that ``new`` holds replaced by ``new``'s."""
    check_blocks(new)
    measured = set(blocks(new))
    kept = [r for r in old if key(r) not in measured]
    out = sort_blocks([*kept, *new], suites, builds)
    check_blocks(out)
    return out


def merge_rows(
    old: Sequence[Rec],
    new: Sequence[Rec],
    row_key: Callable[[Rec], Hashable],
    suites: Sequence[str],
    builds: Sequence[str],
) -> List[Rec]:
    """``old`` with ``new``'s blocks added, row by row: each row of a new block replaces the
    row of the same (build, suite) and ``row_key`` in every earlier block, unless that row
    comes from a later run (by date; on the same date the new block's row wins); rows whose
    key is None replace all rows of theirs (a block-level suite). The rows a new block did
    not measure stay in their own block, under their own block record; a block left without
    rows goes (an earlier block of no rows too), and a block record already in ``old`` (the
    same run merged again) is replaced whole. Blocks in page order, the newest block of a (build, suite) first."""
    check_blocks(new, one_per_key=False)
    have = split_blocks(old)
    for head, rows in split_blocks(new):
        keys = [row_key(r) for r in rows]
        named = [k for k in keys if k is not None]
        if len(set(named)) < len(named):
            raise ValueError(f"{key(head)}: two rows of one key in a block")
        have = [(h, rs) for h, rs in have if h != head]
        mine = [(h, rs) for h, rs in have if key(h) == key(head)]
        date = str(head.get("date") or "")
        later = {row_key(r) for h, rs in mine if str(h.get("date") or "") > date for r in rs}
        rows = [r for r, k in zip(rows, keys) if k not in later]
        measured = {row_key(r) for r in rows}
        out = []
        for h, rs in have:
            left = [r for r in rs if key(h) != key(head) or row_key(r) not in measured]
            if left or (not rs and key(h) != key(head)):
                out.append((h, left))
        have = out
        if rows or not keys:
            have.append((head, rows))
    merged = sort_runs(have, suites, builds)
    check_blocks(merged, one_per_key=False)
    return merged


def sort_runs(
    runs: Sequence[Tuple[Rec, List[Rec]]], suites: Sequence[str], builds: Sequence[str]
) -> List[Rec]:
    """``[(block record, rows)]`` as records in page order: suite, then build (unknown names
    last, by name), then the newest block first; each block record before its own rows."""

    def rank(order: Sequence[str], name: str) -> Tuple[int, str]:
        return (order.index(name) if name in order else len(order), name)

    by_date = sorted(runs, key=lambda hr: str(hr[0].get("date") or ""), reverse=True)
    ordered = sorted(by_date, key=lambda hr: (rank(suites, hr[0]["suite"]), rank(builds, hr[0]["build"])))  # fmt: skip
    return [r for h, rs in ordered for r in (h, *rs)]


def code_commit(root: Path = ROOT) -> str:
    """The code measured: ``COMMIT`` where set (a copy of the tree without ``.git``), else
    git's short hash of HEAD, ``+dirty`` where tracked files differ from it; else unknown."""
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        git = ["git", "-C", str(root)]
        head = subprocess.run([*git, "rev-parse", "--short=7", "HEAD"], capture_output=True,
                              text=True, timeout=30, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run([*git, "diff", "--quiet", "HEAD", "--"], timeout=60).returncode
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# ----------------------------------------------------------------------------- words


def day(date: Any) -> str:
    return str(date or "-")[:10]


def release_of(version: Any) -> str:
    """``"2.20.2"`` -> ``"2.20"``; ``"2.11.0+cu130"`` -> ``"2.11"``."""
    parts = re.findall(r"\d+", str(version or "").split("+")[0])
    return ".".join(parts[:2]) if len(parts) >= 2 else str(version)


def gpus_words(head: Rec) -> str:
    n = head.get("gpu_count") or 1
    return f"{COUNT_WORDS.get(n, n)} {head.get('gpu') or 'GPU'}"


def stack_words(head: Rec, cudnn: bool = False, extra: Sequence[str] = ()) -> str:
    """``one NVIDIA H100 80GB HBM3, driver 580.159.04, torch 2.11.0 with CUDA 13.0, TE
    2.20.2`` (and the cuDNN TE runs where ``cudnn``)."""
    s = head.get("stack") or {}
    torch = str(s.get("torch") or "?").split("+")[0]
    parts = [gpus_words(head)]
    if s.get("sm_count"):
        parts[0] += f" ({s['sm_count']} SMs)"
    if s.get("driver"):
        parts.append(f"driver {s['driver']}")
    parts.append(f"torch {torch}" + (f" with CUDA {s['cuda']}" if s.get("cuda") else ""))
    parts.append(f"TE {s.get('te') or '?'}")
    parts += [f"{name} {s[k]}" for k, name in (("triton", "Triton"), ("megatron_core",
              "Megatron-Core"), ("cpu", "host CPU")) if s.get(k)]  # fmt: skip
    parts += list(extra)
    text = ", ".join(parts)
    if cudnn and s.get("cudnn_te"):
        text += f"; cuDNN as TE runs it {s['cudnn_te']}"
    return text


def stack_groups(heads: Sequence[Rec]) -> List[Tuple[Rec, List[Rec]]]:
    """Blocks of one GPU, stack and day together: ``[(first block, blocks)]``."""
    groups: Dict[Tuple[str, str], List[Rec]] = {}
    for h in heads:
        groups.setdefault((stack_words(h), day(h.get("date"))), []).append(h)
    return [(g[0], g) for g in groups.values()]


def strip_out(command: Optional[str]) -> str:
    """A command without its ``--out PATH`` (a scratch file of the run)."""
    return re.sub(r"\s+--out\s+\S+", "", command or "-")


def cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v).replace("|", "\\|")


def table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> List[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return [*out, ""]


def commit_cell(h: Rec) -> str:
    c = h.get("commit") or "-"
    return f"{c} (inferred)" if h.get("commit_inferred") else c


def gpu_short(head: Rec) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``H100``; ``2x H100`` for two."""
    name = re.sub(r"^NVIDIA\s+", "", str(head.get("gpu") or "GPU")).split()[0]
    n = head.get("gpu_count") or 1
    return f"{n}x {name}" if n > 1 else name


def run_cell(head: Rec) -> str:
    """A block's run, compact, for a table's row: ``2026-12-07 H200 fd9fc6f``."""
    return f"{day(head.get('date'))} {gpu_short(head)} {commit_cell(head)}"


# ----------------------------------------------------------------------------- compatibility


def fake_releases(path: Path = ROOT / "tests" / "fakes" / "te_signatures.py") -> List[str]:
    """The TE releases the CPU fakes copy a signature of: ``SIGNATURES``' keys, read from the
    source without importing it."""
    for node in ast.walk(ast.parse(path.read_text())):
        target = (
            node.targets[0]
            if isinstance(node, ast.Assign) and len(node.targets) == 1
            else getattr(node, "target", None)
        )
        if isinstance(target, ast.Name) and target.id == "SIGNATURES":
            value = getattr(node, "value", None)
            if isinstance(value, ast.Dict):
                return [ast.literal_eval(k) for k in value.keys if k is not None]
    raise ValueError(f"no SIGNATURES dict in {path}")


def _numbers(version: str) -> List[int]:
    return [int(x) for x in re.findall(r"\d+", version)]


def _values(heads: Sequence[Rec], field: str, as_release: bool = False) -> str:
    """The stack's ``field`` over ``heads``, each value once, sorted; ``-`` for none."""
    vals = {str(v) for h in heads if (v := (h.get("stack") or {}).get(field))}
    vals = {release_of(v) for v in vals} if as_release else vals
    return ", ".join(sorted(vals, key=_numbers)) or "-"


def _gpus(heads: Sequence[Rec]) -> str:
    return ", ".join(sorted({h.get("gpu") or "?" for h in heads})) or "-"


def _latest(heads: Sequence[Rec]) -> str:
    return max((day(h.get("date")) for h in heads), default="-")


def compatibility(heads: Sequence[Rec], fakes: Sequence[str]) -> List[str]:
    """The compatibility tables: each TE release of the GPU data (``heads``: block records)
    or of the CPU fakes (``fakes``: releases), marked GPU-validated or CPU fakes only; then
    each cuDNN TE ran."""
    by_te: Dict[str, List[Rec]] = {}
    by_cudnn: Dict[str, List[Rec]] = {}
    for h in heads:
        s = h.get("stack") or {}
        if s.get("te"):
            by_te.setdefault(release_of(s["te"]), []).append(h)
        if s.get("cudnn_te"):
            by_cudnn.setdefault(str(s["cudnn_te"]), []).append(h)
    rows = []
    for r in sorted(set(by_te) | set(fakes), key=_numbers, reverse=True):
        hs = by_te.get(r, [])
        rows.append(
            [
                r,
                _values(hs, "te"),
                "GPU-validated" if hs else "CPU fakes only",
                "yes" if r in fakes else "no",
                _values(hs, "torch", as_release=True),
                _values(hs, "cudnn_te"),
                _gpus(hs),
                _latest(hs),
            ]
        )
    head = ["TE release", "TE versions run", "status", "CPU fakes", "torch",
            "cuDNN as TE runs it", "GPUs", "latest GPU run"]  # fmt: skip
    L = table(head, rows)
    rows = [
        [v, ", ".join(dict.fromkeys(f"`{h['build']}`" for h in hs)), "GPU-validated",
         _values(hs, "te"), _gpus(hs), _latest(hs)]
        for v, hs in sorted(by_cudnn.items(), key=lambda kv: _numbers(kv[0]))
    ]  # fmt: skip
    return L + table(
        ["cuDNN as TE runs it", "builds", "status", "TE", "GPUs", "latest GPU run"], rows
    )


COMPAT_LEGEND = (
    "*GPU-validated*: GPU data for this release on the validation page (a block of "
    "`docs/data/validation.jsonl`: the GPU tests, the examples, the context-parallel or the "
    "Megatron-Core check); *CPU fakes only*: no GPU data, but the CPU tests call the wrapper "
    "through a fake of this release's `fused_attn_bwd` signature "
    "(`tests/fakes/te_signatures.py`). torch and cuDNN are only ever GPU-validated: the CPU "
    "tests run on whatever CPU build of torch CI installs."
)


# ----------------------------------------------------------------------------- figures


def pyplot():
    """matplotlib's pyplot, set up for files that do not change from run to run; None
    where matplotlib is not installed (``pip install -e '.[figures]'``)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {
            "svg.hashsalt": "te-gqa-fix",
            "svg.fonttype": "none",
            "font.size": 9,
            "axes.grid": True,
            "grid.alpha": 0.3,
        }
    )
    return plt


def save(fig: Any, path: Path) -> Path:
    """An SVG without a date or matplotlib's version in it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="svg", metadata={"Date": None, "Creator": None})
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
