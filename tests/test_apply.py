"""Plans applied with DTensor equal single-device training: 5 models x 4 plans x 2 and 4 ranks.

The ranks are threads (torch's threaded process group), so no process is started. Each case runs
one forward and backward pass in fp32 and compares the loss and every gradient with the
single-device module (rtol 1e-5 of the gradient's largest entry).
"""

import copy
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("expecttest")

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate  # noqa: E402

from shardplan.capture import capture  # noqa: E402
from shardplan.capture.models import build  # noqa: E402
from shardplan.cluster import get_cluster  # noqa: E402
from shardplan.cost.analytic import AnalyticCostModel  # noqa: E402
from shardplan.cost.tables import build_tables  # noqa: E402
from shardplan.execute import ApplyError, apply  # noqa: E402
from shardplan.execute.apply import choose_mesh  # noqa: E402
from shardplan.execute.threaded import run_threaded  # noqa: E402
from shardplan.plan import Plan  # noqa: E402
from shardplan.execute.plans import expert_parallel, half_data_parallel, odd, tensor_parallel  # noqa: E402
from shardplan.search.baselines import data_parallel  # noqa: E402
from shardplan.search.solve import solve  # noqa: E402

MODELS = ["torch_mlp", "torch_cnn", "gpt2", "llama", "bert"]
PLANS = ["data_parallel", "tensor_parallel", "searched", "odd"]

def reference(name):
    """(module, kwargs, graph, loss, gradients) of one single-device step of a seeded example model."""
    torch.manual_seed(0)
    module, kwargs = build(name)
    module.eval()
    graph = capture(module, (), kwargs, name=name)
    result = module(**kwargs)
    logits = getattr(result, "logits", result)
    loss = logits.float().pow(2).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    return module, kwargs, graph, loss.item(), grads


@pytest.fixture(scope="module")
def models():
    return {name: reference(name) for name in MODELS}


def assert_matches(results, ref_loss, ref_grads):
    """Every rank's loss and gradients equal the single-device ones (fp32, rtol 1e-5). Some gradients
    are zero in exact arithmetic (BERT's key bias: softmax ignores a constant shift) and only rounding
    noise in fp32, so the absolute floor is set by the model's largest."""
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    for loss, grads in results:
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert set(grads) == set(ref_grads)
        for n, g in grads.items():
            if not torch.allclose(g, ref_grads[n], rtol=1e-5, atol=1e-6 * scale):
                bad = (g - ref_grads[n]).abs() > 1e-6 * scale + 1e-5 * ref_grads[n].abs()
                worst = int(((g - ref_grads[n]).abs() * bad).argmax())
                pytest.fail(f"{n}: {int(bad.sum())} of {g.numel()} elements off, worst "
                            f"{float(g.flatten()[worst]):.9g} against {float(ref_grads[n].flatten()[worst]):.9g} "
                            f"(atol {1e-6 * scale:.3g}, rtol 1e-5)")


def make_plan(graph, which, devices):
    tables = build_tables(graph, AnalyticCostModel(get_cluster("dgx-a100", devices=devices)), devices)
    choice = {"data_parallel": lambda: data_parallel(tables), "tensor_parallel": lambda: tensor_parallel(tables),
              "searched": lambda: solve(tables).choice, "odd": lambda: odd(tables)}[which]()
    return Plan.from_choice(tables, list(choice))


def run_plan(module, kwargs, graph, plan, devices, reduce=True, mesh_shape=None, applier=None):
    """Every rank's (loss, full gradients) of one step of ``plan``; ``reduce``: the partial gradients
    are reduced in buckets (``ParallelModule.reduce_gradients``) as ``shardplan run`` reduces them,
    else DTensor reduces each one when it is read. The mesh is ``choose_mesh``'s unless given;
    ``applier(module, mesh)`` makes the parallel module (``apply`` with ``graph`` by default)."""
    shape = mesh_shape or choose_mesh(graph, plan)
    applier = applier or (lambda m, mesh: apply(m, graph, plan, mesh))

    def rank_fn(rank):
        local = copy.deepcopy(module)
        pm = applier(local, init_device_mesh("cpu", shape))
        result = pm(**kwargs)
        logits = getattr(result, "logits", result)
        full = logits.full_tensor() if isinstance(logits, DTensor) else logits
        loss = full.float().pow(2).mean()
        with pm.context():
            loss.backward()
            if reduce:
                pm.reduce_gradients()
        grads = {}
        for n, p in local.named_parameters():
            if p.grad is not None:
                grads[n] = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        return loss.item(), grads

    return run_threaded(devices, rank_fn)


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("which", PLANS)
@pytest.mark.parametrize("name", MODELS)
def test_plan_matches_single_device(models, name, which, devices):
    module, kwargs, graph, ref_loss, ref_grads = models[name]
    plan = make_plan(graph, which, devices)
    if which != "searched":
        assert any(op.devices > 1 for op in plan.ops), "the plan must actually split something"
    assert_matches(run_plan(module, kwargs, graph, plan, devices), ref_loss, ref_grads)


def _split(tables, graph, name, **ways):
    i = graph.op_index(name)
    return i, tables.index_of(i, tuple(ways.get(d.name, 1) for d in graph.ops[i].dims))


@pytest.mark.parametrize("name,op,ways", [
    # F.linear flattens (batch, seq): a sequence split over both axes of a 2x2 mesh became a strided
    # shard that DTensor could not unflatten (torch 2.13); now computed per rank
    ("llama", "model.layers.0.self_attn.q_proj", {"seq": 4}),
    ("llama", "model.layers.0.self_attn.o_proj", {"batch": 2, "seq": 2}),
    ("bert", "bert.encoder.layer.0.output.dense", {"seq": 2, "out_features": 2}),
    ("llama", "model.layers.1.mlp.down_proj", {"seq": 2, "in_features": 2}),
    # a convolution's batch over both axes: DTensor's convolution rule has no such strategy
    ("torch_cnn", "conv2", {"batch": 4}),
    ("torch_cnn", "conv1", {"batch": 4}),
])
def test_products_dtensor_cannot_run_on_a_2x2_mesh_are_computed_per_rank(models, name, op, ways):
    """Layouts of a linear or a convolution that DTensor's own rules refuse on a 2x2 mesh run as plain
    per-rank products (``execute.local.compute_locally``) and still equal single device."""
    from shardplan.execute.local import local_roles

    module, kwargs, graph, loss, ref = models[name]
    tables = build_tables(graph, AnalyticCostModel(get_cluster("dgx-a100", devices=4)), 4)
    choice = list(data_parallel(tables))
    i, c = _split(tables, graph, op, **ways)
    choice[i] = c
    plan = Plan.from_choice(tables, choice)
    assert local_roles(graph.ops[i], plan.mesh_view(graph, (2, 2))[1][i], (2, 2)) is not None
    assert_matches(run_plan(module, kwargs, graph, plan, 4, mesh_shape=(2, 2)), loss, ref)


@pytest.mark.parametrize("ways,mesh_shape", [
    # conv1 reads the image with its rows split: each rank gathers one halo row from each neighbour
    ({"conv1": {"height": 2}}, (2,)),
    ({"conv1": {"height": 4}}, (4,)),
    ({"conv1": {"height": 4}}, (2, 2)),  # the rows split over both axes: blocks in row-major order
    ({"conv1": {"height": 2, "width": 2}}, (2, 2)),  # the corners come with the second exchange
    ({"conv1": {"batch": 2, "width": 2}}, (2, 2)),
    # conv2 reads the pooled map whole and computes its rows of it (input gradient partial)
    ({"conv2": {"height": 2}, "conv3": {"width": 2}}, (2,)),
    ({"conv1": {"out_channels": 2}, "conv2": {"in_channels": 2}, "conv3": {"out_channels": 2}}, (2,)),
    ({"conv2": {"in_channels": 2, "out_channels": 2}}, (2, 2)),
    ({"conv2": {"height": 2, "in_channels": 2}, "conv3": {"out_channels": 2, "height": 2}}, (2, 2)),
    # rows split all the way: each rank pools its own block (LocalPooling), conv2 and conv3 gather the
    # halo of the pooled map from their neighbours, and the map is gathered before fc1 flattens it
    ({"conv1": {"height": 2}, "conv2": {"height": 2}, "conv3": {"height": 2}, "add": {"height": 2}}, (2,)),
    ({"conv1": {"height": 2, "width": 2}, "conv2": {"height": 2, "width": 2}, "conv3": {"width": 2, "height": 2},
      "add": {"height": 2, "width": 2}}, (2, 2)),
])
def test_convolutions_split_by_channels_rows_and_columns(models, ways, mesh_shape):
    """Channel and spatial splits of the CNN's convolutions (OptCNN's space) run per rank
    (``execute.local``): output channels split the weight, input channels leave partial sums, rows
    and columns gather their halo from the neighbouring ranks' blocks (one all-to-all per split
    axis) or slice a map held whole. Loss and every gradient equal single device."""
    from shardplan.execute.local import local_roles

    module, kwargs, graph, loss, ref = models["torch_cnn"]
    devices = math.prod(mesh_shape)
    tables = build_tables(graph, AnalyticCostModel(get_cluster("dgx-a100", devices=devices)), devices)
    choice = list(data_parallel(tables))
    for op, split in ways.items():
        i, c = _split(tables, graph, op, **split)
        choice[i] = c
    plan = Plan.from_choice(tables, choice)
    opmeshes = plan.mesh_view(graph, mesh_shape)[1]
    for op in ways:
        i = graph.op_index(op)
        if graph.ops[i].kind != "conv":
            continue
        roles = local_roles(graph.ops[i], opmeshes[i], mesh_shape)
        assert roles is not None and all(r is not None for r in roles), (op, roles)
    assert_matches(run_plan(module, kwargs, graph, plan, devices, mesh_shape=mesh_shape), loss, ref)


@pytest.mark.parametrize("devices,rows,conv", [
    (2, 16, dict(kernel_size=3, padding=1)),
    (4, 16, dict(kernel_size=3, padding=1)),
    (4, 16, dict(kernel_size=5, padding=2, stride=2)),  # each rank reads 2 rows above, 1 below
    (2, 16, dict(kernel_size=3, padding=0)),  # 14 output rows: the blocks of input and output differ
    (4, 16, dict(kernel_size=3, padding=2, dilation=2)),
    (2, 8, dict(kernel_size=7, padding=3)),  # a halo of 3 rows from a block of 4
])
def test_halo_rows_forward_and_backward_equal_the_whole_convolution(devices, rows, conv):
    """A convolution whose input and output rows are split in equal blocks over the ranks (``held``):
    its output block and the input's gradient, halo rows sent back to their owners and added there,
    equal those of the whole convolution, for strides, dilations and paddings that give each rank a
    different halo."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from shardplan.execute.local import compute_locally

    torch.manual_seed(0)
    ref = torch.nn.Conv2d(3, 5, **conv)
    x = torch.randn(2, 3, rows, rows + 2)
    xr = x.clone().requires_grad_()
    y = ref(xr)
    (y * y.detach().sin()).sum().backward()

    def rank_fn(rank):
        mesh = init_device_mesh("cpu", (devices,))
        sub = copy.deepcopy(ref)
        sub.zero_grad(set_to_none=True)
        for name, w in list(sub.named_parameters()):
            setattr(sub, name, torch.nn.Parameter(distribute_tensor(w.detach(), mesh, [Replicate()])))
        compute_locally(sub, mesh, (("space", 2, True),))
        xd = distribute_tensor(x, mesh, [Shard(2)]).requires_grad_()
        out = sub(xd)
        assert tuple(out.placements) == (Shard(2),)
        (out * out.detach().sin()).sum().backward()
        return out.full_tensor(), xd.grad.full_tensor(), sub.weight.grad.full_tensor()

    for out, xgrad, wgrad in run_threaded(devices, rank_fn):
        assert torch.allclose(out, y, atol=1e-5)
        assert torch.allclose(xgrad, xr.grad, atol=1e-5)
        assert torch.allclose(wgrad, ref.weight.grad, atol=1e-4)


class _Padded(torch.nn.Module):
    """A reflect-padded convolution (its pad runs before it: capture sees an unpadded convolution of a
    padded map, whose rows it cannot relate to the image's) and a "same"-padded one (string padding:
    its rows and columns stay whole)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Conv2d(3, 8, 3, padding=1, padding_mode="reflect")
        self.b = torch.nn.Conv2d(8, 4, 3, padding="same")

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("ways", [{"height": 2}, {"height": 2, "width": 2}, {"width": 2, "out_channels": 2}])
def test_a_reflect_padded_convolution_split_by_rows(ways):
    """Rows of a reflect-padded convolution split over the ranks: its input is whole on every rank,
    padded as the module pads it, and each rank computes its rows; loss and gradients equal single
    device. The "same"-padded convolution offers no spatial split to the search."""
    torch.manual_seed(0)
    module = _Padded()
    kwargs = {"x": torch.randn(2, 3, 8, 8)}
    graph = capture(module, (), kwargs, name="padded")
    a, b = graph.ops
    assert a.inputs[0].axes[2:] == ((), ()) and a.attr("padding") == (0, 0)
    assert not b.dim("height").splittable and not b.dim("width").splittable
    out = module(**kwargs)
    loss = out.pow(2).mean()
    loss.backward()
    ref = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    devices = math.prod(ways.values())
    tables = build_tables(graph, AnalyticCostModel(get_cluster("dgx-a100", devices=devices)), devices)
    choice = list(data_parallel(tables))
    choice[0] = tables.index_of(0, tuple(ways.get(d.name, 1) for d in a.dims))
    plan = Plan.from_choice(tables, choice)
    assert_matches(run_plan(module, kwargs, graph, plan, devices), loss.item(), ref)


def test_rows_that_do_not_split_evenly_are_refused_before_anything_runs():
    """A 3x3 convolution without padding maps 10 input rows to 8 output rows: 4 blocks of output
    rows would do, but the input's 10 rows do not split into 4 equal blocks for the ranks to hold.
    The search never offers that split (capture limits the rows' splits to divisors of 10), and a
    plan file asking for it is refused by ``check``, naming the op."""
    from shardplan.execute.apply import check
    from shardplan.plan import OpPlan

    module = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3))
    graph = capture(module, (torch.randn(2, 3, 10, 10),), name="valid")
    tables = build_tables(graph, AnalyticCostModel(get_cluster("dgx-a100", devices=4)), 4)
    op = graph.ops[0]
    rows = tables.configs[0][:, op.dim_index("height")]
    assert set(rows.tolist()) == {1, 2}
    plan = Plan.from_choice(tables, [tables.index_of(0, tuple(2 if d.name == "height" else 1 for d in op.dims))])
    bad = Plan(**{**plan.__dict__, "ops": (OpPlan(op.name, op.kind, tuple((d, 4 if d == "height" else 1)
                                                                           for d, _ in plan.ops[0].split)),)})
    with pytest.raises(ApplyError, match=r"op '0' splits axis 2 of 'input' 4 ways.*input rows.*divide 10"):
        check(graph, bad, (4,))
    check(graph, Plan.from_choice(tables, [tables.index_of(0, tuple(2 if d.name == "height" else 1 for d in op.dims))]),
          (2, 2))


def test_pooling_runs_on_each_ranks_block_where_no_window_crosses_its_edge():
    """``LocalPooling`` on a 2x2 mesh: max, average and adaptive pools of maps split along rows,
    columns, batch or channels equal the whole map's pool, forward and backward; where the windows
    fit the blocks the split is kept without any collective, where they cross (a 3x3 window of
    stride 1, an adaptive pool to 3 of 16 rows) DTensor's own rule runs (it replicates)."""
    import torch.nn.functional as F
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    from shardplan.execute.spatial import LocalPooling

    x = torch.randn(4, 8, 16, 16, generator=torch.Generator().manual_seed(0))
    pools = {"max": (lambda t: F.max_pool2d(t, 2), True), "max_kw": (lambda t: F.max_pool2d(t, kernel_size=2, stride=2), True),
             "avg": (lambda t: F.avg_pool2d(t, 4), True), "adaptive": (lambda t: F.adaptive_avg_pool2d(t, 4), True),
             "adaptive_3": (lambda t: F.adaptive_avg_pool2d(t, 3), False),
             "overlapping": (lambda t: F.max_pool2d(t, 3, 1, 1), False)}
    layouts = [(Shard(2), Shard(3)), (Shard(0), Shard(2)), (Shard(2), Shard(2)), (Shard(1), Replicate())]

    def rank_fn(rank):
        mesh = init_device_mesh("cpu", (2, 2))
        out = []
        for pl in layouts:
            for name, (pool, exact) in pools.items():
                xd = distribute_tensor(x, mesh, list(pl)).requires_grad_()
                xr = x.clone().requires_grad_()
                comms = CommDebugMode()
                with comms, LocalPooling():
                    y = pool(xd)
                yr = pool(xr)
                w = torch.randn(yr.shape, generator=torch.Generator().manual_seed(1))
                (y.full_tensor() * w).sum().backward()
                (yr * w).sum().backward()
                spatial = any(p.dim >= 2 for p in pl if isinstance(p, Shard))
                kept = tuple(y.placements) == pl and comms.get_total_counts() == 0
                out.append((name, pl, torch.allclose(y.full_tensor(), yr, atol=1e-6),
                            torch.allclose(xd.grad.full_tensor(), xr.grad, atol=1e-6), kept, exact or not spatial))
        return out

    for name, pl, forward, backward, kept, expected in run_threaded(4, rank_fn)[0]:
        assert forward and backward, (name, pl)
        assert kept == expected, (name, pl, kept)


@pytest.mark.parametrize("name,ways,mesh_shape", [
    ("llama", {"vocab": 2}, (2,)),
    ("llama", {"vocab": 4}, (2, 2)),  # the table's rows over both axes: blocks in row-major order
    ("llama", {"batch": 2, "vocab": 2}, (2, 2)),
    ("llama", {"embed": 2, "vocab": 2}, (2, 2)),
    ("gpt2", {"vocab": 2}, (2,)),  # the table tied to the LM head
    ("bert", {"seq": 2, "vocab": 2}, (2, 2)),
    ("lstm_lm", {"vocab": 2}, (2,)),
])
def test_an_embedding_table_split_by_its_vocabulary(models, name, ways, mesh_shape):
    """Megatron's vocabulary-parallel embedding (``execute.local.look_up_locally``): each rank holds
    rows of the table, looks up the ids that fall in them and writes zeros for the others, and the
    partial outputs are summed; beside a batch, sequence or column split. The rest of the model is
    data parallel. Loss and every gradient equal single device."""
    module, kwargs, graph, loss, ref = models[name] if name in models else reference(name)
    devices = math.prod(mesh_shape)
    tables = build_tables(graph, AnalyticCostModel(get_cluster("dgx-a100", devices=devices)), devices)
    choice = list(data_parallel(tables))
    i = next(k for k, op in enumerate(graph.ops) if op.kind == "embedding")
    choice[i] = tables.index_of(i, tuple(ways.get(d.name, 1) for d in graph.ops[i].dims))
    plan = Plan.from_choice(tables, choice)
    assert dict(plan.ops[i].split)["vocab"] == ways["vocab"]
    assert_matches(run_plan(module, kwargs, graph, plan, devices, mesh_shape=mesh_shape), loss, ref)


@pytest.mark.parametrize("name,devices,seed", [("torch_cnn", 4, 0), ("torch_mlp", 4, 1), ("llama", 4, 2),
                                               ("gpt2", 2, 3), ("bert", 4, 4), ("gpt2", 8, 22)])
def test_a_random_plan_from_the_search_space_runs(models, name, devices, seed):
    """Any configuration the search may pick, op by op at random from the cost tables' search space
    (mixing batch, sequence, feature, head and summed-dim splits, on the mesh ``choose_mesh`` lays
    them on), applies and equals single device: not only the Megatron-shaped plans. GPT-2 on 8 ranks
    lies on a 2x2x2 mesh, where DTensor's own attention matmuls and GPT-2's flattening Conv1D view
    split dims as strided shards and took it minutes per op to plan (about 30 s for the step here)."""
    import numpy as np

    module, kwargs, graph, loss, ref = models[name]
    tables = build_tables(graph, AnalyticCostModel(get_cluster("dgx-a100", devices=devices)), devices)
    rng = np.random.default_rng(seed)
    plan = Plan.from_choice(tables, [int(rng.integers(len(c))) for c in tables.configs])
    assert sum(op.devices > 1 for op in plan.ops) > len(plan.ops) // 2
    if devices == 8:
        assert len(choose_mesh(graph, plan)) == 3
    assert_matches(run_plan(module, kwargs, graph, plan, devices), loss, ref)


@pytest.mark.parametrize("seed", [1, 4])
def test_a_random_mixtral_plan_runs(seed):
    """Random plans of Mixtral on 4 ranks (2x2 mesh), its MoE blocks among them: seed 1 sends the
    first block's tokens by all-to-all over both mesh axes and gathers the second's over 4; seed 4
    mixes a gathered and an all-to-all split of 2 each in the first block, batch and gathered
    experts in the second. Attention and the head around them split at random too."""
    import numpy as np

    module, kwargs, graph, loss, ref = reference("mixtral")
    tables = build_tables(graph, AnalyticCostModel(get_cluster("dgx-a100", devices=4)), 4)
    rng = np.random.default_rng(seed)
    plan = Plan.from_choice(tables, [int(rng.integers(len(c))) for c in tables.configs])
    blocks = [dict(p.split) for p, op in zip(plan.ops, graph.ops) if op.kind == "moe"]
    assert [(b["experts"], b["experts_a2a"]) for b in blocks] == {1: [(1, 4), (4, 1)], 4: [(2, 2), (2, 1)]}[seed]
    assert_matches(run_plan(module, kwargs, graph, plan, 4), loss, ref)


def test_front_doors_capture_and_apply_as_the_issue_names_them(models):
    """``shardplan.capture(module, example_inputs)`` is the captured graph, and ``shardplan.apply(module,
    plan, mesh, example_inputs)`` captures the module itself and runs the plan: the single-device loss
    and gradients on 2 ranks. Another model's plan, or no example inputs, is refused by name."""
    import shardplan

    module, kwargs, graph, ref_loss, ref_grads = models["torch_cnn"]
    assert shardplan.capture(module, (), kwargs, name="torch_cnn").ops == graph.ops
    assert shardplan.capture(module, kwargs["x"]).ops == graph.ops  # one positional input
    plan = make_plan(graph, "odd", 2)
    results = run_plan(module, kwargs, graph, plan, 2,
                       applier=lambda m, mesh: shardplan.apply(m, plan, mesh, (), kwargs))
    assert_matches(results, ref_loss, ref_grads)

    other = make_plan(models["torch_mlp"][2], "data_parallel", 2)

    def refusals(rank):
        mesh = init_device_mesh("cpu", (2,))
        out = []
        for call in (lambda: shardplan.apply(copy.deepcopy(module), other, mesh, (), kwargs),
                     lambda: shardplan.apply(copy.deepcopy(module), plan, mesh)):
            try:
                call()
            except ApplyError as exc:
                out.append(str(exc))
        return out

    first, missing = run_threaded(2, refusals)[0]
    assert "plan is for model 'torch_mlp'" in first
    assert "example inputs" in missing


def test_plan_of_another_model_is_refused(models):
    _, _, mlp_graph, _, _ = models["torch_mlp"]
    llama, _, llama_graph, _, _ = models["llama"]
    plan = make_plan(mlp_graph, "data_parallel", 2)
    with pytest.raises(ApplyError, match="torch_mlp"):
        from shardplan.execute.apply import check
        check(llama_graph, plan, (2,))


def test_mesh_size_mismatch_is_refused(models):
    from shardplan.execute.apply import check

    graph = models["llama"][2]
    plan = make_plan(graph, "data_parallel", 4)
    with pytest.raises(ApplyError, match="mesh 2 has 2 devices; the plan is for 4"):
        check(graph, plan, (2,))


def test_unsplittable_dim_is_refused(models):
    """A plan file splitting a dim the runtime keeps whole (a convolution's kernel rows) is refused
    by name."""
    from shardplan.execute.apply import check
    from shardplan.plan import OpPlan

    graph = models["torch_cnn"][2]
    plan = make_plan(graph, "data_parallel", 2)
    ops = list(plan.ops)
    conv = ops[0]
    ops[0] = OpPlan(conv.name, conv.kind, tuple((d, 3 if d == "kernel_h" else 1) for d, _ in conv.split))
    bad = Plan(**{**plan.__dict__, "ops": tuple(ops)})
    with pytest.raises(ApplyError, match="'conv1' cannot be split along 'kernel_h'"):
        check(graph, bad, (2,))


def test_gqa_split_finer_than_kv_heads_is_refused(models):
    """Llama's k/v projections have 2 kv heads: the search never splits them 4 ways, and a plan file
    that does is refused before anything runs, naming the projection."""
    from shardplan.execute.apply import check
    from shardplan.plan import OpPlan

    graph = models["llama"][2]
    tables = build_tables(graph, AnalyticCostModel(get_cluster("dgx-a100", devices=4)), 4)
    k = graph.op_index("model.layers.0.self_attn.k_proj")
    assert graph.tensor(graph.ops[k].outputs[0].tensor).split_limits[-1] == 2
    assert not any(cfg[graph.ops[k].dim_index("out_features")] == 4 for cfg in tables.configs[k])
    assert any(cfg[graph.ops[k].dim_index("out_features")] == 2 for cfg in tables.configs[k])
    plan = make_plan(graph, "data_parallel", 4)
    ops = list(plan.ops)
    ops[k] = OpPlan(ops[k].name, ops[k].kind, tuple((d, 4 if d == "out_features" else 1) for d, _ in ops[k].split))
    bad = Plan(**{**plan.__dict__, "ops": tuple(ops)})
    with pytest.raises(ApplyError, match="k_proj.*4 ways.*divide 2"):
        check(graph, bad, (4,))


def _lstm_plan(graph, which, devices):
    tables = build_tables(graph, AnalyticCostModel(get_cluster("dgx-a100", devices=devices)), devices)
    if which == "embed_split":  # the table split by columns, the LSTM and head data parallel
        choice = list(data_parallel(tables))
        i = next(k for k, op in enumerate(graph.ops) if op.kind == "embedding")
        choice[i] = tables.index_of(i, tuple(devices if d.name == "embed" else 1 for d in graph.ops[i].dims))
        return Plan.from_choice(tables, choice)
    return make_plan(graph, which, devices)


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("which", ["data_parallel", "odd", "embed_split", "searched"])
def test_lstm_lm_matches_single_device(which, devices):
    """The LSTM runs on each rank's batch shard with its local weights (gradients declared partial over
    the batch split); the embedding and the head split as planned around it."""
    module, kwargs, graph, loss, ref = reference("lstm_lm")
    assert set(ref) == {n for n, _ in module.named_parameters()}
    plan = _lstm_plan(graph, which, devices)
    lstm = next(p for p, op in zip(plan.ops, graph.ops) if op.kind == "lstm")
    if which != "searched":
        assert dict(lstm.split)["batch"] == devices
    assert_matches(run_plan(module, kwargs, graph, plan, devices), loss, ref)


def _mixtral_plan(graph, which, devices):
    if which not in ("expert_parallel", "expert_gather", "searched"):
        return make_plan(graph, which, devices)
    tables = build_tables(graph, AnalyticCostModel(get_cluster("dgx-a100", devices=devices)), devices)
    if which.startswith("expert"):
        return Plan.from_choice(tables, expert_parallel(tables, "gather" if which == "expert_gather" else "all_to_all"))
    # unconstrained, the tiny model's best plan replicates everything (latency beats 0.2 MFLOP ops);
    # under 60% of data parallel's memory the search has to shard its weights
    cap = 0.6 * tables.breakdown(data_parallel(tables))["memory_bytes"]
    return Plan.from_choice(tables, list(solve(tables, memory_limit_bytes=cap).choice))


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("which", ["data_parallel", "tensor_parallel", "searched", "odd", "expert_parallel",
                                   "expert_gather"])
def test_mixtral_matches_single_device(which, devices):
    """Each of Mixtral's routed-experts blocks is one fused op run on each rank's batch shard (local
    weights, gradients partial over the batch split); attention and the head around it split as
    planned. Under expert parallelism each rank holds and runs its own experts (2 of 4 on 2 ranks,
    1 of 4 on 4): GShard's layout sends each rank's own tokens to their experts and back by
    all-to-all (``experts_a2a``), the gathered layout runs them on every token and sums the partial
    outputs (``experts``). The searched plan (under a memory cap) splits the experts too, beside
    tensor-parallel attention."""
    module, kwargs, graph, loss, ref = reference("mixtral")
    blocks = ("model.layers.0.mlp", "model.layers.1.mlp")
    assert dict(graph.meta)["local_blocks"] == blocks
    assert [op.kind for op in graph.ops if op.name in blocks] == ["moe", "moe"]
    plan = _mixtral_plan(graph, which, devices)
    assert any(op.devices > 1 for op in plan.ops)
    for p, op in zip(plan.ops, graph.ops):  # inside the expert blocks only the batch and the experts split
        if op.name in blocks:
            split = dict(p.split)
            assert all(f == 1 for d, f in split.items() if d not in ("batch", "experts", "experts_a2a")), op.name
            if which != "searched":
                assert (split["experts_a2a"] == devices) == (which == "expert_parallel"), (op.name, split)
                assert (split["experts"] == devices) == (which == "expert_gather"), (op.name, split)
    assert_matches(run_plan(module, kwargs, graph, plan, devices), loss, ref)


def test_expert_and_data_parallel_hybrid_holds_a_share_of_the_experts():
    """4 ranks as 2 (batch) x 2 (experts): each rank keeps 2 of the 4 experts and their gradients
    stay sharded over the experts axis (a sum still pending over the batch axis, as any data-parallel
    gradient of a local block); the router's weight is replicated. Loss and gradients equal single
    device."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    module, kwargs, graph, loss, ref = reference("mixtral")
    tables = build_tables(graph, AnalyticCostModel(get_cluster("dgx-a100", devices=4)), 4)
    choice = data_parallel(tables)
    for i, op in enumerate(graph.ops):
        if op.kind == "moe":
            choice[i] = tables.index_of(i, tuple({"batch": 2, "experts": 2}.get(d.name, 1) for d in op.dims))
    plan = Plan.from_choice(tables, list(choice))
    shape = choose_mesh(graph, plan)
    seen = {}

    def rank_fn(rank):
        local = copy.deepcopy(module)
        pm = apply(local, graph, plan, init_device_mesh("cpu", shape))
        experts = local.model.layers[0].mlp.experts
        w, router = experts.gate_up_proj, local.model.layers[0].mlp.gate.weight
        seen[rank] = (experts.num_experts, tuple(w.to_local().shape), tuple(w.placements), tuple(router.placements))
        out = pm(**kwargs)
        full = out.logits.full_tensor() if isinstance(out.logits, DTensor) else out.logits
        value = full.float().pow(2).mean()
        with pm.context():
            value.backward()
        seen[rank] += (tuple(w.grad.placements), tuple(w.grad.to_local().shape))
        return value.item(), {n: (q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad)
                              for n, q in local.named_parameters() if q.grad is not None}

    assert_matches(run_threaded(4, rank_fn), loss, ref)
    for count, local_shape, placed, router_placed, grad_placed, grad_shape in seen.values():
        assert count == 2 and local_shape[0] == 2 and grad_shape == local_shape
        (ep,) = [i for i, q in enumerate(placed) if isinstance(q, Shard) and q.dim == 0]
        assert grad_placed[ep] == placed[ep]
        assert all(isinstance(q, Partial) for i, q in enumerate(grad_placed) if i != ep)
        assert all(isinstance(q, Replicate) for q in router_placed)


@pytest.mark.parametrize("split, mesh_shape", [({"batch": 2, "experts_a2a": 2}, None),
                                               ({"experts": 2, "experts_a2a": 2}, None),
                                               ({"experts_a2a": 4}, (2, 2))])
def test_all_to_all_dispatch_matches_single_device(split, mesh_shape):
    """4 ranks whose Mixtral blocks send each (token, choice) row to its expert's rank by all-to-all:
    beside a batch split, beside a gathered experts split (each all-to-all pair holds half the
    experts of its tokens, the pairs' partial outputs summed), and over both axes of a 2x2 mesh (a
    process group over two mesh axes). Each rank keeps 4 / (its experts splits) of the 4 experts, their
    gradient sharded like the weight (a sum pending only over a batch split); loss and every gradient
    equal single device."""
    from torch.distributed.tensor import Partial, Shard

    module, kwargs, graph, loss, ref = reference("mixtral")
    tables = build_tables(graph, AnalyticCostModel(get_cluster("dgx-a100", devices=4)), 4)
    choice = data_parallel(tables)
    for i, op in enumerate(graph.ops):
        if op.kind == "moe":
            choice[i] = tables.index_of(i, tuple(split.get(d.name, 1) for d in op.dims))
    plan = Plan.from_choice(tables, list(choice))
    shape = mesh_shape or choose_mesh(graph, plan)
    seen = {}

    def rank_fn(rank):
        local = copy.deepcopy(module)
        pm = apply(local, graph, plan, init_device_mesh("cpu", shape))
        experts = local.model.layers[1].mlp.experts
        w = experts.down_proj
        out = pm(**kwargs)
        full = out.logits.full_tensor() if isinstance(out.logits, DTensor) else out.logits
        value = full.float().pow(2).mean()
        with pm.context():
            value.backward()
        seen[rank] = (experts.num_experts, tuple(w.placements), tuple(w.grad.placements), w.grad.to_local().shape[0])
        return value.item(), {n: (q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad)
                              for n, q in local.named_parameters() if q.grad is not None}

    assert_matches(run_threaded(4, rank_fn), loss, ref)
    for count, placed, grad_placed, rows in seen.values():
        assert count == 4 // (split.get("experts", 1) * split["experts_a2a"]) == rows
        for q, g in zip(placed, grad_placed):
            assert g == q if isinstance(q, Shard) else isinstance(g, Partial)


def test_flattened_channel_split_keeps_the_weight_gradient_sharded(models):
    """The CNN's first fc reads the flattened (batch, channels, h, w) map with ``in_features`` split:
    its input arrives split along the flattened features, so each rank computes only its columns of
    the weight gradient (before: the input was replicated, and the whole gradient was computed on
    every rank, then cut down). Every gradient has its parameter's placements (a replicated one's
    may still be a sum pending over the batch split)."""
    module, kwargs, graph, loss, ref = models["torch_cnn"]
    plan = make_plan(graph, "odd", 2)
    assert dict(plan.ops[graph.op_index("fc1")].split)["in_features"] == 2
    seen = {}

    def rank_fn(rank):
        local = copy.deepcopy(module)
        pm = apply(local, graph, plan, init_device_mesh("cpu", choose_mesh(graph, plan)))
        value = pm(**kwargs).full_tensor().float().pow(2).mean()
        with pm.context():
            value.backward()
        seen[rank] = {n: (tuple(q.placements), tuple(q.grad.placements), tuple(q.grad.to_local().shape))
                      for n, q in local.named_parameters()}
        return value.item(), {n: q.grad.full_tensor() for n, q in local.named_parameters()}

    assert_matches(run_threaded(2, rank_fn), loss, ref)
    for per_param in seen.values():
        for name, (placed, grad_placed, local_shape) in per_param.items():
            # a replicated weight's gradient may still be a pending sum (Partial) over the batch split
            assert all(g == p or (p.is_replicate() and g.is_partial()) for p, g in zip(placed, grad_placed)), name
        out_f, in_f = module.fc1.weight.shape
        assert per_param["fc1.weight"][2] == (out_f, in_f // 2)  # this rank's columns only


def test_a_tensor_read_by_several_modules_moves_once_per_layout(models, monkeypatch):
    """Data parallel for the first half of Llama's ops, replicated after: the replicated layers'
    q, k and v projections (and gate and up) read one batch-split hidden state, which is gathered
    once for all of them in each forward, not once per reader; the step still equals single device."""
    import threading

    module, kwargs, graph, loss, ref = models["llama"]
    tables = build_tables(graph, AnalyticCostModel(get_cluster("dgx-a100", devices=2)), 2)
    plan = Plan.from_choice(tables, half_data_parallel(tables))
    moves: dict[int, list] = {}
    original = DTensor.redistribute

    def counting(self, device_mesh=None, placements=None, **kw):
        if placements is not None and tuple(self.placements) != tuple(placements):
            moves.setdefault(threading.get_ident(), []).append((self, tuple(placements)))
        return original(self, device_mesh, placements, **kw)

    monkeypatch.setattr(DTensor, "redistribute", counting)
    assert_matches(run_plan(module, kwargs, graph, plan, 2), loss, ref)
    assert moves
    for per_rank in moves.values():
        keys = [(id(x), target) for x, target in per_rank]  # the tensors are held in the list: ids are unique
        assert len(keys) == len(set(keys)), "a tensor was redistributed to the same layout twice"
    gathers = [x for x, target in next(iter(moves.values())) if x.placements[0].is_shard() and target[0].is_replicate()]
    assert len(gathers) >= 2  # the plan does move the hidden state into the replicated half


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_linear_reads_its_input_split_as_planned_after_a_transpose(models, monkeypatch, name):
    """Tensor parallel: ``o_proj`` (Llama) and ``c_proj`` (GPT-2) read attention's ``(batch, heads,
    seq, head_dim)`` output through a transpose and a reshape, as ``(batch, seq, heads x head_dim)``.
    The input must arrive split on its last dim (the heads, as planned), with no move to another
    sharded dim and back (the reshape's sizes alone would have pointed at ``seq``). GPT-2's Conv1D is
    captured on the ``(batch x seq, features)`` view of its input, so its planned layout is carried
    over to the 3-d input it is called with. Llama's gated MLP's product stays split between gate/up
    and down. The step equals single device."""
    import threading

    module, kwargs, graph, loss, ref = models[name]
    tables = build_tables(graph, AnalyticCostModel(get_cluster("dgx-a100", devices=2)), 2)
    plan = Plan.from_choice(tables, tensor_parallel(tables))
    if name == "llama":
        products = [p for p, op in zip(plan.ops, graph.ops) if op.kind == "elementwise" and op.module.endswith(".mlp")]
        assert products and all(dict(p.split)["features"] == 2 for p in products)  # planned as it runs
    moves: dict[int, list] = {}
    stepping = threading.local()  # counting the forward and backward pass only, not the gradients' gathers
    original = DTensor.redistribute

    def counting(self, device_mesh=None, placements=None, **kw):
        if getattr(stepping, "on", False) and placements is not None and tuple(self.placements) != tuple(placements):
            moves.setdefault(threading.get_ident(), []).append((tuple(self.placements), tuple(placements)))
        return original(self, device_mesh, placements, **kw)

    monkeypatch.setattr(DTensor, "redistribute", counting)

    def rank_fn(rank):
        local = copy.deepcopy(module)
        pm = apply(local, graph, plan, init_device_mesh("cpu", choose_mesh(graph, plan)))
        stepping.on = True
        value = pm(**kwargs).logits.full_tensor().float().pow(2).mean()
        with pm.context():
            value.backward()
        stepping.on = False
        return value.item(), {n: p.grad.full_tensor() for n, p in local.named_parameters()}

    assert_matches(run_threaded(2, rank_fn), loss, ref)
    assert moves  # the plan does reduce partial sums
    for per_rank in moves.values():
        reshards = [(a, b) for a, b in per_rank if a[0].is_shard() and b[0].is_shard()]
        assert not reshards, f"activations moved between sharded dims: {reshards[:3]}"
        gathers = [(a, b) for a, b in per_rank if a[0].is_shard() and b[0].is_replicate()]
        assert not gathers, f"tensor parallel gathered activations: {gathers[:3]}"


@pytest.mark.parametrize("bucket_bytes", [64 * 1024, 1 << 30])
def test_partial_gradients_are_reduced_in_buckets(models, bucket_bytes):
    """Data-parallel Llama on 2 ranks: after the backward pass
    the replicated weights' gradients are pending sums (Partial); ``reduce_gradients`` all-reduces
    them in buckets, one collective per bucket, leaving every gradient placed as its parameter and the
    step equal to single device. Small buckets issue more collectives; one bucket of a GiB issues
    one per group of gradients pending over the same axes."""
    from torch.distributed.tensor import Partial

    module, kwargs, graph, loss, ref = models["llama"]
    plan = make_plan(graph, "data_parallel", 2)
    seen = {}

    def rank_fn(rank):
        local = copy.deepcopy(module)
        pm = apply(local, graph, plan, init_device_mesh("cpu", choose_mesh(graph, plan)))
        value = pm(**kwargs).logits.full_tensor().float().pow(2).mean()
        with pm.context():
            value.backward()
            pending = [q for q in local.parameters() if any(isinstance(g, Partial) for g in q.grad.placements)]
            nbytes = [q.grad.to_local().numel() * 4 for q in pending]
            issued = pm.reduce_gradients(bucket_bytes)
        seen[rank] = (len(pending), nbytes, issued,
                      [(tuple(q.placements), tuple(q.grad.placements)) for q in local.parameters()])
        return value.item(), {n: q.grad.full_tensor() for n, q in local.named_parameters()}

    assert_matches(run_threaded(2, rank_fn), loss, ref)
    for n_pending, nbytes, issued, placed in seen.values():
        assert n_pending >= 10  # data parallel: every replicated weight's gradient was pending
        buckets, size = 1, 0
        for n in nbytes:  # the greedy packing, by hand
            if size and size + n > bucket_bytes:
                buckets, size = buckets + 1, 0
            size += n
        assert issued == buckets
        assert all(p == g for p, g in placed)
    assert (seen[0][2] == 1) == (bucket_bytes == 1 << 30)


def test_view_placements_by_hand():
    from torch.distributed.tensor import Replicate, Shard

    from shardplan.execute.apply import _view_placements

    # flatten (32, 128, 4, 4) -> (32, 2048): the channel split leads the merged dims
    assert _view_placements((32, 128, 4, 4), (32, 2048), [Shard(1)], (2,)) == [Shard(1)]
    assert _view_placements((32, 128, 4, 4), (32, 2048), [Shard(0), Shard(1)], (2, 4)) == [Shard(0), Shard(1)]
    # a split of a trailing dim of the merge has no contiguous counterpart
    assert _view_placements((32, 128, 4, 4), (32, 2048), [Shard(2)], (2,)) == [Replicate()]
    # (b, l, h * k) -> (b, l, h, k): heads split into whole heads; a size-1 dim is skipped
    assert _view_placements((8, 16, 64), (8, 16, 4, 16), [Shard(2)], (4,)) == [Shard(2)]
    assert _view_placements((8, 16, 64), (8, 16, 2, 32), [Shard(2)], (4,)) == [Replicate()]
    assert _view_placements((8, 128), (8, 1, 128), [Shard(1)], (2,)) == [Shard(2)]
    # no planned shape: only the batch carries over
    assert _view_placements((), (8, 16), [Shard(0), Shard(1)], (2, 2)) == [Shard(0), Replicate()]


def test_forward_and_backward_in_one_context(models):
    """As ``shardplan run`` trains: forward and backward inside one ``pm.context()``. The forward enters
    implicit replication itself; leaving it must not switch it off for the backward (a replicated
    model with a vocabulary-split head needs it there: the norm weight's gradient meets a plain
    tensor)."""
    from shardplan.execute.plans import _config, replicated

    module, kwargs, graph, ref_loss, ref_grads = models["llama"]
    tables = build_tables(graph, AnalyticCostModel(get_cluster("dgx-a100", devices=2)), 2)
    choice = replicated(tables)
    head = graph.op_index("lm_head")
    choice[head] = _config(tables, head, out_features=2)
    plan = Plan.from_choice(tables, choice)

    def rank_fn(rank):
        local = copy.deepcopy(module)
        pm = apply(local, graph, plan, init_device_mesh("cpu", choose_mesh(graph, plan)))
        with pm.context():
            loss = pm(**kwargs).logits.full_tensor().float().pow(2).mean()
            loss.backward()
        return loss.item(), {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                             for n, p in local.named_parameters() if p.grad is not None}

    assert_matches(run_threaded(2, rank_fn), ref_loss, ref_grads)


def test_interleaved_steps_take_turns_and_train_each_run(models):
    """``shardplan run --plan A --plan B``: the worker takes the runs' steps round-robin (the warm-up of
    every run, then step 1 of every run, ...), each timed round starting one run further on, times
    every timed step, and each run's first gradients are its own (two plans of one model from the same
    weights: both equal to single device)."""
    from shardplan.execute.worker import _loss, interleaved_sgd_steps

    module, kwargs, graph, ref_loss, ref_grads = models["torch_mlp"]
    tables = build_tables(graph, AnalyticCostModel(get_cluster("dgx-a100", devices=2)), 2)
    plans = [Plan.from_choice(tables, data_parallel(tables)), Plan.from_choice(tables, tensor_parallel(tables))]

    def rank_fn(rank):
        order, runs = [], []
        for i, plan in enumerate(plans):
            local = copy.deepcopy(module)
            pm = apply(local, graph, plan, init_device_mesh("cpu", choose_mesh(graph, plan)))

            def fb(pm=pm, i=i):
                order.append(i)
                loss = _loss(pm(**kwargs))
                loss.backward()
                return loss.item()

            runs.append((fb, local.named_parameters, pm.context))
        measured = interleaved_sgd_steps(runs, 3, keep_first=True)
        return order, measured

    for order, measured in run_threaded(2, rank_fn):
        assert order == [0, 1, 0, 1, 1, 0, 0, 1]  # warm-up, then rounds starting at run 0, 1, 0
        for times, (loss, grads) in measured:
            assert len(times) == 3 and min(times) > 0
            assert_matches([(loss, grads)], ref_loss, ref_grads)
