"""The optimizer's param groups as the checkpoint saved them: the saved groups are the authority,
the args are hints.

Megatron-Core matches each param group it builds to a saved one by its identifier
(``param_group_identifier_keys``: max_lr, min_lr, wd_mult, lr_mult, ...) and fails inside its
optimizer load when one is missing. A rebuilt optimizer takes those values from the args, and the
args of a loop that is not Megatron-LM's (or one with its own per-group settings) do not imply
them: its ``lr`` is not its group's ``max_lr``, or it has no ``min_lr`` at all.

``adopt`` pairs the groups the args built with the saved ones, one to one (identical identifiers
first, then the one saved group left that agrees on what shapes a group: weight decay on or off,
expert parallel or not, a decoupled learning rate or not, its optimizer) and gives each built
group its saved identifier, so megatron's own load restores the saved groups whole. A group that
cannot be paired, a count that differs, or two saved groups that would fit fails with one line
naming the keys and the arg a value came from. The pairing is by what a group is, not by which
parameters it holds (megatron does not persist the distributed optimizer's parameter lists).
"""

from megatron.core.optimizer.optimizer import param_group_identifier_keys

from tasks.errors import CkptopsError

# The arg each identifier comes from when Megatron-LM builds the groups; the others (wd_mult,
# lr_mult) are megatron's standard groups: no weight decay on biases and 1-dim parameters.
ARG_BEHIND = {
    "max_lr": "lr",
    "min_lr": "min_lr",
    "start_wd": "start_weight_decay",
    "end_wd": "end_weight_decay",
    "optimizer": "optimizer",
    "is_expert_parallel": "expert_model_parallel_size",
    "is_decoupled_lr": "decoupled_lr",
}


class ParamGroupMismatch(CkptopsError):
    """A param group the args build has no counterpart among the checkpoint's saved groups."""


def identifier(group: dict) -> tuple:
    """The group's key as megatron matches it (NeMo's ``pre_`` aliases, missing as None)."""
    return tuple(group.get(key, group.get(f"pre_{key}")) for key in param_group_identifier_keys)


def describe(group: dict) -> str:
    return ", ".join(f"{key}={value}" for key, value in zip(param_group_identifier_keys, identifier(group)))


def _shape(group: dict) -> tuple:
    """What a group is, whatever its values: weight decay applied or not, expert parallel or not,
    a decoupled learning rate or not, its optimizer."""
    wd_mult = group.get("wd_mult", group.get("pre_wd_mult"))
    return (
        wd_mult is None or wd_mult != 0,
        bool(group.get("is_expert_parallel")),
        bool(group.get("is_decoupled_lr")),
        group.get("optimizer"),
    )


def _arg_text(key: str, args) -> str:
    name = ARG_BEHIND.get(key)
    if name is None:
        return f"{key} from megatron's standard groups (no weight decay on biases and 1-dim parameters)"
    flag = "--" + name.replace("_", "-")
    if not hasattr(args, name):
        return f"{key} from {flag}, which the checkpoint's args do not hold"
    return f"{key} from {flag} {getattr(args, name)}"


def saved_groups(optimizer_state, inner_count: int) -> list[list[dict]]:
    """The saved param groups of each optimizer megatron chains, from the loaded optimizer state."""
    states = [optimizer_state[i] for i in range(inner_count)] if inner_count > 1 else [optimizer_state]
    groups = []
    for state in states:
        inner = state.get("optimizer", state)
        if not isinstance(inner, dict) or "param_groups" not in inner:
            raise ParamGroupMismatch("the checkpoint's optimizer state holds no param_groups")
        groups.append(list(inner["param_groups"]))
    return groups


def _pair(current: list[dict], saved: list[dict], args) -> list[tuple[int, int]]:
    """One saved group for each built group, and every saved group used: the same key, else the
    one saved group left of the same shape (two of them would be a guess: refused)."""
    if len(current) != len(saved):
        raise ParamGroupMismatch(
            f"the args build {len(current)} optimizer param groups, the checkpoint saved {len(saved)}: "
            + " | ".join(describe(g) for g in saved)
        )
    saved_ids = [identifier(g) for g in saved]
    pairs, free = [], list(range(len(saved)))
    loose = []
    for c, group in enumerate(current):
        match = next((s for s in free if saved_ids[s] == identifier(group)), None)
        if match is None:
            loose.append(c)
        else:
            pairs.append((c, match))
            free.remove(match)
    for c in loose:
        fits = [s for s in free if _shape(saved[s]) == _shape(current[c])]
        if not fits:
            raise ParamGroupMismatch(_unmatched(current[c], saved, args))
        if len(fits) > 1:
            raise ParamGroupMismatch(
                f"optimizer param group ({describe(current[c])}) could be any of {len(fits)} saved groups "
                f"of its shape: {' | '.join(describe(saved[s]) for s in fits)}"
            )
        pairs.append((c, fits[0]))
        free.remove(fits[0])
    return pairs


def _unmatched(group: dict, saved: list[dict], args) -> str:
    """One line: the group's key, the args behind the values no saved group has, the saved keys."""
    saved_ids = [identifier(g) for g in saved]
    unseen = [
        _arg_text(key, args)
        for i, (key, value) in enumerate(zip(param_group_identifier_keys, identifier(group)))
        if all(ids[i] != value for ids in saved_ids)
    ]
    why = "; ".join(unseen) or (
        "no saved group has its shape (weight decay on or off, expert parallel or not, a decoupled "
        "learning rate or not, its optimizer)"
    )
    saved_part = " | ".join(describe(g) for g in saved) or "none"
    return (
        f"optimizer param group ({describe(group)}) has no counterpart in the checkpoint ({why}); "
        f"the checkpoint's groups: {saved_part}"
    )


def adopt(inner_optimizers: list, optimizer_state, args) -> list[str]:
    """Give the built groups the saved identifiers (in place); one note per value the args did not
    imply. Raises ``ParamGroupMismatch`` naming the first group that cannot be paired."""
    notes = []
    for index, (inner, saved) in enumerate(
        zip(inner_optimizers, saved_groups(optimizer_state, len(inner_optimizers)))
    ):
        current = inner.optimizer.param_groups
        for c, s in _pair(current, saved, args):
            group, stored = current[c], saved[s]
            for key, built, kept in zip(param_group_identifier_keys, identifier(group), identifier(stored)):
                if built == kept:
                    continue
                notes.append(
                    f"optimizer {index} group {c}: {key} {kept} from the checkpoint "
                    f"(the args imply {built}: {_arg_text(key, args)})"
                )
                group.pop(f"pre_{key}", None)
                if kept is None:
                    group.pop(key, None)
                else:
                    group[key] = kept
    return notes
