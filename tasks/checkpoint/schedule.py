"""A checkpoint's own learning-rate schedule, as megatron-core computes it (its class, not a copy).

Used by the drill's loader (the scheduler it loads into) and by resume validation (the learning
rate a resumed run must follow beyond the recomputed steps).
"""

import warnings

from tasks.errors import CkptopsError


class ScheduleError(CkptopsError):
    """A checkpoint's scheduler state that megatron-core's scheduler cannot take."""


def scheduler_from_state(
    optimizer,
    state: dict,
    init_lr: float = 0.0,
    wsd_decay_steps: int | None = None,
    wsd_decay_style: str | None = None,
):
    """An ``OptimizerParamScheduler`` set up from a checkpoint's ``opt_param_scheduler`` state (its
    values win on load). Megatron-LM passes ``init_lr`` and the WSD decay from its args; the state
    does not keep them. Raises ``ScheduleError`` on a state it cannot take."""
    with warnings.catch_warnings():  # megatron warns about every optional extra it lacks
        warnings.simplefilter("ignore")
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    wsd_decay_steps = state.get("wsd_decay_steps", wsd_decay_steps)
    if state.get("lr_decay_style") == "WSD" and wsd_decay_steps is None:
        raise ScheduleError("a WSD schedule, and its args hold neither lr_wsd_decay_iters nor _samples")
    try:
        return OptimizerParamScheduler(
            optimizer,
            init_lr=init_lr,
            max_lr=state["max_lr"],
            min_lr=state["min_lr"],
            lr_warmup_steps=state["lr_warmup_steps"],
            lr_decay_steps=state["lr_decay_steps"],
            lr_decay_style=state["lr_decay_style"],
            start_wd=state["start_wd"],
            end_wd=state["end_wd"],
            wd_incr_steps=state["wd_incr_steps"],
            wd_incr_style=state["wd_incr_style"],
            use_checkpoint_opt_param_scheduler=True,
            wsd_decay_steps=wsd_decay_steps,
            lr_wsd_decay_style=state.get("lr_wsd_decay_style", wsd_decay_style),
        )
    except Exception as e:  # noqa: BLE001 (megatron raises bare Exception for an unknown style)
        raise ScheduleError(f"its scheduler state cannot be replayed ({type(e).__name__}: {e})") from None
