"""Run pipeline plans with ``torch.distributed.pipelining``: stages of consecutive blocks, a schedule
(GPipe, 1F1B, interleaved 1F1B), and data parallelism inside each stage over a (pp, dp) mesh.

``PipelineSpec`` names each stage's block range; ``check_pipeline`` refuses, before any process
starts, specs that cannot run (stage count vs ranks, ranges that miss or repeat a block, a microbatch
count that does not divide the batch, an unknown schedule). ``apply_pipeline`` builds this rank's
stage modules (sharing the original parameters, so their FQNs are the model's) and a runner whose
``step`` does one forward/backward over the whole batch and returns the mean loss on every rank.

Tensor parallelism inside a stage (a (pp, dp, tp) mesh) splits each block Megatron-style with DTensor
(``torch.distributed.tensor.parallel``): the attention's q/k/v and the MLP's gate/up (or fc1)
column-wise, the attention output and down (or fc2) projections row-wise, so a block's input and
output are whole on every tensor rank and stage boundaries carry plain tensors. This is the layout the
pipeline search prices a stage's t devices with. Llama and the MLP support it; GPT-2's fused Conv1D
projections do not (refused by name).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


class PipelineError(ValueError):
    """A pipeline spec, model or mesh that cannot run together; the message says which and why."""


@dataclass(frozen=True)
class StageSpec:
    first: int  # first block index (inclusive)
    last: int  # last block index (inclusive)
    embedding: bool = False
    head: bool = False
    data_parallel: int = 1
    tensor_parallel: int = 1


@dataclass(frozen=True)
class PipelineSpec:
    stages: tuple[StageSpec, ...]
    num_microbatches: int
    schedule: str
    chunks: int = 2
    """Stages per rank under interleaved 1F1B (stage j on pipeline rank j mod ranks); 1 otherwise."""

    @classmethod
    def from_stages(cls, layer_ranges, num_microbatches: int, schedule: str, data_parallel: int = 1,
                    tensor_parallel: int = 1, chunks: int = 2) -> "PipelineSpec":
        """``layer_ranges``: (first, last) block indices per stage, inclusive, in pipeline order."""
        ranges = [tuple(r) for r in layer_ranges]
        n = len(ranges)
        return cls(tuple(StageSpec(a, b, embedding=i == 0, head=i == n - 1, data_parallel=data_parallel,
                                   tensor_parallel=tensor_parallel) for i, (a, b) in enumerate(ranges)),
                   num_microbatches, schedule, chunks)

    @classmethod
    def from_plan(cls, plan) -> "PipelineSpec":
        """From a :class:`shardplan.plan.PipelinePlan` (its ``interleaved`` schedule runs as
        ``interleaved_1f1b`` with the plan's chunks per rank)."""
        schedule = "interleaved_1f1b" if plan.schedule == "interleaved" else plan.schedule
        return cls(tuple(StageSpec(s.layers[0], s.layers[1], embedding=i == 0, head=i == len(plan.stages) - 1,
                                   data_parallel=s.data_parallel, tensor_parallel=s.tensor_parallel)
                         for i, s in enumerate(plan.stages)), plan.num_microbatches, schedule, plan.chunks)

    @property
    def data_parallel(self) -> int:
        return self.stages[0].data_parallel if self.stages else 1

    @property
    def tensor_parallel(self) -> int:
        return self.stages[0].tensor_parallel if self.stages else 1

    def mesh_shape(self) -> tuple[int, int, int]:
        """(pp, dp, tp): the DeviceMesh ``apply_pipeline`` expects, dims named "pp", "dp", "tp"."""
        return self.pipeline_ranks(), self.data_parallel, self.tensor_parallel

    def stages_per_rank(self) -> int:
        return self.chunks if self.schedule == "interleaved_1f1b" else 1

    def pipeline_ranks(self) -> int:
        return len(self.stages) // self.stages_per_rank()


@dataclass(frozen=True)
class BlockLayout:
    """Where a model keeps its pieces: the family, the ModuleList of blocks, and their count."""
    family: str  # "mlp" | "gpt2" | "llama"
    blocks: str  # FQN of the ModuleList
    count: int


def find_layout(module: nn.Module) -> BlockLayout:
    mods = dict(module.named_modules())
    if isinstance(mods.get("transformer.h"), nn.ModuleList) and "transformer.wte" in mods and "lm_head" in mods:
        return BlockLayout("gpt2", "transformer.h", len(mods["transformer.h"]))
    if (isinstance(mods.get("model.layers"), nn.ModuleList) and "model.embed_tokens" in mods
            and "model.rotary_emb" in mods and "lm_head" in mods):
        return BlockLayout("llama", "model.layers", len(mods["model.layers"]))
    if type(module).__name__ == "MLP" and isinstance(mods.get("layers"), nn.ModuleList):
        return BlockLayout("mlp", "layers", len(mods["layers"]))
    raise PipelineError(f"{type(module).__name__}: no known block layout (an HF GPT-2 or Llama causal LM, or "
                        f"shardplan's MLP); cannot cut it into pipeline stages")


def check_pipeline(spec: PipelineSpec, num_blocks: int, world_size: int, batch: int) -> None:
    """Refuse, with the reason, a spec that cannot run; called before any process starts."""
    if spec.schedule not in SCHEDULES:
        raise PipelineError(f"unknown schedule {spec.schedule!r}; known: {', '.join(SCHEDULES)}")
    if not spec.stages:
        raise PipelineError("a pipeline needs at least one stage")
    for i, st in enumerate(spec.stages):
        if st.tensor_parallel != spec.tensor_parallel:
            raise PipelineError(f"stage {i} has tensor-parallel degree {st.tensor_parallel}, stage 0 has "
                                f"{spec.tensor_parallel}; all stages must share one (pp, dp, tp) mesh")
        if st.data_parallel != spec.data_parallel:
            raise PipelineError(f"stage {i} has data-parallel degree {st.data_parallel}, stage 0 has "
                                f"{spec.data_parallel}; all stages must share one (pp, dp) mesh")
        if st.embedding != (i == 0) or st.head != (i == len(spec.stages) - 1):
            raise PipelineError(f"stage {i}: the embedding belongs to the first stage and the head to the last")
    covered: list[int] = []
    for st in spec.stages:
        if st.last < st.first:
            raise PipelineError(f"stage range {st.first}..{st.last} is empty")
        covered += range(st.first, st.last + 1)
    if covered != list(range(num_blocks)):
        missing = sorted(set(range(num_blocks)) - set(covered))
        extra = sorted({b for b in covered if covered.count(b) > 1 or not 0 <= b < num_blocks})
        raise PipelineError(f"stage ranges {[(s.first, s.last) for s in spec.stages]} must cover blocks "
                            f"0..{num_blocks - 1} exactly once, in order (missing {missing}, repeated or "
                            f"out of range {extra})")
    v = spec.stages_per_rank()
    if spec.schedule == "interleaved_1f1b" and v < 2:
        raise PipelineError(f"interleaved 1F1B needs at least 2 stages per rank; the spec has {v}")
    if spec.schedule == "interleaved_1f1b" and spec.num_microbatches % (len(spec.stages) // v):
        raise PipelineError(f"interleaved 1F1B needs a microbatch count ({spec.num_microbatches}) that the "
                            f"{len(spec.stages) // v} pipeline ranks divide")
    if len(spec.stages) % v:
        raise PipelineError(f"schedule {spec.schedule!r} puts {v} stages on each rank; {len(spec.stages)} "
                            f"stages do not divide")
    ranks = spec.pipeline_ranks() * spec.data_parallel * spec.tensor_parallel
    if ranks != world_size:
        raise PipelineError(f"{len(spec.stages)} stages ({v} per rank) x data-parallel {spec.data_parallel} x "
                            f"tensor-parallel {spec.tensor_parallel} need {ranks} ranks; got {world_size}")
    per_replica, rem = divmod(batch, spec.data_parallel)
    if rem or per_replica % spec.num_microbatches:
        raise PipelineError(f"batch {batch} does not split into {spec.data_parallel} data-parallel replicas of "
                            f"{spec.num_microbatches} equal microbatches")
    if spec.schedule == "1f1b" and spec.num_microbatches < len(spec.stages):
        raise PipelineError(f"1F1B needs at least as many microbatches ({spec.num_microbatches}) as stages "
                            f"({len(spec.stages)})")


def _block_tp_plan(family: str, block: nn.Module, index: int) -> dict:
    """Megatron's split of one block: column-parallel in-projections, row-parallel out-projections."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if family == "llama":
        col = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
        return {**{n: ColwiseParallel() for n in col}, "self_attn.o_proj": RowwiseParallel(),
                "mlp.down_proj": RowwiseParallel()}
    if family == "mlp":  # blocks alternate: even ones column-parallel, odd ones row-parallel (a pair)
        return {"": ColwiseParallel() if index % 2 == 0 else RowwiseParallel()}
    raise PipelineError(f"tensor parallelism inside a pipeline stage is not supported for {family} blocks "
                        f"(GPT-2's fused Conv1D projections); use tensor_parallel=1")


def check_tensor_parallel(module: nn.Module, layout: "BlockLayout", spec: PipelineSpec) -> None:
    """Refuse, naming the culprit, a tensor-parallel degree the blocks cannot be split by."""
    t = spec.tensor_parallel
    if t == 1:
        return
    if layout.family == "gpt2":
        _block_tp_plan("gpt2", None, 0)
    if layout.family == "llama":
        cfg = module.config
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            if getattr(cfg, name) % t:
                raise PipelineError(f"tensor_parallel={t} does not divide {name}={getattr(cfg, name)} of the "
                                    f"Llama blocks")
    if layout.family == "mlp":
        for st in spec.stages:
            if (st.last - st.first + 1) % 2 or st.first % 2:
                raise PipelineError(f"stage blocks {st.first}..{st.last}: a tensor-parallel MLP stage needs whole "
                                    f"column/row pairs of blocks (even first block, even count)")
        for i in range(layout.count):
            lin = module.get_submodule(f"{layout.blocks}.{i}")
            if (lin.out_features if i % 2 == 0 else lin.in_features) % t:
                raise PipelineError(f"tensor_parallel={t} does not divide the hidden width of block {i}")


class StageModule(nn.Module):
    """Blocks ``first..last`` of a model (plus its embedding / head), registered at their original FQNs."""

    def __init__(self, module: nn.Module, layout: BlockLayout, st: StageSpec):
        super().__init__()
        self.family, self.first, self.last = layout.family, st.first, st.last
        self.embedding, self.head = st.embedding, st.head
        self.n_blocks = layout.count
        self._attach(layout.blocks, nn.ModuleDict(
            {str(i): module.get_submodule(f"{layout.blocks}.{i}") for i in range(st.first, st.last + 1)}))
        if layout.family == "gpt2":
            self.config = module.config
            self._mask = sys.modules[type(module.transformer).__module__].create_causal_mask
            if st.embedding:
                for n in ("wte", "wpe", "drop"):
                    self._attach(f"transformer.{n}", module.get_submodule(f"transformer.{n}"))
            if st.head:
                self._attach("transformer.ln_f", module.transformer.ln_f)
                self._attach("lm_head", module.lm_head)
        elif layout.family == "llama":
            self.config = module.config
            self._mask = sys.modules[type(module.model).__module__].create_causal_mask
            self._attach("model.rotary_emb", module.model.rotary_emb)
            if st.embedding:
                self._attach("model.embed_tokens", module.model.embed_tokens)
            if st.head:
                self._attach("model.norm", module.model.norm)
                self._attach("lm_head", module.lm_head)

    def _attach(self, fqn: str, sub: nn.Module) -> None:
        parent = self
        *path, leaf = fqn.split(".")
        for p in path:
            if not hasattr(parent, p):
                parent.add_module(p, nn.Module())
            parent = getattr(parent, p)
        parent.add_module(leaf, sub)

    def parallelize(self, tp_mesh) -> None:
        """Split this stage's blocks over the tensor-parallel mesh (see the module doc)."""
        from torch.distributed.tensor.parallel import parallelize_module

        blocks = getattr(self, "layers") if self.family == "mlp" else (
            self.model.layers if self.family == "llama" else self.transformer.h)
        for key, block in blocks.items():
            plan = _block_tp_plan(self.family, block, int(key))
            if "" in plan:
                parallelize_module(block, tp_mesh, plan[""])
            else:
                parallelize_module(block, tp_mesh, plan)

    def forward(self, x):
        if self.family == "mlp":
            for i in range(self.first, self.last + 1):
                x = self.layers[str(i)](x)
                if i + 1 < self.n_blocks:
                    x = torch.relu(x)
            return x
        if self.family == "gpt2":
            t = self.transformer
            pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
            if self.embedding:
                emb = t.wte(x)
                x = t.drop(emb + t.wpe(pos))
            mask = self._mask(config=self.config, inputs_embeds=x, attention_mask=None, cache=None,
                              position_ids=pos)
            for i in range(self.first, self.last + 1):
                x = t.h[str(i)](x, None, mask, None, encoder_attention_mask=None, use_cache=False,
                                position_ids=pos)
            if self.head:
                x = self.lm_head(t.ln_f(x))
            return x
        m = self.model
        if self.embedding:
            x = m.embed_tokens(x)
        pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        mask = self._mask(config=self.config, inputs_embeds=x, attention_mask=None, cache=None, position_ids=pos)
        pe = m.rotary_emb(x, position_ids=pos)
        for i in range(self.first, self.last + 1):
            x = m.layers[str(i)](x, attention_mask=mask, position_embeddings=pe, position_ids=pos, cache=None,
                                 use_cache=False)
        if self.head:
            x = self.lm_head(m.norm(x))
        return x


class PipelineRunner:
    """This rank's stages and schedule; ``step(x)`` runs one forward/backward of the whole batch."""

    def __init__(self, spec, stages, schedule, mesh, loss_fn):
        self.spec, self.stages, self.schedule, self.mesh, self.loss_fn = spec, stages, schedule, mesh, loss_fn

    def named_parameters(self):
        for st in self.stages:
            yield from st.submod.named_parameters()

    def step(self, x: torch.Tensor) -> float:
        """Forward and backward of the global batch ``x`` (the same on every rank); the mean loss."""
        dp = self.spec.data_parallel
        dp_rank = self.mesh["dp"].get_local_rank()
        local = x.chunk(dp)[dp_rank]
        target = torch.zeros(local.shape[0])
        losses: list = []
        first = any(s.is_first for s in self.stages)
        last = any(s.is_last for s in self.stages)
        args = (local,) if first else ()
        self.schedule.step(*args, target=target if last else None, losses=losses if last else None)
        loss = torch.stack([l.detach() for l in losses]).mean() if last else torch.zeros(())
        pp_group = self.mesh["pp"].get_group()
        last_rank = dist.get_global_rank(pp_group, (len(self.spec.stages) - 1) % self.spec.pipeline_ranks())
        loss = loss.reshape(1).clone()
        dist.broadcast(loss, src=last_rank, group=pp_group)
        if dp > 1:
            from torch.distributed.tensor import DTensor

            g = self.mesh["dp"].get_group()
            dist.all_reduce(loss, group=g)
            loss /= dp
            for _, p in self.named_parameters():
                if p.grad is not None:
                    local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                    dist.all_reduce(local, group=g)
                    local /= dp
        return float(loss.item())


def apply_pipeline(module: nn.Module, spec: PipelineSpec, mesh, example_input: torch.Tensor, loss_fn):
    """A :class:`PipelineRunner` for this rank on ``mesh`` (a DeviceMesh with dims ("pp", "dp")).

    ``loss_fn(output)`` must be a mean over the microbatch (the schedule divides by the microbatch count).
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    layout = find_layout(module)
    check_pipeline(spec, layout.count, mesh.size(), example_input.shape[0])
    check_tensor_parallel(module, layout, spec)
    names = mesh.mesh_dim_names or ()
    if spec.tensor_parallel > 1 and "tp" not in names:
        raise PipelineError(f"tensor_parallel={spec.tensor_parallel} needs a mesh with a \"tp\" dim; got {names}")
    pp = spec.pipeline_ranks()
    pp_rank = mesh["pp"].get_local_rank()
    group = mesh["pp"].get_group()
    mine = [i for i in range(len(spec.stages)) if i % pp == pp_rank]
    modules = [StageModule(module, layout, spec.stages[i]) for i in mine]
    if spec.tensor_parallel > 1:
        for m in modules:
            m.parallelize(mesh["tp"])
    stages = [PipelineStage(m, i, len(spec.stages), torch.device("cpu"), group=group) for m, i in zip(modules, mine)]
    fn = lambda out, _target: loss_fn(out)  # noqa: E731 - the schedule passes a target we do not use
    if spec.schedule == "interleaved_1f1b":
        sched = ScheduleInterleaved1F1B(stages, spec.num_microbatches, loss_fn=fn)
    else:
        cls = ScheduleGPipe if spec.schedule == "gpipe" else Schedule1F1B
        sched = cls(stages[0], spec.num_microbatches, loss_fn=fn)
    return PipelineRunner(spec, stages, sched, mesh, loss_fn)
