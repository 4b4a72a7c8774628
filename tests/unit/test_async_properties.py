"""Property tests: the staleness controller and the sample buffer together, under random interleavings.

Rollouts finish out of order, get accepted or rejected, the trainer consumes (``on_stale: drop``
drops what is too old), admission pauses for weight updates, and the driver crashes and resumes
from its last checkpoint. Invariants: every submitted group is in exactly one place, the counters
agree with those places, and no trained group started more than η versions before its step.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from areal_plugins.core.buffer import BufferedGroup, OldestFirstBuffer
from areal_plugins.core.staleness import StalenessController

OPS = ["submit", "finish_ok", "finish_reject", "consume", "pause", "resume", "checkpoint", "crash"]


@settings(max_examples=300, deadline=None)
@given(
    eta=st.integers(0, 3),
    batch=st.integers(1, 3),
    concurrent=st.integers(1, 8),
    on_stale=st.sampled_from(["wait", "drop"]),
    ops=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 7)), max_size=120),
)
def test_every_group_is_accounted_for_and_none_trains_beyond_eta(eta, batch, concurrent, on_stale, ops):
    def fresh():
        return StalenessController(eta, batch, concurrent), OldestFirstBuffer(eta, on_stale=on_stale)

    controller, buffer = fresh()
    version, paused, next_id = 0, False, 0
    running: dict[str, int] = {}  # group -> version it was submitted at (its head version)
    trained, rejected, dropped = set(), set(), set()
    checkpoint = None

    for op, pick in ops:
        submitted = False
        if op == "submit" and not paused and controller.capacity(version) > 0:
            controller.on_submit()
            submitted = True
            running[f"g{next_id}"] = version
            next_id += 1
        elif op in ("finish_ok", "finish_reject") and running:
            name = sorted(running)[pick % len(running)]  # any in-flight group may finish first
            head = running.pop(name)
            if op == "finish_ok":
                controller.on_accept()
                buffer.put(BufferedGroup(group_id=name, head_versions=[head]))
            else:
                controller.on_reject()
                rejected.add(name)
        elif op == "consume" and len(buffer) >= batch:
            groups, stale = buffer.take(batch, trainer_version=version, timeout=0)
            if stale:
                controller.on_drop_accepted(len(stale))
                dropped.update(g.group_id for g in stale)
            if groups:
                for g in groups:
                    assert g.group_id not in trained
                    if on_stale == "drop":
                        assert version - g.head_version <= eta
                trained.update(g.group_id for g in groups)
                version += 1  # a weight update follows every step
        elif op == "pause":
            paused = True
        elif op == "resume":
            paused = False
        elif op == "checkpoint":
            # What survives a crash: the version, the groups trained, and every group still alive
            # (buffered ones are restored finished, running ones re-issued; both count as running).
            alive = {g.group_id: g.head_version for g in buffer.snapshot()}  # restored finished: heads kept
            alive |= {name: None for name in running}  # in flight: re-issued at the resumed version
            checkpoint = (version, set(trained), set(rejected), set(dropped), alive, next_id)
        elif op == "crash" and checkpoint is not None:
            version, trained, rejected, dropped, alive, next_id = (
                checkpoint[0],
                set(checkpoint[1]),
                set(checkpoint[2]),
                set(checkpoint[3]),
                dict(checkpoint[4]),
                checkpoint[5],
            )
            controller, buffer = fresh()
            controller.recover(version)
            # The trainer's recover is accepted = v*B; groups dropped before the crash lowered
            # accepted, so the bound is only conservative (never looser) after a drop.
            controller.on_submit(len(alive))
            running = {name: version if head is None else head for name, head in alive.items()}
            paused = False

        # Invariants, after every operation.
        places = [set(running), {g.group_id for g in buffer.snapshot()}, trained, rejected, dropped]
        assert sum(map(len, places)) == len(set().union(*places)), "a group is in two places"
        assert set().union(*places) == {f"g{i}" for i in range(next_id)}, "a group was lost"
        assert controller.running == len(running)
        # A resume re-issues everything alive at the checkpoint, which may exceed the limit for a while;
        # admission itself never takes the in-flight count above it.
        assert controller.running <= concurrent or not submitted
