#!/usr/bin/env python3
"""docs/performance.md and its figures from one data file, docs/data/performance.jsonl
(blocks keyed by build and suite, the suite being the benchmark: see evidence_common.py).

``collect`` turns the JSON files the benchmarks wrote (``bench_step.py``,
``bench_postpass.py``, ``fallback_cost.py``, ``startup_cudnn.py``, any build) into a file of
the blocks that run measured; ``merge`` puts such a file into the data file row by row: a
row replaces only the earlier row of its build, benchmark and row key (``row_key``), and
every row it did not measure again stays, in its own run's block with that run's date,
commit, GPU and stack; ``render`` writes the page (each row with its run) and figures;
``render --check`` fails when the committed page is not what the data gives.

    python3 evidence/performance_report.py collect RAW.json... [--run CMD] -o RUN.jsonl
    python3 evidence/performance_report.py merge RUN.jsonl [--into DATA]
    python3 evidence/performance_report.py render [DATA] [-o PAGE] [--check]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, Hashable, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import evidence_common as ev
from evidence_common import Rec, day

ROOT = ev.ROOT
DATA = ROOT / "docs" / "data" / "performance.jsonl"
PAGE = ROOT / "docs" / "performance.md"
FIGURES = "figures"  # beside the page
ORDER = ("step", "postpass", "fallback", "startup")
BUILDS = ("system", "pip", "route", "cudnn927")
NAMES = {"step": "training step", "postpass": "post-pass", "fallback": "exact fallback",
         "startup": "start-up"}  # fmt: skip
ROWS = {"postpass": "workloads"}  # a benchmark's list of rows, where not "rows"
PLACEHOLDER = "<!-- numbers: regenerate -->"
RUN = "bash evidence/run_benchmarks.sh"


# ----------------------------------------------------------------------------- collect


def blocks_of(doc: Rec, run: str, commit: str) -> List[Rec]:
    """One benchmark's JSON file as a block: its record, then one record per row."""
    bench, build = doc["bench"], doc.get("build") or "-"
    rows_key = ROWS.get(bench, "rows")
    skip = {"bench", "build", "date", "command", "stack", rows_key}
    stack = {**doc.get("stack", {}), "date": (doc.get("stack") or {}).get("date") or doc.get("date")}  # fmt: skip
    head = ev.block_head(build, bench, date=stack["date"], commit=commit,
                         command=doc.get("command"), stack=stack, run=run,
                         params={k: v for k, v in doc.items() if k not in skip})  # fmt: skip
    rows = [{"kind": "row", "build": build, "suite": bench, **r} for r in doc.get(rows_key, [])]
    return [head, *rows]


def collect(paths: List[Path], run: str, commit: str) -> List[Rec]:
    out: List[Rec] = []
    for p in paths:
        out += blocks_of(json.loads(p.read_text()), run, commit)
    return ev.compact(ev.sort_runs(ev.split_blocks(out), ORDER, BUILDS))


def row_key(bench: str, row: Rec) -> Hashable:
    """What one row of a benchmark measured, the same from run to run: a new run's row
    replaces the earlier row of its build with the same key. None for a benchmark not named
    here: a new block of it replaces the earlier ones whole."""
    if bench == "step":
        return row.get("tokens"), row.get("offsets"), row.get("mode", "synced")
    if bench == "postpass":
        return (row.get("name"),)
    if bench == "fallback":
        return row.get("workload") or row.get("tokens"), row.get("variant")
    if bench == "startup":
        return (row.get("module"),)
    return None


def merge(old: List[Rec], new: List[Rec]) -> List[Rec]:
    return ev.merge_rows(old, new, lambda r: row_key(r["suite"], r), ORDER, BUILDS)


def documents(recs: List[Rec]) -> List[Rec]:
    """The blocks as the benchmarks wrote them (their record's fields, the rows under the
    benchmark's own name), each with its ``head``: one per block, several for a (build,
    benchmark) whose rows come from several runs."""
    docs: List[Rec] = []
    for h, rows in ev.split_blocks(recs):
        name = ROWS.get(h["suite"], "rows")
        strip = ("kind", "build", "suite")
        docs.append({**(h.get("params") or {}), "bench": h["suite"], "build": h["build"],
                     "head": h, name: [{x: v for x, v in r.items() if x not in strip}
                                       for r in rows]})  # fmt: skip
    return docs


# The fields that order a benchmark's rows on the page: numbers by value, names in the order
# the runs measured them (the oldest run first).
ROW_ORDER = {"step": ("tokens", "offsets", "mode"), "postpass": ("heads", "tokens"),
             "fallback": ("tokens", "variant"), "startup": ("module",)}  # fmt: skip


def in_order(docs: List[Rec], bench: str) -> List[Tuple[Rec, Rec]]:
    """A benchmark's rows on the page, each with the block (run) it comes from, ``[(doc,
    row)]``: by build, then in the benchmark's own order (``ROW_ORDER``), whichever run a
    row comes from. Of two rows of one key (data not merged), the later run's."""
    docs = [d for d in docs if d["bench"] == bench]
    name = ROWS.get(bench, "rows")
    oldest_first = sorted(docs, key=lambda d: str(d["head"].get("date") or ""))
    fields = ROW_ORDER.get(bench, ())
    seen: Dict[str, Dict[str, int]] = {f: {} for f in fields}
    for d in oldest_first:
        for r in d[name]:
            for f in fields:
                v = r.get(f)
                if not isinstance(v, (int, float)):
                    seen[f].setdefault(json.dumps(v), len(seen[f]))

    def rank(r: Rec) -> Tuple[Any, ...]:
        return tuple((0, v, 0) if isinstance(v := r.get(f), (int, float)) else
                     (1, 0, seen[f][json.dumps(v)]) for f in fields)  # fmt: skip

    out: List[Tuple[Rec, Rec]] = []
    for build in dict.fromkeys(d["build"] for d in docs):
        at: Dict[Hashable, Tuple[Rec, Rec]] = {}
        for n, d in enumerate(x for x in oldest_first if x["build"] == build):
            for i, r in enumerate(d[name]):
                k = row_key(bench, r)
                at[(None, n, i) if k is None else k] = (d, r)
        out += sorted(at.values(), key=lambda dr: rank(dr[1]))
    return out


def merged_words(
    before: List[Tuple[Rec, List[Rec]]], after: List[Tuple[Rec, List[Rec]]], new: List[Rec]
) -> List[str]:
    """What a merge did, a line per block of the run: its rows kept, and what became of the
    earlier blocks of its (build, benchmark)."""
    lines = []
    left = {id(h): rs for h, rs in after}
    for head, rows in ev.split_blocks(new):
        k = ev.key(head)
        mine = next((rs for h, rs in after if h == head), [])
        text = f"{k[0]}/{k[1]}: {len(mine)} of {len(rows)} rows of this run"
        for h, rs in before:
            if ev.key(h) == k and h != head:
                text += f"; {ev.run_cell(h)}: {len(left.get(id(h), []))} of {len(rs)} rows kept"
        lines.append(text)
    return lines


# ----------------------------------------------------------------------------- render


def _fmt(v: Any, unit: str = "", digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}{unit}"
    return f"{v}{unit}"


def _cudnn(v: Any) -> str:
    """TE's ``get_cudnn_version()`` integer (91400) as 9.14.0."""
    return f"{v // 10000}.{v % 10000 // 100}.{v % 100}" if isinstance(v, int) else "-"


def _table(head: List[str], rows: List[List[str]]) -> List[str]:
    return [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(r) + " |" for r in rows),
        "",
    ]


def _missing(how: str) -> List[str]:
    return [PLACEHOLDER, f"Not in the data file yet: `{how}` on the GPU machine.", ""]


def _measured(docs: List[Rec]) -> List[str]:
    """Which run each block of a section comes from: builds, GPU, date, commit."""
    groups: Dict[Tuple[str, str, str], List[str]] = {}
    for d in docs:
        h = d["head"]
        groups.setdefault((ev.gpus_words(h), day(h.get("date")), ev.commit_cell(h)), []).append(d["build"])  # fmt: skip
    if not groups:
        return []
    parts = [f"{', '.join(f'`{b}`' for b in bs)} on {g}, {dt}, commit {c}"
             for (g, dt, c), bs in groups.items()]  # fmt: skip
    return ["Measured: " + "; ".join(parts) + ".", ""]


def _header(docs: List[Rec]) -> List[str]:
    heads = [d["head"] for d in docs]
    te = sorted({(h.get("stack") or {}).get("te") for h in heads} - {None})
    L = [
        "Medians of CUDA-event (device) or `perf_counter` (host) timings after warm-up; every "
        "cost is a difference or ratio to something timed side by side in the same process. "
        "On `system` (cuDNN < 9.18, affected) the wrapper runs its post-pass; on `pip` "
        "(cuDNN 9.19, measured clean at these head dims) it passes through.",
        "",
        "Each row keeps the result of its latest run, with that run's date, GPU, stack and "
        "the commit of the code measured: a new run replaces only the rows it measured again "
        "(the same build and benchmark, and the same tokens, offsets and mode of a training "
        "step, workload of the post-pass, workload and variant of the fallback, module of the "
        "start-up), and every other row stays with its own run. So rows of different runs "
        "can sit side by side in one table, the last column (*run*: date, GPU, commit) naming "
        "each row's; they compare within a run only, and a ratio within a row (x TE's) is to "
        "its own run's reference. How the runs are made: on a GPU machine without network, "
        f"Transformer Engine (TE) {', '.join(te) or '?'} installed there from PyPI wheels "
        "carried in (the run scripts call that staged copy the *GPU kit*); the outputs of each "
        "command come back in one folder (`$OUT` in the scripts) and are merged into the data "
        "file on a CPU machine.",
        "",
        "## Runs",
        "",
    ]
    rows = [[NAMES.get(d["bench"], d["bench"]), d["build"], day(d["head"].get("date")),
             ev.gpus_words(d["head"]), ev.commit_cell(d["head"]),
             f"`{ev.strip_out(d['head'].get('command'))}`",
             str(len(d[ROWS.get(d["bench"], "rows")]))] for d in docs]  # fmt: skip
    L += _table(["benchmark", "build", "date", "GPU", "commit", "command", "rows kept"], rows)
    runs: Dict[Tuple[str, str, str], List[str]] = {}
    for d in docs:
        h = d["head"]
        k = (h.get("run") or "-", day(h.get("date")), ev.gpus_words(h))
        names = runs.setdefault(k, [])
        if NAMES.get(d["bench"], d["bench"]) not in names:
            names.append(NAMES.get(d["bench"], d["bench"]))
    L += ["Run by: " + "; ".join(f"`{r}` ({dt}, {g}: {', '.join(n)})"
                                 for (r, dt, g), n in runs.items()) + ".", ""]  # fmt: skip
    L += ["The stacks, in words:", ""]
    for first, g in ev.stack_groups(heads):
        cud: Dict[str, List[str]] = {}
        for h in g:
            v = (h.get("stack") or {}).get("cudnn_te")
            if v and h["build"] not in cud.setdefault(v, []):
                cud[v].append(h["build"])
        text = f"- {day(first.get('date'))}: {ev.stack_words(first)}"
        if cud:
            text += "; cuDNN as TE runs it: " + ", ".join(
                f"{v} ({', '.join(f'`{b}`' for b in bs)})" for v, bs in cud.items()
            )
        L.append(text + ".")
    return [*L, ""]


def render(recs: List[Rec]) -> str:
    docs = documents(recs)
    by = {b: [d for d in docs if d["bench"] == b] for b in ORDER}
    L = [
        "# Performance",
        "",
        "<!-- Generated by evidence/performance_report.py from docs/data/performance.jsonl; "
        "do not edit. -->",
        "",
    ]
    L += _header(docs)

    L += [
        "## Training step",
        "",
        "TE's `DotProductAttention` forward + backward: THD, GQA 32/8, d 128, bf16, "
        "`padding_causal`, 8 packed sequences with padding. `one`: one offsets tensor for "
        "queries and keys, as self-attention passes them, which the wrapper leaves to TE "
        "(nothing in such a call can need repair); `two`: the keys' offsets a second tensor of "
        "the same values, so an affected stack runs the post-pass on every step. Blocks with "
        "and without `te_gqa_fix.install()` alternate in one process, the garbage collector "
        "run between blocks; added = median over block pairs of the difference of the blocks' "
        "times, with its 95% confidence interval. `synced`: each step timed alone, then a "
        "sync; `back-to-back`: a block's steps with no sync between them, as a training loop "
        "runs them, so host work the GPU cannot hide counts (`benchmarks/bench_step.py`).",
        "",
        *_measured(by["step"]),
    ]
    rows = []
    for d, r in in_order(docs, "step"):
        calls = r["calls_patched"]
        did = (
            "post-pass"
            if calls.get("fixed")
            else ("pass-through" if calls.get("calls") else "not called")
        )
        ci = r.get("added_us_ci95")
        rows.append(
            [
                d["build"],
                str(r["tokens"]),
                r.get("offsets", "-"),
                r.get("mode", "synced"),
                _fmt(r["step_ms"], " ms", 3),
                _fmt(r["added_us"], " us"),
                _fmt(r["added_pct"], "%", 2),
                f"{_fmt(ci[0])} .. {_fmt(ci[1])} us" if ci else "-",
                str(r.get("pairs", "-")),
                did,
                ev.run_cell(d["head"]),
            ]
        )
    L += (
        _table(
            [
                "build",
                "tokens",
                "offsets",
                "mode",
                "step",
                "added per step",
                "% of step",
                "95% CI",
                "pairs",
                "wrapper",
                "run",
            ],
            rows,
        )
        if rows
        else _missing(RUN)
    )

    L += [
        "## Post-pass device time",
        "",
        "TE's `fused_attn_bwd` and the post-pass alone on its gradients "
        "(`zero_dead_rows`, Triton kernel and PyTorch path), interleaved while the GPU is held "
        "busy, so the events read device time. Write bound: the zeros the post-pass must write "
        "over the device's copy bandwidth measured in the same run "
        "(`benchmarks/bench_postpass.py`).",
        "",
        *_measured(by["postpass"]),
    ]
    rows = []
    for d, w in in_order(docs, "postpass"):
        dev = w["device_us"]
        bound_us = w["bytes_to_write"] / d["copy_GBps"] / 1e3
        rows.append(
            [
                d["build"],
                w["name"],
                str(w["tokens"]),
                w["heads"],
                _fmt(dev["bwd"] / 1e3, " ms", 2),
                _fmt(dev["postpass_triton"], " us"),
                _fmt(100 * dev["postpass_triton"] / dev["bwd"], "%", 2),
                _fmt(dev.get("postpass_torch"), " us"),
                _fmt(w["bytes_to_write"] / 1e6, " MB"),
                _fmt(dev["postpass_triton"] / bound_us, "x", 2),
                ev.run_cell(d["head"]),
            ]
        )
    L += (
        _table(
            [
                "build",
                "workload",
                "tokens",
                "heads q/kv",
                "fused_attn_bwd",
                "post-pass (Triton)",
                "% of bwd",
                "post-pass (PyTorch)",
                "zeros",
                "/ write bound",
                "run",
            ],
            rows,
        )
        if rows
        else _missing(RUN)
    )

    L += [
        "## Host time of the wrapper",
        "",
        "`wrapper_for(stub)` against `stub`, a function with TE's signature that returns real "
        "gradients at once, called by position as TE calls `fused_attn_bwd`, on one CPU; median "
        "over rounds of the difference within a round. With the post-pass it includes the kernel "
        "launch (where the table shows it, the launch alone through Triton's launch path, timed "
        "in the same rounds); pass-through does no device work. The stub's own time tracks the "
        "host's speed, which varies from row to row within a run.",
        "",
    ]
    rows = []
    # where some runs timed the launch alone: "-" in the rows of the others
    launched = any("launch" in w["host_us"] for _, w in in_order(docs, "postpass"))
    for d, w in in_order(docs, "postpass"):
        h = w["host_us"]
        ok = {
            m: ("" if (h["did"][m].get("fixed") == (m == "postpass")) else " (mode check failed)")
            for m in ("postpass", "passthrough")
        }
        rows.append(
            [
                d["build"],
                w["name"],
                _fmt(h["stub"], " us"),
                "+" + _fmt(h["postpass"], " us") + ok["postpass"],
                *([_fmt(h.get("launch"), " us")] if launched else []),
                "+" + _fmt(h["passthrough"], " us") + ok["passthrough"],
                w["passthrough_via"],
                ev.run_cell(d["head"]),
            ]
        )
    head = ["build", "workload", "stub", "post-pass", "pass-through", "pass-through via", "run"]
    if launched and rows:
        head.insert(4, "of it, Triton's launch")
    L += _table(head, rows) if rows else _missing(RUN)
    if rows:
        L += [
            "![Post-pass device time (Triton and PyTorch) and the wrapper's host cost against "
            f"tokens]({FIGURES}/performance-postpass.svg)",
            "",
        ]

    L += [
        "## The exact fallback",
        "",
        "Head dim 256, GQA 16/4, bf16, 8 packed `padding_causal` sequences without padding, "
        "the valid offsets passed as the padded ones, as DotProductAttention passes them. TE's "
        "`fused_attn_bwd` on the cuDNN TE runs (`deterministic=False`: the base of every ratio, "
        "and `True`), next to the wrapper's call where cuDNN is wrong on live rows, made as "
        "DotProductAttention makes it: FlashAttention-2's backward fed TE's output and softmax "
        "statistics, then the post-pass, with one offsets tensor, and with two (`split`: "
        "top-left causal across two offsets tensors, as context parallelism passes them; one "
        "backward on the keys moved to their queries' rows), each not deterministic and "
        "deterministic (bitwise repeatable: two calls compared); and with the forward "
        "recomputed, for statistics of an unknown layout. CUDA events, medians over rounds in "
        "which the variants take turns (`benchmarks/fallback_cost.py`): *synced* is one call "
        "then a sync (the host's time before the first kernel counts), *back to back* a block "
        "of calls (the host's time hidden, as in a step where the GPU is the bottleneck). "
        "Each row's x TE's is its time over the `te` row of its own run (the benchmark "
        "stores it), so a variant measured again keeps the ratio to the `te` it ran beside.",
        "",
        *_measured(by["fallback"]),
    ]
    rows = []
    for d, r in in_order(docs, "fallback"):
        cells: List[str] = []
        for mode in ("synced", "back-to-back"):
            ms, x = (r.get("ms") or {}).get(mode), (r.get("x_te") or {}).get(mode)
            cells += [r.get("error") or _fmt(ms, " ms", 3), _fmt(x, "x", 2)]
        repeatable = {True: "yes", False: "NO"}.get(r.get("bitwise_repeatable"), "-")
        rows.append([d["build"], r["workload"], r["variant"], *cells, repeatable,
                     ev.run_cell(d["head"])])  # fmt: skip
    head = ["build", "tokens", "backward", "synced", "x TE's", "back to back", "x TE's"]
    L += _table([*head, "bitwise repeatable", "run"], rows) if rows else _missing(RUN)
    if rows:
        L += [
            "![The fallback's time as a multiple of TE's backward against tokens, per variant]"
            f"({FIGURES}/performance-fallback.svg)",
            "",
        ]

    L += [
        "## Start-up with `TE_GQA_FIX_CUDNN=auto`",
        "",
        "Fresh processes, unset and `auto` alternating, median of each: the import alone "
        "(timed inside the process) and the whole process (start to exit); the installed "
        "start-up hook loads the fixed cuDNN first (`benchmarks/startup_cudnn.py`).",
        "",
        *_measured(by["startup"]),
    ]
    rows = []
    for d, r in in_order(docs, "startup"):
        te = {k: _cudnn(v) for k, v in (r.get("te_cudnn") or {}).items()}
        for what in ("import", "process"):
            t = r[what]
            rows.append(
                [
                    f"`import {r['module']}`",
                    what,
                    _fmt(t["unset"], " ms", 0),
                    _fmt(t["auto"], " ms", 0),
                    _fmt(t["added"], " ms", 0),
                    f"{te.get('unset', '-')} -> {te.get('auto', '-')}",
                    ev.run_cell(d["head"]),
                ]
            )
    L += (
        _table(["import", "timed", "unset", "auto", "added", "cuDNN TE runs", "run"], rows)
        if rows
        else _missing(RUN)
    )

    L += [
        "## Workloads of the post-pass benchmark",
        "",
        "8 sequences of 22, 8, 18, 5, 15, 12, 10 and 10% of the buffer, as a context-parallel "
        "rank sees them: sequences 1 and 4 have no queries on this step (their KV rows are the "
        "ones the bug corrupts), sequence 3 half of them; each padded to a multiple of 4, two "
        "with an extra gap; about 3% tail rows. Mask `padding_causal_bottom_right`, d 128, bf16. "
        "`llama8b-*`: 32/8 heads; `mqa-*`: 16/1.",
        "",
        "## Regenerate",
        "",
        "```bash",
        "# GPU machine, repository root, TE installed as above; PARTS=... and BUILDS=... pick",
        "# what runs (see the script). Writes $OUT/performance.jsonl: the blocks this run measured.",
        RUN,
        "# CPU machine, with that file back: replace the rows it measured again (each keeps",
        "# its run), keep the rest, then write this page and docs/figures/performance-*.svg.",
        "python3 evidence/performance_report.py merge $OUT/performance.jsonl",
        "python3 evidence/performance_report.py render",
        "python3 evidence/performance_report.py render --check    # the page is what the data gives",
        "```",
    ]
    return "\n".join(L) + "\n"


# ----------------------------------------------------------------------------- figures


def _runs_title(docs: List[Rec]) -> str:
    """Which run each plotted block comes from, for a figure's title."""
    groups: Dict[str, List[str]] = {}
    for d in docs:
        h = d["head"]
        k = f"{ev.gpus_words(h)}, {day(h.get('date'))}, commit {ev.commit_cell(h)}"
        groups.setdefault(k, []).append(d["build"])
    return "; ".join(f"{', '.join(bs)}: {k}" for k, bs in groups.items())


def _tokens_axis(ax: Any, tokens: Sequence[int]) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted(set(tokens))
    ax.set_xticks(ticks, [f"{t // 1024}K" if t % 1024 == 0 else str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("tokens")


def _plotted(docs: List[Rec], bench: str) -> List[Tuple[Rec, List[Rec], bool]]:
    """The blocks a figure draws, each with the rows the page shows of it (the latest of
    each row key) and whether it is the latest block of its build (drawn with filled
    markers; earlier runs' rows hollow). A line joins rows of one run only."""
    shown = in_order(docs, bench)
    out = []
    for d in (d for d in docs if d["bench"] == bench):
        rows = [r for e, r in shown if e is d]
        if rows:
            newest = all(str(e["head"].get("date") or "") <= str(d["head"].get("date") or "")
                         for e, _ in shown if e["build"] == d["build"])  # fmt: skip
            out.append((d, rows, newest))
    return out


def draw_figures(recs: List[Rec], folder: Path) -> List[Path]:
    """The performance page's figures, as SVG files in ``folder``; [] without matplotlib."""
    plt = ev.pyplot()
    if plt is None:
        return []
    docs = documents(recs)
    out = []
    post = _plotted(docs, "postpass")
    if post:
        n = sum(len({w["heads"] for w in ws}) for _, ws, _ in post)  # lines per panel: 2n
        fig, (dev, host) = plt.subplots(1, 2, figsize=(10, 4.4 + 0.2 * n), layout="constrained")
        markers: Dict[str, str] = {}
        colours = {b: f"C{i}" for i, b in enumerate(dict.fromkeys(d["build"] for d, _, _ in post))}
        several = len({id(d) for d, _, _ in post}) > len(colours)
        tokens = [w["tokens"] for _, ws, _ in post for w in ws]
        for d, rows, newest in post:
            colour, face = colours[d["build"]], {} if newest else {"markerfacecolor": "none"}
            for heads in dict.fromkeys(w["heads"] for w in rows):
                ws = sorted((w for w in rows if w["heads"] == heads), key=lambda w: w["tokens"])
                m = markers.setdefault(heads, "os^vD"[len(markers) % 5])
                toks = [w["tokens"] for w in ws]
                what = f"{heads}, {d['build']}"
                what += f", {ev.run_cell(d['head'])}" if several else ""
                dev.plot(toks, [w["device_us"]["postpass_triton"] for w in ws], color=colour,
                         marker=m, label=f"Triton kernel, {what}", **face)  # fmt: skip
                dev.plot(toks, [w["device_us"].get("postpass_torch") for w in ws], color=colour,
                         marker=m, linestyle="--", label=f"PyTorch path, {what}", **face)  # fmt: skip
                host.plot(toks, [w["host_us"]["postpass"] for w in ws], color=colour, marker=m,
                          label=f"with the post-pass, {what}", **face)  # fmt: skip
                host.plot(toks, [w["host_us"]["passthrough"] for w in ws], color=colour,
                          marker=m, linestyle=":", label=f"pass-through, {what}", **face)  # fmt: skip
        dev.set_yscale("log")
        dev.set_ylabel("device time (us)")
        dev.set_title("post-pass device time")
        host.set_ylabel("added host time per call (us)")
        host.set_title("wrapper's host cost over TE's call")
        for ax in (dev, host):
            _tokens_axis(ax, tokens)
            ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.14))  # below
        fig.suptitle(_runs_title([d for d, _, _ in post]), fontsize=8)
        out.append(ev.save(fig, folder / "performance-postpass.svg"))
    fb = _plotted(docs, "fallback")
    if fb:
        n = sum(len({r["variant"] for r in rows}) for _, rows, _ in fb)  # legend entries
        fig, axes = plt.subplots(
            1, 2, figsize=(10, 4.0 + 0.07 * n), sharey=True, layout="constrained"
        )
        tokens = [r["tokens"] for _, rows, _ in fb for r in rows]
        variants = list(dict.fromkeys(r["variant"] for _, rows, _ in fb for r in rows))
        builds = list(dict.fromkeys(d["build"] for d, _, _ in fb))
        several = len(fb) > len(builds)
        for ax, mode in zip(axes, ("synced", "back-to-back")):
            for d, rows, newest in fb:
                face = {} if newest else {"markerfacecolor": "none"}
                for v in dict.fromkeys(r["variant"] for r in rows):
                    j = variants.index(v)
                    pts = sorted((r["tokens"], (r.get("x_te") or {}).get(mode)) for r in rows
                                 if r["variant"] == v and (r.get("x_te") or {}).get(mode) is not None)  # fmt: skip
                    label = v + (f" ({d['build']})" if len(builds) > 1 else "")
                    label += f", {ev.run_cell(d['head'])}" if several else ""
                    if pts:
                        ax.plot(*zip(*pts), marker="os^vD<>p"[j % 8], color=f"C{j}",
                                linestyle=["-", "--", ":"][builds.index(d["build"]) % 3],
                                label=label, **face)  # fmt: skip
            _tokens_axis(ax, tokens)
            ax.set_title(f"{mode}: time / TE's backward")
            ax.axhline(1.0, color="black", linewidth=0.8)
        axes[0].set_ylabel("x TE's backward (deterministic=False)")
        handles, labels = axes[0].get_legend_handles_labels()  # both panels plot the same
        fig.legend(handles, labels, fontsize=6, loc="outside lower center", ncol=3)  # below
        fig.suptitle(_runs_title([d for d, _, _ in fb]), fontsize=8)
        out.append(ev.save(fig, folder / "performance-fallback.svg"))
    return out


# ----------------------------------------------------------------------------- main


def check(data: Path = DATA, page: Path = PAGE) -> bool:
    """Whether ``page`` is exactly what ``data`` renders to (figures are not compared: their
    bytes depend on matplotlib's release)."""
    return page.exists() and page.read_text() == render(ev.read_jsonl(data))


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="step", required=True)
    co = sub.add_parser("collect", help="the benchmarks' JSON files -> a file of their blocks")
    co.add_argument("raw", type=Path, nargs="+")
    co.add_argument("--run", default=RUN, help="the run script's command line")
    co.add_argument("--commit", default=None, help="the code measured (default: COMMIT or git)")
    co.add_argument("-o", "--output", type=Path, required=True)
    me = sub.add_parser("merge", help="a run's blocks -> the data file, replacing those blocks")
    me.add_argument("run", type=Path, nargs="+")
    me.add_argument("--into", type=Path, default=DATA)
    re_ = sub.add_parser("render", help="the data file -> the page and figures")
    re_.add_argument("data", type=Path, nargs="?", default=DATA)
    re_.add_argument("-o", "--output", type=Path, default=PAGE)
    re_.add_argument("--check", action="store_true", help="exit 1 if the page differs")
    re_.add_argument("--no-figures", action="store_true")
    a = ap.parse_args(argv)
    if a.step == "collect":
        recs = collect(a.raw, a.run, a.commit or ev.code_commit())
        ev.write_jsonl(recs, a.output)
        print(f"{a.output}: " + ", ".join(f"{b}/{s}" for b, s in ev.blocks(recs)))
        return 0
    if a.step == "merge":
        recs = ev.read_jsonl(a.into)
        for p in a.run:
            new = ev.read_jsonl(p)
            before = ev.split_blocks(recs)
            recs = merge(recs, new)
            for line in merged_words(before, ev.split_blocks(recs), new):
                print(f"{p}: {line}")
        ev.write_jsonl(recs, a.into)
        return 0
    if a.check:
        ok = check(a.data, a.output)
        if not ok:
            print(f"{a.output} is not what {a.data} renders to: run {Path(__file__).name} render")
        return 0 if ok else 1
    recs = ev.read_jsonl(a.data)
    a.output.write_text(render(recs))
    if not a.no_figures:
        drawn = draw_figures(recs, a.output.parent / FIGURES)
        print(f"figures: {', '.join(str(p) for p in drawn) or 'none (pip install matplotlib)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
