"""The CLI with its stdout a pipe, as in `stepdump stats RUN | grep c_attn` or a CI log: one full
line per row (TSV), full tensor names and full-precision numbers, --json/--csv on every data
command, --columns keeping step/kind/name, a logged NaN told apart from a value never logged, and
`show` of a module buffer.

Every command runs in a real subprocess whose stdout is a pipe and whose environment has no
COLUMNS (as in CI): one process runs every command line through ``stepdump.cli.main.main`` (the
function ``python -m stepdump`` calls), because each process pays for importing torch. The entry
points themselves are run by tests/test_cli.py (the installed script) and, as ``python -m
stepdump``, by tests/test_bundle.py and tests/test_report_live.py.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import subprocess
import sys
from collections import OrderedDict

import pytest
import torch
from helpers import record_run, tiny_batch
from torch import nn

import stepdump

# Longer than an 80-column table could show (the user's `grep c_attn` found "tra…").
BLOCK = "transformer_h_0_attention_block_with_a_rather_long_name"
C_ATTN = f"{BLOCK}.c_attn.weight"
RUNNING_MEAN = f"{BLOCK}.ln.running_mean"


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(8, 16)
        self.ln = nn.BatchNorm1d(16)  # module buffers: running_mean, running_var, num_batches_tracked
        self.proj = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.ln(self.c_attn(x)))


def _log(t: int, loss: torch.Tensor) -> dict[str, object]:
    if t == 1:
        return {"loss": float("nan"), "acc": 0.5}  # a NaN that was logged
    if t == 2:
        return {"acc": 0.25}  # loss not logged at all
    return {"loss": loss, "acc": 1 / 3}


def _env() -> dict[str, str]:
    """The environment of a CI job: a TERM, but no COLUMNS and no forced colours."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "FORCE_COLOR", "TTY_COMPATIBLE")}
    env["TERM"] = "xterm-256color"
    return env


# Runs each command line (a JSON list of argv lists) through main() in this one process and ends
# each one's output with a record separator and its exit code.
_DRIVER = r"""
import json, sys
from stepdump.cli.main import main
for argv in json.loads(sys.argv[1]):
    if argv == ["--console-line"]:  # a long message through the console every command prints with
        from stepdump.cli.common import console
        console.print("word " * 60 + "end")
        code = 0
    else:
        code = main(argv)
    sys.stdout.flush()
    sys.stdout.write("\x1e%d\n" % code)
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict([(BLOCK, _Block())]))
    return record_run(tmp_path_factory.mktemp("pipes") / "run", steps=5, model=model,
                      opt=torch.optim.Adam(model.parameters(), lr=1e-2), batch=tiny_batch, log=_log)


COMMANDS = {
    "stats_tsv": ["stats", "{run}"],
    "stats_json": ["stats", "{run}", "--json"],
    "stats_csv": ["stats", "{run}", "--csv"],
    "stats_cols": ["stats", "{run}", "--columns", "norm,nan"],
    "stats_cols_csv": ["stats", "{run}", "--columns", "nan", "--csv", "--kind", "grads"],
    "stats_cols_table": ["stats", "{run}", "--columns", "norm", "--table", "--kind", "params", "--limit", "3"],
    "scalars_tsv": ["scalars", "{run}"],
    "scalars_csv": ["scalars", "{run}", "--csv"],
    "scalars_json": ["scalars", "{run}", "--json"],
    "scalars_table": ["scalars", "{run}", "--table"],
    "show_buffer_json": ["show", "{run}", RUNNING_MEAN, "--values", "0", "--json"],
    "show_buffer_tsv": ["show", "{run}", RUNNING_MEAN, "--step", "2"],
    "show_csv": ["show", "{run}", C_ATTN, "--kind", "grads", "--step", "1", "--csv"],
    "show_buffer_as_param": ["show", "{run}", RUNNING_MEAN, "--kind", "params"],
    "info_json": ["info", "{run}", "--json"],
    "info_tsv": ["info", "{run}"],
    "info_csv": ["info", "{run}", "--csv"],
    "ls_json": ["ls", "{run}", "--json"],
    "ls_tsv": ["ls", "{run}"],
    "ls_csv": ["ls", "{run}", "--csv", "--kind", "buffers"],
    "ls_steps_json": ["ls", "{run}", "--all-steps", "--json"],
    "verify_json": ["verify", "{run}", "--json"],
    "console_line": ["--console-line"],
}


@pytest.fixture(scope="module")
def piped(run_dir):
    """{key: (exit code, stdout)} of every line of COMMANDS, all run in one subprocess into a pipe."""
    argvs = [[str(run_dir) if a == "{run}" else a for a in argv] for argv in COMMANDS.values()]
    proc = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(argvs)], capture_output=True,
                          text=True, timeout=300, env=_env(), check=False)
    assert proc.returncode == 0, proc.stderr
    parts = proc.stdout.split("\x1e")
    out: dict[str, tuple[int, str]] = {}
    prev = parts[0]
    for key, part in zip(COMMANDS, parts[1:], strict=True):
        code_line, _, rest = part.partition("\n")
        out[key] = (int(code_line), prev)
        prev = rest
    return out


def _ok(piped, key: str) -> str:
    code, text = piped[key]
    assert code == 0, f"{key}: exit {code}\n{text}"
    return text


def test_piped_stats_is_one_full_line_per_row(piped, run_dir):
    """`stepdump stats RUN | grep c_attn`: every row one TSV line, the full name and the
    full-precision norm in it, every row there (no 50-row limit), nothing cut with "…"."""
    text = _ok(piped, "stats_tsv")
    assert "…" not in text
    lines = text.splitlines()
    header = lines[0].split("\t")
    assert header[:3] == ["step", "kind", "name"] and "norm" in header and "numel" in header
    rows = [line.split("\t") for line in lines[1:]]
    assert all(len(r) == len(header) for r in rows), "a row is wrapped or has a tab in a value"
    with stepdump.open(run_dir) as run:
        df = run.stats()
    assert len(rows) == len(df) > 50
    grepped = [r for r in rows if "c_attn.weight" in "\t".join(r) and r[1] == "grads"]
    want = df[(df["kind"] == "grads") & (df["name"] == C_ATTN)]
    assert [int(r[0]) for r in grepped] == want["step"].tolist()
    assert {r[2] for r in grepped} == {C_ATTN}
    norm = header.index("norm")
    # full precision: the text is the float the run holds, not 6 digits of it
    assert [float(r[norm]) for r in grepped] == want["norm"].tolist()


def test_json_on_every_data_command(piped, run_dir):
    with stepdump.open(run_dir) as run:
        df = run.stats()
        names = {k: run.names(k) for k in run.kinds()}
        all_steps = run.all_steps
        buf = run.tensor(RUNNING_MEAN, run.steps[-1], kind="buffers")
    rows = json.loads(_ok(piped, "stats_json"))
    assert len(rows) == len(df) and {"step", "kind", "name", "norm", "nan"} <= set(rows[0])
    assert [r["norm"] for r in rows] == df["norm"].tolist()
    assert [r["step"] for r in json.loads(_ok(piped, "scalars_json"))] == all_steps
    shown = json.loads(_ok(piped, "show_buffer_json"))
    assert shown["kind"] == "buffers" and shown["shape"] == list(buf.shape)
    assert torch.equal(torch.tensor(shown["values"], dtype=buf.dtype), buf)
    info = json.loads(_ok(piped, "info_json"))
    assert info["steps_seen"]["count"] == len(all_steps) and info["tensors"]["buffers"] == 3
    assert info["size_on_disk_bytes"] > 0 and info["codec"] == "raw"
    assert json.loads(_ok(piped, "ls_json")) == names
    assert json.loads(_ok(piped, "ls_steps_json")) == all_steps
    verified = json.loads(_ok(piped, "verify_json"))
    assert verified["ok"] is True and verified["problems"] == [] and verified["blobs_checked"] > 0


def test_csv_on_every_data_command(piped, run_dir):
    with stepdump.open(run_dir) as run:
        df = run.stats()
        grad = run.tensor(C_ATTN, 1, kind="grads")
        buffers = run.names("buffers")
    stats = list(csv.DictReader(io.StringIO(_ok(piped, "stats_csv"))))
    assert [(int(r["step"]), r["kind"], r["name"]) for r in stats] == list(zip(df["step"], df["kind"], df["name"]))
    assert [float(r["norm"]) for r in stats] == df["norm"].tolist()
    show = dict(csv.reader(io.StringIO(_ok(piped, "show_csv"))))
    assert show["name"] == C_ATTN and show["kind"] == "grads" and show["shape"] == str(tuple(grad.shape))
    first8 = [float(v) for v in show["values"].removesuffix(" ...").split(", ")]
    assert torch.equal(torch.tensor(first8, dtype=grad.dtype), grad.reshape(-1)[:8])
    info = dict(csv.reader(io.StringIO(_ok(piped, "info_csv"))))
    assert info["status"] == "closed" and info["buffers tensors"] == "3"
    assert list(csv.reader(io.StringIO(_ok(piped, "ls_csv")))) == [["kind", "name"]] + [["buffers", n] for n in buffers]


def test_columns_keep_step_kind_name(piped):
    lines = _ok(piped, "stats_cols").splitlines()
    assert lines[0].split("\t") == ["step", "kind", "name", "norm", "nan"]
    assert all(len(line.split("\t")) == 5 for line in lines)
    assert next(csv.reader(io.StringIO(_ok(piped, "stats_cols_csv")))) == ["step", "kind", "name", "nan"]
    table = _ok(piped, "stats_cols_table")  # --table: a table even in a pipe, as wide as its content
    header = next(line for line in table.splitlines() if "norm" in line)
    assert [c.strip() for c in header.strip("┃ ").split("┃")] == ["step", "kind", "name", "norm"]
    assert f"{BLOCK}.c_attn.weight" in table and "…" not in table


def test_nan_and_not_logged_are_distinct(piped):
    """loss was NaN at step 1 and not logged at step 2: `nan` vs `-` (CSV: nan vs empty, JSON: "nan" vs null)."""
    tsv = [line.split("\t") for line in _ok(piped, "scalars_tsv").splitlines()]
    col = tsv[0].index("loss")
    by_step = {int(r[0]): r[col] for r in tsv[1:]}
    assert by_step[1] == "nan" and by_step[2] == "-" and math.isfinite(float(by_step[0]))
    rows = {int(r["step"]): r["loss"] for r in csv.DictReader(io.StringIO(_ok(piped, "scalars_csv")))}
    assert rows[1] == "nan" and rows[2] == ""
    records = {r["step"]: r for r in json.loads(_ok(piped, "scalars_json"))}
    assert records[1]["loss"] == "nan" and records[2]["loss"] is None and records[2]["acc"] == 0.25
    table_rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[1:-1]]
                  for line in _ok(piped, "scalars_table").splitlines() if line.startswith("│")}
    header = next(line for line in _ok(piped, "scalars_table").splitlines() if "loss" in line)
    tcol = [c.strip() for c in header.strip("┃ ").split("┃")].index("loss")
    assert table_rows["1"][tcol] == "nan" and table_rows["2"][tcol] == "-"


def test_show_finds_a_module_buffer(piped, run_dir):
    """No --kind: the name is a buffer, so show shows the buffer; --kind params still refuses it (exit 3)."""
    with stepdump.open(run_dir) as run:
        want = run.tensor(RUNNING_MEAN, 2, kind="buffers")
    fields = dict(line.split("\t", 1) for line in _ok(piped, "show_buffer_tsv").splitlines())
    assert fields["kind"] == "buffers" and fields["step"] == "2" and fields["name"] == RUNNING_MEAN
    values = torch.tensor([float(v) for v in fields["values"].removesuffix(" ...").split(", ")], dtype=want.dtype)
    assert torch.equal(values, want.reshape(-1)[:8])
    code, _ = piped["show_buffer_as_param"]
    assert code == 3


def test_info_and_ls_in_a_pipe(piped, run_dir):
    info = dict(line.split("\t", 1) for line in _ok(piped, "info_tsv").splitlines())
    assert info["codec"] == "raw" and info["buffers tensors"] == "3"
    assert info["size on disk"].endswith(("KiB", "MiB")), info["size on disk"]
    with stepdump.open(run_dir) as run:
        want = [["kind", "name"]] + [[k, n] for k in run.kinds() for n in run.names(k)]
    assert [line.split("\t") for line in _ok(piped, "ls_tsv").splitlines()] == want


def test_console_lines_do_not_wrap_in_a_pipe(piped):
    """Messages (check's findings, diff's summary, errors) print through the same console: one line each."""
    assert _ok(piped, "console_line") == "word " * 60 + "end\n"


def test_sizes_are_binary_units():
    from stepdump.cli.common import human_bytes

    assert human_bytes(512) == "512 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(3 * 2**20) == "3.0 MiB"
    assert human_bytes(5 * 2**30) == "5.0 GiB"
