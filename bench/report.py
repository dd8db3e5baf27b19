"""Markdown tables from a bench/results JSON (the docs' Performance page renders them).

    python -m bench.report bench/results/full-<date>.json
"""

from __future__ import annotations

import json
import statistics
import sys


def markdown(result: dict) -> str:
    lines = ["| workload | table rows | hand-written MERGE | sink, default (driver tagging here) | "
             "sink, executor tagging |",
             "|---|---:|---:|---:|---:|"]
    for c in result["e2e"]:
        lines.append(
            f"| {c['workload']} | {c['table_rows'] // 1_000_000}M | {c['baseline']['median_after_first']:.2f} s "
            f"| {c['sink']['median_after_first']:.2f} s ({c['ratio_baseline_over_sink']:.2f}x) "
            f"| {c['sink-executors']['median_after_first']:.2f} s ({c['ratio_baseline_over_sink_executors']:.2f}x) |")
    spark = [c for c in result["e2e"] if "spark-merge-careful" in c]
    with_dvs = {c["table_rows"]: c for c in result.get("e2e_deletion_vectors", [])}
    if spark:
        dv_note = " (with deletion vectors)" if with_dvs else ""
        lines += ["", "| workload | table rows | delta-spark MERGE, as documented | delta-spark MERGE, partitions in "
                  f"ON{dv_note} | sink, default | sink, executor tagging | tables equal |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        for c in spark:
            careful = f"{c['spark-merge-careful']['median_after_first']:.2f} s"
            dv = with_dvs.get(c["table_rows"]) if c["workload"] == "events" else None
            if dv is not None:
                careful += f" ({dv['spark-merge-careful-dv']['median_after_first']:.2f} s)"
            if dv is not None and "sink-spark-dv" in dv:
                dv_sink = (f"sink on it (delta-spark): {dv['sink-spark-dv']['median_after_first']:.2f} s, executor "
                           f"tagging {dv['sink-spark-dv-executors']['median_after_first']:.2f} s")
                careful += f", {dv_sink}"
            lines.append(
                f"| {c['workload']} | {c['table_rows'] // 1_000_000}M | {c['spark-merge']['median_after_first']:.2f} s "
                f"| {careful} | {c['sink']['median_after_first']:.2f} s "
                f"({c['ratio_spark_merge_careful_over_sink']:.2f}x) | "
                f"{c['sink-executors']['median_after_first']:.2f} s "
                f"({c['ratio_spark_merge_careful_over_sink_executors']:.2f}x) | {c['tables_equal']} |")
    lines += ["", "| events, executor tagging | table rows | hand-written MERGE | sink | sink, batches with warm "
              "replicas | partition loads, warm batches | shard moves |", "|---|---:|---:|---:|---:|---:|---:|"]
    one = {c["table_rows"]: c for c in result["e2e"] if c["workload"] == "events"}
    for c in result.get("e2e_two_executors", []):
        for label, case in (("one executor", one.get(c["table_rows"])), ("two executors", c)):
            if case is None:
                continue
            sink = case["sink-executors"]
            warm = [loads for loads, rebuilt in zip(sink["partition_loads"][1:], sink["replicas_rebuilt"][1:])
                    if not rebuilt]
            loads = sum(sum(batch.values()) for batch in warm)
            moves = sum(sink.get("shard_moves", [0])[1:])
            lines.append(f"| {label} | {case['table_rows'] // 1_000_000}M | "
                         f"{case['baseline']['median_after_first']:.2f} s | {sink['median_after_first']:.2f} s "
                         f"({case['ratio_baseline_over_sink_executors']:.2f}x) | {sink['median_warm']:.2f} s | "
                         f"{loads} | {moves} |")
    if result.get("e2e_connect"):
        lines += ["", "| events, seconds per batch | table rows | hand-written MERGE | sink, driver tagging | "
                  "sink, executor tagging | tables equal |", "|---|---:|---:|---:|---:|---|"]
        for c in result["e2e_connect"]:
            for label, case in (("classic session", one.get(c["table_rows"])), ("through Spark Connect", c)):
                if case is not None:
                    lines.append(f"| {label} | {case['table_rows'] // 1_000_000}M | "
                                 + " | ".join(f"{case[n]['median_after_first']:.2f} s"
                                              for n in ("baseline", "sink", "sink-executors"))
                                 + f" | {case['tables_equal']} |")
    if result.get("driver_memory"):
        lines += ["", "| one batch, executor tagging, two executors | commit | driver's Python peak above its "
                  "peak before | batch | table equal to expected |", "|---:|---|---:|---:|---|"]
        for c in result["driver_memory"]:
            how = "files written by executors" if c["commit_mode"] == "auto" else "MERGE fallback (rows collected)"
            if c["commit_mode"] == "merge" and c.get("engine") == "delta-spark":
                how = "delta-spark MERGE from the executors"
            if c.get("merge_in_task"):
                how = "delta-rs MERGE in one Spark task"
            if c.get("scd_type") == 2:
                how = "history table (scd_type = 2), files written by executors"
            lines.append(f"| {c['records']:,} records | {how} ({c['mode']}) | {c['driver_peak_rise_mb']:,.0f} MB "
                         f"| {c['batch_seconds']:.1f} s | {c['table_exact']} |")
    if result.get("e2e_tiny"):
        lines += ["", "| tiny batches (events mix) | table rows | records per batch | hand-written MERGE "
                  "| sink, default | sink, executor tagging | sink, default: partitions loaded / read for few keys, "
                  "after the first batch |", "|---|---:|---:|---:|---:|---:|---:|"]
        for c in result["e2e_tiny"]:
            sink = c["sink"]
            loads = sum(sum(batch.values()) for batch in sink["partition_loads"][1:])
            peeks = sum(sink.get("partition_peeks", [])[1:])
            lines.append(f"| events | {c['table_rows'] // 1_000_000}M | {c['batch_rows']:,} | "
                         f"{c['baseline']['median_after_first']:.2f} s | {sink['median_after_first']:.2f} s "
                         f"({c['ratio_baseline_over_sink']:.2f}x) | {c['sink-executors']['median_after_first']:.2f} s "
                         f"({c['ratio_baseline_over_sink_executors']:.2f}x) | {loads} / {peeks} |")
    lines += ["", "| sink, default: phase medians (s) | table rows | collect | tag | split | commit | other | batch |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for c in result["e2e"]:
        phases = c["sink"]["phases"]
        shown = [phases.get(p, 0.0) for p in ("collect", "tag", "split", "commit")]
        other = sum(phases.values()) - sum(shown)
        lines.append(f"| {c['workload']} | {c['table_rows'] // 1_000_000}M | "
                     + " | ".join(f"{v:.2f}" for v in shown)
                     + f" | {other:.2f} | {c['sink']['median_after_first']:.2f} |")
    cases = [*result["e2e"], *result.get("e2e_tiny", []), *result.get("global", [])]
    above = [c for c in cases if "above_commit" in c["baseline"]]  # results before it lack it
    if above:
        lines += ["", "| time above the commit, medians (s) | table rows | records per batch "
                  "| hand-written: batch - its MERGE | sink, default: batch - its commit phase | sink - hand-written |",
                  "|---|---:|---:|---:|---:|---:|"]
        for c in above:
            hand, sink = c["baseline"]["above_commit"], c["sink"]["above_commit"]
            lines.append(f"| {c['workload']} | {c['table_rows'] // 1_000_000}M | {c['batch_rows']:,} | {hand:.3f} "
                         f"| {sink:.3f} | {sink - hand:+.3f} |")
    merged = [c for c in result["e2e"] if "sink-merge" in c]
    if merged:
        lines += ["", "| sink, default: commit phase medians (s) | table rows | rewrite (default) | MERGE (fallback) "
                  "| rewrite / MERGE | batch, rewrite | batch, MERGE |", "|---|---:|---:|---:|---:|---:|---:|"]
        for c in merged:
            rewrite, merge = c["sink"]["phases"].get("commit", 0.0), c["sink-merge"]["phases"].get("commit", 0.0)
            lines.append(f"| {c['workload']} | {c['table_rows'] // 1_000_000}M | {rewrite:.2f} | {merge:.2f} | "
                         f"{rewrite / merge if merge else float('nan'):.2f}x | {c['sink']['median_after_first']:.2f} s "
                         f"| {c['sink-merge']['median_after_first']:.2f} s |")
    steps = [c for c in result["e2e"] if "tag_steps" in c["sink"]]
    if steps:
        names = [n for n in steps[0]["sink"]["tag_steps"]
                 if any(c["sink"]["tag_steps"][n] >= 0.0005 for c in steps)]
        lines += ["", f"| sink, default: tag steps, medians summed over shards (s) | table rows | {' | '.join(names)} "
                  "| key filters per key |", "|---|---:|" + "---:|" * (len(names) + 1)]
        for c in steps:
            filters = c["sink"].get("key_filter_bytes_per_key")  # results before partitions' filters lack it
            lines.append(f"| {c['workload']} | {c['table_rows'] // 1_000_000}M | "
                         + " | ".join(f"{c['sink']['tag_steps'][n]:.3f}" for n in names)
                         + f" | {'n/a' if filters is None else f'{filters} B'} |")
    if result.get("global"):
        lines += ["", "| global scope | table rows | MERGE on the key alone (delta-rs) | the same in delta-spark "
                  "| sink | sink commit | index memory per key | key filter per key | its false positives per batch "
                  "| partition loads after bootstrap | tables equal to the oracle |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for c in result["global"]:
            sink = c["sink"]
            contenders = [c[n] for n in ("sink", "baseline", "spark-merge") if n in c]
            spark = (f"{c['spark-merge']['median_after_first']:.2f} s ({c['ratio_spark_merge_over_sink']:.2f}x)"
                     if "spark-merge" in c else "n/a")  # results before it lack it
            lines.append(f"| {c['workload']} | {c['table_rows'] // 1_000_000}M | "
                         f"{c['baseline']['median_after_first']:.2f} s ({c['ratio_baseline_over_sink']:.2f}x) | "
                         f"{spark} | {sink['median_after_first']:.2f} s | {sink['phases'].get('commit', 0.0):.2f} s | "
                         f"{sink['index_memory_bytes_per_key']} B | {_key_filter(sink)} | "
                         f"{sink['loads_after_bootstrap']} | "
                         f"{all(x['table_equal_to_oracle'] for x in contenders)} |")
    if result.get("history"):
        lines += ["", "| SCD type 2 (events) | table rows | type 1 | type 2 | type 2 / type 1 | type 2 commit "
                  "| versions written / replaced per batch | current rows equal to type 1 |",
                  "|---|---:|---:|---:|---:|---:|---:|---|"]
        for c in result["history"]:
            one, two = c["type-1"], c["type-2"]
            lines.append(f"| {c['workload']} | {c['table_rows'] // 1_000_000}M | {one['median_after_first']:.2f} s | "
                         f"{two['median_after_first']:.2f} s | {c['ratio_type_2_over_type_1']:.2f}x | "
                         f"{two['phases'].get('commit', 0.0):.2f} s | "
                         f"{statistics.median(two['versions_written'][1:]):,.0f} / "
                         f"{statistics.median(two['versions_replaced'][1:]):,.0f} | {c['current_rows_equal']} |")
    lines += ["", "| table rows | append | rewrite (sink) | MERGE, pruned (sink's fallback) | MERGE, unpruned |",
              "|---:|---:|---:|---:|---:|"]
    for c in result["commit"]:
        rewrite = f"{c['rewrite_median']:.3f} s" if "rewrite_median" in c else "-"  # older results lack it
        lines.append(f"| {c['table_rows'] // 1_000_000}M | {c['append_median']:.3f} s | {rewrite} | "
                     f"{c['merge_pruned_median']:.3f} s | {c['merge_unpruned_median']:.3f} s |")
    t, i = result["tagging"], result["index"]
    lines += [
        "",
        "| figure | measured |",
        "|---|---:|",
        f"| tagging, warm replica, {t['warm_memory_hit_share']:.0%} memory hits | {t['warm_hits_per_s']:,} records/s |",
        f"| tagging, hits from RocksDB (memory tier off) | {t['cold_hits_per_s']:,} records/s |",
        f"| tagging, misses (new keys) | {t['misses_per_s']:,} records/s |",
        f"| tagging against a plain dict index | {t['dict_hits_per_s']:,} records/s |",
        *([f"| memory tier, bytes per entry held (at most `hot_cache_entries` per shard replica) | "
           f"{t['memory_tier_bytes_per_entry']} |"] if "memory_tier_bytes_per_entry" in t else []),
        *([f"| tagging, hits in a resident keyspace | {t['resident_hits_per_s']:,} records/s |",
           f"| resident keyspace, bytes per key held (at most `resident_keys` per shard replica) | "
           f"{t['resident_bytes_per_key']} |"] if "resident_bytes_per_key" in t else []),
        f"| bootstrap, {i['parameters']['partitions']} x {i['parameters']['keys_per_partition']:,} keys, "
        f"{i['parameters']['shards']} shards | {i['bootstrap']['keys_per_second']:,} keys/s |",
        f"| one cold {i['cold_partition']['keys']:,}-key partition | {i['cold_partition']['seconds']:.2f} s |",
        f"| on-disk bytes per entry | {i['bootstrap']['bytes_per_entry']} |",
        f"| warm restart: partitions loaded, seconds | {i['warm_restart']['partitions_loaded']}, "
        f"{i['warm_restart']['seconds']:.3f} s |",
    ]
    return "\n".join(lines)


def _key_filter(sink: dict) -> str:
    """Key filter bytes per key and its median false positives per batch (results before it: n/a)."""
    if "key_filter_bytes_per_key" not in sink:
        return "n/a | n/a"
    false_positives = statistics.median(sink["key_filter_false_positives"][1:] or [0])
    return f"{sink['key_filter_bytes_per_key']} B | {false_positives:.0f}"


if __name__ == "__main__":
    print(markdown(json.loads(open(sys.argv[1]).read())))
