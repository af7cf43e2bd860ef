"""One layer at real dimensions: wall time of a `jit_forward` step (its program compiled ahead of
time with its plan's compiler options, as the serving engine calls its programs; cache donated)
per batch kind, latent cache format and variant, the variants interleaved in one run.

    python scripts/bench_layer.py [--kinds a,b] [--variants static,cond,no_skip,xla,masked,sparse] [--kv bf16,fp8]
                                  [--repeats 7] [--out results.json] [--profile DIR]   # GPU, deepseek_v32
    (each kind's rows are printed, and --out rewritten, as soon as the kind is measured)
    python scripts/bench_layer.py --smoke    # CPU: tiny config, 3 kinds, every variant, 1 repeat

Variants: static (plan_batch's default, kernels="auto": the exact program), cond (dispatch="cond",
the serving program, with an engine's BucketPolicy.for_limits at 256 sequences of up to 128K
tokens: one program per row bucket and stage set), no_skip
(skip_indexer=False: every row scored), cond_2x (cond with the row bucket doubled:
the same rows in a bucket of 2N, what padding rows cost the serving program), static_graphs_off
(the static program compiled with XLA's command buffers off, as programs with conditionals are:
model.compiler_options), cond_graphs (the cond program with every command type in the graphs,
its conditionals too, as CUDA conditional nodes: no host round trip at a conditional),
cond_graphs_around (the cond program with XLA's default command buffers: graphs between the
conditionals, each branch's body its own graph), cond_slices and cond_2x_slices (cond and
cond_2x compiled with XLA's dynamic-slice fusion too: a library call, cuBLAS's GEMM among them,
reads its operand's row slice and writes its result's in place instead of a copy; XLA's default
is off), cond_baked and cond_2x_baked (cond and cond_2x with the batch's stage sizes compiled in
as constants: no conditional, XLA's default command buffers; one program per combination of
sizes, so not a serving program: what the cond program's conditionals cost, the round trips and
the bucket-sized tensors between stages), xla (static plan, kernels="xla"), masked and sparse
(prefill_route forced: every prefill longer than index_topk as masked MHA, or sparse). Hidden states are
random; every cache slot holds random values of the cache's dtypes (contents do not change the
work). Each call takes the cache the previous call returned (it is donated). A round times every
variant once (the order alternates round by round): back-to-back calls, at least ~20 ms of them,
then block_until_ready; the median over rounds is reported, after compilation and a warm-up call.
A variant that fails (out of memory, say: XLA's indexer materialises [rows, heads, keys]) is
reported with its error and the run goes on; a variant whose plan is the static one (no_skip
on the sparse route: nothing to skip; masked or sparse where the plan picks that route) is not
timed again.

Columns: kv (latent cache format), kind (batch), rows (real rows / plan.num_tokens, the bucket),
route (the static plan's: dense | masked | sparse; masked: its dense program has masked rows), variant, ms (median per step), min (fastest round),
vs static (ms / the static variant's ms), first (s: the first call, compile included), dispatch
(ms: how long a call takes to return with the device idle, median of DISPATCH_CALLS: the
host's launch, or more where the program waits on the host), rel_err (||out - out_static|| / ||out_static|| over
the real rows, of the last call), vs xla (the same against the xla variant's output, when it ran:
which of two variants that differ is off the reference).

--profile DIR also writes a jax.profiler trace of 3 steps per (kind, kv, variant) under DIR and
prints the variant's op time per step by the layer's named scopes (projections, cache_write,
indexer_queries, indexer_logits, indexer_topk, dense_kv_up, dense_mha, sparse_attention, o_proj),
then the time outside them by the layer function that emitted the ops ("forward (other)": forward
itself; "(control flow)": a cond's or loop's own time), then the unattributed remainder, and the
coverage: the traced op time per step (GPU kernels and copies; on CPU, XLA's thunks) and the share
of it in named scopes and attributed at all. Every instruction of the compiled module (`HloScopes`:
entry, cond branches, loop and fusion bodies) gets a scope from its op_name metadata; each trace
event is matched to its instruction (`trace_breakdown`), on the GPU by the event's `hlo_op` arg
(the thunk's instruction) or, under XLA's command buffers (hlo_op "command_buffer_N"), by the
kernel's name (HloScopes.event_instructions says which event fields it relies on). --out rows
then carry profile_ms_per_step ({scope: ms}), profile_ops_ms_per_step ({scope: [[op, ms], ...]}:
the scope's TOP_OPS ops by time, each "instruction opcode result-type", printed under its named
scope), profile_traced_ms, profile_named_share and profile_attributed_share.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import statistics
import sys
import time
from collections import Counter, defaultdict

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (also when a test loads it by path)

from jax_sparse_mla import MLAConfig, Request, init_cache, init_params, jit_forward, plan_batch  # noqa: E402
from jax_sparse_mla.model import COMMAND_BUFFERS_OFF, DEFAULT_COMMAND_TYPES, compiler_options, forward  # noqa: E402
from jax_sparse_mla.plan import BucketPolicy  # noqa: E402
from traces import load_trace, on_stream  # noqa: E402

KINDS = {  # name -> [(context_len, query_len)] per request
    "prefill_8x256": [(0, 256)] * 8, "prefill_4x1024": [(0, 1024)] * 4,
    "prefill_4k": [(0, 4096)], "prefill_8k": [(0, 8192)], "prefill_16k": [(0, 16384)], "prefill_32k": [(0, 32768)],
    "chunk_4k_after_4k": [(4096, 4096)], "chunk_4k_after_28k": [(28672, 4096)],
    "chunk_2k_after_6k": [(6144, 2048)],  # 2048 scored rows of one sequence (cond: 256 sequences)
    "decode_64x4k": [(4096, 1)] * 64, "decode_128x4k": [(4096, 1)] * 128,
    "decode_64x32k": [(32768, 1)] * 64, "decode_128x32k": [(32768, 1)] * 128,
    "mixed_2x1024_64x4k": [(0, 1024)] * 2 + [(4096, 1)] * 64,
    "pad50_4097": [(0, 4097)],  # bucket 8192: ~50% padding rows
}
SMOKE_KINDS = {"decode_4x40": [(40, 1)] * 4, "mixed_12_4x40": [(0, 12)] + [(40, 1)] * 4,  # tiny: sparse, dense,
               "prefill_40": [(0, 40)]}  # masked
VARIANTS = {  # name -> (plan_batch options, kernels)
    "static": ({}, "auto"), "static_graphs_off": ({}, "auto"),  # the static program, XLA's command buffers off
    "cond": ({"dispatch": "cond"}, "auto"),
    "cond_2x": ({"dispatch": "cond"}, "auto"),  # the same rows in a row bucket twice cond's
    "no_skip": ({"skip_indexer": False}, "auto"), "xla": ({}, "xla"),
    "masked": ({"prefill_route": "masked"}, "auto"), "sparse": ({"prefill_route": "sparse"}, "auto"),
    "cond_graphs": ({"dispatch": "cond"}, "auto"), "cond_graphs_around": ({"dispatch": "cond"}, "auto"),
    "cond_slices": ({"dispatch": "cond"}, "auto"), "cond_2x_slices": ({"dispatch": "cond"}, "auto"),
    "cond_baked": ({"dispatch": "cond"}, "auto"), "cond_2x_baked": ({"dispatch": "cond"}, "auto"),
}
BAKED = ("cond_baked", "cond_2x_baked")  # compiled with the batch's stage sizes as constants (baked_forward)
# (XLA's command-buffer update mode is not among them: it takes effect only set process-wide, in
# XLA_FLAGS before jax starts, where it switches the client's allocator; docs/design/dispatch.md)
OPTIONS = {  # variant -> the XLA compiler options its program is compiled with (others: jit_forward's)
    "static_graphs_off": COMMAND_BUFFERS_OFF, "cond_graphs_around": {},
    "cond_graphs": {"xla_gpu_enable_command_buffer": DEFAULT_COMMAND_TYPES + ",CONDITIONAL,WHILE"},
    **{v: {} for v in BAKED}}  # (no conditional left: XLA's defaults)
SLICE_FUSION = {"xla_gpu_enable_dynamic_slice_fusion": True}
ADDED_OPTIONS = {"cond_slices": SLICE_FUSION, "cond_2x_slices": SLICE_FUSION}  # variant -> added to its plan's
DISPATCH_CALLS = 10
KV = {"bf16": "bfloat16", "fp8": "fp8"}
LIBRARY_SCOPES = ("projections", "cache_write", "indexer_queries", "indexer_logits", "indexer_topk",
                  "dense_kv_up", "dense_mha", "sparse_attention", "o_proj")  # jax_sparse_mla.model's scopes


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    csv = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--smoke", action="store_true", help="tiny config on CPU, 3 kinds, 1 repeat")
    p.add_argument("--kinds", type=csv, default=None, help=f"default: all of {','.join(KINDS)}")
    p.add_argument("--variants", type=csv, default=list(VARIANTS))
    p.add_argument("--kv", type=csv, default=list(KV), help="latent cache formats: bf16,fp8")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 7; 1 with --smoke)")
    p.add_argument("--out", default=None, help="write every row as JSON here")
    p.add_argument("--profile", default=None, metavar="DIR", help="trace dir; prints a per-scope breakdown")
    a = p.parse_args(argv)
    kinds = SMOKE_KINDS if a.smoke else KINDS
    a.kinds = a.kinds or list(kinds)
    for name, known in (("kinds", kinds), ("variants", VARIANTS), ("kv", KV)):
        bad = [x for x in getattr(a, name) if x not in known]
        if bad:
            p.error(f"unknown {name} {bad}; one of {list(known)}")
    a.repeats = a.repeats or (1 if a.smoke else 7)
    return a


def random_cache(config: MLAConfig, num_pages: int, key):
    """A cache whose every slot holds random values of its dtypes (scales: powers of two)."""
    shapes = jax.eval_shape(lambda: init_cache(config, num_pages))

    @jax.jit
    def fill(key):
        out = {}
        for i, f in enumerate(dataclasses.fields(shapes)):
            s = getattr(shapes, f.name)
            if s is None:
                out[f.name] = None
            elif f.name.endswith("scale"):
                out[f.name] = 2.0 ** jax.random.randint(jax.random.fold_in(key, i), s.shape, -8, -4).astype(s.dtype)
            else:
                scale = 8.0 if jnp.dtype(s.dtype).itemsize == 1 else 1.0  # e4m3: use its range
                out[f.name] = (scale * jax.random.normal(jax.random.fold_in(key, i), s.shape)).astype(s.dtype)
        return dataclasses.replace(shapes, **out)

    return fill(key)


def batch(config, specs):
    """Requests over pages 1.. in order (page 0 unused) and the page count they need."""
    page, start, requests = config.page_size, 1, []
    for c, q in specs:
        n = -(-(c + q) // page)
        requests.append(Request(c, q, list(range(start, start + n))))
        start += n
    return requests, start


def step_time(step, cache, reps: int):
    """ms per call of `reps` back-to-back calls, each taking the cache the last one returned."""
    t0 = time.perf_counter()
    for _ in range(reps):
        out, cache = step(cache)
    jax.block_until_ready((out, cache))
    return (time.perf_counter() - t0) / reps * 1e3, out, cache


# ------------------------------------------------------------------------------------------------
# --profile: op time by named scope. The compiled module's instructions, in every computation
# (the entry, conditional branches, while bodies, fusion bodies, calls such as XLA:GPU's command
# buffers), each get a scope; the trace's op events are mapped to instructions and add their
# self time to the instruction's scope.
# ------------------------------------------------------------------------------------------------

def _tables(text: str) -> dict[str, dict[int, str]]:
    """The compiled module's stack-frame tables: section -> {id: line body}."""
    tables, section = defaultdict(dict), None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
        elif section and (m := re.match(r"^(\d+) (.*)$", line)):
            tables[section][int(m.group(1))] = m.group(2)
        else:
            section = None
    return tables


def _frames(tables, frame_id: int) -> list[tuple[str, str]]:
    """(file, function) of a stack frame and its callers, innermost first (parent ids print +1)."""
    out, seen = [], set()
    while frame_id in tables["StackFrames"] and frame_id not in seen:
        seen.add(frame_id)
        loc_id, parent = map(int, re.findall(r"=(\d+)", tables["StackFrames"][frame_id]))
        loc = dict(re.findall(r"(\w+)=(\d+)", tables["FileLocations"].get(loc_id, "")))
        out.append((tables["FileNames"].get(int(loc.get("file_name_id", 0)), "?").strip('"'),
                    tables["FunctionNames"].get(int(loc.get("function_name_id", 0)), "?").strip('"')))
        frame_id = parent - 1
    return out


DISPATCHERS = ("forward", "_dense_program", "_sparse_program", "_attend_sparsely", "_cond_program", "_switch",
               "_over_rows")  # and the branches' closures (lambdas, "<locals>.run")
UNATTRIBUTED = "(unattributed)"
CONTROL_FLOW = ("conditional", "while", "call")
NO_KERNEL = ("parameter", "constant", "tuple", "get-tuple-element", "bitcast")  # no work of their own
CONTROL_FLOW_SCOPE = "(control flow)"  # a cond's or loop's own time outside the named scopes (predicate, dispatch)
PROFILED_STEPS = 3


def _named(op_name: str | None) -> str | None:
    """The innermost of the library's named scopes in an op_name, or None."""
    named = [p for p in (op_name or "").split("/") if p in LIBRARY_SCOPES]
    return named[-1] if named else None


def _function_scope(frames) -> str:
    """An op outside the named scopes: the outermost function of the layer (jax_sparse_mla/)
    below forward and the program dispatchers on its stack: mla_projections, _dense_prefill,
    _put_rows, ...; "linear" called by forward itself is o_proj; none: "forward (other)"."""
    ours = [fn for f, fn in reversed(frames) if "jax_sparse_mla" in f]  # outermost first
    ours = ours[max((i + 1 for i, fn in enumerate(ours) if fn in DISPATCHERS), default=0):]  # (PlanJit.lower is above)
    while ours and (ours[0] == "<module>" or ours[0].endswith("<lambda>") or ".<locals>." in ours[0]):
        ours = ours[1:]
    if not ours:
        return "forward (other)"
    return "o_proj" if ours == ["linear"] else ours[0]


@dataclasses.dataclass(frozen=True)
class _Instruction:
    computation: str
    opcode: str
    operands: tuple[str, ...]
    op_name: str | None  # metadata op_name (None: no metadata)
    frame: int | None  # metadata stack_frame_id
    dedup: str | None  # metadata deduplicated_name: the instruction whose kernel this one runs
    calls: tuple[str, ...]  # computations it calls (fusion body, branches, loop body, call)
    shape: str  # its result type without layouts: "f32[128,128,512]", "(bf16[8], s32[])"


_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
                    r"|\b(?:branch_computations|called_computations)=\{([^}]*)\}")


def _type_end(rest: str) -> int:
    """Where the result type at the start of an instruction's right-hand side ends (a tuple type
    in parentheses, else its first token)."""
    if not rest.startswith("("):
        return len(rest.split(None, 1)[0]) if rest.strip() else 0
    depth = 0
    for i, ch in enumerate(rest):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
            return i + 1
    return len(rest)


def _operation(rest: str) -> tuple[str, tuple[str, ...]]:
    """(opcode, operand names) of an instruction's right-hand side: `type opcode(operands), attributes`
    (a tuple type in parentheses)."""
    i = _type_end(rest)
    m = re.compile(r"[^\s(]*\s+([\w\-]+)\(").match(rest, i)
    if not m:
        return "?", ()
    depth, j = 0, m.end() - 1
    for j in range(m.end() - 1, len(rest)):
        depth += (rest[j] == "(") - (rest[j] == ")")
        if depth == 0:
            break
    return m.group(1), tuple(re.findall(r"%([\w.\-]+)", rest[m.end():j]))


def _result_shape(rest: str) -> str:
    """An instruction's result type (the start of its right-hand side), layouts dropped."""
    return re.sub(r"\{[^{}]*\}", "", rest[:_type_end(rest)])


class HloScopes:
    """Every instruction of a compiled HLO module (`compiled.as_text()`) and its scope.

    An instruction's scope: the innermost of LIBRARY_SCOPES in its metadata op_name
    ("jit(forward)/cond/branch_1_fun/sparse_attention/..."). One with no op_name (XLA made it: a
    copy, a layout change, a fusion of such) takes the most common named scope of its fused
    computation's instructions, else of its users, else of its operands (transitively through
    others without one). Else, the named scope of an instruction calling its computation (an op
    of a branch or loop body under a scoped cond or while). An op outside the named scopes is
    named by the function of the layer that emitted it (its stack frame, `_function_scope`)."""

    def __init__(self, text: str):
        module = re.match(r"HloModule ([\w.\-]+)", text)
        self.module = module.group(1) if module else None
        self.instructions: dict[str, _Instruction] = {}
        computation = None
        for line in text.splitlines():
            if m := re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line):
                computation = m.group(1)
            elif line.startswith("}"):
                computation = None
            elif computation and (m := re.match(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$", line)):
                name, rest = m.groups()
                op_name = re.search(r'\bop_name="([^"]*)"', rest)
                frame = re.search(r"\bstack_frame_id=(\d+)", rest)
                dedup = re.search(r'\bdeduplicated_name="([^"]*)"', rest)
                calls = tuple(c.strip().lstrip("%") for m in _CALLS.finditer(rest)
                              for c in (m.group(1) or m.group(2)).split(",") if c.strip())
                self.instructions[name] = _Instruction(computation, *_operation(rest), op_name and op_name.group(1),
                                                       frame and int(frame.group(1)), dedup and dedup.group(1), calls,
                                                       _result_shape(rest))
        self._members, self._position, self._callers = defaultdict(list), {}, defaultdict(list)
        callers = self._callers
        edges = {"users": defaultdict(list), "operands": defaultdict(list)}
        for name, ins in self.instructions.items():
            self._position[name] = len(self._members[ins.computation])
            self._members[ins.computation].append(name)
            for c in ins.calls:
                callers[c].append(name)
            for o in ins.operands:
                edges["users"][o].append(name)
                edges["operands"][name].append(o)
        self._reach: dict[str, frozenset[str]] = {}

        def own(name: str) -> str | None:  # from its op_name; with none, its fused computation's
            ins = self.instructions[name]
            if ins.op_name is not None:
                return _named(ins.op_name)
            body = Counter(s for c in ins.calls for i in self._members[c]
                           if (s := _named(self.instructions[i].op_name)))
            return body.most_common(1)[0][0] if body else None

        def along(name: str, direction: str, memo: dict) -> str | None:  # own, else its users' (operands')
            if name not in memo:
                memo[name] = own(name)
                if memo[name] is None and self.instructions[name].op_name is None:
                    found = Counter(s for n in edges[direction][name] if (s := along(n, direction, memo)))
                    memo[name] = found.most_common(1)[0][0] if found else None
            return memo[name]

        down, up, memo = {}, {}, {}

        def named(name: str) -> str | None:  # the named scope of an instruction, or None
            if name not in memo:
                scope = along(name, "users", down) or along(name, "operands", up)
                for caller in callers[self.instructions[name].computation] if scope is None else ():
                    scope = scope or named(caller)
                memo[name] = scope
            return memo[name]

        tables = _tables(text)
        self.scope = {name: named(name) or (CONTROL_FLOW_SCOPE if ins.opcode in CONTROL_FLOW else
                                            _function_scope(_frames(tables, ins.frame) if ins.frame else []))
                      for name, ins in self.instructions.items()}
        # kernel name -> instructions: a fusion's kernel is named by its instruction (or the one
        # whose kernel it reuses), '.' and '-' as '_'; a Pallas kernel by a component of its custom
        # call's op_name (Mosaic GPU appends "_mosaic_gpu_kernel")
        self._kernels = defaultdict(set)
        for name, ins in self.instructions.items():
            if ins.opcode in CONTROL_FLOW:
                continue
            for key in (name, ins.dedup):
                if key:
                    self._kernels[re.sub(r"[.\-]", "_", key)].add(name)
            if ins.opcode == "custom-call":
                for part in (ins.op_name or "").split("/"):
                    self._kernels[part].add(name)

    def reachable(self, name: str) -> frozenset[str]:
        """The computations an instruction calls, transitively."""
        if name not in self._reach:
            out, todo = set(), list(self.instructions[name].calls)
            while todo:
                c = todo.pop()
                if c not in out:
                    out.add(c)
                    todo += [cc for i in self._members[c] for cc in self.instructions[i].calls]
            self._reach[name] = frozenset(out)
        return self._reach[name]

    def event_instructions(self, name: str, args: dict) -> set[str]:
        """The instructions a trace event may have run (its name and args). By its hlo_op arg, the
        instruction whose thunk it is (XLA:GPU kernels and copies, XLA:CPU thunks). Where hlo_op
        names a call or no instruction of the module (XLA:GPU command buffers launch their kernels
        under the buffer's name, "command_buffer_1"), by the kernel's name (the event's name):
        the fusions of that name (within the call's computations where any is, else in the module:
        a loop's kernels under a graph's WHILE node are named by the loop's fusions) or the Pallas
        custom calls (Mosaic GPU's "<name>_mosaic_gpu_kernel", Triton's "<name>" or "<name>__<n>")."""
        op = args.get("hlo_op")
        if op in self.instructions and self.instructions[op].opcode != "call":
            return {op}
        kernel = re.sub(r"__\d+$", "", name.removesuffix("_mosaic_gpu_kernel"))  # Triton adds __<n> to repeats
        found = self._kernels.get(re.sub(r"[.\-]", "_", kernel), set())
        if op in self.instructions:
            within = self.reachable(op)
            # else the module's: a kernel name held by several computations then has several
            # instructions, and the caller takes a scope only where they agree on one
            found = {i for i in found if self.instructions[i].computation in within} or found
        return found

    def unmatched_around(self, before: str | None, after: str | None, matched: set[str]) -> set[str]:
        """The instructions that may have run an event no name matches (a cuBLAS kernel in a
        command buffer) between events of the instructions `before` and `after` on its line: the
        work scheduled right after `before` and right before `after` in their computations (the
        text's order is the schedule) that no event's name matched, up to a matched or control-flow
        instruction; that control-flow instruction where there is no such work (a command buffer's
        set_case_condition kernel: its conditional). Where neither side finds any, the control-flow
        instructions calling the computation a scan left (`before`'s first: a graph's
        set_while_condition and predicate copy after a loop's condition: its while)."""
        out, left = set(), []
        for name, step in ((before, 1), (after, -1)):
            if name is None:
                continue
            computation = self.instructions[name].computation
            members, run = self._members[computation], []
            k = self._position[name] + step
            while 0 <= k < len(members) and members[k] not in matched:
                if self.instructions[members[k]].opcode in CONTROL_FLOW:
                    run = run or [members[k]]
                    break
                if self.instructions[members[k]].opcode not in NO_KERNEL:
                    run.append(members[k])
                k += step
            if not run and not 0 <= k < len(members):
                left.append({c for c in self._callers[computation] if self.instructions[c].opcode in CONTROL_FLOW})
            out.update(run)
        return out or next((c for c in left if c), set())


def _self_times(events, scopes: HloScopes) -> list[float]:
    """Each event's self time (us): a control-flow instruction's event (XLA:CPU runs a
    conditional's branch or a loop's body inside it, on its thread and others) less the union of
    the events of the instructions it calls that overlap it; any other event its duration."""
    out = []
    for e in events:
        op = scopes.instructions.get(e.get("args", {}).get("hlo_op"))
        t0, t1 = e["ts"], e["ts"] + e.get("dur", 0)
        if op is None or op.opcode not in CONTROL_FLOW:
            out.append(t1 - t0)
            continue
        within = scopes.reachable(e["args"]["hlo_op"])
        inner = sorted((max(c["ts"], t0), min(c["ts"] + c.get("dur", 0), t1)) for c in events
                       if c["ts"] < t1 and c["ts"] + c.get("dur", 0) > t0 and c is not e
                       and (ci := scopes.instructions.get(c.get("args", {}).get("hlo_op")))
                       and ci.computation in within)
        covered, end = 0.0, t0
        for a, b in inner:
            covered += max(0.0, b - max(a, end))
            end = max(end, b)
        out.append(t1 - t0 - covered)
    return out


def trace_breakdown(trace_dir: str, scopes: HloScopes, steps: int) -> dict:
    """ms per step by scope over the newest trace under trace_dir (the trace viewer's
    *.trace.json.gz): {"ms": {scope: ms}, "ops": {scope: [(op, ms), ...]} (its TOP_OPS largest,
    each "instruction opcode result-type" where the event is one instruction's, else the event's
    name), "traced_ms": ms, "named_share", "attributed_share"}.

    Counted, each by its self time: the events on a device's "Stream" lines (XLA:GPU kernels and
    copies; not the derived lines, "XLA Ops" and such, which repeat them) and elsewhere those with
    an hlo_op arg (XLA:CPU's thunks, on the host's threads); of this module where their
    hlo_module arg names it. An event's instructions (HloScopes.event_instructions; for an event no
    name matches, HloScopes.unmatched_around the nearest matched events on its line) give its
    scope where they agree on one; where they name several, the scope of the nearest event of one
    scope on its line before it, else after it, where that scope is among theirs (a kernel name
    that fusions of several scopes share: a graph's loop kernels); else the named scope in its
    name arg (a GPU event's op_name, cut at its first comma); with neither, the scope of the
    events on both sides where they agree (a graph's own copies and condition kernels); else it
    is UNATTRIBUTED.
    named_share: the share of the traced time in LIBRARY_SCOPES; attributed_share: in any scope
    (named, or the function that emitted the op, or control flow)."""
    loaded = load_trace(trace_dir)
    if loaded is None:
        return {"ms": {}, "ops": {}, "traced_ms": 0.0, "named_share": 0.0, "attributed_share": 0.0,
                "note": "no trace file"}
    events, lines, devices = loaded
    modules = {e.get("args", {}).get("hlo_module") for e in events}

    def counted(e):  # a device's stream events; elsewhere (XLA:CPU's threads) those with an hlo_op
        args = e.get("args", {})
        if e.get("pid") in devices:
            if not on_stream(e, lines, devices):
                return False
        elif "hlo_op" not in args:
            return False
        return scopes.module not in modules or args.get("hlo_module") in (None, scopes.module)

    events = sorted((e for e in events if counted(e)), key=lambda e: e["ts"])
    found = [scopes.event_instructions(e.get("name", ""), e.get("args", {})) for e in events]
    matched = set().union(*found)
    by_line = defaultdict(list)
    for i, e in enumerate(events):
        by_line[(e.get("pid"), e.get("tid"))].append(i)

    def beside(line, k, known):  # known's values of the nearest events in it before and after line[k]
        sides = (range(k - 1, -1, -1), range(k + 1, len(line)))
        return [next((known[line[j]] for j in side if line[j] in known), None) for side in sides]
    one = {i: next(iter(f)) for i, f in enumerate(found) if len(f) == 1}  # event -> its one instruction
    claimed = list(found)  # each event's instructions; for one no name matches, unmatched_around its
    for line in by_line.values():  # nearest neighbours of one instruction (never itself a neighbour)
        for k, i in enumerate(line):
            if not found[i]:
                claimed[i] = scopes.unmatched_around(*beside(line, k, one), matched)
    candidates = [{scopes.scope[n] for n in c} for c in claimed]
    resolved = {i: next(iter(c)) for i, c in enumerate(candidates) if len(c) == 1}
    for line in by_line.values():  # a kernel name that fusions of several scopes share (a graph's loop kernels):
        for k, i in enumerate(line):  # the nearest one-scope event's scope, before it, else after it, if a candidate
            if len(candidates[i]) > 1:
                scope = next((s for s in beside(line, k, resolved) if s in candidates[i]), None)
                if scope is not None:
                    candidates[i] = {scope}
    known = {i: next(iter(c)) for i, c in enumerate(candidates) if len(c) == 1}
    for line in by_line.values():  # no instruction and no named scope of its own (a graph's copies and
        for k, i in enumerate(line):  # condition kernels): the scope of the events on both sides where they agree
            if not candidates[i] and _named(events[i].get("args", {}).get("name")) is None:
                before, after = beside(line, k, known)
                if before is not None and before == after:
                    candidates[i] = {before}
    totals, ops = defaultdict(float), defaultdict(lambda: defaultdict(float))
    for i, (e, t) in enumerate(zip(events, _self_times(events, scopes))):
        scope = next(iter(candidates[i])) if len(candidates[i]) == 1 else None
        scope = scope or _named(e.get("args", {}).get("name")) or UNATTRIBUTED
        ins = {n for n in claimed[i] if scopes.scope[n] == scope}  # (those of its scope)
        ms = t / 1e3 / steps
        totals[scope] += ms
        ops[scope][_op_label(scopes, ins) if len(ins) == 1 else _event_label(e)] += ms
    traced = sum(totals.values())
    share = lambda keep: sum(t for s, t in totals.items() if keep(s)) / traced if traced else 0.0  # noqa: E731
    return {"ms": dict(sorted(totals.items(), key=lambda kv: -kv[1])), "traced_ms": traced,
            "ops": {scope: sorted(by_op.items(), key=lambda lt: -lt[1])[:TOP_OPS] for scope, by_op in ops.items()},
            "named_share": share(lambda s: s in LIBRARY_SCOPES), "attributed_share": share(lambda s: s != UNATTRIBUTED)}


TOP_OPS = 4  # the ops of a scope that --profile lists, by time


def _event_label(e) -> str:
    """A trace event of no one instruction: its name, and its hlo_op where it has one."""
    op = e.get("args", {}).get("hlo_op")
    return e.get("name", "?") + (f" (hlo_op {op})" if op else "")


def _op_label(scopes: HloScopes, instructions: set[str]) -> str:
    """A trace event's one instruction as "name opcode result-type" ("fusion.3 fusion f32[64,512]")."""
    name = next(iter(instructions))
    ins = scopes.instructions[name]
    return f"{name} {ins.opcode} {ins.shape}"


# ------------------------------------------------------------------------------------------------

ENGINE_LIMITS = dict(max_num_seqs=256, max_model_len=131072)  # the cond variant's BucketPolicy.for_limits
SMOKE_LIMITS = dict(max_num_seqs=8, max_model_len=256)


def variant_options(config, variant: str, smoke: bool, num_tokens: int) -> dict:
    """plan_batch's options of a variant for a batch of num_tokens rows (cond: an engine's buckets
    at ENGINE_LIMITS; the cond_2x variants: those with min_tokens twice the batch's row bucket)."""
    options = dict(VARIANTS[variant][0])
    if options.get("dispatch") == "cond":
        bp = BucketPolicy.for_limits(config, **(SMOKE_LIMITS if smoke else ENGINE_LIMITS))
        if variant.startswith("cond_2x"):
            bp = dataclasses.replace(bp, min_tokens=2 * BucketPolicy.round_up(num_tokens, bp.min_tokens))
        options["buckets"] = bp
    return options


@functools.partial(jax.jit, static_argnames=("plan", "config", "kernels", "branches"), donate_argnames=("cache",))
def baked_forward(params, hidden, cache, meta, *, plan, config, kernels, branches: tuple[int, ...]):
    """forward with meta.branches the constants `branches` (the batch's own): each stage at the
    size the batch takes, no conditional (model._switch calls the branch). Not a serving program
    (one per combination of stage sizes): what the cond program costs without its conditionals."""
    meta = dataclasses.replace(meta, branches=np.asarray(branches, np.int32))
    return forward(params, hidden, cache, meta, plan=plan, config=config, kernels=kernels)


def compiled_step(params, hidden, plan, meta, config, kernels: str, options: dict, baked: bool = False):
    """step(cache) -> (out, cache): jit_forward's program of `plan` compiled ahead of time (at
    its first call) with the XLA compiler options `options`, the cache donated. Every variant
    is called this way (as the serving engine calls its programs), so that their dispatch
    times differ only by their programs. step.compiled holds the executable once compiled (the
    profile reads its module)."""
    compiled = []

    def step(cache):
        if not compiled:
            if baked:
                lowered = baked_forward.lower(params, hidden, cache, meta, plan=plan, config=config, kernels=kernels,
                                              branches=tuple(int(b) for b in np.asarray(meta.branches)))
            else:
                lowered = jit_forward.lower(params, hidden, cache, meta, plan=plan, config=config, kernels=kernels)
            compiled.append(lowered.compile(compiler_options=options))
        return compiled[0](params, hidden, cache, meta)
    step.compiled = compiled
    return step


def run_kind(config, kv, params, kind, specs, args, key):
    requests, num_pages = batch(config, specs)
    n = sum(q for _, q in specs)
    plans = {v: plan_batch(config, requests, num_pages=num_pages, **variant_options(config, v, args.smoke, n))
             for v in args.variants}
    static_plan = plan_batch(config, requests, num_pages=num_pages)[0]
    route = static_plan.program
    widest = max(p.num_tokens for p, _ in plans.values())
    x = jax.random.normal(key, (widest, config.hidden_size), jnp.float32).astype(config.jnp_dtype)
    hidden = {v: x[:p.num_tokens] for v, (p, _) in plans.items()}  # the same rows, each variant's bucket
    cache = random_cache(config, num_pages, jax.random.fold_in(key, 1))
    steps = {v: compiled_step(params, hidden[v], *plans[v], config, VARIANTS[v][1],
                              OPTIONS.get(v, compiler_options(plans[v][0])) | ADDED_OPTIONS.get(v, {}), v in BAKED)
             for v in args.variants}
    ms, outs, errors, reps, first = defaultdict(list), {}, {}, {}, {}
    same = {v for v in args.variants if v != "static" and v not in OPTIONS and "static" in plans
            and VARIANTS[v][1] == "auto" and plans[v][0] == plans["static"][0]}  # e.g. no_skip on the sparse route
    for v, step in steps.items():  # compile, warm up, size the batches of calls
        if v in same:
            continue
        try:
            t0 = time.perf_counter()
            _, _, cache = step_time(step, cache, 1)
            first[v] = time.perf_counter() - t0
            once, _, cache = step_time(step, cache, 1)
            reps[v] = int(min(50, max(1, 20 / max(once, 1e-3))))
        except Exception as e:  # noqa: BLE001 (an OOM at 32K for XLA, say: report and go on)
            errors[v] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            if cache.latent.is_deleted():
                cache = random_cache(config, num_pages, jax.random.fold_in(key, 1))
    live = [v for v in args.variants if v not in errors and v not in same]
    for r in range(args.repeats):
        for v in (live if r % 2 == 0 else live[::-1]):
            t, outs[v], cache = step_time(steps[v], cache, reps[v])
            ms[v].append(t)
    dispatch = defaultdict(list)
    for _ in range(DISPATCH_CALLS):  # each call with the device idle: how long it takes to return
        for v in live:
            jax.block_until_ready(cache)
            t0 = time.perf_counter()
            out, cache = steps[v](cache)
            dispatch[v].append((time.perf_counter() - t0) * 1e3)
            jax.block_until_ready(out)
    base, oracle = outs.get("static"), outs.get("xla")
    rows = []
    for v in args.variants:
        row = {"kv": kv, "kind": kind, "rows": n, "bucket": plans[v][0].num_tokens, "route": route, "variant": v}
        if v in errors or v in same:
            row["error" if v in errors else "note"] = errors.get(v, "the static program (not timed again)")
        else:
            row.update(ms=statistics.median(ms[v]), min_ms=min(ms[v]), reps=reps[v], rounds=len(ms[v]),
                       first_s=first[v], dispatch_ms=statistics.median(dispatch[v]),
                       temp_mb=steps[v].compiled[0].memory_analysis().temp_size_in_bytes / 2**20)  # its workspace
            for key, ref in (("rel_err", base), ("rel_err_xla", oracle)):
                if ref is not None:
                    a, b = np.asarray(outs[v][:n], np.float32), np.asarray(ref[:n], np.float32)
                    row[key] = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
        rows.append(row)
    if args.profile and live:
        for v in live:
            row = next(r for r in rows if r["variant"] == v)
            trace_dir = os.path.join(args.profile, f"{kind}-{kv}-{v}")
            text = steps[v].compiled[0].as_text()  # the module the step runs
            with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
                _, _, cache = step_time(steps[v], cache, PROFILED_STEPS)
            profile = trace_breakdown(trace_dir, HloScopes(text), PROFILED_STEPS)
            row["profile_ms_per_step"] = profile.pop("ms")
            row["profile_ops_ms_per_step"] = profile.pop("ops")
            row.update({f"profile_{k}": x for k, x in profile.items()})
    del cache
    return rows


def print_profile(r) -> None:
    """A row's --profile breakdown: the named scopes, then the functions outside them, then what
    no instruction accounts for, then the coverage."""
    ms = r.get("profile_ms_per_step")
    if ms is None:
        return
    traced = r["profile_traced_ms"]
    named = {s: t for s, t in ms.items() if s in LIBRARY_SCOPES}
    other = {s: t for s, t in ms.items() if s not in LIBRARY_SCOPES and s != UNATTRIBUTED}
    for title, part in (("", named), ("outside the named scopes:", other),
                        ("", {UNATTRIBUTED: ms.get(UNATTRIBUTED, 0.0)})):
        if title and part:
            print(f"{'':<16}{title}")
        for scope, t in part.items():
            print(f"{'':<16}{scope:<40}{t:>10.3f} ms/step {100 * t / traced if traced else 0:>5.1f}%")
            if scope in LIBRARY_SCOPES:
                for label, op_t in r.get("profile_ops_ms_per_step", {}).get(scope, []):
                    print(f"{'':<20}{label[:70]:<72}{op_t:>8.3f}")
    note = f" ({r['profile_note']})" if "profile_note" in r else ""
    print(f"{'':<16}traced op time {traced:.3f} ms/step: {100 * r['profile_named_share']:.1f}% in named scopes, "
          f"{100 * r['profile_attributed_share']:.1f}% attributed{note}")


HEADER = (f"{'kv':<5}{'kind':<22}{'rows':>13} {'route':<7}{'variant':<18}{'ms':>10}{'min':>10}{'vs static':>10}"
          f"{'first':>8}{'dispatch':>10}{'rel_err':>10}{'vs xla':>10}")


def print_rows(rows):
    """One line per row (rows: one kind's, static first where timed), flushed."""
    static = {(r["kv"], r["kind"]): r.get("ms") for r in rows if r["variant"] == "static"}
    for r in rows:
        head = f"{r['kv']:<5}{r['kind']:<22}{str(r['rows']) + '/' + str(r['bucket']):>13} {r['route']:<7}{r['variant']:<19}"
        if "error" in r or "note" in r:
            print(head + (f"  failed: {r['error']}" if "error" in r else f"  {r['note']}"))
            continue
        s = static.get((r["kv"], r["kind"]))
        ratio = f"{r['ms'] / s:.3f}" if s else "-"
        err, err_xla = (f"{r[key]:.1e}" if key in r else "-" for key in ("rel_err", "rel_err_xla"))
        print(head + f"{r['ms']:>9.3f}{r['min_ms']:>10.3f}{ratio:>10}{r['first_s']:>8.1f}{r['dispatch_ms']:>10.3f}{err:>10}"
                     f"{err_xla:>10}")
        print_profile(r)
    sys.stdout.flush()


def write_rows(path: str, rows, dev) -> None:
    """Every row measured so far as JSON (rewritten after each kind: a run cut short keeps them)."""
    with open(path + ".tmp", "w") as f:
        json.dump({"device": dev.device_kind, "backend": jax.default_backend(), "argv": sys.argv[1:],
                   "date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)
    os.replace(path + ".tmp", path)


def main(argv=None) -> int:
    args = parse_args(argv)
    base = MLAConfig.tiny() if args.smoke else MLAConfig.deepseek_v32()
    kinds = SMOKE_KINDS if args.smoke else KINDS
    dev = jax.devices()[0]
    print(f"{dev.device_kind} ({jax.default_backend()}), {'tiny' if args.smoke else 'deepseek_v32'}, "
          f"repeats {args.repeats}, jax {jax.__version__}, {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    rows, t0 = [], time.perf_counter()
    print(HEADER, flush=True)
    for kv in args.kv:
        config = dataclasses.replace(base, kv_cache_dtype=KV[kv])
        params = init_params(config, jax.random.key(0))
        for i, kind in enumerate(args.kinds):
            kind_rows = run_kind(config, kv, params, kind, kinds[kind], args, jax.random.key(100 + i))
            print_rows(kind_rows)  # each kind as soon as it is measured
            rows += kind_rows
            if args.out:
                write_rows(args.out, rows, dev)
            print(f"  ({kv} {kind} done at {time.perf_counter() - t0:.0f} s)", flush=True)
        del params
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
