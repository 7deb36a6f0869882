"""Whether the state inside a checkpoint is right, not only intact: the checks on what the
tensors hold (``values``), on the optimizer's own invariants (``optimizer``) and against the
previous verified checkpoint of the job (``lineage``), from the statistics the one read took
(``values.RecordValues``) and the manifests, never reading an older checkpoint's files again.

The faults they catch were all reported with valid CRCs: NaN weights in replicated shards, an
async save whose optimizer step ran one ahead of its weights, re-saves byte for byte the first
one, and a cached save plan that left a whole tensor out of the files and of ``.metadata``.
"""

import hashlib
import math
import re
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from tasks.checkpoint.checks import VerifyCheck
from tasks.checkpoint.dcp import DcpIndex
from tasks.checkpoint.values import RecordValues, dtype_name

_SQ = re.compile(r"(^|\.)exp_avg_sq(\.|$)")
_MOMENT = re.compile(r"(^|\.)exp_avg(_sq)?(\.|$)")
_MAIN_PARAM = re.compile(r"(^|\.)(fp32_param|param)(\.|$)")
_STEP_TENSOR = re.compile(r"(^|\.)step(\.|$)")
_PER_PARAM = "optimizer.state."
_ALIGNMENT = 64  # the distributed optimizer's parameter alignment in its buffers (elements)
_DP_GROUP = r"optimizer\.distributed\.dp_group_idx_\d+"
# A lineage warning that says the check had nothing to compare with: the verdict says so too.
LINEAGE_NOT_CHECKED = "lineage not checked"


@dataclass
class TensorStats:
    """One tensor's statistics over all its chunks, as the manifest keeps them."""

    dtype: str
    shape: list[int]
    numel: int
    digest: str  # of the chunks' element CRCs: equal digests, equal tensors
    nan: int = 0
    inf: int = 0
    min: float | None = None
    max: float | None = None
    norm: float | None = None  # L2 norm of the finite elements; None for integer tensors
    value: float | None = None  # a one-element tensor's element
    change: float | None = None  # norm now / norm at the previous verified checkpoint


@dataclass
class Finding:
    check: VerifyCheck
    file: str | None
    detail: str


@dataclass
class Content:
    """What the three checks found: failures, warnings and the lines that say what passed."""

    failures: list[Finding] = field(default_factory=list)
    warnings: list[Finding] = field(default_factory=list)
    passes: dict[VerifyCheck, str] = field(default_factory=dict)
    unchecked: dict[VerifyCheck, str] = field(default_factory=dict)

    def fail(self, check: VerifyCheck, file: str | None, detail: str) -> None:
        self.failures.append(Finding(check, file, detail))


def _padding(fqn: str, chunk) -> bool:
    """A dp_reshardable bucket's intra-param padding: saved as its own chunk of the bucket
    (``DistributedOptimizer.sharded_param_state_dp_reshardable``), never initialised (torch.empty),
    so its values mean nothing. It runs from a parameter's end to the next 64-element boundary,
    where the next parameter starts."""
    if not fqn.startswith("optimizer.distributed."):
        return False
    start, size = chunk.offsets[0], chunk.sizes[0]
    return start % _ALIGNMENT != 0 and (start + size) % _ALIGNMENT == 0 and size < _ALIGNMENT


def is_model(fqn: str) -> bool:
    return not fqn.startswith(("optimizer.", "rng_state", "common_state", "rerun_state_machine"))


def _misfit(content: Content, fqn: str, chunk, record, values, dtype: str, needed: int) -> None:
    """A chunk whose record holds no tensor, or not the dtype or size ``.metadata`` says."""
    where = f"tensor '{fqn}' chunk {list(chunk.offsets)}"
    if values is None:
        content.fail(VerifyCheck.VALUES, record.file, f"{where}: its record holds no tensor")
    elif values.dtype != dtype:
        content.fail(
            VerifyCheck.VALUES, record.file, f"{where}: stored as {values.dtype}, .metadata says {dtype}"
        )
    else:
        content.fail(
            VerifyCheck.VALUES,
            record.file,
            f"{where}: {values.bytes} bytes of elements, .metadata's {list(chunk.sizes)} of {dtype} "
            f"needs {needed}",
        )


def tensor_stats(
    index: DcpIndex, found: dict[tuple[str, int], RecordValues], read: set[str], content: Content
) -> dict:
    """Per tensor of ``.metadata``, its chunks' statistics joined; a chunk whose record holds no
    tensor, or another dtype or size than ``.metadata`` says, fails the values check. Only files
    in ``read`` (read whole, every CRC right) are judged: the others' failures are the files and
    crc checks' to report."""
    stats = {}
    for fqn, item in sorted(index.tensors.items()):
        dtype = dtype_name(item.properties.dtype)
        itemsize = item.properties.dtype.itemsize
        parts, digest = [], hashlib.blake2b(digest_size=8)
        for chunk in sorted(item.chunks, key=lambda c: tuple(c.offsets)):
            record = index.records.get((fqn, tuple(chunk.offsets)))
            if record is None or record.file not in read:
                continue  # the records, files or crc check says so
            values = found.get((record.file, record.offset))
            numel = math.prod(chunk.sizes)
            if values is None or values.dtype != dtype or values.bytes != numel * itemsize:
                _misfit(content, fqn, chunk, record, values, dtype, numel * itemsize)
                continue
            if not _padding(fqn, chunk):
                parts.append((chunk, record, values))
            digest.update(f"{list(chunk.offsets)}:{values.bytes}:{values.crc};".encode())
        if not parts:
            continue
        joined = TensorStats(dtype, list(item.size), sum(v.numel for _, _, v in parts), digest.hexdigest())
        if item.properties.dtype.is_floating_point:
            joined.norm = math.sqrt(sum(v.sumsq for _, _, v in parts))
            joined.nan = sum(v.nan for _, _, v in parts)
            joined.inf = sum(v.inf for _, _, v in parts)
            lows = [v.min for _, _, v in parts if v.min is not None]
            highs = [v.max for _, _, v in parts if v.max is not None]
            joined.min, joined.max = (min(lows), max(highs)) if lows else (None, None)
            second_moment = _SQ.search(fqn) is not None
            for chunk, record, v in parts:
                if v.nan or v.inf:
                    content.fail(
                        VerifyCheck.VALUES,
                        record.file,
                        f"tensor '{fqn}' chunk {list(chunk.offsets)}: {v.nan} NaN and {v.inf} Inf "
                        f"of {v.numel} elements",
                    )
                if second_moment and v.min is not None and v.min < 0:
                    content.fail(
                        VerifyCheck.OPTIMIZER,
                        record.file,
                        f"tensor '{fqn}' chunk {list(chunk.offsets)}: Adam's second moment has a negative "
                        f"element ({v.min:.3g}), which it cannot have",
                    )
        if joined.numel == 1:
            joined.value = parts[0][2].value
        stats[fqn] = joined
    floating = sum(1 for s in stats.values() if s.norm is not None)
    content.passes[VerifyCheck.VALUES] = f"{floating} floating-point tensors finite"
    return stats


def step_counters(
    common: dict, objects: dict[str, object], stats: dict[str, TensorStats]
) -> dict[str, float]:
    """Every optimizer step counter a checkpoint holds, by where it is: Megatron's common step
    (the plain optimizer's per-parameter steps, saved as one), the param groups' ``step`` (the
    distributed optimizer's: in the common state when fully reshardable, in each data-parallel
    group's ``optimizer`` object when dp_reshardable) and one-element ``step`` tensors (torch's
    per-parameter steps where a loop saves them)."""
    found: dict[str, float] = {}

    def walk(value, where: str) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                here = f"{where}.{key}"
                if key in ("common_step", "step") and _number(inner) is not None:
                    found[here] = _number(inner)
                else:
                    walk(inner, here)
        elif isinstance(value, (list, tuple)):
            for i, inner in enumerate(value):
                walk(inner, f"{where}[{i}]")

    walk(common.get("optimizer"), "common_state.optimizer")
    for key, value in sorted(objects.items()):
        walk(value, key)
    for fqn, s in stats.items():
        if fqn.startswith("optimizer.") and _STEP_TENSOR.search(fqn) and s.value is not None:
            found[fqn] = s.value
    return found


def _number(value) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if hasattr(value, "numel") and value.numel() == 1:
        return float(value.item())
    return None


def group_optimizer_objects(index: DcpIndex) -> list[str]:
    """The objects holding a dp_reshardable distributed optimizer's param groups, one per
    data-parallel group."""
    return sorted(k for k in index.objects if re.match(rf"^{_DP_GROUP}\.optimizer/shard_", k))


def check_optimizer(content: Content, iteration: int, args, steps: dict[str, float], previous) -> int | None:
    """The step counters agree with each other and never exceed the iteration; against the
    previous verified checkpoint's manifest, a job that cannot skip a step (no fp16 loss scaler)
    advanced the step by exactly the iterations between them, unless this run started without
    the saved optimizer."""
    if not steps:
        content.unchecked[VerifyCheck.OPTIMIZER] = "no optimizer step counter found"
        return None
    values = sorted(set(steps.values()))
    if len(values) > 1:
        listed = ", ".join(f"{where} = {value:g}" for where, value in sorted(steps.items())[:4])
        content.fail(VerifyCheck.OPTIMIZER, None, f"the optimizer's step counters disagree: {listed}")
    step = values[-1]
    where = max(steps, key=steps.get)
    if step > iteration:
        content.fail(
            VerifyCheck.OPTIMIZER,
            None,
            f"optimizer step {step:g} ({where}) is past the iteration {iteration}",
        )
    before = previous.optimizer_step if previous is not None else None
    if before is not None and VerifyCheck.OPTIMIZER not in {f.check for f in content.failures}:
        advanced, iterations = step - before, iteration - previous.iteration
        skipping = bool(getattr(args, "fp16", False))
        restarted = bool(getattr(args, "no_load_optim", False) or getattr(args, "finetune", False))
        if not restarted and (advanced > iterations or (not skipping and advanced != iterations)):
            content.fail(
                VerifyCheck.OPTIMIZER,
                None,
                f"optimizer step went from {before:g} at iteration {previous.iteration} to "
                f"{step:g}: {advanced:g} steps in {iterations} iterations",
            )
    content.passes[VerifyCheck.OPTIMIZER] = (
        f"{len(steps)} step counters agree at {step:g}, iteration {iteration}"
    )
    return int(step)


def check_claims(
    content: Content,
    index: DcpIndex,
    objects: set[str],
    common: dict,
    args,
    frozen: list[str],
    step: int | None,
) -> None:
    """What the common state says the checkpoint holds is there: the optimizer objects of every
    data-parallel group of a dp_reshardable save, and Adam's moments for every model tensor of a
    per-parameter one (and no moments of a tensor the model does not have) once the optimizer
    has taken a step (``step``: its counter, None when none was found)."""
    sharding = (common.get("content_metadata") or {}).get("distrib_optim_sharding_type")
    if getattr(args, "no_save_optim", False):
        return
    if getattr(args, "use_distributed_optimizer", False) and sharding == "dp_reshardable":
        groups = {m.group(1) for k in index.tensors if (m := re.match(rf"({_DP_GROUP})\.", k))}
        for group in sorted(groups):
            if f"{group}.optimizer" not in objects:
                content.fail(
                    VerifyCheck.LINEAGE,
                    None,
                    f"object '{group}.optimizer' is missing: the common state says "
                    "the distributed optimizer saved it (dp_reshardable)",
                )
        return
    per_param = [k for k in index.tensors if k.startswith(_PER_PARAM)]
    if not per_param or getattr(args, "optimizer", "adam") != "adam":
        return
    model = {k for k in index.tensors if is_model(k)}
    if not any(k.startswith(f"{_PER_PARAM}{m}.") for k in per_param for m in ("exp_avg", "exp_avg_sq")):
        # Adam makes its moments at its first step. An fp16 job skips its first iterations
        # while the loss scale falls from 2^32, so a save before its first step has none.
        if step:
            content.fail(VerifyCheck.LINEAGE, None, f"no Adam moments saved, after {step} optimizer steps")
        else:
            content.warnings.append(
                Finding(
                    VerifyCheck.LINEAGE, None, "no Adam moments saved: the optimizer has not taken a step yet"
                )
            )
        return
    for moment in ("exp_avg", "exp_avg_sq"):
        prefix = f"{_PER_PARAM}{moment}."
        have = {k[len(prefix) :] for k in per_param if k.startswith(prefix)}
        for name in sorted(model - have):
            if not any(fnmatchcase(name, pattern) for pattern in frozen):
                content.fail(
                    VerifyCheck.LINEAGE, None, f"tensor '{name}' has no optimizer state '{prefix}{name}'"
                )
        for name in sorted(have - model):
            content.fail(
                VerifyCheck.LINEAGE, None, f"optimizer state '{prefix}{name}' has no model tensor '{name}'"
            )


def check_lineage(
    content: Content,
    stats: dict[str, TensorStats],
    objects: set[str],
    previous,
    frozen: list[str],
    drift_factor: float,
    earlier: int | None = None,
) -> None:
    """Against the previous verified checkpoint's manifest: not a stale re-save, no tensor or
    object family lost, and (a warning) no tensor whose norm moved more than ``drift_factor``.
    Without one, ``earlier`` (the newest earlier checkpoint of the job on disk, none verified
    valid) makes it a warning that the lineage was not checked: a stale re-save of it would pass."""
    if previous is None and earlier is not None:  # first among the warnings: the verdict says it
        content.warnings.insert(
            0,
            Finding(
                VerifyCheck.LINEAGE,
                None,
                f"{LINEAGE_NOT_CHECKED}: no earlier verified checkpoint "
                f"(iteration {earlier} is not verified valid)",
            ),
        )
        return
    if previous is None:
        content.passes.setdefault(VerifyCheck.LINEAGE, "no earlier checkpoint of the job to compare with")
        return
    name = f"iteration {previous.iteration}"
    if previous.tensors is None:
        content.unchecked[VerifyCheck.LINEAGE] = (
            f"{name}'s manifest has no tensor statistics (an older schema)"
        )
        return
    old = previous.tensors
    for fqn in sorted(set(old) - set(stats)):
        content.fail(VerifyCheck.LINEAGE, None, f"tensor '{fqn}' of {name} is missing")
    for family in sorted(set(previous.objects or []) - objects):
        content.fail(VerifyCheck.LINEAGE, None, f"object '{family}' of {name} is missing")
    added = sorted(set(stats) - set(old))
    common = [k for k in stats if k in old]
    for label, keys in (
        ("model tensors", [k for k in common if is_model(k) and not any(fnmatchcase(k, p) for p in frozen)]),
        ("optimizer state", [k for k in common if k.startswith("optimizer.")]),
    ):
        if keys and all(stats[k].digest == old[k]["digest"] for k in keys):
            content.fail(
                VerifyCheck.LINEAGE,
                None,
                f"all {len(keys)} {label} are byte for byte those of {name}: a stale re-save",
            )
    for fqn in common:
        now, then = stats[fqn].norm, old[fqn].get("norm")
        # Weights and main params only (moments legitimately grow from zero), of two or more
        # dimensions: a bias or a norm's scale starts near zero and grows tenfold in healthy runs.
        weight = (is_model(fqn) or _MAIN_PARAM.search(fqn)) and not _MOMENT.search(fqn)
        if not weight or len(stats[fqn].shape) < 2 or not now or not then:
            continue
        stats[fqn].change = now / then
        ratio = max(now / then, then / now)
        if ratio > drift_factor:
            content.warnings.append(
                Finding(
                    VerifyCheck.LINEAGE,
                    None,
                    f"tensor '{fqn}': norm {then:.4g} at {name}, {now:.4g} now ({ratio:.1f}x)",
                )
            )
    note = f"; {len(added)} new: {', '.join(added[:3])}" if added else ""
    content.passes[VerifyCheck.LINEAGE] = f"{len(common)} tensors compared with {name}{note}"


def _short(value: float | None) -> str:
    return "" if value is None else f"{value:.4g}"


def worst_tensors(tensors: dict[str, dict], limit: int = 10) -> list[dict]:
    """The tensors a human should look at first: any with NaN or Inf, then the largest norm
    change since the previous verified checkpoint (either way)."""

    def badness(item):
        _, s = item
        change = s.get("change")
        moved = abs(math.log(change)) if change else 0.0
        return (s.get("nan", 0) + s.get("inf", 0), moved)

    rows = []
    for fqn, s in sorted(tensors.items(), key=badness, reverse=True)[:limit]:
        change = s.get("change")
        rows.append(
            {
                "tensor": fqn,
                "nan": s.get("nan", 0),
                "inf": s.get("inf", 0),
                "norm change": f"{change:.3g}x" if change else "",
                "norm": _short(s.get("norm")),
                "min": _short(s.get("min")),
                "max": _short(s.get("max")),
                "dtype": s["dtype"],
                "shape": "x".join(map(str, s.get("shape", []))),
            }
        )
    return rows
