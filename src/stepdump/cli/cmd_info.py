"""stepdump info: what a run holds."""

from __future__ import annotations

import argparse
import datetime as dt
from typing import Any

from stepdump.cli.common import add_run_arg, human_bytes, open_run, run_bytes
from stepdump.cli.exitcodes import Exit
from stepdump.cli.output import add_format_args, print_record

EXAMPLES = """examples:
  stepdump info demo-run
  stepdump info demo-run --json | jq .size_on_disk_bytes
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arg(p)
    add_format_args(p, json_help="write the summary as one JSON object (sizes in bytes, steps as lists)")


def run(args: argparse.Namespace) -> int:
    # Imported here, not at the top: `stepdump info --help` must not load torch.
    from stepdump.read.reader import ranked_stores

    with open_run(args.run) as r:
        m = r.meta
        steps, all_steps, stats_steps = r.steps, r.all_steps, r.stats_steps
        # (key, label, text) for people and TSV; `data` is the same in machine-readable shape.
        fields: list[tuple[str, str, object]] = [("path", "run", str(r.path))]
        data: dict[str, Any] = {"path": str(r.path)}

        def add(key: str, label: str, text: object, value: object) -> None:
            fields.append((key, label, text))
            data[key] = value

        add("status", "status", "being written" if r.live else "closed", "live" if r.live else "closed")
        ranked = ranked_stores(r)
        if ranked:  # steps and names below are the primary rank's; sizes are over every rank
            dist = r.meta.get("distributed")
            world = dist.get("world_size") if isinstance(dist, dict) else None
            add("ranks", "ranks recorded", f"{', '.join(str(k) for k, _ in ranked)} (world size {world or '?'})",
                [k for k, _ in ranked])
            data["world_size"] = world
            for k, store in ranked:
                add(f"rank_{k}", f"rank {k}", f"{_span(store.all_steps)} steps, {len(store.steps)} stored in full",
                    {"steps_seen": len(store.all_steps), "steps_stored": len(store.steps)})
        add("format_version", "store format", str(r.format_version), r.format_version)
        add("written_by", "written by", f"stepdump {m.get('stepdump_version')}, torch {m.get('torch_version')}",
            {"stepdump": m.get("stepdump_version"), "torch": m.get("torch_version")})
        if m.get("cpu_capability") or m.get("blas"):  # runs made before these keys do not say
            add("kernels", "CPU kernels", f"{m.get('cpu_capability')}, BLAS {m.get('blas')}",
                {"cpu_capability": m.get("cpu_capability"), "blas": m.get("blas")})
        created = m.get("created")
        if created:
            add("created", "created", dt.datetime.fromtimestamp(created).isoformat(timespec="seconds"), created)
        add("model_optimizer", "model / optimizer", f"{m.get('model_class')} / {m.get('optimizer_class')}",
            {"model": m.get("model_class"), "optimizer": m.get("optimizer_class")})
        if m.get("scheduler_class"):
            add("scheduler", "scheduler", str(m["scheduler_class"]), m["scheduler_class"])
        # counts and ends, not lists: a lean run has a million steps (`ls --all-steps --json` lists them)
        add("steps_seen", "steps seen", _span(all_steps), _ends(all_steps))
        if m.get("gradient_log"):  # only keyframes are stored in full; params and optimizer state are rebuilt
            _gradient_log_steps(r, steps, add)
        else:
            add("steps_stored", "steps stored in full", _span(steps), _ends(steps))
        add("steps_with_stats", "steps with stats", _span(stats_steps), _ends(stats_steps))
        skipped = r.skipped_steps
        add("skipped_steps", "skipped steps", ", ".join(map(str, skipped[:10])) + (" ..." if len(skipped) > 10 else "")
            or "none", skipped)
        stopped = m.get("recording_stopped")
        if isinstance(stopped, dict):  # the Recorder stepped aside (on_error="warn"): say so
            add("recording_stopped", "recording stopped",
                f"at step {stopped.get('step')} ({stopped.get('where')}): {stopped.get('error')}; "
                "training went on unrecorded", stopped)
        tensors = {kind: len(r.names(kind)) for kind in r.kinds()}
        for kind, n in tensors.items():
            fields.append((f"tensors_{kind}", f"{kind} tensors", n))
        data["tensors"] = tensors
        add("capture", "capture",
            f"{', '.join(m.get('capture', []))}; full {m.get('every')}, stats {m.get('stats_every')}",
            {"kinds": m.get("capture", []), "every": m.get("every"), "stats_every": m.get("stats_every")})
        add("codec", "codec", str(m.get("codec")), m.get("codec"))
        kinds = _fingerprint_kinds(r)
        if set(kinds) - {"xxh3"}:  # only a run with device fingerprints says (FORMAT.md "Fingerprint kinds")
            add("fingerprint_kinds", "fingerprints",
                ", ".join(f"{k} for {n} tensor{'s' if n != 1 else ''}" for k, n in sorted(kinds.items())), kinds)
        size = run_bytes(r.path)
        add("size_on_disk", "size on disk", human_bytes(size), human_bytes(size))
        data["size_on_disk_bytes"] = size
        stored, raw = r.blob_bytes()
        if raw:
            add("tensor_data", "tensor data",
                f"{human_bytes(stored)} stored, {human_bytes(raw)} raw ({stored / raw:.2f}×)",
                {"stored_bytes": stored, "raw_bytes": raw})
    print_record(fields, args, json_obj=data)
    return Exit.OK


def _gradient_log_steps(r: Any, steps: list[int], add: Any) -> None:
    """A gradient log's steps: stored in full (keyframes), rebuilt from them, and those between
    keyframes that store params (changed outside the optimizer, docs/gradient-log.md)."""
    from stepdump.store.format import LEVEL_FULL, LEVEL_STATS

    catalog = next(iter(r.stores()))[1].catalog  # the primary store's (rank 0 of a multi-rank run)
    full = catalog.steps(LEVEL_FULL)
    rebuilt = sorted(set(steps) - set(full))
    between = catalog.steps_storing("params", LEVEL_STATS)
    add("steps_stored", "steps stored in full", f"{_span(full)} (keyframes)" if full else "none", _ends(full))
    add("steps_rebuilt", "steps rebuilt (gradient log)", _span(rebuilt), _ends(rebuilt))
    add("params_between_keyframes", "params stored between keyframes",
        f"at {_span(between)} steps (changed outside the optimizer)" if between else "none", _ends(between))


def _fingerprint_kinds(r: Any) -> dict[str, int]:
    """How many series (tensors) of the primary store (rank 0 of a multi-rank run, as the names
    above) have each fingerprint kind; {"xxh3": ...} needs no look at the series."""
    catalog = next(iter(r.stores()))[1].catalog
    other = catalog.fp_kinds_by_name()
    if not other:
        return {"xxh3": 0}
    counts: dict[str, int] = {}
    for key in catalog.series_keys():
        kind = other.get(tuple(key), "xxh3")
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def _ends(steps: list[int]) -> dict[str, int | None]:
    return {"count": len(steps), "first": steps[0] if steps else None, "last": steps[-1] if steps else None}


def _span(steps: list[int]) -> str:
    if not steps:
        return "none"
    return f"{len(steps)} ({steps[0]}..{steps[-1]})"
