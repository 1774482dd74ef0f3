"""stepdump info: what a run holds."""

from __future__ import annotations

import argparse
import datetime as dt

from rich.table import Table

from stepdump.cli.common import add_run_arg, console, human_bytes, open_run, run_bytes
from stepdump.cli.exitcodes import Exit

EXAMPLES = "examples:\n  stepdump info demo-run\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arg(p)


def run(args: argparse.Namespace) -> int:
    # Imported here, not at the top: `stepdump info --help` must not load torch.
    from stepdump.read.reader import ranked_stores

    with open_run(args.run) as r:
        m = r.meta
        steps, all_steps = r.steps, r.all_steps
        t = Table(show_header=False, title=str(r.path))
        t.add_row("status", "being written" if r.live else "closed")
        ranked = ranked_stores(r)
        if ranked:  # steps and names below are the primary rank's; sizes are over every rank
            dist = r.meta.get("distributed")
            world = dist.get("world_size", "?") if isinstance(dist, dict) else "?"
            t.add_row("ranks recorded", f"{', '.join(str(k) for k, _ in ranked)} (world size {world})")
            for k, store in ranked:
                t.add_row(f"rank {k}", f"{_span(store.all_steps)} steps, {len(store.steps)} stored in full")
        t.add_row("store format", str(r.format_version))
        t.add_row("written by", f"stepdump {m.get('stepdump_version')}, torch {m.get('torch_version')}")
        created = m.get("created")
        if created:
            t.add_row("created", dt.datetime.fromtimestamp(created).isoformat(timespec="seconds"))
        t.add_row("model / optimizer", f"{m.get('model_class')} / {m.get('optimizer_class')}")
        if m.get("scheduler_class"):
            t.add_row("scheduler", str(m["scheduler_class"]))
        t.add_row("steps seen", _span(all_steps))
        t.add_row("steps stored in full", _span(steps))
        t.add_row("steps with stats", _span(r.stats_steps))
        t.add_row("skipped steps", ", ".join(map(str, r.skipped_steps[:10])) or "none")
        stopped = m.get("recording_stopped")
        if isinstance(stopped, dict):  # the Recorder stepped aside (on_error="warn"): say so first
            t.add_row("[bold red]recording stopped[/]", f"at step {stopped.get('step')} ({stopped.get('where')}): "
                      f"{stopped.get('error')}; training went on unrecorded")
        for kind in r.kinds():
            t.add_row(f"{kind} tensors", str(len(r.names(kind))))
        t.add_row("capture", f"{', '.join(m.get('capture', []))}; full {m.get('every')}, stats {m.get('stats_every')}")
        t.add_row("codec", str(m.get("codec")))
        t.add_row("size on disk", human_bytes(run_bytes(r.path)))
        stored, raw = r.blob_bytes()
        if raw:
            t.add_row("tensor data", f"{human_bytes(stored)} stored, {human_bytes(raw)} raw ({stored / raw:.2f}×)")
        console.print(t)
    return Exit.OK


def _span(steps: list[int]) -> str:
    if not steps:
        return "none"
    return f"{len(steps)} ({steps[0]}..{steps[-1]})"
