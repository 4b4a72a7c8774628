"""The areal_gloo checkpoint engine between real processes: one sender, two receivers, several buckets."""

from __future__ import annotations

import multiprocessing
import socket

import pytest
import torch

from areal_plugins.weight_sync.gloo import buckets
from tests.unit.store_ports import store_port


def weights(large: bool = False) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "embed": torch.randn(64, 16, generator=generator),
        "norm": torch.randn(16, generator=generator).to(torch.bfloat16),
        "layer.0": torch.randn(16, 16, generator=generator),
        "count": torch.arange(5, dtype=torch.int64),
    }
    if large:
        tensors["lm_head"] = torch.randn(LARGE, generator=generator)
    return tensors


#: A tensor after the others, in a bucket of its own, larger than what a loopback socket buffers: its broadcast
#: waits until every receiver takes it.
LARGE = 8 * 1024 * 1024 // 4


def run_rank(
    rank: int,
    world: int,
    port: int,
    out,
    read,
    corrupt_rank: int = -1,
    staged_rank: int = -1,
    large: bool = False,
    abandon_rank: int = -1,
) -> None:
    import asyncio

    from areal_plugins.weight_sync import gloo

    gloo.TIMEOUT_S = 60.0  # a rank left waiting fails the test in a minute, not in 10; the start-up fits in it

    if rank == corrupt_rank:  # the broadcast leg goes wrong on this worker: one received value changes
        unpack = gloo._unpack

        def corrupted(entries, payload):
            for name, tensor in unpack(entries, payload):
                if name == "layer.0":
                    tensor.view(-1)[3] += 1.0
                yield name, tensor

        gloo._unpack = corrupted
    engine = gloo._make_engine_class()(bucket_size=5000, is_master=rank == 0)
    engine.init_process_group(rank=rank, world_size=world, master={"host": "127.0.0.1", "port": port})
    try:
        if rank == 0:
            asyncio.run(engine.send_weights(iter(weights(large).items()), global_steps=3))
            out.put((rank, None))
        elif rank == abandon_rank:  # its consumer stops after the first tensor (as the adapter does when it raises)
            received = engine.receive_weights(global_steps=3)
            first = next(received)[0]
            received.close()
            out.put((rank, first))
        elif rank == staged_rank:  # the whole update first (the engines generate meanwhile), handed over at the load
            kept = engine.stage(global_steps=3)
            out.put((rank, (kept, {name: t.clone() for name, t in engine.receive_weights(global_steps=3)})))
        else:
            out.put((rank, {name: t.clone() for name, t in engine.receive_weights(global_steps=3)}))
    except Exception as error:
        out.put((rank, error))
    # torch hands a queued tensor over by a file descriptor this process serves: stay until the parent has it.
    read.wait(timeout=120)
    engine.finalize()


def broadcast(
    corrupt_rank: int = -1, staged_rank: int = -1, large: bool = False, abandon_rank: int = -1, world: int = 3
) -> dict:
    # Ranks fork from a server that has imported torch and verl once (spawning, each imported both: ~8 s of CPU).
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["areal_plugins.weight_sync.gloo", "verl.checkpoint_engine.base", __name__])
    out, read = context.Queue(), context.Event()
    port = store_port()
    processes = [
        context.Process(
            target=run_rank, args=(rank, world, port, out, read, corrupt_rank, staged_rank, large, abandon_rank)
        )
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    results = dict(out.get(timeout=120) for _ in processes)
    read.set()
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    return results


def assert_bit_for_bit(received: dict[str, torch.Tensor], rank: int, large: bool = False) -> None:
    sent = weights(large)
    assert list(received) == list(sent)  # order kept
    for name, tensor in sent.items():
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), (rank, name)


#: Bytes of embed, norm (bf16), layer.0 and count: what a stage keeps.
STAGED_BYTES = 64 * 16 * 4 + 16 * 2 + 16 * 16 * 4 + 5 * 8


def test_a_value_changed_on_the_broadcast_leg_is_named_and_a_staged_worker_gets_everything_bit_for_bit():
    results = broadcast(corrupt_rank=2, staged_rank=1)  # rank 1 receives the whole update first, rank 2 streams
    error = results[2]
    assert type(error).__name__ == "WeightSyncError", error
    assert "areal_gloo broadcast, rollout worker rank 2: tensor layer.0 arrived different" in str(error)
    kept, staged = results[1]
    assert kept == STAGED_BYTES
    assert_bit_for_bit(staged, 1)


def test_a_value_changed_on_the_way_to_a_stage_stops_it_before_any_load_and_a_streaming_worker_is_intact():
    results = broadcast(corrupt_rank=1, staged_rank=1)
    error = results[1]
    assert type(error).__name__ == "WeightSyncError", error  # raised by stage(), before receive_weights
    assert "rollout worker rank 1: tensor layer.0 arrived different" in str(error)
    assert_bit_for_bit(results[2], 2)


def test_workers_that_stop_part_way_take_the_rest_so_the_sender_and_the_others_finish():
    # Rank 1 finds layer.0 corrupted in the second bucket; rank 2's consumer stops after the first tensor (as the
    # adapter does when its own check raises). 8 MB follow, more than a socket buffers for either of them.
    results = broadcast(corrupt_rank=1, staged_rank=1, large=True, abandon_rank=2, world=4)
    assert results[0] is None, results[0]  # the sender finished: it was not left waiting for rank 1 or rank 2
    assert "rollout worker rank 1: tensor layer.0 arrived different" in str(results[1])
    assert results[2] == "embed"
    assert_bit_for_bit(results[3], 3, large=True)


def test_a_corruption_is_what_the_worker_reports_even_when_taking_the_rest_fails():
    from areal_plugins.weight_sync import gloo

    engine = gloo._make_engine_class()(bucket_size=5000)
    engine.rank = 1
    entries, payload = gloo._pack([("norm", torch.ones(4))])
    arrivals = iter([({"entries": entries, "checksums": [[4.0, 4.0, 4.0, 9.0]], "is_last": False}, payload)])

    def next_bucket():  # the first bucket's checksum disagrees; then the sender is gone
        for arrival in arrivals:
            return arrival
        raise RuntimeError("gloo: connection reset by peer")

    engine._next_bucket = next_bucket
    with pytest.raises(gloo.WeightSyncError, match="rollout worker rank 1: tensor norm arrived different"):
        engine.stage(global_steps=3)


def test_buckets_respect_the_size_and_end_with_one_that_may_be_empty():
    tensors = [("a", torch.zeros(300)), ("b", torch.zeros(300)), ("c", torch.zeros(1000))]  # 1200, 1200, 4000 B
    sizes = [[name for name, _ in bucket] for bucket in buckets(iter(tensors), bucket_size=2500)]
    assert sizes == [["a", "b"], ["c"]]  # c alone exceeds the size: a bucket of its own
    assert [list(b) for b in buckets(iter([]), 100)] == [[]]


@pytest.mark.parametrize("world", [2])
def test_topology_has_one_sender_and_every_rollout_worker(world):
    from areal_plugins.weight_sync.gloo import _make_engine_class

    engine_cls = _make_engine_class()
    actor, rollout = engine_cls.build_topology(3, 2, [{"host": "h", "port": 1}, {}, {}, {}, {}])
    assert actor["rank"] == [0, -1, -1] and rollout["rank"] == [1, 2]
    assert set(actor["world_size"] + rollout["world_size"]) == {3}


def test_the_group_address_is_a_port_no_outbound_connection_can_take():
    """The group is built again at every update: its port must not come from the ephemeral range, where any
    outbound connection may take it between the choice and the bind (EADDRINUSE in CI, after 8 updates)."""
    from areal_plugins.platforms.ports import LOWEST_PORT, ephemeral_range
    from areal_plugins.weight_sync import gloo

    engine_class = gloo._make_engine_class()
    address = engine_class(bucket_size=5000, is_master=True).prepare()
    assert LOWEST_PORT <= address["port"] < ephemeral_range()[0], address
    with socket.socket() as probe:
        probe.bind(("", address["port"]))  # free now
    assert engine_class(bucket_size=5000, is_master=False).prepare() == {}
