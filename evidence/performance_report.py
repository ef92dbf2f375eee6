#!/usr/bin/env python3
"""docs/performance.md and its figures from one data file, docs/data/performance.jsonl
(blocks keyed by build and suite, the suite being the benchmark: see evidence_common.py).

``collect`` turns the JSON files the benchmarks wrote (``bench_step.py``,
``bench_postpass.py``, ``fallback_cost.py``, ``startup_cudnn.py``, any build) into a file of
the blocks that run measured; ``merge`` puts such a file into the data file, replacing only
the (build, benchmark) blocks it holds; ``render`` writes the page and figures;
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
from typing import Any, Dict, List, Optional, Sequence, Tuple

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
    return ev.compact(ev.sort_blocks(out, ORDER, BUILDS))


def merge(old: List[Rec], new: List[Rec]) -> List[Rec]:
    return ev.merge(old, new, ORDER, BUILDS)


def documents(recs: List[Rec]) -> List[Rec]:
    """The blocks as the benchmarks wrote them (their record's fields, the rows under the
    benchmark's own name), each with its ``head``."""
    docs: Dict[Tuple[str, str], Rec] = {}
    for r in recs:
        k = ev.key(r)
        if r["kind"] == ev.BLOCK:
            docs[k] = {**(r.get("params") or {}), "bench": r["suite"], "build": r["build"],
                       "head": r, ROWS.get(r["suite"], "rows"): []}  # fmt: skip
        else:
            row = {x: v for x, v in r.items() if x not in ("kind", "build", "suite")}
            docs[k][ROWS.get(r["suite"], "rows")].append(row)
    return list(docs.values())


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
        "Each benchmark and build keeps the results of its latest run, with that run's date, "
        "GPU and the commit of the code measured: a new run replaces only the blocks it "
        "measured again, so numbers from different runs sit side by side below and compare "
        "within a run only. How the runs are made: on a GPU machine without network, "
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
             f"`{ev.strip_out(d['head'].get('command'))}`"] for d in docs]  # fmt: skip
    L += _table(["benchmark", "build", "date", "GPU", "commit", "command"], rows)
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
    for d in by["step"]:
        for r in d["rows"]:
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
    for d in by["postpass"]:
        for w in d["workloads"]:
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
    launched = all("launch" in w["host_us"] for d in by["postpass"] for w in d["workloads"])
    for d in by["postpass"]:
        for w in d["workloads"]:
            h = w["host_us"]
            ok = {
                m: (
                    ""
                    if (h["did"][m].get("fixed") == (m == "postpass"))
                    else " (mode check failed)"
                )
                for m in ("postpass", "passthrough")
            }
            rows.append(
                [
                    d["build"],
                    w["name"],
                    _fmt(h["stub"], " us"),
                    "+" + _fmt(h["postpass"], " us") + ok["postpass"],
                    *([_fmt(h["launch"], " us")] if launched else []),
                    "+" + _fmt(h["passthrough"], " us") + ok["passthrough"],
                    w["passthrough_via"],
                ]
            )
    head = ["build", "workload", "stub", "post-pass", "pass-through", "pass-through via"]
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
        "of calls (the host's time hidden, as in a step where the GPU is the bottleneck).",
        "",
        *_measured(by["fallback"]),
    ]
    rows = []
    for d in by["fallback"]:
        for r in d["rows"]:
            cells: List[str] = []
            for mode in ("synced", "back-to-back"):
                ms, x = (r.get("ms") or {}).get(mode), (r.get("x_te") or {}).get(mode)
                cells += [r.get("error") or _fmt(ms, " ms", 3), _fmt(x, "x", 2)]
            repeatable = {True: "yes", False: "NO"}.get(r.get("bitwise_repeatable"), "-")
            rows.append([d["build"], r["workload"], r["variant"], *cells, repeatable])
    head = ["build", "tokens", "backward", "synced", "x TE's", "back to back", "x TE's"]
    L += _table([*head, "bitwise repeatable"], rows) if rows else _missing(RUN)
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
    for d in by["startup"]:
        for r in d["rows"]:
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
                    ]
                )
    L += (
        _table(["import", "timed", "unset", "auto", "added", "cuDNN TE runs"], rows)
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
        "# CPU machine, with that file back: replace those (build, benchmark) blocks, keep the",
        "# rest, then write this page and docs/figures/performance-*.svg.",
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


def draw_figures(recs: List[Rec], folder: Path) -> List[Path]:
    """The performance page's figures, as SVG files in ``folder``; [] without matplotlib."""
    plt = ev.pyplot()
    if plt is None:
        return []
    docs = documents(recs)
    out = []
    post = [d for d in docs if d["bench"] == "postpass" and d["workloads"]]
    if post:
        fig, (dev, host) = plt.subplots(1, 2, figsize=(10, 4.6))
        markers: Dict[str, str] = {}
        tokens = [w["tokens"] for d in post for w in d["workloads"]]
        for i, d in enumerate(post):
            colour = f"C{i}"
            for heads in dict.fromkeys(w["heads"] for w in d["workloads"]):
                ws = sorted((w for w in d["workloads"] if w["heads"] == heads), key=lambda w: w["tokens"])  # fmt: skip
                m = markers.setdefault(heads, "os^vD"[len(markers) % 5])
                toks = [w["tokens"] for w in ws]
                what = f"{heads}, {d['build']}"
                dev.plot(toks, [w["device_us"]["postpass_triton"] for w in ws], color=colour,
                         marker=m, label=f"Triton kernel, {what}")  # fmt: skip
                dev.plot(toks, [w["device_us"].get("postpass_torch") for w in ws], color=colour,
                         marker=m, linestyle="--", label=f"PyTorch path, {what}")  # fmt: skip
                host.plot(toks, [w["host_us"]["postpass"] for w in ws], color=colour, marker=m,
                          label=f"with the post-pass, {what}")  # fmt: skip
                host.plot(toks, [w["host_us"]["passthrough"] for w in ws], color=colour,
                          marker=m, linestyle=":", label=f"pass-through, {what}")  # fmt: skip
        dev.set_yscale("log")
        dev.set_ylabel("device time (us)")
        dev.set_title("post-pass device time")
        host.set_ylabel("added host time per call (us)")
        host.set_title("wrapper's host cost over TE's call")
        for ax in (dev, host):
            _tokens_axis(ax, tokens)
            ax.legend(fontsize=6, loc="upper left")
        fig.suptitle(_runs_title(post), fontsize=8)
        fig.tight_layout()
        out.append(ev.save(fig, folder / "performance-postpass.svg"))
    fb = [d for d in docs if d["bench"] == "fallback" and d["rows"]]
    if fb:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
        tokens = [r["tokens"] for d in fb for r in d["rows"]]
        for ax, mode in zip(axes, ("synced", "back-to-back")):
            for i, d in enumerate(fb):
                variants = list(dict.fromkeys(r["variant"] for r in d["rows"]))
                for j, v in enumerate(variants):
                    pts = sorted((r["tokens"], (r.get("x_te") or {}).get(mode)) for r in d["rows"]
                                 if r["variant"] == v and (r.get("x_te") or {}).get(mode) is not None)  # fmt: skip
                    if pts:
                        ax.plot(*zip(*pts), marker="os^vD<>p"[j % 8], color=f"C{j}",
                                linestyle=["-", "--", ":"][i % 3],
                                label=v + (f" ({d['build']})" if len(fb) > 1 else ""))  # fmt: skip
            _tokens_axis(ax, tokens)
            ax.set_title(f"{mode}: time / TE's backward")
            ax.axhline(1.0, color="black", linewidth=0.8)
        axes[0].set_ylabel("x TE's backward (deterministic=False)")
        axes[0].legend(fontsize=6, loc="upper left")
        fig.suptitle(_runs_title(fb), fontsize=8)
        fig.tight_layout()
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
            recs = merge(recs, new)
            print(f"{p}: replaced " + ", ".join(f"{b}/{s}" for b, s in ev.blocks(new)))
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
