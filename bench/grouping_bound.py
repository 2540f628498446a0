"""The best schedule reachable without prediction on small cases, and each grouping's share of it.

    python bench/grouping_bound.py [--requests 2] [--out bench/results/grouping-bound.json]
    python bench/grouping_bound.py --case 8:8 --model qwen3.6-35b-a3b --profile thor --max-nodes 3000000
    python bench/grouping_bound.py --requests 2 --requests 4 --seeds 6 --out DIR/seeds6-2-4.json
    python bench/grouping_bound.py --case 8:all --max-nodes 1 --seeds 4 --first-seed 2 --out DIR/b.json
    python bench/grouping_bound.py --pool DIR/a.json DIR/b.json --out DIR/pooled.json

For each paper model on each profile: the sim's synthetic routing (seed 0, the bench's), one decode
step after ``--warmup`` steps (default 64) whose experts fill the cache (30% of all experts, most
used first: what the sim's LFU cache holds once it has settled, so a step reads as many experts as
the sim's steady state does; after the 8 warm-up steps of the rows before the 43rd session a step
read up to 60% more), on the profile's link as the sim has it (its read latency, its reads in
flight; the model then plays each grouping as the sim does, tests/test_bound.py) or with
``--first-link`` on the model's first link (one read at a time, no latency). Searched exactly
(:func:`runahead.bound_search.best_schedule`, seeded with the shorter of the pilot schedule and the
best holds schedule): 2 requests over every layer, 4 over the first 8 and 12 layers, 8 over the
first 6 (a case that passes ``MAX_NODES`` decisions is left unsearched). For every case, 4 and 8
requests over every layer included: the pilot schedule (:func:`runahead.bound.pilot_schedule`: a
schedule reachable without prediction, at least as short as the bottleneck rule's), the best holds
schedule (:func:`runahead.bound_search.best_holds`: groups computed lowest layer first, as the rules
here compute them, every decision to wait searched exactly; seconds even at 8 requests over every
layer) and the overlap relaxation's floor (:func:`runahead.relaxation.case_floor`: no schedule is
shorter). Sync, the paper's grouping and the bottleneck-aware one are played through the same model
(:func:`runahead.bound.run_policy`). Printed per case: sync's overlap limit ``(C + F) / max(C, F)``,
``F`` its link time as the sim's rows count it (each read from its issue to its landing:
:func:`runahead.bound.sync_link_s`; the rows before the 43rd session took the transfers alone, so
their shares of the limit are not the sim's); the share of the limit's gain of the bound, the best
holds schedule, the pilot schedule, the floor, the paper's grouping and the new one; and the new
one's share of the bound's, the holds', the pilot's and the floor's gains. The truth for a case lies
between the shorter of the holds and pilot schedules (or the bound, where searched) and the floor.
With ``--online-samples N`` also the pilot method without hindsight
(:func:`runahead.bound_online.sampled_pilot_schedule`: each option followed by the rule on ``N``
completions of the routing, the unrevealed layers drawn from each request's last ``--history``
warm-up steps), a schedule a runtime could reach knowing the routing's distribution: the bound and
the pilot choose with hindsight. One step's figures move by several points from step to step:
``--seeds N`` plays each case over N steps of the routing (seeds 0..N-1) and adds a row pooling
them as one run; ``--first-seed`` and ``--pool`` split such a run over processes and pool their
files afterwards (``--max-nodes 1`` skips a case's exact search: the holds and pilot schedules and
the floor only).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from runahead.bench import cache_slots, warm_keys
from runahead.bound import Schedule, SmallCase, pilot_schedule, run_policy, sync_link_s
from runahead.bound_online import StepRouting, sampled_pilot_schedule
from runahead.bound_search import best_holds, best_schedule
from runahead.costs import CostModel
from runahead.jobs import Job
from runahead.metrics import overlap_limit
from runahead.relaxation import case_floor
from runahead.scheduling import Grouping
from runahead.specs import load_model_spec, load_profile
from runahead.synthetic import default_trace

WARMUP = 64  # steps of routing whose most used experts are resident (8 in the rows before the 43rd session)
CONTEXT = 200  # tokens of context each job's attention reads (a chat prompt's order of magnitude)
CASES = ((2, None), (4, 8), (4, 12), (8, 6))  # (requests, layers: None for all): searched exactly
PILOT_CASES = ((4, None), (8, None))  # too big for the search: the pilot schedule and the floor only
MAX_NODES = 1_000_000  # a searched case that passes this many decisions shows the pilot and floor only
MAX_HOLDS_NODES = 20_000_000  # the holds search's (lowest layer first): ~130k at 8 requests, every layer
CASE_FIELDS = ("model", "profile", "requests", "layers", "cache_fraction", "link")  # a case, with `warmup`
HISTORY = 48  # steps before the case (of the warm-up's) the pilot without hindsight draws completions from
REACHED = ("bound", "holds", "pilot", "floor", "online")  # schedules searched or built (``bound_row``)
GROUPINGS = {
    "sync": Grouping(static=True),
    "paper": Grouping(),
    "bottleneck": Grouping(bottleneck=True),
}


def small_case(
    model: str,
    profile: str,
    requests: int,
    layers: int | None,
    cache: float,
    first_link: bool = False,
    seed: int = 0,
    warmup: int = WARMUP,
) -> SmallCase:
    """The case on the profile's link as the sim has it (latency, reads in flight), or with
    ``first_link`` on the model's first one (one read at a time, no latency: a bound for any link
    of that pace). ``seed``: the synthetic routing's (0 is the bench's); each seed is another step.
    ``warmup``: the steps before it whose most used experts are resident (the cache it finds)."""
    spec = load_model_spec(model)
    link = load_profile(profile)
    costs = CostModel(spec, link)
    layers = layers or spec.num_layers
    trace = default_trace(spec, requests, warmup + 1, seed=seed)
    used = Counter(warm_keys(trace, requests, warmup))
    resident = frozenset(k for k, _ in used.most_common(cache_slots(spec, cache)) if k.layer < layers)
    selections = [
        [[tuple(trace.selections(r)[warmup][layer]) for layer in range(layers)]] for r in range(requests)
    ]

    def group_s(jobs: Sequence[Job]) -> float:
        distinct = len({e for job in jobs for e in job.experts})
        return costs.compute_time(jobs[0].layer, [1] * len(jobs), [CONTEXT] * len(jobs), distinct)

    if first_link:
        return SmallCase(selections, resident, costs.fetch_transfer_time(), group_s)
    return SmallCase(
        selections,
        resident,
        costs.fetch_transfer_time(),
        group_s,
        latency_s=link.link_latency_s,
        queue_depth=link.link_queue_depth,
    )


def measure(
    model: str,
    profile: str,
    requests: int,
    layers: int | None,
    cache: float,
    search: bool,
    max_nodes: int = MAX_NODES,
    max_holds_nodes: int = MAX_HOLDS_NODES,
    rules_only: bool = False,
    first_link: bool = False,
    seed: int = 0,
    warmup: int = WARMUP,
    online_samples: int = 0,
    history: int = HISTORY,
) -> dict[str, object]:
    case = small_case(model, profile, requests, layers, cache, first_link, seed, warmup)
    online = None
    if online_samples and not rules_only:
        online = Online(
            case_history(model, requests, case.layers, seed, warmup, history), online_samples, seed
        )
    row: dict[str, object] = {
        "model": model,
        "profile": profile,
        "requests": requests,
        "layers": case.layers,
        "cache_fraction": cache,
        "link": "first" if first_link else "sim",
        "seed": seed,
        "warmup": warmup,
    }
    if online is not None:
        row |= {"online_samples": online_samples, "history": history}
    return row | bound_row(case, search, max_nodes, max_holds_nodes, rules_only, online)


@dataclass(frozen=True)
class Online:
    """The pilot method without hindsight's inputs (:func:`sampled_pilot_schedule`)."""

    history: Sequence[Sequence[StepRouting]]
    samples: int
    seed: int


def case_history(
    model: str, requests: int, layers: int, seed: int, warmup: int, steps: int
) -> list[list[StepRouting]]:
    """Each request's routing over the last ``steps`` warm-up steps before the case's step (what a
    runtime has seen of it), cut to the case's ``layers``."""
    if not 1 <= steps <= warmup:
        raise ValueError(f"the history is 1 to {warmup} warm-up steps, not {steps}")
    trace = default_trace(load_model_spec(model), requests, warmup + 1, seed=seed)
    return [
        [
            [tuple(experts) for experts in trace.selections(r)[step][:layers]]
            for step in range(warmup - steps, warmup)
        ]
        for r in range(requests)
    ]


def bound_row(
    case: SmallCase,
    search: bool,
    max_nodes: int = MAX_NODES,
    max_holds_nodes: int = MAX_HOLDS_NODES,
    rules_only: bool = False,
    online: Online | None = None,
) -> dict[str, object]:
    """Every schedule of ``case`` (sync, the paper's grouping, the bottleneck rule, the pilot, the best
    holds, the floor, with ``search`` the exact bound, with ``online`` the pilot without hindsight)
    as makespans and shares of the limit's gain; ``rules_only``: the three groupings alone (seconds,
    where the pilot takes minutes at 8 requests)."""
    played = {name: run_policy(case, grouping) for name, grouping in GROUPINGS.items()}
    started = time.perf_counter()
    sync = played["sync"]
    link = sync_link_s(sync)  # as the sim's rows count it (the rows before the 43rd session: transfers alone)
    limit = overlap_limit(sync.compute_s, link)
    row: dict[str, object] = {
        "limit": limit,
        "fetch_ms": link * 1e3,
        "transfer_ms": sync.fetch_s * 1e3,
        "sync_compute_ms": sync.compute_s * 1e3,
    }
    if rules_only:
        return row | {"search_s": 0.0} | played_rows(played, {}, limit)
    pilot = pilot_schedule(case, GROUPINGS["bottleneck"])
    try:  # the paper's grouping never waits: one of the holds schedules, to prune from
        holds = best_holds(case, max_nodes=max_holds_nodes, known=played["paper"])
    except RuntimeError:
        holds = None
    best = None
    if search:
        try:
            seed = pilot if holds is None else min(pilot, holds, key=_makespan)
            best = best_schedule(case, known=seed, max_nodes=max_nodes)
        except RuntimeError:  # too big: the pilot schedule and the floor only
            best = None
    row["search_s"] = time.perf_counter() - started
    reached = {"pilot": pilot.makespan, "floor": case_floor(case)}
    if online is not None:
        started = time.perf_counter()
        blind = sampled_pilot_schedule(
            case, GROUPINGS["bottleneck"], online.history, online.samples, online.seed
        )
        row["online_s"] = time.perf_counter() - started
        reached["online"] = blind.makespan
        row["online_explored"] = blind.explored
        row["online_compute_ms"] = blind.compute_s * 1e3
    if holds is not None:
        reached["holds"] = holds.makespan
        row["holds_explored"] = holds.explored
    if best is not None:
        reached["bound"] = best.makespan
        row["explored"] = best.explored
        row["bound_compute_ms"] = best.compute_s * 1e3
    row["pilot_compute_ms"] = pilot.compute_s * 1e3
    return row | played_rows(played, reached, limit)


def played_rows(played: dict[str, Schedule], reached: dict[str, float], limit: float) -> dict[str, object]:
    """The fields of the schedules reached (makespans by name) and of the groupings played through the
    model: makespans, speedups over sync, shares of the limit's gain and of each reached schedule's."""
    row = share_rows({name: schedule.makespan for name, schedule in played.items()}, reached, limit)
    for name, schedule in played.items():
        row[f"{name}_compute_ms"] = schedule.compute_s * 1e3
    return row


def share_rows(played: dict[str, float], reached: dict[str, float], limit: float) -> dict[str, object]:
    """Makespans (seconds, by name; ``played`` holds ``sync``'s), speedups over sync, shares of the
    limit's gain, and each played grouping's share of each reached schedule's gain."""
    sync = played["sync"]
    row: dict[str, object] = {}
    for name, makespan in reached.items():
        x = sync / makespan
        row[f"{name}_ms"] = makespan * 1e3
        row[f"{name}_x"] = x
        row[f"{name}_share_of_limit"] = (x - 1) / (limit - 1)
    for name, makespan in played.items():
        x = sync / makespan
        row[f"{name}_ms"] = makespan * 1e3
        row[f"{name}_x"] = x
        row[f"{name}_share_of_limit"] = (x - 1) / (limit - 1)
        for of in reached:
            gain = row[f"{of}_x"] - 1  # type: ignore[operator]
            row[f"{name}_share_of_{of}"] = (x - 1) / gain if gain > 0 else 1.0
    return row


def summed_ms(rows: Sequence[dict[str, object]]) -> dict[str, float]:
    """Every ``*_ms`` field that all ``rows`` have, summed: a schedule only where every row reached it
    (the bound only where each search finished)."""
    return {
        key: sum(row[key] for row in rows)  # type: ignore[misc]
        for key in rows[0]
        if key.endswith("_ms") and all(key in row for row in rows)
    }


def pooled_row(rows: Sequence[dict[str, object]]) -> dict[str, object]:
    """One case's rows over several seeds (steps) as one run of those steps: every schedule's makespans
    summed, the limit of sync's summed compute and link time; a reached schedule only where every
    seed reached it (the bound where each was searched to the end)."""
    first = rows[0]
    total = summed_ms(rows)
    limit = overlap_limit(total["sync_compute_ms"], total["fetch_ms"])
    played = {name: total[f"{name}_ms"] / 1e3 for name in GROUPINGS}
    reached = {name: total[f"{name}_ms"] / 1e3 for name in REACHED if f"{name}_ms" in total}
    pooled: dict[str, object] = {key: first[key] for key in CASE_FIELDS} | {"warmup": case_warmup(first)}
    pooled |= {"seed": "pooled", "seeds": len(rows)}
    pooled |= {"limit": limit, "fetch_ms": total["fetch_ms"], "sync_compute_ms": total["sync_compute_ms"]}
    pooled["search_s"] = sum(row["search_s"] for row in rows)  # type: ignore[misc]
    return pooled | share_rows(played, reached, limit)


def case_warmup(row: dict[str, object]) -> object:
    """The warm-up steps a row's case was built after (rows written before the 43rd session have none: 8)."""
    return row.get("warmup", 8)


def _makespan(schedule: Schedule) -> float:
    return schedule.makespan


def parse_case(text: str) -> tuple[int, int | None]:
    """``REQUESTS:LAYERS`` (``LAYERS`` a count, or ``all``) as a case of :data:`CASES`' form."""
    requests, _, layers = text.partition(":")
    try:
        return int(requests), None if layers == "all" else int(layers)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a case is REQUESTS:LAYERS (e.g. 8:12 or 8:all), not {text!r}"
        ) from None


def share(row: dict[str, object], key: str) -> str:
    value = row.get(key)
    return f"{value:5.0%}" if isinstance(value, float) else f"{'-':>5}"


def print_header() -> None:
    print(
        f"{'model':<16} {'profile':<9} {'req':>3} {'lay':>3} {'seed':>6} {'limit':>5} | "
        f"share of limit: {' '.join(f'{name[:5]:>5}' for name in (*REACHED, 'paper', 'new'))} | "
        f"new's share of: {' '.join(f'{name[:5]:>5}' for name in REACHED)} | {'s':>5}"
    )


def print_row(r: dict[str, object], model: str, profile: str, requests: int) -> None:
    limit_shares = " ".join(share(r, f"{name}_share_of_limit") for name in (*REACHED, "paper", "bottleneck"))
    new_shares = " ".join(share(r, f"bottleneck_share_of_{of}") for of in REACHED)
    print(
        f"{model:<16} {profile:<9} {requests:>3} {r['layers']:>3} {r['seed']!s:>6} {r['limit']:5.2f} | "
        f"{'':>16} {limit_shares} | {'':>16} {new_shares} | {r['search_s']:5.1f}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    parser.add_argument("--cache-fraction", type=float, default=0.3)
    parser.add_argument(
        "--requests", type=int, choices=[2, 4, 8], action="append", help="only these cases (default: all)"
    )
    parser.add_argument(
        "--case",
        type=parse_case,
        action="append",
        help="search this case instead of the default ones: REQUESTS:LAYERS (LAYERS a count or 'all')",
    )
    parser.add_argument("--model", action="append", help="only this paper model (default: both)")
    parser.add_argument("--profile", action="append", help="only this profile (default: both)")
    parser.add_argument(
        "--max-nodes", type=int, default=MAX_NODES, help="give up a search after this many decisions"
    )
    parser.add_argument(
        "--max-holds-nodes",
        type=int,
        default=MAX_HOLDS_NODES,
        help="give up the holds search (groups lowest layer first) after this many decisions",
    )
    parser.add_argument(
        "--rules-only",
        action="store_true",
        help="only sync, the paper's grouping and the bottleneck rule played through the model (seconds)",
    )
    parser.add_argument(
        "--first-link",
        action="store_true",
        help="the model's first link (one read at a time, no latency), not the profile's as the sim has it",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="this many steps of routing (seeds 0..N-1) per case, then one row pooling them (default 1)",
    )
    parser.add_argument(
        "--pool",
        type=Path,
        nargs="+",
        help="instead of searching: these files' rows (of runs split by --first-seed), pooled per case",
    )
    parser.add_argument(
        "--first-seed",
        type=int,
        default=0,
        help="the first step's seed (with --seeds N: seeds K..K+N-1), to split a long run over processes",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=WARMUP,
        help=f"steps of routing whose most used experts are resident before the step (default {WARMUP}; "
        "8: the cache of the rows written before the 43rd session)",
    )
    parser.add_argument(
        "--online-samples",
        type=int,
        default=0,
        help="also the pilot method without hindsight, with this many completions of the routing drawn "
        "at each decision (0: not played; 48 takes ~45 s a step at 2 requests)",
    )
    parser.add_argument(
        "--history",
        type=int,
        default=HISTORY,
        help=f"warm-up steps before the case the completions are drawn from (default {HISTORY})",
    )
    args = parser.parse_args()
    if args.online_samples < 0 or (args.online_samples and not 1 <= args.history <= args.warmup):
        parser.error(f"--online-samples >= 0 and --history within 1..--warmup ({args.warmup})")
    if args.warmup < 1:
        parser.error(f"--warmup needs at least 1 step, got {args.warmup}")
    if args.seeds < 1:
        parser.error(f"--seeds needs at least 1 step, got {args.seeds}")
    if args.pool:
        pool_files(args.pool, args.out)
        return
    cases = args.case or CASES + PILOT_CASES
    searched = set(args.case or CASES)
    rows = []
    print_header()
    for profile in args.profile or ("thor", "mac-mini"):
        for model in args.model or ("qwen3.6-35b-a3b", "gemma4-26b-a4b"):
            for requests, layers in cases:
                if args.requests and requests not in args.requests:
                    continue
                search = (requests, layers) in searched
                seeded = []
                for seed in range(args.first_seed, args.first_seed + args.seeds):
                    seeded.append(
                        measure(
                            model,
                            profile,
                            requests,
                            layers,
                            args.cache_fraction,
                            search,
                            args.max_nodes,
                            args.max_holds_nodes,
                            args.rules_only,
                            args.first_link,
                            seed,
                            args.warmup,
                            args.online_samples,
                            args.history,
                        )
                    )
                    rows.append(seeded[-1])
                    print_row(seeded[-1], model, profile, requests)
                    write_rows(args.out, rows)  # after every step: a long run stopped keeps what it found
                if args.seeds > 1:
                    rows.append(pooled_row(seeded))
                    print_row(rows[-1], model, profile, requests)
    write_rows(args.out, rows)


def pool_files(files: Sequence[Path], out: Path | None) -> None:
    """Every case's rows from ``files`` (one row a seed; pooled rows there are left out), each seed
    once, and one row pooling them, printed and written to ``out``."""
    cases: dict[tuple[object, ...], dict[object, dict[str, object]]] = {}
    for path in files:
        for row in json.loads(path.read_text()):
            if row.get("seed", 0) != "pooled":
                key = (*(row[k] for k in CASE_FIELDS), case_warmup(row))
                cases.setdefault(key, {}).setdefault(row.get("seed", 0), row)
    rows: list[dict[str, object]] = []
    print_header()
    for (model, profile, requests, *_), seeded in cases.items():
        ordered = [seeded[seed] for seed in sorted(seeded)]
        for row in [*ordered, pooled_row(ordered)] if len(ordered) > 1 else ordered:
            rows.append(row)
            print_row(row, str(model), str(profile), int(requests))  # type: ignore[call-overload]
    write_rows(out, rows)


def write_rows(out: Path | None, rows: list[dict[str, object]]) -> None:
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
