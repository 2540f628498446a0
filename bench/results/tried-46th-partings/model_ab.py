import json, sys, math, os
sys.path.insert(0, "/work/main/bench")
from grouping_bound import small_case, GROUPINGS, WARMUP
from runahead.bound import run_policy
rows = {}
for profile in ("thor", "mac-mini"):
    for model in ("qwen3.6-35b-a3b", "gemma4-26b-a4b"):
        for requests, seeds in ((2, 12), (4, 12), (8, 6)):
            for seed in range(seeds):
                case = small_case(model, profile, requests, None, 0.3, False, seed, WARMUP)
                ms = {}
                for g in ("paper", "bottleneck"):
                    ms[g] = run_policy(case, GROUPINGS[g]).makespan
                rows[f"{profile}|{model}|{requests}|{seed}"] = ms
json.dump(rows, open(sys.argv[1], "w"))
