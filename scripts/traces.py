"""The one reader of the benchmark scripts' profiler traces (jax.profiler.trace(...,
create_perfetto_trace=True) writes the trace viewer's *.trace.json.gz beside its xplane)."""

from __future__ import annotations

import glob
import gzip
import json
import os


def load_trace(trace_dir: str) -> tuple[list[dict], dict, set] | None:
    """The newest *.trace.json.gz under trace_dir -> (its complete events ("ph" X, with a "ts"),
    {(pid, tid): thread name}, the pids of device processes ("/device:...")); None without one."""
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True), key=os.path.getmtime)
    if not files:
        return None
    with gzip.open(files[-1]) as f:
        trace = json.load(f).get("traceEvents", [])
    lines = {(e.get("pid"), e.get("tid")): e.get("args", {}).get("name", "") for e in trace
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    devices = {e.get("pid") for e in trace if e.get("ph") == "M" and e.get("name") == "process_name"
               and str(e.get("args", {}).get("name", "")).startswith("/device:")}
    return [e for e in trace if e.get("ph") == "X" and "ts" in e], lines, devices


def on_stream(e: dict, lines: dict, devices: set) -> bool:
    """Whether an event is on a device's "Stream" line (XLA:GPU's kernels and copies; not the
    derived lines, "XLA Ops" and such, which repeat them)."""
    return e.get("pid") in devices and lines.get((e.get("pid"), e.get("tid")), "").startswith("Stream")
