"""The decision, once every file is read: the lines placed in time across files, the class
that wins, its suspects, first error and reason (the rules in the package's docstring)."""

from tasks.recovery.triage.model import EVIDENCE_CAP, MEGATRON, FailureClass, Hit, Triage
from tasks.recovery.triage.patterns import gpus_of


class Decide:
    """The decision part of a scan (tasks.recovery.triage.scan.Scan): its files, read."""

    def result(self, exit_code: int | None) -> "Triage":
        roots, cascades = [], []
        for f in self.files:
            hits = sorted([h for group in f.roots.values() for h in group] + f.cascades, key=lambda h: h.line)
            latest = None
            for h in hits:
                h.at = self._epoch(h.ts)
                when = h.at if h.ts is not None else self._epoch(f.first_ts)
                if when is not None:
                    latest = when if latest is None else max(latest, when)
                # A file without any timestamp cannot be placed in time: first, in the order given.
                h.order = (
                    (0, 0.0, h.file_index, h.line) if latest is None else (1, latest, h.file_index, h.line)
                )
            roots += [h for h in hits if h.kind == "root"]
            cascades += [h for h in hits if h.kind == "cascade"]
        roots.sort(key=lambda h: h.order)
        cascades.sort(key=lambda h: h.order)
        found = self._decide(roots, cascades, exit_code)
        began = [self._epoch(f.first_ts) for f in self.files if f.first_ts is not None]
        found.logs_began = min(began) if began else None
        return found

    def _decide(self, roots: list[Hit], cascades: list[Hit], exit_code: int | None) -> "Triage":
        exits = [h for h in cascades if h.exit_code in MEGATRON]
        if exit_code is None and exits:
            exit_code = exits[0].exit_code
        megatron = MEGATRON.get(exit_code)
        by_class: dict[str, list[Hit]] = {}
        for h in roots:
            by_class.setdefault(h.cls, []).append(h)
        suspects: list[str] = []
        if "hardware" in by_class:
            cls, first = FailureClass.HARDWARE, by_class[FailureClass.HARDWARE][0]
        elif FailureClass.DATA in by_class:
            cls, first = FailureClass.DATA, by_class[FailureClass.DATA][0]
        elif exit_code == 17:
            cls = FailureClass.NUMERICS
            first = (
                by_class.get(FailureClass.NUMERICS)
                or roots
                or [h for h in exits if h.exit_code == 17]
                or [None]
            )[0]
        elif roots:
            first = roots[0]
            cls = first.cls
            if cls == FailureClass.PREEMPTED:
                reasoned = [h for h in by_class[FailureClass.PREEMPTED] if "reasoned" in h.tags]
                first = reasoned[0] if reasoned else first
        elif cascades:
            cls, first = FailureClass.HANG, cascades[0]
            exited = next((h for h in cascades if "task-exit" in h.tags), None)
            timeout = next((h for h in cascades if "timeout" in h.tags), None)
            if (
                exited is not None
                and "single" in exited.tags
                and (timeout is None or exited.order < timeout.order)
            ):
                first = exited
                suspects.append(exited.nodes[0])
        else:
            cls, first = FailureClass.UNKNOWN, None
        gpus: list[str] = []
        if cls not in (FailureClass.HANG, FailureClass.UNKNOWN, FailureClass.DATA):
            for h in self._suspect_lines(cls, by_class):
                for node in h.nodes:
                    if node not in suspects:
                        suspects.append(node)
                if cls == FailureClass.HARDWARE and "rerun" in h.tags:
                    gpus += [g for g in gpus_of(h.text) if g not in gpus]
        if cls not in (FailureClass.PREEMPTED, FailureClass.DATA):
            for h in exits:
                for node in h.nodes:
                    if node not in suspects:
                        suspects.append(node)
        chosen = by_class.get(cls, []) if cls != FailureClass.HANG else cascades
        others = [h for h in roots if h.cls != cls] if cls != FailureClass.HANG else []
        evidence = sorted(
            chosen[:EVIDENCE_CAP] + others[: max(0, EVIDENCE_CAP - len(chosen))], key=lambda h: h.order
        )
        anomaly = None
        if cls in (FailureClass.NUMERICS, FailureClass.DATA):
            anomaly = next((h.anomaly for h in by_class.get(cls, []) if h.anomaly is not None), None)
        iterations = [f.iteration for f in self.files if f.iteration is not None]
        taken = next(
            (h for h in by_class.get(FailureClass.PREEMPTED, []) if "infrastructure" in h.tags), None
        )
        return Triage(
            cls=cls,
            suspect_nodes=suspects,
            first_error=None if first is None else first.to_line(first.at),
            evidence=[h.to_line(h.at) for h in evidence],
            reason=self._reason(cls, first, by_class, cascades, exit_code),
            exit_code=exit_code,
            megatron=megatron,
            iteration=max(iterations) if iterations else None,
            anomaly_iteration=anomaly,
            infrastructure=taken.text[:240] if cls == FailureClass.PREEMPTED and taken else None,
            suspect_gpus=gpus,
        )

    @staticmethod
    def _suspect_lines(cls: str, by_class: dict[str, list[Hit]]) -> list[Hit]:
        """The lines whose nodes are the suspects. A rerun on another GPU that did not reproduce
        the result convicts the first GPU, not the one that reran it: its node is the one the
        tracker file recorded when the first rerun reproduced the result there."""
        lines = by_class.get(cls, [])
        if cls == FailureClass.HARDWARE and lines and all("elsewhere" in h.tags for h in lines):
            return [h for h in by_class.get(FailureClass.NUMERICS, []) if "suspicious" in h.tags]
        return [h for h in lines if "elsewhere" not in h.tags]

    def _reason(self, cls, first, by_class, cascades, exit_code) -> str:
        where = f" (first at {first.file}:{first.line})" if first is not None else ""
        count = len(by_class.get(cls, [])) if cls != FailureClass.HANG else len(cascades)
        lines = sum(f.lines for f in self.files)
        if cls == FailureClass.UNKNOWN:
            return f"nothing recognised as a failure in {lines} lines of {len(self.files)} file(s)"
        if cls == FailureClass.HARDWARE and first is not None and "rerun" in first.tags:
            where_ = "another GPU" if "elsewhere" in first.tags else "the same GPU"
            return (
                f"Megatron's rerun state machine could not reproduce a rejected result on {where_}{where}: "
                "a fault of the GPU that computed it, not the data"
            )
        if cls == FailureClass.DATA:
            return (
                f"Megatron's rerun state machine reproduced a rejected result on another GPU{where}: "
                "the data at that position (or the code), not a GPU; relaunching elsewhere fails again "
                "at the same place"
            )
        if cls == FailureClass.HARDWARE:
            return (
                f"GPU hardware evidence (critical XID, uncorrectable ECC, GPU off the bus){where}; "
                "it outranks every other error, which a GPU fault commonly causes"
            )
        if cls == FailureClass.NUMERICS and exit_code == 17 and not by_class.get(FailureClass.NUMERICS):
            return "Megatron exited 17: its result validation failed (a rerun gave a different result)"
        what = {
            "network": "an InfiniBand/NCCL network failure",
            "numerics": "a numerical failure (NaN/Inf, loss-scale collapse or a loss spike)",
            "oom": "out of memory",
            "save-failed": "a checkpoint write that failed (no space, over quota, an I/O error or a "
            "dead writer)",
            "software": "an exception or CUDA error with no hardware evidence anywhere",
            "preempted": "the scheduler or the cloud ended the job "
            "(time limit, preemption, cancellation, requeue)",
        }
        if cls == FailureClass.HANG:
            return (
                f"only consequences of a failure elsewhere ({count} lines: collective timeouts, closed "
                f"connections, exited tasks){where}: a rank stopped without logging why"
            )
        return f"the earliest root-cause line is {what[cls]}{where}; {count} such line(s)"
