"""The fleet at a glance: each node's place (healthy, drained by ckptops or by someone else, in
burn-in, held for a person, returned) and the spares (ready, in use, out of service), from Slurm's
state now, ckptops' drain log and the nodes' histories. ``ckptops health fleet`` and the
node-burn-in flow's artifact show it; fewer ready spares than ``health.burn_in.min_ready_spares``
is said before the job runs out of them."""

from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime

from tasks.cluster import slurm
from tasks.health.burn_in import drained_by_us, passing_since, proof, returned_at
from tasks.health.run import resolve_nodes
from tasks.health.sweep import HELD_STATES

_BUSY = ("alloc", "mix", "comp")


@dataclass
class NodePlace:
    node: str
    spare: bool
    state: str  # Slurm's
    place: str
    detail: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Fleet:
    nodes: list[NodePlace] = field(default_factory=list)
    min_ready_spares: int = 0

    def count(self, place: str) -> int:
        return sum(1 for n in self.nodes if n.place == place)

    @property
    def spares_short(self) -> str | None:
        """A line when fewer spares are ready than the profile asks for, else None."""
        ready = self.count("spare ready")
        if ready >= self.min_ready_spares:
            return None
        return (
            f"spares running out: {ready} ready, health.burn_in.min_ready_spares is {self.min_ready_spares} "
            f"({self.count('spare in use')} in use, {self.count('spare out of service')} out of service)"
        )

    def summary(self) -> str:
        places = {}
        for n in self.nodes:
            places[n.place] = places.get(n.place, 0) + 1
        return f"{len(self.nodes)} nodes: " + ", ".join(f"{k} {v}" for k, v in sorted(places.items()))

    def to_dict(self) -> dict:
        return {"nodes": [n.to_dict() for n in self.nodes], "spares_short": self.spares_short}


def _place(settings, node: str, state: str, reason: str, ours, now: datetime) -> tuple[str, str]:
    held = state in HELD_STATES
    if node in settings.spares:
        if held:
            return "spare out of service", reason
        return ("spare in use", "") if state in _BUSY else ("spare ready", "")
    drained = ours.get(node)
    if held and drained is not None and drained.ours:
        since = datetime.fromtimestamp(drained.since, UTC).isoformat(timespec="minutes")
        what, _, hours = proof(settings, node, now)
        if what == "held":
            return "held for a person", f"{reason} (since {since}): repeatedly suspect"
        if hours and passing_since(settings, node, drained) is not None:
            return "in burn-in", f"{reason} (since {since}): passing, {hours:g} h needed"
        return "drained by ckptops", f"{reason} (since {since})"
    if held:
        return "drained by someone else", reason
    back = returned_at(settings, node)
    return ("returned", f"resumed {back} after its burn-in") if back else ("healthy", "")


def fleet(settings, now: float | None = None) -> Fleet:
    """Every node of the profile's fleet and its spares, placed."""
    clock = datetime.now(UTC) if now is None else datetime.fromtimestamp(now, UTC)
    ours = drained_by_us(settings)
    names = sorted(set(resolve_nodes(settings, None)) | set(settings.spares))
    statuses = slurm.node_statuses(names)
    found = Fleet(min_ready_spares=settings.burn_in.min_ready_spares)
    for node in names:
        state, reason = statuses.get(node, ("unknown", "not known to Slurm"))
        place, detail = _place(settings, node, state, reason, ours, clock)
        found.nodes.append(NodePlace(node, node in settings.spares, state, place, detail))
    return found
