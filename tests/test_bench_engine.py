"""scripts/bench_engine.py end to end at tiny size on CPU: every part produces its figures, the
controlled acceptance really controls it (a = 1 accepts everything, a = 0.5 about half), and
at one KV budget FP4 holds more running sequences than fp32, and 4 queries per page more than 1."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_bench_engine_small_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_engine.py"), "--small", "--device", "cpu",
                           "--geometry", "tiny", "--draft-geometry", "tiny-draft", "--kv", "fp32,fp4",
                           "--accept", "0.5,1.0", "--profile-steps", "2", "--profile-docs", "1",
                           "--host-profile-docs", "1", "--spec-chain", "on,off",
                           "--work", str(tmp_path / "models"), "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    errors = {k: v for k, v in r.items() if k.endswith("_error")}
    assert not errors, (errors, proc.stderr[-3000:])
    a = r["a_batch1_decode"]
    # timings are noise at this size (and timed assertions do not belong in tests): only their presence
    assert all(isinstance(a[k], float) for k in ("ours_tokens_per_s", "transformers_tokens_per_s", "share_of_roofline"))
    assert a["bytes_per_step"] > 0 and a["prompt_tokens"] > 300  # one 448x560 page: 320 image tokens
    assert a["profile"]["steps"] == 2 and a["profile"]["top_host"] and a["profile"]["pdl"] is False
    b = r["b_offline_batch"]
    assert b["ours_fp32"]["cached_prompt_tokens"] > 0  # the queries of a page share its prefix
    assert b["profile_fp32"]["documents"] == 1 and b["profile_fp32"]["wall_s"] > 0 and b["profile_fp32"]["top_host"]
    assert b["transformers_best"]["batch"] in (2, 4) and b["flops_per_page"]["total"] > 0
    # one-off costs inside the timed runs: on CPU no graphs and no Triton compiles
    for kv in ("fp32", "fp4"):
        for fu in (b[f"ours_{kv}"]["first_use"], b[f"ours_{kv}"]["second_pass"]["first_use"]):
            assert fu == {"graph_captures": 0, "graph_capture_seconds": 0.0, "kernel_compiles": 0,
                          "kernel_compile_seconds": 0.0}
        assert b[f"ours_{kv}"]["second_pass"]["pages_per_s"] > 0
    vb = b["vision_tower_sdpa_backends"]
    assert vb["pages"] == 1 and not vb["fast_path"] and vb["default"]["ms_per_page"] > 0
    hp = b["host_profile_fp32"]
    assert hp["documents"] == 1 and hp["wall_s"] > 0 and hp["by_tottime"] and hp["by_cumtime"]
    runs = r["c_speculation"]["runs"]
    # both draft modes, alternated on one engine; on CPU there are no graphs, so nothing is chained
    assert {x["draft_chain"] for x in runs} == {"on", "off"} and all(x["draft_chained_rounds"] == 0 for x in runs)
    assert all(x["acceptance_rate"] == 1.0 for x in runs if x["a"] == 1.0 and x["k"] == 4)
    # (at a = 0.5 the share of drafts kept, acceptance_rate, is about (E(0.5, 4) - 1) / 4 = 0.23;
    # the per-position acceptance the passes drew, acceptance_realized, about 0.5: below)
    assert all(0 < x["acceptance_rate"] < 0.5 for x in runs if x["a"] == 0.5 and x["k"] == 4)
    assert {x["k"] for x in runs} == {4, "auto"} and all("analytic_speedup" not in x for x in runs if x["k"] == "auto")
    # the per-position acceptance the timed passes drew, and the K of each of their verifications
    # (a window is cut shorter only where max_tokens ends)
    assert all(x["acceptance_realized"] == 1.0 and x["k_histogram"].get("4") == max(x["k_histogram"].values())
               for x in runs if x["a"] == 1.0 and x["k"] == 4)
    assert all(0.2 < x["acceptance_realized"] < 0.8 for x in runs if x["a"] == 0.5 and x["k"] == 4)
    # (the default --spec-interpolate-at 0.8 lies between a = 0.5 and a = 1.0 for K = 4)
    interp = [x for x in r["c_speculation"]["interpolated"] if x["k"] == "4"]
    assert {x["draft_chain"] for x in interp} == {"on", "off"} and all(x["a"] == 0.8 for x in interp)
    assert all(x["analytic_speedup"] > 0 and x["cost_ratio_c"] > 0 for x in runs if x["k"] == 4)
    # the adaptive policy's beliefs around each (batch, a): fixed K reports fixed; costs measured after the runs
    assert all(x["policy_before"]["fixed"] == (x["k"] == 4) for x in runs)
    assert all(x["policy_after"]["target_step_s"] > 0 for x in runs if x["k"] == "auto")
    # plain and speculative passes alternate: the median and range are those of the per-pair ratios,
    # and the best plain pass is the baseline
    for x in runs:
        ratios = sorted(p / q for p, q in x["paired_seconds"])
        assert len(ratios) >= 2 and x["speedup_paired_median"] == pytest.approx(statistics.median(ratios), abs=1e-3)
        assert x["speedup_paired_range"] == pytest.approx([ratios[0], ratios[-1]], abs=1e-3)
        assert x["baseline_seconds"] == pytest.approx(min(p for p, _ in x["paired_seconds"]), abs=1e-3)
    d = r["d_memory"]
    assert d["fp4_q1"]["num_blocks"] > 3 * d["fp32_q1"]["num_blocks"]
    assert d["fp32_q1"]["capacity_bound"] and d["fp32_q1"]["max_running"] < d["fp32_q1"]["requests"]
    assert d["fp4_q1"]["max_running"] > d["fp32_q1"]["max_running"]
    assert d["fp32_q4"]["max_running"] > d["fp32_q1"]["max_running"]
    assert d["fp4_q1"]["tokens_per_s"] > 0 and d["fp4_vs_fp32_q1_tokens_per_s"] > 0
    # the decode-only rate counts pure decode steps: at least one such step, batches of >= 1
    assert all(d[f"{kv}_q{q}"]["decode_steps"] > 0 and d[f"{kv}_q{q}"]["mean_decode_batch"] >= 1
               and d[f"{kv}_q{q}"]["decode_tokens_per_s"] > 0 for kv in ("fp32", "fp4") for q in (1, 4))
    assert d["fp4_vs_fp32_q1_decode_tokens_per_s"] > 0


def test_interpolate_in_the_realized_acceptance():
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_engine import interpolate

    def row(k, realized, speedup):
        return {"batch": 1, "k": k, "draft_chain": "on", "acceptance_realized": realized,
                "speedup": speedup, "speedup_paired_median": speedup - 0.1}

    runs = [row(6, 0.9, 3.0), row(6, 0.3, 1.0), row(6, 0.7, 2.0), row("auto", 0.75, 2.2)]
    out = interpolate(runs, [0.8, 0.95])
    # K = 6: 0.8 lies between the cells that realized 0.7 and 0.9 (the sort is by realized a);
    # 0.95 lies past every cell, and auto has one cell only: neither is interpolated
    assert out == [{"batch": 1, "k": "6", "draft_chain": "on", "a": 0.8, "between": [0.7, 0.9],
                    "speedup": 2.5, "speedup_paired_median": 2.4}]
