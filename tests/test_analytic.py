"""The analytic cost model and the cluster model against hand calculations, and the search on it."""

from dataclasses import replace

import numpy as np
import pytest

from shardplan.cluster import Cluster, Device, Level, collective_seconds, get_cluster
from shardplan.cost.analytic import GRAD_BUCKET_BYTES, AnalyticCostModel
from shardplan.cost.tables import build_tables
from shardplan.cost.routing import uniform_load
from shardplan.ir.builder import GraphBuilder
from shardplan.search.brute_force import brute_force
from shardplan.search.exact import exact_search

ALPHA0, BETA0, ALPHA1, BETA1 = 2e-6, 100e9, 10e-6, 10e9
PEAK, HBM = 100e12, 1e12


def cluster(per_node=4, nodes=1, **kw):
    dev = Device("toy", kw.get("peak", PEAK), 16e9, kw.get("hbm", HBM))
    return Cluster("toy", dev, (Level("node", per_node, kw.get("b0", BETA0), kw.get("a0", ALPHA0)),
                                Level("net", nodes, kw.get("b1", BETA1), kw.get("a1", ALPHA1))))


def one_linear(batch=64, k=256, n=512):
    b = GraphBuilder("lin")
    x = b.input("x", (batch, k), ("batch", "features"))
    b.linear(x, n, name="fc")
    return b.build()


def costs_of(graph, model, devices, op, config):
    tables = build_tables(graph, model, devices)
    i = graph.op_index(op)
    j = tables.index_of(i, config)
    n = tables.nodes[i]
    return tables, float(n.compute[j]), float(n.comm[j]), float(n.memory[j])


def update_of(graph, model, devices, op, config, names=("optimizer_update",)):
    """The seconds of ``op``'s cost items called ``names`` under ``config`` (by default the optimizer
    update's)."""
    tables = build_tables(graph, model, devices)
    i = graph.op_index(op)
    j = tables.index_of(i, config)
    items = model.node_cost_items(graph, graph.ops[i], tables.configs[i][j:j + 1])
    return sum(float(it.seconds[0]) for it in items if it.name in names)


def params_of(graph, op):
    return sum(graph.tensor(o.tensor).is_param for o in op.inputs)


def test_ring_all_reduce_on_one_node():
    c = cluster()
    nbytes = 4 * 256 * 512
    got = collective_seconds(c, "all_reduce", nbytes, c.per_level(4, 1))
    assert got == pytest.approx(2 * 3 * ALPHA0 + 2 * (3 / 4) * nbytes / BETA0, rel=1e-12)


def test_hierarchical_all_reduce_across_nodes():
    """16 devices, 4 per node: ring in the node on n bytes, then across nodes on n / 4."""
    c = cluster(nodes=4)
    n = 1e8
    q = c.per_level(16, 1)
    assert q.tolist() == [4.0, 4.0]
    want = 2 * 3 * ALPHA0 + 2 * 0.75 * n / BETA0 + 2 * 3 * ALPHA1 + 2 * 0.75 * (n / 4) / BETA1
    assert collective_seconds(c, "all_reduce", n, q) == pytest.approx(want, rel=1e-12)
    # a 2-member group at stride 4 crosses nodes only
    assert c.per_level(2, 4).tolist() == [1.0, 2.0]
    assert c.per_level(8, 2).tolist() == [2.0, 4.0]


def test_gather_and_all_to_all():
    c = cluster()
    n = 8e6
    q = c.per_level(4, 1)
    assert collective_seconds(c, "all_gather", n, q) == pytest.approx(3 * ALPHA0 + 0.75 * n / BETA0)
    assert collective_seconds(c, "all_to_all", n, q) == pytest.approx(3 * ALPHA0 + 0.75 * n / BETA0)


def test_data_parallel_linear_hand_calculation():
    """Batch split 4 ways: compute on a quarter, weight gradient all-reduced over the 4 replicas. The
    input is training data, so the backward pass computes the weight gradient only: two GEMMs."""
    batch, k, n = 64, 256, 512
    _, compute, comm, memory = costs_of(one_linear(batch, k, n), AnalyticCostModel(cluster()), 4, "fc",
                                        (4, 1, 1))
    flops = 2 * 2 * batch * k * n / 4
    bytes_ = 2 * 4 * (batch * k / 4 + n * k + batch * n / 4)
    weight = 4 * n * k
    # then the gradient copied into its bucket (read + write), and Adam's update of the whole weight:
    # read weight, gradient and 2 moments, write 3 of them back
    assert compute == pytest.approx(max(flops / PEAK, bytes_ / HBM) + 2 * weight / HBM + 7 * weight / HBM,
                                    rel=1e-12)
    # the gradient shares a 25 MiB bucket with others: it pays its share of the bucket's latency
    share = weight / GRAD_BUCKET_BYTES
    assert comm == pytest.approx(2 * 3 * ALPHA0 * share + 2 * 0.75 * weight / BETA0, rel=1e-12)
    # weight + gradient + two Adam moments, and the output activation kept for backward, and the input
    assert memory == pytest.approx(4 * weight + 4 * batch * n / 4 + 4 * batch * k / 4, rel=1e-12)
    # reduced one gradient per collective, it pays the whole latency
    _, _, alone, _ = costs_of(one_linear(batch, k, n), AnalyticCostModel(cluster(), grad_bucket_bytes=None), 4,
                              "fc", (4, 1, 1))
    assert alone == pytest.approx(2 * 3 * ALPHA0 + 2 * 0.75 * weight / BETA0, rel=1e-12)


def test_first_layer_backward_skips_the_input_gradient():
    """By hand: a linear that reads training data runs two GEMMs (forward, weight gradient), the same
    linear fed by another op three (its input gradient too); the forward is one pass of each."""
    batch, k, n = 64, 256, 512
    b = GraphBuilder("two")
    x = b.input("x", (batch, k), ("batch", "features"))
    h = b.linear(x, k, name="first")
    b.linear(h, n, name="second")
    g = b.build()
    model = AnalyticCostModel(cluster(peak=1e9))  # compute-bound at this rate
    for op, passes, flops in (("first", 2, 2 * batch * k * k), ("second", 3, 2 * batch * k * n)):
        i = g.op_index(op)
        items = model.node_cost_items(g, g.ops[i], np.array([[1, 1, 1]]))
        compute = next(it for it in items if it.name == "compute")
        assert float(compute.seconds[0]) == pytest.approx(passes * flops / 1e9, rel=1e-12), op
        assert float(compute.fwd[0]) == pytest.approx(flops / 1e9, rel=1e-12), op


def test_column_parallel_linear_needs_no_weight_all_reduce():
    """Output features split: the weight is not replicated; the graph input needs no gradient."""
    _, _, comm, memory = costs_of(one_linear(), AnalyticCostModel(cluster()), 4, "fc", (1, 4, 1))
    assert comm == 0.0
    assert memory == pytest.approx(4 * 4 * 512 * 256 / 4 + 4 * 64 * 512 / 4 + 4 * 64 * 256, rel=1e-12)


def test_row_parallel_linear_all_reduces_partial_sums():
    """A split reduction dim: the output tile (64 x 512 floats) is all-reduced over 4 devices."""
    _, _, comm, _ = costs_of(one_linear(), AnalyticCostModel(cluster()), 4, "fc", (1, 1, 4))
    out = 4 * 64 * 512
    assert comm == pytest.approx(2 * 3 * ALPHA0 + 2 * 0.75 * out / BETA0, rel=1e-12)


def test_conv_halo_exchange():
    """Two ghost rows of the input per split height, forward; backward their gradients go back, except
    for the model's input (the image), which has no gradient."""
    b = GraphBuilder("conv")
    x = b.input("x", (8, 16, 32, 32), ("batch", "channels", "height", "width"))
    y = b.conv2d(x, 16, 3, padding=1, name="conv")
    b.conv2d(y, 16, 3, padding=1, name="conv2")
    g = b.build()
    model = AnalyticCostModel(cluster())
    cfg = {"batch": 1, "in_channels": 1, "height": 2, "width": 1, "kernel_h": 1, "kernel_w": 1, "out_channels": 1}
    halo = 4 * 8 * 16 * 32 * 2  # two ghost rows of the input (batch x channels x width)
    weight = 4 * 16 * 16 * 3 * 3  # replicated over the 2 height shards: its gradient is all-reduced
    for name, passes in (("conv", 1), ("conv2", 2)):
        _, _, comm, _ = costs_of(g, model, 2, name, tuple(cfg[d.name] for d in g.ops[0].dims))
        assert comm == pytest.approx(passes * (2 * ALPHA0 + halo / BETA0) + 2 * ALPHA0 * weight / GRAD_BUCKET_BYTES
                                     + weight / BETA0, rel=1e-12), name


def edge_copies() -> float:
    """Seconds of local copies on the 64 x 256 edge batch-split -> feature-split 4 ways (see
    ``test_redistribution_edge``): a 64 x 64 tile cut out forward, the 64 x 256 gradient concatenated
    backward, fp32, each read and written at the device's memory bandwidth."""
    return 2 * 4 * (64 * 64 + 64 * 256) / cluster().device.memory_bandwidth


def test_inner_copy_words_by_hand():
    """Gathers and cuts of the outermost non-trivial dim are views; of an inner dim, copies: the
    gathered tile (it arrives stacked along the outermost dim) or the destination tile."""
    from shardplan.cost.analytic import inner_copy_words

    def words(shape, src, dst):
        return inner_copy_words(shape, np.array([src]), np.array([dst]))[0, 0]

    assert words((8, 64), [2, 1], [1, 1]) == 0.0  # gather the rows
    assert words((8, 64), [1, 2], [1, 1]) == 8 * 64  # gather the columns: concatenated
    assert words((8, 64), [1, 1], [2, 1]) == 0.0  # cut rows: a view
    assert words((8, 64), [1, 1], [1, 2]) == 8 * 32  # cut columns: copied out
    assert words((8, 64), [2, 1], [1, 2]) == 8 * 32  # rows gathered (free), columns cut (copied)
    assert words((1, 64), [1, 2], [1, 1]) == 0.0  # a leading dim of 1 leaves the columns outermost
    assert words((4, 8, 64), [1, 2, 2], [1, 1, 1]) == 4 * 8 * 64  # a gather of inner dims
    assert words((4, 8, 64), [2, 2, 1], [2, 2, 1]) == 0.0  # nothing moves


def test_redistribution_edge():
    """Batch-split producer, feature-split consumer: each device lacks 3/4 of its tile, both ways.
    Locally, forward cuts its features out of the gathered batch (an inner cut: a copy of its
    64 x 64 tile), backward gathers the gradient along the features (an inner gather: the 64 x 256
    result concatenated into place); each copy is read and written at the memory bandwidth."""
    b = GraphBuilder("two")
    x = b.input("x", (64, 256), ("batch", "features"))
    y = b.linear(x, 256, name="a")
    b.layer_norm(y, name="n")  # norm over features keeps the layout question on the edge
    g = b.build()
    model = AnalyticCostModel(cluster())
    tables = build_tables(g, model, 4)
    e = tables.edges[0]
    src = tables.index_of(0, (4, 1, 1))
    dst = tables.index_of(1, (1, 4))
    tile = 4 * 64 * 256 / 4
    got = e.cost[e.src_class[src], e.dst_class[dst]]
    assert got == pytest.approx(2 * (ALPHA0 + 0.75 * tile / BETA0) + edge_copies(), rel=1e-12)
    same = tables.index_of(1, (4, 1))
    assert e.cost[e.src_class[src], e.dst_class[same]] == 0.0


def test_gather_rates_price_one_way_collectives_and_edges():
    """With a level's ``gather_latency`` and ``gather_bandwidth`` set, all-gather, reduce-scatter and
    all-to-all and the moves on edges take them, the all-reduce keeps ``latency`` and ``bandwidth``;
    the fields round-trip through a cluster file, survive growing the cluster, and bad values are
    refused by name."""
    import dataclasses

    from shardplan.cluster.model import ClusterError
    from shardplan.cluster.presets import cluster_from_dict, cluster_to_dict

    base = cluster()
    a_g, b_g = 3 * ALPHA0, BETA0 / 2
    lv = dataclasses.replace(base.levels[0], gather_latency=a_g, gather_bandwidth=b_g)
    c = dataclasses.replace(base, levels=(lv,) + base.levels[1:])
    n, q = 8e6, c.per_level(4, 1)
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        assert collective_seconds(c, kind, n, q) == pytest.approx(3 * a_g + 0.75 * n / b_g)
    assert collective_seconds(c, "all_reduce", n, q) == collective_seconds(base, "all_reduce", n, q)
    # the edge of test_redistribution_edge: each way, one move of 3/4 of a tile at the gather rates
    b = GraphBuilder("two")
    x = b.input("x", (64, 256), ("batch", "features"))
    b.layer_norm(b.linear(x, 256, name="a"), name="n")
    g = b.build()
    tables = build_tables(g, AnalyticCostModel(c), 4)
    e = tables.edges[0]
    got = e.cost[e.src_class[tables.index_of(0, (4, 1, 1))], e.dst_class[tables.index_of(1, (1, 4))]]
    assert got == pytest.approx(2 * (a_g + 0.75 * (4 * 64 * 256 / 4) / b_g) + edge_copies(), rel=1e-12)
    back = cluster_from_dict(cluster_to_dict(c))
    assert (back.levels[0].gather_latency, back.levels[0].gather_bandwidth) == (a_g, b_g)
    assert "gather_latency" not in cluster_to_dict(base)["levels"][0]
    grown = dataclasses.replace(c, levels=(c.levels[0], dataclasses.replace(c.levels[1], gather_latency=a_g)))
    assert grown.with_devices(64).levels[-1].gather_latency == a_g
    with pytest.raises(ClusterError, match="gather_bandwidth"):
        dataclasses.replace(lv, gather_bandwidth=0.0)
    with pytest.raises(ClusterError, match="gather_latency"):
        dataclasses.replace(lv, gather_latency=-1.0)


def test_all_to_all_rates_price_the_all_to_all_alone():
    """A level's ``all_to_all_latency`` and ``all_to_all_bandwidth`` (the runtime's own all-to-all,
    calibrated apart) price the all-to-all and nothing else; unset, the all-to-all takes the one-way
    collectives' rates; the fields round-trip through a cluster file and bad values are refused by name."""
    import dataclasses

    from shardplan.cluster.model import ClusterError
    from shardplan.cluster.presets import cluster_from_dict, cluster_to_dict

    base = cluster()
    a_g, b_g, a_a, b_a = 3 * ALPHA0, BETA0 / 2, ALPHA0 / 2, BETA0 / 3
    gathered = dataclasses.replace(base.levels[0], gather_latency=a_g, gather_bandwidth=b_g)
    lv = dataclasses.replace(gathered, all_to_all_latency=a_a, all_to_all_bandwidth=b_a)
    c = dataclasses.replace(base, levels=(lv,) + base.levels[1:])
    plain = dataclasses.replace(base, levels=(gathered,) + base.levels[1:])
    n, q = 8e6, c.per_level(4, 1)
    assert collective_seconds(c, "all_to_all", n, q) == pytest.approx(3 * a_a + 0.75 * n / b_a)
    assert collective_seconds(plain, "all_to_all", n, q) == pytest.approx(3 * a_g + 0.75 * n / b_g)
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        assert collective_seconds(c, kind, n, q) == collective_seconds(plain, kind, n, q)
    back = cluster_from_dict(cluster_to_dict(c))
    assert (back.levels[0].all_to_all_latency, back.levels[0].all_to_all_bandwidth) == (a_a, b_a)
    assert "all_to_all_latency" not in cluster_to_dict(plain)["levels"][0]
    with pytest.raises(ClusterError, match="all_to_all_bandwidth"):
        dataclasses.replace(lv, all_to_all_bandwidth=0.0)
    with pytest.raises(ClusterError, match="all_to_all_latency"):
        dataclasses.replace(lv, all_to_all_latency=-1.0)


def test_a_runtime_without_all_to_all_gathers_the_split_dim_it_leaves():
    """On a CPU mesh DTensor moves batch-split -> feature-split (4 ways) by gathering the batch and
    cutting the features: each device receives the 3 tiles it lacks of the whole tensor, both ways,
    where an all-to-all receives 3/4 of one tile. A gather to the whole tensor and a finer split of
    the same dim are priced as before; the flag round-trips through a cluster file and must be a
    boolean there."""
    import dataclasses

    from shardplan.cluster.model import ClusterError
    from shardplan.cluster.presets import cluster_from_dict, cluster_to_dict
    from shardplan.cost.analytic import gathered_words

    b = GraphBuilder("two")
    x = b.input("x", (64, 256), ("batch", "features"))
    y = b.linear(x, 256, name="a")
    b.layer_norm(y, name="n")
    g = b.build()
    base = cluster()
    gloo = dataclasses.replace(base, device=dataclasses.replace(base.device, all_to_all_by_gather=True))
    tile = 4 * 64 * 256 / 4
    for cl, lacking in ((base, 0.75 * tile), (gloo, 3 * tile)):
        tables = build_tables(g, AnalyticCostModel(cl), 4)
        e = tables.edges[0]
        src, dst = tables.index_of(0, (4, 1, 1)), tables.index_of(1, (1, 4))
        assert e.cost[e.src_class[src], e.dst_class[dst]] == pytest.approx(2 * (ALPHA0 + lacking / BETA0)
                                                                          + edge_copies(), rel=1e-12)
    shape = (64, 256)
    assert gathered_words(shape, np.array([[4, 1]]), np.array([[1, 4]]))[0, 0] == 64 * 256 * 3 / 4
    assert gathered_words(shape, np.array([[2, 2]]), np.array([[1, 4]]))[0, 0] == 64 * 256 / 2 - 64 * 256 / 4
    for src, dst in (([4, 1], [1, 1]), ([1, 1], [4, 1]), ([2, 1], [4, 1]), ([2, 2], [2, 2])):
        assert gathered_words(shape, np.array([src]), np.array([dst]))[0, 0] == 0.0

    assert cluster_from_dict(cluster_to_dict(gloo)).device.all_to_all_by_gather is True
    assert "all_to_all_by_gather" not in cluster_to_dict(base)["device"]
    raw = cluster_to_dict(gloo)
    raw["device"]["all_to_all_by_gather"] = "yes"
    with pytest.raises(ClusterError, match="all_to_all_by_gather"):
        cluster_from_dict(raw)


def test_redistribution_edge_moves_each_way_what_that_way_lacks():
    """A batch-split producer feeding a linear split over its output features, which reads its input
    whole: forward, each of the 4 devices lacks 3/4 of the input; backward, the gradient comes back
    whole on every device (the linear's own all-reduce made it so), and each producer device cuts its
    quarter out of it: no byte moves (PaSE's rule, which counts an unsplit tile as held on one
    device, charged 1/4 here). The reverse edge (a whole output from a summed-dim split, read
    batch-split) moves nothing forward and 3/4 backward: the same price. With a redistribution
    overhead h each direction that changes the layout adds h; equal layouts cost nothing."""
    import dataclasses

    b = GraphBuilder("two")
    x = b.input("x", (64, 256), ("batch", "features"))
    y = b.linear(x, 256, name="a")
    b.linear(y, 512, name="b")
    g = b.build()
    full = 4 * 64 * 256
    h = 150e-6
    base = cluster()
    for dev, extra in ((base.device, 0.0), (dataclasses.replace(base.device, redistribute_overhead=h), 2 * h)):
        tables = build_tables(g, AnalyticCostModel(dataclasses.replace(base, device=dev)), 4)
        e = tables.edges[0]
        batch_split = tables.index_of(0, (4, 1, 1))
        whole_input = tables.index_of(1, (1, 4, 1))  # b's out_features split 4 ways
        assert e.cost[e.src_class[batch_split], e.dst_class[whole_input]] == pytest.approx(
            ALPHA0 + 0.75 * full / BETA0 + extra, rel=1e-12)
        whole_output = tables.index_of(0, (1, 1, 4))  # a's sum split 4 ways: y whole (summed) everywhere
        b_batch = tables.index_of(1, (4, 1, 1))
        assert e.cost[e.src_class[whole_output], e.dst_class[b_batch]] == pytest.approx(
            ALPHA0 + 0.75 * full / BETA0 + extra, rel=1e-12)
        assert e.cost[e.src_class[batch_split], e.dst_class[b_batch]] == 0.0

    from shardplan.cluster.model import ClusterError
    from shardplan.cluster.presets import cluster_from_dict, cluster_to_dict

    slow = dataclasses.replace(base, device=dataclasses.replace(base.device, redistribute_overhead=h))
    assert cluster_from_dict(cluster_to_dict(slow)).device.redistribute_overhead == h
    assert "redistribute_overhead" not in cluster_to_dict(base)["device"]
    with pytest.raises(ClusterError, match="redistribute_overhead"):
        dataclasses.replace(base.device, redistribute_overhead=-1.0)


def random_graph(rng):
    """Chains with skips of conv / pool / norm / relu / add and a linear head."""
    b = GraphBuilder(f"cnn{rng.integers(1 << 30)}")
    c = int(rng.choice([2, 4]))
    x = b.input("x", (4, c, 8, 8), ("batch", "channels", "height", "width"))
    live = [x]
    for _ in range(int(rng.integers(1, 4))):
        kind = rng.choice(["conv", "pool", "norm", "relu", "add"])
        src = live[-1]
        if kind == "conv":
            y = b.conv2d(src, c, int(rng.choice([1, 3])), padding=1 if rng.random() < 0.5 else 0)
            if b.shape(y) != b.shape(src):
                live = [y]
                continue
        elif kind == "pool":
            y = b.pool2d(src, 3, padding=1)
        elif kind == "norm":
            y = b.batch_norm(src)
        elif kind == "relu":
            y = b.relu(src)
        else:
            y = b.add(src, live[int(rng.integers(len(live)))])
        live.append(y)
    while len(live) > 2:
        a, d = live.pop(), live.pop()
        live.append(b.add(a, d))
    h = b.reshape(live[-1], (4, int(np.prod(b.shape(live[-1])[1:]))), ("batch", "features"))
    b.softmax_xent(b.linear(h, 4))
    return b.build()


@pytest.mark.parametrize("seed", range(200))
def test_exact_equals_brute_force_analytic(seed):
    rng = np.random.default_rng(5000 + seed)
    for _ in range(20):
        g = random_graph(rng)
        devices = int(rng.choice([2, 4]))
        c = cluster(per_node=2, nodes=2, b1=float(rng.choice([1e9, 10e9])))
        tables = build_tables(g, AnalyticCostModel(c), devices)
        if np.prod([float(k) for k in tables.num_configs]) <= 100_000:
            break
    else:
        pytest.skip("no small graph drawn")
    _, best = brute_force(tables)
    result = exact_search(tables)
    assert result.cost == pytest.approx(best, rel=1e-12)


def test_free_communication_uses_every_device():
    free = cluster(per_node=8, nodes=1, b0=1e30, a0=0.0, b1=1e30, a1=0.0)
    g = one_linear(batch=64, k=512, n=512)
    tables = build_tables(g, AnalyticCostModel(free), 8)
    result = exact_search(tables)
    for cfgs, c in zip(tables.configs, result.choice):
        assert cfgs[c].prod() == 8


def test_presets_scale():
    c = get_cluster("dgx-h100", nodes=16)
    assert c.num_devices == 128 and c.devices_per_node == 8
    assert get_cluster("dgx-a100", devices=1024).num_devices == 1024


def test_op_overhead_is_charged_per_pass():
    """A calibrated dispatch overhead o adds 3 o to a contraction (forward + 2 backward) and 2 o to
    other priced ops, whatever the configuration, and o per parameter for its update."""
    import dataclasses

    import numpy as np

    from shardplan.cluster import get_cluster
    from shardplan.cost.analytic import AnalyticCostModel
    from shardplan.cost.tables import build_tables
    from shardplan.zoo import build_model

    graph = build_model("mlp")
    base = get_cluster("dgx-a100", devices=8)
    slow = dataclasses.replace(base, device=dataclasses.replace(base.device, op_overhead=1e-3))
    t0 = build_tables(graph, AnalyticCostModel(base), 8)
    t1 = build_tables(graph, AnalyticCostModel(slow), 8)
    for op, n0, n1 in zip(graph.ops, t0.nodes, t1.nodes):
        extra = {"fc": 3e-3, "softmax_xent": 2e-3}.get(op.kind)
        if extra is not None:
            extra += 1e-3 * params_of(graph, op)
            assert np.allclose(n1.compute - n0.compute, extra), op.name


def fc_with_folded(extra=(("folded_bytes", 8e6), ("folded_ops", 5))):
    """(a 64 x 1024 -> 1024 fc, the same fc carrying the attributes ``extra``: by default 5 folded
    cheap ops writing 8 MB in all)."""
    import dataclasses

    from shardplan.ir.graph import Graph

    b = GraphBuilder("folded")
    x = b.input("x", (64, 1024), ("batch", "features"))
    b.linear(x, 1024, name="fc")
    plain = b.build()
    op = plain.ops[0]
    return plain, Graph(plain.name, (dataclasses.replace(op, attrs=op.attrs + tuple(extra)),), plain.tensors)


def test_folded_cheap_ops_are_priced_by_hand():
    """An fc with 5 folded ops writing 8 MB in all: 6 x 8 MB of traffic shared by its P devices plus
    2 x 5 dispatches, on top of the same op without them."""
    import dataclasses

    plain, folded = fc_with_folded()
    cluster = get_cluster("dgx-a100", devices=8)
    cluster = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, op_overhead=1e-4))
    t0 = build_tables(plain, AnalyticCostModel(cluster), 8)
    t1 = build_tables(folded, AnalyticCostModel(cluster), 8)
    procs = t0.configs[0].prod(axis=1)
    expected = 6 * 8e6 / procs / cluster.device.memory_bandwidth + 2 * 5 * 1e-4
    assert np.allclose(t1.nodes[0].compute - t0.nodes[0].compute, expected)


def test_folded_ops_the_loss_and_the_update_take_the_elementwise_bandwidth():
    """With an ``elementwise_bandwidth`` a third of the copy bandwidth, the folded bytes (6 x 8 MB
    over P devices) cost three times as much, and the optimizer's update likewise; the field
    round-trips through a cluster file and a non-positive value is refused by name."""
    import dataclasses

    from shardplan.cluster.model import ClusterError
    from shardplan.cluster.presets import cluster_from_dict, cluster_to_dict
    from shardplan.cost.analytic import update_seconds

    plain, folded = fc_with_folded()
    c = get_cluster("dgx-a100", devices=8)
    bw = c.device.memory_bandwidth
    slow = dataclasses.replace(c, device=dataclasses.replace(c.device, elementwise_bandwidth=bw / 3))
    assert c.device.kernel_bandwidth == bw and slow.device.kernel_bandwidth == bw / 3

    def compute(graph, cluster):
        return build_tables(graph, AnalyticCostModel(cluster), 8).nodes[0].compute

    procs = build_tables(plain, AnalyticCostModel(c), 8).configs[0].prod(axis=1)
    # the folded bytes: 6 x 8 MB over P devices, at a third of the bandwidth
    assert np.allclose(compute(folded, slow) - compute(plain, slow), 3 * 6 * 8e6 / procs / bw)
    assert np.allclose(compute(folded, c) - compute(plain, c), 6 * 8e6 / procs / bw)
    assert update_seconds(slow.device, "adam", 1e6) == pytest.approx(7e6 / (bw / 3))
    assert cluster_from_dict(cluster_to_dict(slow)).device.elementwise_bandwidth == bw / 3
    assert "elementwise_bandwidth" not in cluster_to_dict(c)["device"]
    with pytest.raises(ClusterError, match="elementwise_bandwidth"):
        dataclasses.replace(c.device, elementwise_bandwidth=0.0)
    # the jitter's horizon, likewise
    capped = dataclasses.replace(c, device=dataclasses.replace(c.device, sync_jitter=0.01, sync_jitter_horizon=0.016))
    assert cluster_from_dict(cluster_to_dict(capped)).device.sync_jitter_horizon == 0.016
    with pytest.raises(ClusterError, match="sync_jitter_horizon"):
        dataclasses.replace(c.device, sync_jitter_horizon=-1.0)


def test_captured_dispatches_replace_the_per_pass_overhead():
    """A captured op that stands for d exported calls pays 3 d op_overhead (once forward, about twice
    backward), and its folded ops no longer pay dispatches of their own."""
    import dataclasses

    plain, captured = fc_with_folded((("dispatches", 7), ("folded_bytes", 8e6), ("folded_ops", 5)))
    cluster = get_cluster("dgx-a100", devices=8)
    cluster = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, op_overhead=1e-4))
    t0 = build_tables(plain, AnalyticCostModel(cluster), 8)
    t1 = build_tables(captured, AnalyticCostModel(cluster), 8)
    procs = t0.configs[0].prod(axis=1)
    # plain: 3 passes x 1e-4; captured: 3 x 7 x 1e-4 plus the folded bytes only
    expected = 6 * 8e6 / procs / cluster.device.memory_bandwidth + (3 * 7 - 3) * 1e-4
    assert np.allclose(t1.nodes[0].compute - t0.nodes[0].compute, expected)


def test_calibrated_fields_survive_a_cluster_file_and_convs_use_their_rate():
    """op_overhead and conv_efficiency round-trip through a cluster file; a conv at conv_efficiency 0.5
    takes twice the compute of the same FLOPs at 1.0 (when compute-bound)."""
    import dataclasses

    from shardplan.cluster.model import ClusterError
    from shardplan.cluster.presets import cluster_from_dict, cluster_to_dict
    from shardplan.zoo import build_model

    c = get_cluster("dgx-a100", devices=8)
    calibrated = dataclasses.replace(c, device=dataclasses.replace(c.device, op_overhead=2e-5, conv_efficiency=0.5))
    back = cluster_from_dict(cluster_to_dict(calibrated))
    assert back.device.op_overhead == 2e-5 and back.device.conv_efficiency == 0.5
    with pytest.raises(ClusterError, match="conv_efficiency"):
        dataclasses.replace(c.device, conv_efficiency=0.0)
    g = build_model("alexnet")
    full = build_tables(g, AnalyticCostModel(c), 8)
    half = build_tables(g, AnalyticCostModel(calibrated), 8)
    for op, a, b in zip(g.ops, full.nodes, half.nodes):
        if op.kind == "conv":
            assert np.all(b.compute >= a.compute) and np.any(b.compute > 1.5 * a.compute), op.name
        elif op.kind == "fc":
            # only the dispatch changed: 3 passes and the update of each parameter
            assert np.allclose(b.compute - a.compute, (3 + params_of(g, op)) * 2e-5), op.name


def test_skinny_products_run_at_the_calibrated_curve():
    """``gemm_efficiency`` by hand: a data-parallel linear whose local batch is 16 (the smallest of
    m = 16, n = 512, k = 256) runs at the curve's value at 16, interpolated in log m between the points
    at 8 and 32; the curve survives a cluster file and a bad one names the field."""
    import dataclasses
    import math

    from shardplan.cluster.model import ClusterError, gemm_factor
    from shardplan.cluster.presets import cluster_from_dict, cluster_to_dict

    curve = ((8.0, 0.4), (32.0, 0.6), (512.0, 1.0))
    slow = cluster(peak=1e9)  # compute-bound at this rate
    skinny = dataclasses.replace(slow, device=dataclasses.replace(slow.device, gemm_efficiency=curve))
    assert gemm_factor(skinny.device, [16.0])[0] == pytest.approx(0.5, rel=1e-12)  # halfway in log m
    assert gemm_factor(skinny.device, [4.0, 1024.0]).tolist() == [0.4, 1.0]  # the end values hold
    assert gemm_factor(slow.device, [16.0]).tolist() == [1.0]
    _, plain, _, _ = costs_of(one_linear(64, 256, 512), AnalyticCostModel(slow), 4, "fc", (4, 1, 1))
    _, curved, _, _ = costs_of(one_linear(64, 256, 512), AnalyticCostModel(skinny), 4, "fc", (4, 1, 1))
    # the optimizer step (read 4 and write 3 weight-sized tensors) and the gradient's copy into its
    # bucket (read + write): memory bound, no GEMM
    update = 7 * 4 * 256 * 512 / HBM + 2 * 4 * 256 * 512 / HBM
    assert plain == pytest.approx(2 * 2 * 64 * 256 * 512 / 4 / 1e9 + update, rel=1e-12)  # a first layer: 2 GEMMs
    assert curved - update == pytest.approx((plain - update) / 0.5, rel=1e-12)
    # a 2-way split leaves m = 32: the curve's point
    _, two, _, _ = costs_of(one_linear(64, 256, 512), AnalyticCostModel(skinny), 2, "fc", (2, 1, 1))
    assert two == pytest.approx(2 * 2 * 64 * 256 * 512 / 2 / 1e9 / 0.6 + update, rel=1e-12)
    assert not math.isclose(two, curved)
    back = cluster_from_dict(cluster_to_dict(skinny))
    assert back.device.gemm_efficiency == curve
    with pytest.raises(ClusterError, match="gemm_efficiency"):
        cluster_from_dict({**cluster_to_dict(skinny), "device": {**cluster_to_dict(skinny)["device"],
                                                                "gemm_efficiency": [[32, 0.6], [8, 0.4]]}})
    with pytest.raises(ClusterError, match="gemm_efficiency"):
        cluster_from_dict({**cluster_to_dict(skinny), "device": {**cluster_to_dict(skinny)["device"],
                                                                "gemm_efficiency": "fast"}})


def test_convolutions_run_at_their_im2col_shape_curves():
    """By hand: a 3x3 convolution of 16 -> 32 channels on an 8 x 8 map, batch 8, is an im2col GEMM of
    M = 8 x 8 x 8 = 512 rows and reduction K = 16 x 9 = 144; its rate is the matmul's x
    ``conv_efficiency`` x the reduction curve at K x the rows curve at M, each interpolated in log
    size. A 2-way batch split halves M (a lower point of the rows curve) and leaves K. The curves
    survive a cluster file; a falling one is refused by name."""
    import dataclasses
    import math

    from shardplan.cluster.model import ClusterError
    from shardplan.cluster.presets import cluster_from_dict, cluster_to_dict

    b = GraphBuilder("conv")
    x = b.input("x", (8, 16, 8, 8), ("batch", "channels", "height", "width"))
    b.conv2d(x, 32, 3, padding=1, name="conv")
    g = b.build()
    reduction, rows = ((27.0, 0.3), (576.0, 1.0)), ((128.0, 0.6), (2048.0, 1.0))
    slow = cluster(peak=1e9)  # compute-bound at this rate
    dev = dataclasses.replace(slow.device, conv_efficiency=0.9, conv_reduction_efficiency=reduction,
                              conv_rows_efficiency=rows)
    curved = dataclasses.replace(slow, device=dev)
    flops = 2.0 * 8 * 32 * 8 * 8 * 16 * 9
    e_k = 0.3 + 0.7 * math.log(144 / 27) / math.log(576 / 27)
    names = g.ops[0].dim_names
    for batch_split, e_m in ((1, 0.6 + 0.4 * math.log(512 / 128) / math.log(16)),
                             (2, 0.6 + 0.4 * math.log(256 / 128) / math.log(16))):
        config = tuple(batch_split if n == "batch" else 1 for n in names)
        # the optimizer step, and (batch split) the gradient's copy into its bucket: no convolution
        update = update_of(g, AnalyticCostModel(curved), 2, "conv", config, ("optimizer_update", "grad_bucket_pack"))
        pack = 2 * 4 * 32 * 16 * 9 / HBM if batch_split == 2 else 0.0  # read + write the weight gradient
        assert update == pytest.approx(7 * 4 * 32 * 16 * 9 / HBM + pack, rel=1e-12)
        _, compute, _, _ = costs_of(g, AnalyticCostModel(curved), 2, "conv", config)
        # a first layer: forward and weight-gradient convolutions
        assert compute - update == pytest.approx(2 * flops / batch_split / (1e9 * 0.9 * e_k * e_m), rel=1e-12)
    back = cluster_from_dict(cluster_to_dict(curved)).device
    assert (back.conv_reduction_efficiency, back.conv_rows_efficiency) == (reduction, rows)
    assert "conv_rows_efficiency" not in cluster_to_dict(slow)["device"]
    with pytest.raises(ClusterError, match="conv_rows_efficiency"):
        cluster_from_dict({**cluster_to_dict(curved), "device": {**cluster_to_dict(curved)["device"],
                                                                 "conv_rows_efficiency": [[2048, 1.0], [128, 0.6]]}})


def test_sharded_configurations_pay_the_split_dispatch_cost():
    """With ``split_op_overhead`` set, a linear run replicated pays 3 op_overhead of dispatch and run
    split pays 3 split_op_overhead, and its weight's update one op_overhead either way (by hand: the
    compute difference from the same device without overheads); the field survives a cluster file, and a negative one is refused by name."""
    import dataclasses

    from shardplan.cluster.model import ClusterError
    from shardplan.cluster.presets import cluster_from_dict, cluster_to_dict

    base = cluster()
    dev = dataclasses.replace(base.device, op_overhead=1e-4, split_op_overhead=3e-4)
    slow = dataclasses.replace(base, device=dev)
    g = one_linear()
    for config, per_call in (((1, 1, 1), 1e-4), ((4, 1, 1), 3e-4), ((1, 2, 1), 3e-4)):
        _, plain, _, _ = costs_of(g, AnalyticCostModel(base), 4, "fc", config)
        _, paid, _, _ = costs_of(g, AnalyticCostModel(slow), 4, "fc", config)
        assert paid - plain == pytest.approx(3 * per_call + 1e-4, rel=1e-9), config
    assert cluster_from_dict(cluster_to_dict(slow)).device.split_op_overhead == 3e-4
    assert "split_op_overhead" not in cluster_to_dict(base)["device"]
    with pytest.raises(ClusterError, match="split_op_overhead"):
        dataclasses.replace(base.device, split_op_overhead=-1.0)


def test_compute_before_a_sync_point_is_stretched():
    """``sync_stretch`` lengthens an op's compute in each pass that ends in a collective on the critical
    path, and in no other (by hand: a linear whose input is a graph input has one such collective,
    the forward all-reduce of a split ``in_features``, so its forward compute, half of its compute
    (forward and weight-gradient GEMMs: training data needs no gradient), is stretched; data parallel has only the weight-gradient all-reduce, which overlaps the
    backward pass, and an ``out_features`` split has no collective at all; the optimizer update comes
    after both passes and is never stretched). The field survives a
    cluster file and a negative one is refused by name."""
    import dataclasses

    from shardplan.cluster.model import ClusterError
    from shardplan.cluster.presets import cluster_from_dict, cluster_to_dict

    base = cluster()
    rho = 0.25
    slow = dataclasses.replace(base, device=dataclasses.replace(base.device, sync_stretch=rho))
    g = one_linear()
    names = g.ops[g.op_index("fc")].dim_names
    for split, stretched in (({}, 0.0), ({"batch": 4}, 0.0), ({"in_features": 4}, 1 / 2), ({"out_features": 4}, 0.0)):
        config = tuple(split.get(n, 1) for n in names)
        _, plain, comm, _ = costs_of(g, AnalyticCostModel(base), 4, "fc", config)
        _, paid, comm_paid, _ = costs_of(g, AnalyticCostModel(slow), 4, "fc", config)
        update = update_of(g, AnalyticCostModel(base), 4, "fc", config)
        assert update > 0
        assert paid - plain == pytest.approx(rho * stretched * (plain - update), rel=1e-9, abs=1e-15), split
        assert comm_paid == comm
    assert cluster_from_dict(cluster_to_dict(slow)).device.sync_stretch == rho
    assert "sync_stretch" not in cluster_to_dict(base)["device"]
    with pytest.raises(ClusterError, match="sync_stretch"):
        dataclasses.replace(base.device, sync_stretch=-1.0)


def test_sync_points_wait_the_square_root_of_the_compute_before_them():
    """``sync_jitter`` j, by hand on one linear layer over 4 devices whose input is training data (so
    its compute C is the forward and the weight-gradient GEMM, half each; U is the bucket copy and
    the optimizer update, after both passes). A step waits ``j sqrt(compute since the last sync
    point)`` at each sync point and at its end (timed on the slowest rank):

    * replicated, or ``out_features`` split (no collective): once, ``j sqrt(C + U)``;
    * ``in_features`` split: the forward all-reduce after ``C / 2``, then the end: ``j (sqrt(C / 2) +
      sqrt(C / 2 + U))``;
    * data parallel: the weight-gradient reduction after the backward pass, then the end:
      ``j (sqrt(C) + sqrt(U))``;
    * one device: nothing.

    ``step_seconds`` is the tables' cost with the per-op ``sync_stretch`` swapped for these waits,
    and the tables' cost itself when the device has no jitter. The field survives a cluster file
    and a negative one is refused by name."""
    import dataclasses
    import math

    from shardplan.cluster.model import ClusterError
    from shardplan.cluster.presets import cluster_from_dict, cluster_to_dict
    from shardplan.cost.step import step_seconds, sync_waits

    j, rho = 0.02, 0.25
    base = cluster()
    jittery = dataclasses.replace(base, device=dataclasses.replace(base.device, sync_jitter=j, sync_stretch=rho))
    g = one_linear()
    names = g.ops[0].dim_names
    per_iteration = ("optimizer_update", "grad_bucket_pack")
    for split, sqrt_terms in (({}, lambda c, u: [c + u]), ({"out_features": 4}, lambda c, u: [c + u]),
                              ({"in_features": 4}, lambda c, u: [c / 2, c / 2 + u]),
                              ({"batch": 4}, lambda c, u: [c, u])):
        config = tuple(split.get(n, 1) for n in names)
        tables, compute_and_u, _, _ = costs_of(g, AnalyticCostModel(base), 4, "fc", config)
        u = update_of(g, AnalyticCostModel(base), 4, "fc", config, names=per_iteration)
        c = compute_and_u - u
        model = AnalyticCostModel(jittery)
        jt = build_tables(g, model, 4)
        choice = [jt.index_of(0, config)]
        waits, stretch = sync_waits(model, jt, choice)
        assert waits == pytest.approx(j * sum(math.sqrt(t) for t in sqrt_terms(c, u)), rel=1e-9), split
        assert stretch == pytest.approx(rho * c / 2 if "in_features" in split else 0.0, rel=1e-9, abs=1e-18), split
        assert step_seconds(model, jt, choice) == pytest.approx(jt.cost_of(choice) - stretch + waits, rel=1e-12)
        assert step_seconds(AnalyticCostModel(base), tables, choice) == tables.cost_of(choice)
    one = build_tables(g, AnalyticCostModel(jittery), 1)
    assert sync_waits(AnalyticCostModel(jittery), one, [0])[0] == 0.0
    assert cluster_from_dict(cluster_to_dict(jittery)).device.sync_jitter == j
    assert "sync_jitter" not in cluster_to_dict(base)["device"]
    with pytest.raises(ClusterError, match="sync_jitter"):
        dataclasses.replace(base.device, sync_jitter=-1.0)


def test_jitter_walk_by_hand():
    """Three ops, jitter 1 s^0.5: forward compute 1, 3, 5 s, backward 2, 2, 4 s; a redistribution
    feeds op 1, op 2's forward ends in a collective and so does op 0's backward; a gradient reduction
    follows the backward pass and 9 s of updates end the step. Sync points in program order: before
    op 1's forward (1 s since the start), after op 2's forward (3 + 5), op 1's inputs in the backward
    pass (4 + 2), after op 0's backward (2), the reduction (nothing since) and the end (9)."""
    import math

    from shardplan.cost.step import jitter_waits

    waits = jitter_waits(1.0, fwd=[1, 3, 5], bwd=[2, 2, 4], fwd_sync=[False, False, True],
                         bwd_sync=[True, False, False], moved=[False, True, False], reduces=True, after_backward=9)
    assert waits == {("before fwd", 1): 1.0, ("after fwd", 2): math.sqrt(8), ("inputs bwd", 1): math.sqrt(6),
                     ("after bwd", 0): math.sqrt(2), ("reduce", -1): 0.0, ("end", -1): 3.0}
    # exponent 0: one jitter per sync point with compute before it, none where there is none (the
    # reduction right after a sync point); exponent 1: the compute itself; a 4 s horizon caps T
    kw = dict(fwd=[1, 3, 5], bwd=[2, 2, 4], fwd_sync=[False, False, True], bwd_sync=[True, False, False],
              moved=[False, True, False], reduces=True, after_backward=9)
    flat = jitter_waits(0.5, exponent=0.0, **kw)
    assert list(flat.values()) == [0.5, 0.5, 0.5, 0.5, 0.0, 0.5]
    assert list(jitter_waits(1.0, exponent=1.0, **kw).values()) == [1.0, 8.0, 6.0, 2.0, 0.0, 9.0]
    assert list(jitter_waits(1.0, exponent=1.0, horizon=4.0, **kw).values()) == [1.0, 4.0, 4.0, 2.0, 0.0, 4.0]


def test_the_jitter_exponent_round_trips_and_is_checked():
    """A cluster file keeps a device's ``sync_jitter_exponent`` (and leaves out the default 0.5); an
    exponent outside [0, 1] is refused by name, in the file as in code."""
    import dataclasses

    from shardplan.cluster.model import ClusterError
    from shardplan.cluster.presets import cluster_from_dict, cluster_to_dict

    base = cluster()
    flat = dataclasses.replace(base, device=dataclasses.replace(base.device, sync_jitter=0.002, sync_jitter_exponent=0.1))
    assert cluster_from_dict(cluster_to_dict(flat)).device.sync_jitter_exponent == 0.1
    assert "sync_jitter_exponent" not in cluster_to_dict(base)["device"]
    with pytest.raises(ClusterError, match="sync_jitter_exponent"):
        dataclasses.replace(base.device, sync_jitter_exponent=1.5)
    raw = cluster_to_dict(flat)
    raw["device"]["sync_jitter_exponent"] = -0.2
    with pytest.raises(ClusterError, match="sync_jitter_exponent"):
        cluster_from_dict(raw)


def two_linears_tables(devices=2):
    b = GraphBuilder("two")
    x = b.input("x", (64, 256), ("batch", "features"))
    h = b.linear(x, 256, name="fc1")
    b.linear(h, 256, name="fc2")
    graph = b.build()
    c = cluster(per_node=devices)
    c = replace(c, device=replace(c.device, sync_jitter=1.0, redistribute_overhead=1e-5))
    model = AnalyticCostModel(c)
    return graph, model, build_tables(graph, model, devices)


def test_only_collectives_are_sync_points_of_an_edge():
    """fc1 -> fc2 on 2 devices. Batch-split into whole: the forward is an all-gather, the gradient
    goes back by a local cut (code 1). Whole into batch-split: a local cut forward, an all-gather of
    the gradient backward (code 2). Batch-split into feature-split: bytes both ways (3). The same
    layout both sides: nothing (0). Every changed layout still costs DTensor's host work, so a cost
    alone does not tell a collective from a local cut."""
    from shardplan.cost.step import _moved

    graph, model, tables = two_linears_tables()
    (edge,) = [e for e in tables.edges if e.src == 0 and e.dst == 1]
    names = graph.ops[0].dim_names, graph.ops[1].dim_names

    def cfg(i, **split):
        return tables.index_of(i, tuple(split.get(d, 1) for d in names[i]))

    batch, whole = (cfg(0, batch=2), cfg(1, batch=2)), (cfg(0), cfg(1))
    feature = cfg(1, in_features=2)
    cases = {(batch[0], whole[1]): 1, (whole[0], batch[1]): 2, (batch[0], feature): 3,
             (batch[0], batch[1]): 0, (whole[0], whole[1]): 0}
    for (a, b), code in cases.items():
        assert edge.sync_code(a, b) == code, (a, b)
        same = (a, b) in ((batch[0], batch[1]), (whole[0], whole[1]))
        assert (float(edge.cost[edge.src_class[a], edge.dst_class[b]]) > 0) == (not same)
        fwd, bwd = _moved(tables, [a, b])
        assert (fwd[1], bwd[1]) == (bool(code & 1), bool(code & 2))


def test_a_local_cut_is_no_sync_point_of_the_walk():
    """Whole fc1 into batch-split fc2: the edge costs host work and no collective forward, so the
    forward walk has no sync point before fc2; backward, fc2's input gradient is all-gathered, one
    sync point; then the reduction of fc2's batch-split weight gradient, and the step's end."""
    from shardplan.cost.step import StepObjective, _moved, jitter_waits

    graph, model, tables = two_linears_tables()
    names = [op.dim_names for op in graph.ops]
    choice = [tables.index_of(0, tuple(1 for _ in names[0])),
              tables.index_of(1, tuple(2 if d == "batch" else 1 for d in names[1]))]
    fwd, bwd = _moved(tables, choice)
    assert (fwd, bwd) == ([False, False], [False, True])
    so = StepObjective(model, tables, [np.array([c]) for c in choice])
    waits = jitter_waits(1.0, [float(x[0]) for x in so.parts["fwd"]], [float(x[0]) for x in so.parts["bwd"]],
                         [False, False], [False, False], fwd, True, 0.0, moved_back=bwd)
    assert [k for k in waits] == [("inputs bwd", 1), ("reduce", -1), ("end", -1)]


def test_bias_gradient_is_whole_under_a_reduction_split():
    """A bias is added to the reduced product, so splitting ``in_features`` leaves its gradient whole
    on every device (as DTensor computes it: Replicate, no collective); a batch split still makes it
    partial. By hand, on 4 devices of one node: with a bias, the in_features split pays only the
    forward all-reduce of the output, exactly as without one; the batch split pays the weight's and
    the bias's gradient all-reduces."""
    from shardplan.ir.builder import GraphBuilder

    def linear(bias):
        b = GraphBuilder("lin")
        x = b.input("x", (64, 256), ("batch", "features"))
        b.linear(x, 512, bias=bias, name="fc")
        return b.build()

    c = cluster()
    model = AnalyticCostModel(c)
    names = linear(True).ops[0].dim_names
    k_split = tuple(4 if n == "in_features" else 1 for n in names)
    b_split = tuple(4 if n == "batch" else 1 for n in names)
    _, _, with_bias, _ = costs_of(linear(True), model, 4, "fc", k_split)
    _, _, without, _ = costs_of(linear(False), model, 4, "fc", k_split)
    assert with_bias == pytest.approx(without, rel=1e-12)
    assert without == pytest.approx(float(collective_seconds(c, "all_reduce", 4 * 64 * 512, c.per_level(4, 1))))
    _, _, dp_bias, _ = costs_of(linear(True), model, 4, "fc", b_split)
    _, _, dp, _ = costs_of(linear(False), model, 4, "fc", b_split)
    assert dp_bias - dp == pytest.approx(float(collective_seconds(c, "all_reduce", 4 * 512, c.per_level(4, 1),
                                                                  4 * 512 / GRAD_BUCKET_BYTES)))


def _moe_graph(batch=8, seq=16, features=64, experts=4, ffn=128, top_k=2, kept=12345, a2a=False):
    """A producer (elementwise) feeding one fused mixture-of-experts op, as ``capture.moe`` builds it;
    ``a2a``: with its second experts split, whose tokens move by all-to-all (``experts_a2a``)."""
    from shardplan.ir.graph import Dim, DimKind, Graph, Op, Operand, TensorSpec

    bsf = (("batch",), ("seq",), ("features",))
    x_axes = ((("batch", "experts_a2a"),) + bsf[1:]) if a2a else bsf
    e_axes = ("experts", "experts_a2a") if a2a else ("experts",)
    tokens = batch * seq
    def limit(n, rank):  # whole samples, whole experts per device under both experts splits
        return {"split_limits": (n,) + (0,) * (rank - 1)} if a2a else {}
    tensors = (TensorSpec("x", (batch, seq, features)), TensorSpec("h", (batch, seq, features), **limit(batch, 3)),
               TensorSpec("router", (experts, features), is_param=True),
               TensorSpec("w_in", (experts, features, 2 * ffn), is_param=True, **limit(experts, 3)),
               TensorSpec("w_out", (experts, ffn, features), is_param=True, **limit(experts, 3)),
               TensorSpec("y", (tokens, features), **limit(batch, 2)))
    pre = Op("pre", "elementwise", (Dim("batch", batch, DimKind.BATCH), Dim("seq", seq, DimKind.SEQUENCE),
                                    Dim("features", features)),
             (Operand("x", bsf),), (Operand("h", bsf),), flops=float(tokens * features), attrs=(("pw_ops", 1),))
    grouped = 2.0 * tokens * top_k * features * 2 * ffn + 2.0 * tokens * top_k * ffn * features
    a2a_dims = (Dim("experts_a2a", experts, DimKind.PARALLEL),) if a2a else ()
    dims = (Dim("batch", batch, DimKind.BATCH), Dim("seq", seq, DimKind.SEQUENCE, splittable=False),
            Dim("experts", experts, DimKind.PARALLEL), *a2a_dims, Dim("features", features, splittable=False))
    moe = Op("mlp", "moe", dims,
             (Operand("h", x_axes), Operand("router", ((), ("features",))),
              Operand("w_in", (e_axes, (), ())), Operand("w_out", (e_axes, (), ()))),
             (Operand("y", (tuple(a for ax in x_axes[:2] for a in ax), ("features",))),),
             flops=grouped + 2.0 * tokens * features * experts,
             attrs=tuple(sorted({"ffn": ffn, "top_k": top_k, "grouped_flops": grouped, "kept_bytes": kept}.items())),
             module="mlp")
    return Graph("moe", (pre, moe), tensors)


def test_expert_parallel_moe_by_hand():
    """4 experts over 4 devices of one node: each device keeps one expert's weights; the output (every
    token's partial sum over the local experts) is all-reduced, as is the gradient of the block's input
    (each device back-propagates through its own experts) and the replicated router's; the experts'
    own gradients need no collective."""
    c = cluster()
    g = _moe_graph()
    model = AnalyticCostModel(c)
    q = c.per_level(4, 1)
    f32 = 4
    _, _, comm, memory = costs_of(g, model, 4, "mlp", (1, 1, 4, 1))
    out, h, router = f32 * 128 * 64, f32 * 128 * 64, f32 * 4 * 64
    def grad(n, group):  # a weight gradient: its share of a bucket's latency
        return float(collective_seconds(c, "all_reduce", n, group, n / GRAD_BUCKET_BYTES))

    want = sum(float(collective_seconds(c, "all_reduce", n, q)) for n in (out, h)) + grad(router, q)
    assert comm == pytest.approx(want, rel=1e-12)
    w_in, w_out = f32 * 4 * 64 * 256, f32 * 4 * 128 * 64
    experts = w_in + w_out
    # weights, gradients and two Adam moments: the router whole, a quarter of the experts; the output
    # and a quarter of the block's inner activations kept for the backward pass, on the busiest
    # device: L times the mean under uniform routing of 128 tokens, top-2 of 4 experts (cost.routing)
    load = uniform_load(8 * 16, 2, 4, 4)
    assert load > 1.1
    assert memory == pytest.approx(4 * router + 4 * experts / 4 + out + load * 12345 / 4, rel=1e-12)
    # pure data parallelism: every weight's gradient all-reduced, no output or input-grad collective
    _, _, dp_comm, dp_memory = costs_of(g, model, 4, "mlp", (4, 1, 1, 1))
    assert dp_comm == pytest.approx(sum(grad(n, q) for n in (router, w_in, w_out)), rel=1e-12)
    assert dp_memory == pytest.approx(4 * router + 4 * experts + out / 4 + 12345 / 4, rel=1e-12)
    # 2 (batch) x 2 (experts): the experts' gradients reduced over the batch pair only, the output
    # half-tiles over the experts pair, the router over all four
    _, _, hy_comm, _ = costs_of(g, model, 4, "mlp", (2, 1, 2, 1))
    pair_e, pair_b = c.per_level(2, 1), c.per_level(2, 2)
    want = (sum(float(collective_seconds(c, "all_reduce", n / 2, pair_e)) for n in (out, h))
            + grad(router, q) + sum(grad(n / 2, pair_b) for n in (w_in, w_out)))
    assert hy_comm == pytest.approx(want, rel=1e-12)


def test_all_to_all_dispatch_by_hand():
    """The experts split 4 ways over one node with each device's own tokens sent to their experts
    (``experts_a2a``): 8 x 16 tokens, a quarter per device, top-2, so a device sends 64 rows of 64
    floats. Forward: the row counts (8 bytes per peer), the rows' expert ids (8 bytes a row), the
    rows there and back; backward the rows' gradients both ways. No output, input-gradient or expert
    gradient all-reduce; the replicated router's gradient is all-reduced as ever. Gathered tokens
    move the whole token set instead: more bytes, fewer latencies."""
    c = cluster()
    g = _moe_graph(a2a=True)
    model = AnalyticCostModel(c)
    q, f32 = c.per_level(4, 1), 4

    def a2a(n, group):
        return float(collective_seconds(c, "all_to_all", n, group))

    def grad(n, group):  # a weight gradient: its share of a bucket's latency
        return float(collective_seconds(c, "all_reduce", n, group, n / GRAD_BUCKET_BYTES))
    router, out = f32 * 4 * 64, f32 * 128 * 64
    load = uniform_load(8 * 16, 2, 4, 4)  # the busiest device's rows over the mean (cost.routing)
    rows = 8 * 16 // 4 * 2 * load
    i = g.op_index("mlp")
    configs = np.array([[1, 1, 1, 4, 1], [1, 1, 2, 2, 1], [1, 1, 4, 1, 1]])
    items = {it.name: it for it in model.node_cost_items(g, g.ops[i], configs)}
    moves = items["token_all_to_all"]
    assert moves.fwd[0] == pytest.approx(a2a(8 * 4, q) + a2a(8 * rows, q) + 2 * a2a(f32 * rows * 64, q), rel=1e-12)
    assert moves.bwd[0] == pytest.approx(2 * a2a(f32 * rows * 64, q), rel=1e-12)
    _, _, comm, memory = costs_of(g, model, 4, "mlp", (1, 1, 1, 4, 1))
    assert comm == pytest.approx(float(moves.seconds[0]) + grad(router, q), rel=1e-12)
    w_in, w_out = f32 * 4 * 64 * 256, f32 * 4 * 128 * 64
    # one expert per device; the output and inner activations a quarter each
    assert memory == pytest.approx(4 * router + 4 * (w_in + w_out) / 4 + out / 4 + load * 12345 / 4, rel=1e-12)
    # 2 (experts, gathered) x 2 (experts, all-to-all): each pair of the all-to-all (ranks 2 apart)
    # holds half the tokens and sends the half of their choices its two experts take, 128 rows; the
    # partial outputs and input gradients of half the tokens are all-reduced over the gathered pair
    pair_e, pair_a = c.per_level(2, 1), c.per_level(2, 2)
    half = 8 * 16 // 2 * 2 // 2 * load  # the tokens of the whole batch over 4 groups of one expert each
    want = a2a(8 * 2, pair_a) + a2a(8 * half, pair_a) + 2 * a2a(f32 * half * 64, pair_a)
    assert moves.fwd[1] == pytest.approx(want, rel=1e-12)
    _, _, mixed, _ = costs_of(g, model, 4, "mlp", (1, 1, 2, 2, 1))
    halves = 2 * float(collective_seconds(c, "all_reduce", out / 2, pair_e))  # output and input gradient
    assert mixed == pytest.approx(float(moves.seconds[1]) + halves + grad(router, q), rel=1e-12)
    assert moves.seconds[2] == 0.0
    # six collectives of 3 peers each are mostly latency at this size, so the gathered pair wins...
    _, _, gathered, _ = costs_of(g, model, 4, "mlp", (1, 1, 4, 1, 1))
    assert mixed < gathered < comm
    # ...and with 64 x 128 tokens of 1024 features the bytes decide: all-to-all, then mixed, then gathered
    big = _moe_graph(batch=64, seq=128, features=1024, ffn=1024, a2a=True)
    comms = [costs_of(big, model, 4, "mlp", cfg)[2] for cfg in ((1, 1, 1, 4, 1), (1, 1, 2, 2, 1), (1, 1, 4, 1, 1))]
    assert comms == sorted(comms)


def test_search_picks_expert_parallelism_when_expert_weights_dominate():
    """Few tokens, large experts (8 x 2 x 1024 x 4096 floats): data parallelism all-reduces every
    expert's gradient, an experts split only the tokens' partial sums, so the exact search splits
    the experts, and a memory cap that one device's whole experts exceed makes it the only choice."""
    from shardplan.search.solve import solve

    g = _moe_graph(batch=4, seq=32, features=1024, experts=8, ffn=4096, top_k=2, kept=0)
    model = AnalyticCostModel(cluster())
    tables = build_tables(g, model, 4)
    sol = solve(tables)
    i = g.op_index("mlp")
    split = dict(zip(g.ops[i].dim_names, tables.configs[i][sol.choice[i]]))
    assert split["experts"] == 4, split
    dp = [tables.index_of(k, tuple(4 if d.kind.name == "BATCH" else 1 for d in op.dims)) for k, op in enumerate(g.ops)]
    assert sol.cost < tables.cost_of(dp)
    experts_bytes = 4 * 8 * 3 * 1024 * 4096
    capped = solve(tables, memory_limit_bytes=2 * experts_bytes)  # weights + grads + Adam: 4x per copy
    split = dict(zip(g.ops[i].dim_names, tables.configs[i][capped.choice[i]]))
    assert split["experts"] >= 2, split


def test_optimizer_update_by_hand():
    """The optimizer step is priced per parameter tile, memory bound: plain SGD moves 3 x the tile
    (reads weight and gradient, writes the weight), Adam 7 x (and its two moments), plus one dispatch
    each; an ``out_features`` split 4 ways updates a quarter of the weight on each device."""
    import dataclasses

    base = cluster()
    o = 1e-5
    slow = dataclasses.replace(base, device=dataclasses.replace(base.device, op_overhead=o))
    g = one_linear(64, 256, 512)
    weight = 4 * 256 * 512
    names = g.ops[g.op_index("fc")].dim_names
    for split, tile in (({}, weight), ({"batch": 4}, weight), ({"out_features": 4}, weight / 4)):
        config = tuple(split.get(n, 1) for n in names)
        for optimizer, moved in (("sgd", 3), ("sgd_momentum", 5), ("adam", 7)):
            got = update_of(g, AnalyticCostModel(slow, optimizer=optimizer), 4, "fc", config)
            assert got == pytest.approx(moved * tile / HBM + o, rel=1e-12), (split, optimizer)
    # it is compute on the critical path, after both passes (no forward share)
    tables = build_tables(g, AnalyticCostModel(slow), 4)
    i = g.op_index("fc")
    item = next(it for it in AnalyticCostModel(slow).node_cost_items(g, g.ops[i], tables.configs[i])
                if it.name == "optimizer_update")
    assert item.stream == "compute" and item.critical and not item.fwd.any()


def test_a_tied_weight_is_stepped_once():
    """GPT's token embedding is read by the lookup and by the output head: the optimizer steps it once
    and memory holds it once (at its first reader, whose placement the runtime gives it), so the
    update items of a single-device step add up to one update per distinct parameter."""
    from shardplan.cost.analytic import update_seconds
    from shardplan.zoo.models import gpt

    g = gpt(layers=2, hidden=128, heads=4, seq=32, batch=4)
    readers = [o.tensor for op in g.ops for o in op.inputs if g.tensor(o.tensor).is_param]
    assert len(readers) > len(set(readers))  # the embedding is tied
    import dataclasses

    c = cluster()
    c = dataclasses.replace(c, device=dataclasses.replace(c.device, op_overhead=3e-6))
    model = AnalyticCostModel(c)
    total = 0.0
    for op in g.ops:
        configs = np.ones((1, len(op.dims)), dtype=np.int64)
        total += sum(float(it.seconds[0]) for it in model.node_cost_items(g, op, configs) if it.name == "optimizer_update")
    want = sum(update_seconds(c.device, "adam", g.tensor(n).nbytes) for n in set(readers))
    assert total == pytest.approx(want, rel=1e-12)
    # and held once: weight, gradient and two Adam moments per distinct parameter
    held = sum(float(m.nbytes[0]) for op in g.ops
               for m in model.memory_items(g, op, np.ones((1, len(op.dims)), dtype=np.int64)) if m.kind == "parameter")
    assert held == pytest.approx(4 * sum(g.tensor(n).nbytes for n in set(readers)), rel=1e-12)
