"""`met bench`'s report: the printed table, the markdown tables of docs/benchmarks.md and the
PNG chart, all from the report dict `tools.bench.run.measure` builds."""

from __future__ import annotations

import sys
from pathlib import Path

from protos.params import DFLASH, MTP, NONE, PROMPT_LOOKUP
from tools.bench.choice import lines as choice_lines
from tools.bench.depth import depth_lines, depth_table
from tools.bench.llama_cpp import lines as llama_lines
from tools.bench.methods import MTP_AUTO
from tools.bench.prefix import prefix_lines, prefix_table


def markdown(report: dict) -> str:
    """The report as the tables of docs/benchmarks.md."""
    m = report["machine"]
    out = [
        f"Model `{report['model']}`; {m['cpu']}, {m['cores']} cores; Python {m['python']}, "
        f"torch {m['torch']}, engine at {m['engine_threads']} thread(s).",
        "",
        "| method | concurrent | tok/s (in process) | mean accepted length | acceptance "
        "by position | identical to none |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["methods"]:
        acc = ", ".join(f"{a:.2f}" for a in r["acceptance_per_position"]) or "-"
        out.append(
            f"| {r['method']} | {r['concurrency']} | {r['tok_s']:.1f} | "
            f"{r['accepted_length']:.2f} | {acc} | {'yes' if r['identical'] else 'NO'} |"
        )
    out += _split_tables(report)
    out += [
        "",
        "| verify (steps unpipelined) | concurrent | tok/s | decode-phase tok/s | step ms |",
        "|---|---|---|---|---|",
    ]
    for r in report["batch_vs_serial"]:
        out.append(
            f"| {r['verify']} | {r['concurrency']} | {r['tok_s']:.1f} | "
            f"{r['decode_tok_s']:.1f} | {r['step_ms']:.1f} |"
        )
    mem = report["memory"]
    out += [
        "",
        f"Verify buffers: {mem['tiered_bytes'] / 2**20:.2f} MiB with tiers `{mem['tiers']}`, "
        f"{mem['full_capacity_bytes'] / 2**20:.2f} MiB with every slot at full capacity.",
    ]
    if "tracing" in report:
        t = report["tracing"]
        out.append(
            f"Tracing, both processes, {t['concurrency']} concurrent: "
            f"{t['disabled_tok_s']:.1f} tok/s disabled, {t['exported_tok_s']:.1f} exporting "
            f"to a local OTLP receiver ({t['spans']} spans); {overlap_line(t['overlap'])}."
        )
    out += _against(report)
    out += ["", *(f"- {line}" for line in figure_lines(report))]
    if "choice" in report:
        out += ["", "```", *choice_lines(report["choice"]), "```"]
    if "breakdown" in report:
        out += ["", "```", *breakdown_lines(report["breakdown"]), "```"]
    out += depth_table(report.get("depth"))
    out += prefix_table(report.get("prefix_cache"))
    out += _replicas_table(report.get("replicas", []))
    out += tensor_parallel_table(report.get("tensor_parallel", []))
    return "\n".join(out) + "\n"


def _replicas_table(rows: list[dict]) -> list[str]:
    """One service under a plain scheduler, under a router, and N services under a router."""
    if not rows:
        return []
    n = rows[0]["replicas"]
    out = [
        "",
        f"| method | concurrent | tok/s single | router, 1 replica | router_1 / single | "
        f"router, {n} replicas | router_{n} / router_1 | requests per replica | identical |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        split = "/".join(map(str, r["requests_by_replica"]))
        out.append(
            f"| {r['method']} | {r['concurrency']} | {r['single_tok_s']:.1f} | "
            f"{r['router_1_tok_s']:.1f} | {r['router_1_over_single']:.2f}x | "
            f"{r['router_n_tok_s']:.1f} | {r['router_n_over_router_1']:.2f}x | {split} | "
            f"{'yes' if r['identical'] else 'NO'} |"
        )
    return [*out, "", _replicas_note(rows[0])]


def replicas_lines(rows: list[dict]) -> list[str]:
    """The replicas section's rows as printed lines, and what its multi-replica figure means."""
    lines = [
        f"replicas {r['method']} at {r['concurrency']}: single {r['single_tok_s']:6.1f} tok/s, "
        f"router_1 {r['router_1_tok_s']:6.1f} ({r['router_1_over_single']:.2f}x single), "
        f"router_{r['replicas']} {r['router_n_tok_s']:6.1f} "
        f"({r['router_n_over_router_1']:.2f}x router_1; requests per replica "
        f"{'/'.join(map(str, r['requests_by_replica']))}); identical {r['identical']}; "
        f"placing a request {r['router_1_submit_us']:.0f} us through the router, "
        f"{r['single_submit_us']:.0f} us direct ({r['routing_share'] * 100:.2f}% of the run)"
        for r in rows
    ]
    return [*lines, _replicas_note(rows[0])] if rows else lines


def _replicas_note(row: dict) -> str:
    n = row["replicas"]
    return (
        f"note: the {n} GPU services share this machine's {row['cores']} cores and its device, "
        f"so router_{n} / router_1 measures routing, not scaling"
    )


def tensor_parallel_table(rows: list[dict]) -> list[str]:
    """One service at TP 1, at TP N summing in rank order, and at TP N through the backend's
    all-reduce."""
    if not rows:
        return []
    n = rows[0]["size"]
    out = [
        "",
        f"| method | concurrent | tok/s TP 1 | TP {n} ordered | ordered / TP 1 | "
        f"TP {n} nccl-style | nccl / TP 1 | ordered costs | one reduction, ordered / nccl (us) | "
        "identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        us = r["reduce_us"]
        out.append(
            f"| {r['method']} | {r['concurrency']} | {r['tp_1_tok_s']:.1f} | "
            f"{r['ordered_tok_s']:.1f} | {r['ordered_over_tp_1']:.2f}x | {r['nccl_tok_s']:.1f} | "
            f"{r['nccl_over_tp_1']:.2f}x | {r['ordered_cost'] * 100:+.1f}% | "
            f"{us['ordered']:.0f} / {us['nccl']:.0f} | {_identical(r)} |"
        )
    return [*out, "", _tensor_parallel_note(rows[0])]


def tensor_parallel_lines(rows: list[dict]) -> list[str]:
    """The tensor-parallel section's rows as printed lines, and what TP N over TP 1 means."""
    lines = []
    for r in rows:
        n, us = r["size"], r["reduce_us"]
        lines.append(
            f"tensor parallel {r['method']} at {r['concurrency']}: TP 1 {r['tp_1_tok_s']:6.1f} "
            f"tok/s, TP {n} ordered {r['ordered_tok_s']:6.1f} ({r['ordered_over_tp_1']:.2f}x "
            f"TP 1), TP {n} nccl-style {r['nccl_tok_s']:6.1f} ({r['nccl_over_tp_1']:.2f}x TP 1); "
            f"ordered costs {r['ordered_cost'] * 100:+.1f}% against nccl-style; one reduction "
            f"of [{r['reduce_rows']}, {r['hidden']}] fp32: {us['ordered']:.0f} us ordered, "
            f"{us['nccl']:.0f} us nccl-style; identical {_identical(r)}"
        )
    return [*lines, _tensor_parallel_note(rows[0])] if rows else lines


def _identical(row: dict) -> str:
    return "yes" if row["identical"] else f"NO ({', '.join(row['differs'])} differ from TP 1)"


def _tensor_parallel_note(row: dict) -> str:
    n = row["size"]
    return (
        f"note: the {n} ranks share this machine's {row['cores']} cores, one thread each, and "
        f"reduce over gloo; nccl-style is gloo's all-reduce, ordered gathers and sums in rank "
        "order (a row's bytes independent of its batch)"
    )


def _split_tables(report: dict) -> list[str]:
    """In process against over gRPC per method, pipelined and not, then mtp over none."""
    out = [
        "",
        "| method | concurrent | tok/s in process | tok/s over gRPC | gRPC / in process | "
        "unpipelined: in process | over gRPC | gRPC / in process | "
        "service idle between steps (gRPC, pipelined) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["split"]:
        out.append(
            f"| {r['method']} | {r['concurrency']} | {r['in_process_tok_s']:.1f} | "
            f"{r['grpc_tok_s']:.1f} | {r['grpc_over_in_process']:.2f}x | "
            f"{r['in_process_unpipelined_tok_s']:.1f} | {r['grpc_unpipelined_tok_s']:.1f} | "
            f"{r['grpc_over_in_process_unpipelined']:.2f}x | {r['grpc_idle'] * 100:.1f}% |"
        )
    out += [
        "",
        "| concurrent | mtp / none in process | mtp / none over gRPC (both pipelined) |",
        "|---|---|---|",
    ]
    for r in report["speedup"]:
        out.append(f"| {r['concurrency']} | {r['in_process']:.2f}x | {r['grpc']:.2f}x |")
    return out


def overlap_line(o: dict) -> str:
    """`overlaps`' figures in a sentence."""
    line = (
        f"steps overlapping across the processes: {o['overlapping']} of the service's "
        f"{o['steps']} steps (`engine.plan` spans) ran while the control plane had opened a "
        "later step's `step_mtp`"
    )
    if o["first"] is not None:
        f = o["first"]
        line += (
            f" (the first: a {f['step_ms']:.1f} ms step, the later one opened "
            f"{f['next_step_opened_at_ms']:.1f} ms into it)"
        )
    return line


def split_lines(rows: list[dict]) -> list[str]:
    """The split's rows as printed lines."""
    return [
        f"split {r['method']:4} at {r['concurrency']}: pipelined {r['in_process_tok_s']:6.1f} "
        f"tok/s in process, {r['grpc_tok_s']:6.1f} over gRPC "
        f"({r['grpc_over_in_process']:.2f}x; service idle {r['grpc_idle'] * 100:.1f}% "
        f"between steps); unpipelined {r['in_process_unpipelined_tok_s']:6.1f} in process, "
        f"{r['grpc_unpipelined_tok_s']:6.1f} over gRPC "
        f"({r['grpc_over_in_process_unpipelined']:.2f}x)"
        for r in rows
    ]


def figure_lines(report: dict) -> list[str]:
    """A draft's cost against a target step, the speedup the accepted length predicts against
    the measured one (`tools.bench.predict`), and transformers' static batch
    against ours, where measured: lines printed and in the markdown alike."""
    lines = [_draft_line(report["draft_cost"]), _prediction_line(report["prediction"])]
    if "transformers_generate_batch" in report:
        lines.append(_batch_line(report["transformers_generate_batch"]))
    return lines


def _draft_line(c: dict) -> str:
    return (
        f"draft cost at 1 request: target step {c['target_step_ms']:.2f} ms (a plain decode "
        f"step: verify and verdict), one MTP draft {c['draft_ms']:.2f} ms: "
        f"{c['draft_over_step'] * 100:.1f}% of a step (slope through depth 0 over depths "
        f"1..{c['max_depth']}, medians of {c['repeats']} repeats)"
    )


def _prediction_line(p: dict) -> str:
    grpc = (
        f", {p['measured_grpc']:.2f}x over gRPC ({p['deviation_grpc'] * 100:+.1f}%)"
        if "measured_grpc" in p
        else ""
    )
    return (
        f"mtp / none at 1 predicted from accepted length {p['accepted_length']:.2f} and "
        f"{p['drafts_per_verify']:.2f} drafts per verify ({p['drafts_from']}), an mtp step of "
        f"{p['mtp_step_ms']:.2f} ms: {p['predicted']:.2f}x; measured "
        f"{p['measured_in_process']:.2f}x in process ({p['deviation_in_process'] * 100:+.1f}%)"
        + grpc
    )


def _batch_line(b: dict) -> str:
    n = b["batch"]
    ours = ", ".join(
        f"{m} {v:.1f} ({b['in_process'][m]:.2f}x)" for m, v in b["in_process_tok_s"].items()
    )
    grpc = ", ".join(f"{m} {v:.1f} ({b['grpc'][m]:.2f}x)" for m, v in b["grpc_tok_s"].items())
    return (
        f"transformers generate, static batch of {n} (greedy, {b['threads']} thread): "
        f"{b['tok_s']:.1f} tok/s; ours at {n} concurrent in process: {ours}"
        + (
            f"; over gRPC (pipelined{_rounds(b)}): {grpc}"
            if grpc
            else f" (over gRPC not measured at {n})"
        )
    )


def _rounds(b: dict) -> str:
    """Where the gRPC ratios' baseline was measured again in the gRPC arms' own rounds."""
    t = b.get("grpc_transformers_tok_s")
    return "" if t is None else f", against transformers in the same rounds: {t:.1f} tok/s"


def _against(report: dict) -> list[str]:
    """The outside baseline and the batched/serial ratios, as sentences."""
    out = []
    hf = report.get("transformers_generate")
    if hf:
        out.append(
            f"transformers `Qwen3NextForCausalLM.generate` (greedy, 1 request, "
            f"{hf['threads']} thread, measured in the same rounds as the methods): "
            f"{hf['tok_s']:.1f} tok/s; ours in process at 1 request: "
            + ", ".join(f"{k} {x:.2f}x" for k, x in hf["in_process"].items())
            + f"; over gRPC (pipelined{_rounds(hf)}): "
            + ", ".join(
                f"{k} {v:.1f} tok/s ({hf['grpc'][k]:.2f}x)" for k, v in hf["grpc_tok_s"].items()
            )
            + "."
        )
    ratios = report.get("batched_over_serial", {})
    if ratios:
        out.append(
            "Batched verify over serial: "
            + ", ".join(
                f"{x['decode_tok_s']:.2f}x in the decode phase at {n} "
                f"({x['tok_s']:.2f}x end to end, the shared prefill included)"
                for n, x in ratios.items()
            )
            + "."
        )
    return out


def draw_chart(report: dict, path: Path) -> None:
    """Tokens per second by method (bars) and concurrency (groups), in process; gRPC figures
    beside them where the split measured them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["methods"]
    concs = sorted({r["concurrency"] for r in rows})
    every = (NONE, MTP, MTP_AUTO, PROMPT_LOOKUP, DFLASH)
    names = [m for m in every if any(r["method"] == m for r in rows)]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    width = 0.8 / len(names)
    for j, m in enumerate(names):
        values = [
            next(r["tok_s"] for r in rows if r["method"] == m and r["concurrency"] == c)
            for c in concs
        ]
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(concs))]
        ax.bar(xs, values, width, label=f"{m} (in process)")
    grpc_rows = report["split"]
    for m, marker in ((NONE, "o"), (MTP, "^")):
        offset = (names.index(m) - (len(names) - 1) / 2) * width  # over its method's bar
        pts = [
            (concs.index(r["concurrency"]) + offset, r["grpc_tok_s"])
            for r in grpc_rows
            if r["method"] == m and r["concurrency"] in concs
        ]
        if pts:
            ax.scatter(
                *zip(*pts, strict=True),
                marker=marker,
                color="black",
                zorder=3,
                label=f"{m} over gRPC (pipelined)",
            )
    ax.set_xticks(range(len(concs)), [str(c) for c in concs])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"met bench: {report['model']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def breakdown_lines(rows: list[dict]) -> list[str]:
    """The breakdown section's rows (`tools/bench/breakdown.py`), ms a step."""
    out = [
        f"{'concurrent':>10} {'period':>8} {'forward':>8} {'service':>8} {'outside':>8} "
        f"{'overhead':>9}  (ms a step, medians)"
    ]
    for r in rows:
        out.append(
            f"{r['concurrency']:>10} {r['period_ms']:8.2f} {r['forward_ms']:8.2f} "
            f"{r['service_other_ms']:8.2f} {r['outside_ms']:8.2f} {r['overhead_ms']:9.2f}"
        )
    return out


def _traced_lines(report: dict) -> list[str]:
    """What the spans of both processes said: tracing's cost, a step's breakdown."""
    out = []
    if "tracing" in report:
        t = report["tracing"]
        out.append(
            f"tracing at {t['concurrency']}: {t['disabled_tok_s']:.1f} tok/s off, "
            f"{t['exported_tok_s']:.1f} exported ({t['spans']} spans)"
        )
        out.append(overlap_line(t["overlap"]))
    if "breakdown" in report:
        out.append("a step's time through both processes, mtp, greedy:")
        out += breakdown_lines(report["breakdown"])
    if "llama_cpp" in report:
        out.append("against llama.cpp's llama-server on the same checkpoint, one thread each:")
        out += llama_lines(report["llama_cpp"])
    return out


def print_table(report: dict) -> None:
    """The report as lines on stdout; each failure on stderr."""
    print(f"model {report['model']}")
    print("method         conc   tok/s   accepted length   identical")
    for r in report["methods"]:
        print(
            f"{r['method']:14} {r['concurrency']:4d} {r['tok_s']:7.1f}   "
            f"{r['accepted_length']:15.2f}   {r['identical']}"
        )
    for r in report["batch_vs_serial"]:
        print(
            f"verify {r['verify']:8} at {r['concurrency']:2d}: {r['tok_s']:7.1f} tok/s, "
            f"{r['decode_tok_s']:7.1f} in the decode phase, {r['step_ms']:.1f} ms a step"
        )
    for n, x in report["batched_over_serial"].items():
        print(
            f"batched verify / serial at {n}: {x['decode_tok_s']:.2f}x decode phase, "
            f"{x['tok_s']:.2f}x end to end"
        )
    for line in split_lines(report["split"]):
        print(line)
    for r in report["speedup"]:
        print(
            f"mtp / none at {r['concurrency']}: {r['in_process']:.2f}x in process, "
            f"{r['grpc']:.2f}x over gRPC"
        )
    m = report["memory"]
    print(
        f"verify buffers: {m['tiered_bytes'] / 2**20:.1f} MiB with tiers {m['tiers']}, "
        f"{m['full_capacity_bytes'] / 2**20:.1f} MiB at full capacity"
    )
    if traced := _traced_lines(report):
        print("\n".join(traced))
    if report.get("transformers_generate"):
        t = report["transformers_generate"]
        print(
            f"transformers generate (1 request, greedy): {t['tok_s']:.1f} tok/s; ours in "
            "process: "
            + ", ".join(f"{m} {x:.2f}x" for m, x in t["in_process"].items())
            + f"; over gRPC (pipelined{_rounds(t)}): "
            + ", ".join(f"{m} {v:.1f} ({t['grpc'][m]:.2f}x)" for m, v in t["grpc_tok_s"].items())
        )
    more = [
        *(choice_lines(report["choice"]) if "choice" in report else []),
        *depth_lines(report.get("depth")),
        *prefix_lines(report.get("prefix_cache")),
        *replicas_lines(report.get("replicas", [])),
        *tensor_parallel_lines(report.get("tensor_parallel", [])),
    ]
    for line in [*figure_lines(report), *more]:
        print(line)
    for f in report["failures"]:
        print(f"FAIL: {f}", file=sys.stderr)
