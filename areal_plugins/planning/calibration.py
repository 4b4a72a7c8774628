"""What ``areal-plugins plan`` shares with the simulator's fit to the AReaL paper (``tools/simulate_paper.py``).

The simulated run's length (the fit's, so that the plan's numbers are the fit's) and how the paper's synchronous
baseline splits the GPUs (``plan --baseline areal-sync``). The fit itself, the paper's numbers and the prediction of
its Table 1 serve ``tools/simulate_paper.py`` only, and live beside it. Sources in docs/simulator.md.
"""

from __future__ import annotations

from areal_plugins.planning.cluster_sim import Cluster

#: The paper's synchronous baseline is AReaL's own synchronous mode on its disaggregated allocation: half
#: the GPUs run SGLang, half train, taking turns (AReaL v0.2's 16-node 1.5B and 7B configurations:
#: ``allocation_mode: sglang.d64p1m1+d32p2m1``, 64 + 32x2 GPUs). The same halves are assumed at 24-48 nodes.
PAPER_SYNC_GENERATING_SHARE = 0.5

#: Steps of an asynchronous simulation, and the first ones left out of its throughput.
STEPS = 30
WARMUP = 10


def paper_sync_generating_gpus(cluster: Cluster) -> int:
    """GPUs that generate in the paper's synchronous system: half the cluster, in whole engines."""
    tp = cluster.engine().tensor_parallel
    return max(tp, round(cluster.gpus * PAPER_SYNC_GENERATING_SHARE / tp) * tp)
