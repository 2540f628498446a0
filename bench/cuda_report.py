"""Write docs/results-cuda.md from what bench/cuda-check.sh left in its work folder.

    python bench/cuda_report.py --work .cuda-check/cuda --out docs/results-cuda.md

Reads stages.tsv (stage, exit status, seconds), tests.log, exactness.jsonl, bench-host/ and
bench-disk/results.jsonl, single/results.jsonl and machine.json; every part that is missing is
reported as missing, never filled in.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from summarize import summarize

POLICIES = ("sync", "prefetch-gate", "runahead")


def rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def stages(work: Path) -> dict[str, tuple[int, float]]:
    found = {}
    path = work / "stages.tsv"
    if path.exists():
        for line in path.read_text().splitlines():
            name, rc, seconds = line.split("\t")
            found[name] = (int(rc), float(seconds))
    return found


def status(rc: int) -> str:
    return "ok" if rc == 0 else ("cut at its time limit" if rc in (124, 137) else f"failed (exit {rc})")


def bench_section(title: str, found: list[dict[str, Any]]) -> list[str]:
    if not found:
        return [
            f"### {title}",
            "",
            "No rows: the stage did not run or produced nothing (see the stages above).",
            "",
        ]
    first = found[0]
    lines = [
        f"### {title}",
        "",
        f"{first['steps']} decode steps per request after {first['warmup_steps']} warm-up steps, "
        f"{first['cache_fraction']:.0%} of the experts cached ({first['cache_slots']} slots), "
        f"{first['dtype']}, eviction {first['eviction']}, step barrier "
        f"{'on' if first['step_barrier'] else 'off'}; direct I/O: {first.get('direct_io')}.",
        "",
        "| requests | "
        + " | ".join(f"{p} tok/s" for p in POLICIES)
        + " | sync compute / fetch per step (ms) "
        "| runahead step / lower bound | runahead both-busy | wall (s) |",
        "| ---: | " + " | ".join("---:" for _ in POLICIES) + " | ---: | ---: | ---: | ---: |",
    ]
    by: dict[int, dict[str, dict[str, Any]]] = {}
    for row in found:
        by.setdefault(row["concurrency"], {})[row["policy"]] = row
    for concurrency, policies in sorted(by.items()):
        speeds = " | ".join(f"{policies[p]['tokens_per_s']:.1f}" if p in policies else "-" for p in POLICIES)
        sync, runahead = policies.get("sync"), policies.get("runahead")
        cf = f"{sync['compute_s'] * 1e3:.1f} / {sync['fetch_s'] * 1e3:.1f}" if sync else "-"
        bound = f"{runahead['bound_ratio']:.3f}" if runahead else "-"
        overlap = f"{runahead['overlap_fraction']:.2f}" if runahead else "-"
        wall = sum(r["wall_s"] for r in policies.values())
        lines.append(f"| {concurrency} | {speeds} | {cf} | {bound} | {overlap} | {wall:.0f} |")
    lines.append("")
    summary = summarize(found)
    if summary:
        lines += [
            "| requests | runahead / sync | overlap limit of sync's run | share of the limit reached "
            "| runahead / prefetch-gate |",
            "| ---: | ---: | ---: | ---: | ---: |",
        ]
        for s in summary:
            pref = f"{s['vs_best_prefetch']:.2f}" if s["vs_best_prefetch"] else "-"
            lines.append(
                f"| {s['concurrency']} | {s['vs_sync']:.2f} | {s['limit']:.2f} | {s['of_limit']:.0%} | {pref} |"
            )
        lines.append("")
    return lines


def targets(disk: list[dict[str, Any]], single: list[dict[str, Any]]) -> list[str]:
    lines = ["## Targets (issue 13)", "", "| target | measured | met |", "| --- | ---: | --- |"]
    at8 = {r["policy"]: r for r in disk if r["concurrency"] == 8}
    if "sync" in at8 and "runahead" in at8:
        ratio = at8["runahead"]["tokens_per_s"] / at8["sync"]["tokens_per_s"]
        overlap = at8["runahead"]["overlap_fraction"]
        bound = at8["runahead"]["bound_ratio"]
        lines += [
            f"| runahead / sync >= 1.5 at 8 requests, disk store | {ratio:.2f} | {'yes' if ratio >= 1.5 else 'no'} |",
            f"| runahead both-busy fraction >= 0.7 there | {overlap:.2f} | {'yes' if overlap >= 0.7 else 'no'} |",
            f"| runahead step <= 1.10x its lower bound there | {bound:.3f} | {'yes' if bound <= 1.10 else 'no'} |",
        ]
    else:
        lines.append("| the disk-store targets at 8 requests | not measured | - |")
    if len(single) >= 2:
        ratio = single[0]["tokens_per_s"] / single[1]["tokens_per_s"]
        lines.append(
            f"| single request, every expert resident, no slower than transformers | {ratio:.2f}x "
            f"| {'yes' if ratio >= 1.0 else 'no'} |"
        )
    else:
        lines.append("| single request vs transformers | not measured | - |")
    return [*lines, ""]


def profile_section(work: Path) -> list[str]:
    """bench/cuda_profile.py's timings and device synchronisations (its tables: profile-tables.txt)."""
    path = work / "profile" / "profile.json"
    lines = ["## Where a group's time goes (`bench/cuda_profile.py`)", ""]
    if not path.exists():
        return [*lines, "- not measured (see the stages above)", ""]
    found = json.loads(path.read_text())
    lines += [
        "Time inside the backend's compute call, per group, on the compute thread: wall and the thread's "
        "own CPU (CPU close to wall: the host, not the GPU, sets the pace). Python's hot spots and "
        "torch's op and CUDA-API tables are in the work folder's `profile/profile-tables.txt`.",
        "",
        "| run | tokens/s | groups | jobs a group | wall a group (us) | CPU a group (us) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in found.items():
        if isinstance(r, dict) and "tokens_per_s" in r:
            lines.append(
                f"| {name} | {r['tokens_per_s']:.1f} | {r['groups']} | {r['jobs_per_group']:.2f} "
                f"| {r['group_wall_us']:.0f} | {r['group_cpu_us']:.0f} |"
            )
    if "us per torch call" in found:
        lines += ["", f"Host time of one small torch call there: {found['us per torch call']:.1f} us."]
    sites = found.get("sync sites") or {}
    lines += ["", "Device synchronisations inside groups (torch's sync debug mode): " + ("none" if not sites else "")]
    lines += [f"- {count} at {site}" for site, count in sites.items()]
    return [*lines, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--command", default="bench/cuda-check.sh")
    args = parser.parse_args()
    work = args.work
    machine = json.loads((work / "machine.json").read_text()) if (work / "machine.json").exists() else {}
    ran = stages(work)
    gpu = machine.get("device_name", "no GPU")
    lines = [f"# CUDA path: results ({gpu})", ""]
    if machine.get("device") != "cuda" or machine.get("quick"):
        lines += [
            "> **Not GPU results.** This file was written by a CPU self-test of the script "
            f"(`{args.command}`): small model, few steps, CPU. It shows the script runs end to end; "
            "its numbers say nothing about the CUDA path.",
            "",
        ]
    total = sum(seconds for _, seconds in ran.values())
    lines += [
        f"Written by `{args.command}` on {machine.get('date', '?')} in {total:.0f} s of stages. "
        "Every figure below comes from this one run. What each GPU run showed, and what changed "
        "after it: [docs/cuda-runs.md](cuda-runs.md).",
        "",
        "## Machine",
        "",
        f"- device: {gpu}; driver {machine.get('driver', '?')}; torch {machine.get('torch', '?')} "
        f"(CUDA {machine.get('cuda', '-')}); transformers {machine.get('transformers', '?')}; "
        f"Python {machine.get('python', '?')}",
        f"- model folder: `{machine.get('model', '?')}` on {machine.get('filesystem', '?')} "
        f"(memory-backed: {machine.get('memory_backed', '?')}); weights on disk: "
        f"{machine.get('weights_gb', 0):.2f} GB",
        "",
        "## Stages",
        "",
        "| stage | status | seconds |",
        "| --- | --- | ---: |",
        *(f"| {name} | {status(rc)} | {seconds:.0f} |" for name, (rc, seconds) in ran.items()),
        "",
        "## CUDA tests (`pytest -m cuda tests/test_cuda.py`)",
        "",
    ]
    log = work / "tests.log"
    summary = (
        re.findall(r"^=*\s*(\d+ (?:passed|failed|skipped|error).*?)\s*=*$", log.read_text(), re.M)
        if log.exists()
        else []
    )
    failed = re.findall(r"^FAILED (\S+)", log.read_text(), re.M) if log.exists() else []
    lines += [f"Result: {summary[-1] if summary else 'no summary (did the stage run?)'}", ""]
    lines += [f"- failed: `{name}`" for name in failed] + ([""] if failed else [])
    lines += [
        "## Exactness against transformers on the same device (`bench/exactness.py`)",
        "",
        "4 requests at once, 8 cache slots (experts evicted and refetched), greedy; errors are the max "
        "(and mean) |logit - transformers float32| over the generated steps, teacher-forced on our own "
        "tokens. In bfloat16 two implementations round differently, so tokens may part after a few "
        "steps; the test asks that ours stay as close to float32 as transformers' own bfloat16.",
        "",
        "| architecture | dtype | tokens equal transformers' (same dtype) | first divergence "
        "| ours vs float32: max (mean) | transformers in that dtype vs float32: max (mean) |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    for r in rows(work / "exactness.jsonl"):
        if "skipped" in r:
            lines.append(f"| {r['arch']} | - | skipped: {r['skipped'][:80]} | | | |")
            continue
        lines.append(
            f"| {r['arch']} | {r['dtype']} | {'yes' if r['tokens_equal'] else 'no'} | "
            f"{r['first_divergence'] if r['first_divergence'] is not None else '-'} | "
            f"{r['logit_error']:.2e} ({r['logit_mean_error']:.1e}) | "
            f"{r['reference_error']:.2e} ({r['reference_mean_error']:.1e}) |"
        )
    lines += ["", "## Runahead vs sync vs prefetch-gate (`runahead bench --backend torch`)", ""]
    host, disk = rows(work / "bench-host" / "results.jsonl"), rows(work / "bench-disk" / "results.jsonl")
    lines += bench_section("Host store (pinned host memory -> device over PCIe)", host)
    lines += bench_section("Disk store (O_DIRECT reads of the safetensors files -> device)", disk)
    single = rows(work / "single" / "results.jsonl")
    lines += ["## Single request, every expert resident (`bench/single_request.py`)", ""]
    lines += [f"- {r['system']}: {r['tokens_per_s']:.1f} tokens/s" for r in single] or ["- not measured"]
    lines += ["", *profile_section(work), *targets(disk, single)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
