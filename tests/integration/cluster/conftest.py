"""One Ray cluster simulated on this machine for each test module here: a head without GPUs and
two worker nodes with 4 fake GPUs each (ray.cluster_utils.Cluster starts real raylets); this
process is connected to it as a driver. Module scope: "package" scope in a folder without
__init__.py lasts until the whole session ends, which left this cluster running under every later
test."""

import pytest

ray = pytest.importorskip("ray")

GPUS_PER_NODE = 4


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    try:
        for _ in range(2):
            c.add_node(num_cpus=4, num_gpus=GPUS_PER_NODE)
        c.wait_for_nodes()
        ray.init(address=c.address)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
