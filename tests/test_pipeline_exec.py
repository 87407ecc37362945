"""Pipeline plans run with torch.distributed.pipelining (real gloo processes, one torchrun launch per
rank count) equal single-device training: loss and every gradient, fp32, rtol 1e-5.
Plus the refusals made before any process starts."""

import json
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from shardplan.capture.models import build  # noqa: E402
from shardplan.execute.launch import last_lines, torchrun  # noqa: E402
from shardplan.execute.pipeline import (PipelineError, PipelineSpec, check_pipeline,  # noqa: E402
                                        check_tensor_parallel, find_layout)

L4 = {"num_hidden_layers": 4}
CASES = {
    2: [dict(model="gpt2", ranges=[[0, 0], [1, 1]], microbatches=2, schedule="gpipe", batch=4),
        dict(model="llama", ranges=[[0, 0], [1, 1]], microbatches=4, schedule="1f1b", batch=4),
        dict(model="llama", ranges=[[0, 0], [1, 1], [2, 2], [3, 3]], microbatches=2, schedule="interleaved_1f1b",
             batch=4, config=L4),
        dict(model="torch_mlp", ranges=[[0, 1], [2, 2]], microbatches=2, schedule="1f1b", batch=4)],
    4: [dict(model="llama", ranges=[[0, 0], [1, 1], [2, 2], [3, 3]], microbatches=4, schedule="gpipe", batch=8,
             config=L4),
        dict(model="gpt2", ranges=[[0, 0], [1, 1], [2, 2], [3, 3]], microbatches=4, schedule="1f1b", batch=4,
             config={"n_layer": 4}),
        dict(model="llama", ranges=[[0, 0], [1, 1]], microbatches=2, schedule="1f1b", batch=8, dp=2),
        dict(model="llama", ranges=[[0, 0], [1, 1]], microbatches=2, schedule="1f1b", batch=4, tp=2)],
}


def reference(case):
    torch.manual_seed(0)
    module, kwargs = build(case["model"], batch=case["batch"], seq=case.get("seq", 16), **case.get("config", {}))
    module.eval()
    out = module(**kwargs)
    loss = getattr(out, "logits", out).float().pow(2).mean()
    loss.backward()
    return loss.item(), {n: p.grad for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("ranks", [2, 4])
def test_pipeline_matches_single_device(tmp_path, ranks):
    cases = CASES[ranks]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    proc = torchrun(ranks, "shardplan.execute.pipeline_worker",
                    ["--cases", str(tmp_path / "cases.json"), "--out", str(tmp_path)], timeout_s=300)
    assert proc.returncode == 0, last_lines(proc, 20)
    for k, case in enumerate(cases):
        ref_loss, ref_grads = reference(case)
        scale = max(float(g.abs().max()) for g in ref_grads.values())
        seen = {}
        for r in range(ranks):
            res = torch.load(os.path.join(tmp_path, f"case{k}.rank{r}.pt"))
            assert res["error"] is None, (case, res["error"])
            assert res["loss"] == pytest.approx(ref_loss, rel=1e-5), case
            for n, g in res["grads"].items():
                assert torch.allclose(g, ref_grads[n], rtol=1e-5, atol=1e-6 * scale), (case, n)
                seen[n] = seen.get(n, 0) + 1
        # every rank of a stage returns its gradients (tensor-parallel ones gathered whole)
        per_param = ranks // (len(case["ranges"]) // (2 if case["schedule"] == "interleaved_1f1b" else 1))
        assert set(seen) == set(ref_grads), case  # every gradient comes back from some rank
        assert set(seen.values()) == {per_param}, case  # once per data-parallel replica


def spec(ranges, mb=2, schedule="gpipe", dp=1):
    return PipelineSpec.from_stages(ranges, mb, schedule, data_parallel=dp)


def test_refusals_name_the_reason():
    with pytest.raises(PipelineError, match="unknown schedule 'zb'"):
        check_pipeline(spec([[0, 0], [1, 1]], schedule="zb"), 2, 2, 4)
    with pytest.raises(PipelineError, match="need 2 ranks; got 4"):
        check_pipeline(spec([[0, 0], [1, 1]]), 2, 4, 4)
    with pytest.raises(PipelineError, match=r"missing \[1\]"):
        check_pipeline(spec([[0, 0], [2, 3]]), 4, 2, 4)
    with pytest.raises(PipelineError, match=r"repeated or out of range \[1\]"):
        check_pipeline(spec([[0, 1], [1, 3]]), 4, 2, 4)
    with pytest.raises(PipelineError, match="batch 6 does not split into 1 data-parallel replicas of 4"):
        check_pipeline(spec([[0, 0], [1, 1]], mb=4), 2, 2, 6)
    tp2 = PipelineSpec.from_stages([[0, 0], [1, 1]], 2, "gpipe", tensor_parallel=2)
    with pytest.raises(PipelineError, match="tensor-parallel 2 need 4 ranks; got 2"):
        check_pipeline(tp2, 2, 2, 4)
    check_pipeline(tp2, 2, 4, 4)
    gpt2 = build("gpt2")[0]
    with pytest.raises(PipelineError, match="not supported for gpt2 blocks"):
        check_tensor_parallel(gpt2, find_layout(gpt2), tp2)
    llama = build("llama")[0]  # 4 heads, 2 kv heads
    with pytest.raises(PipelineError, match="tensor_parallel=4 does not divide num_key_value_heads=2"):
        check_tensor_parallel(llama, find_layout(llama),
                              PipelineSpec.from_stages([[0, 0], [1, 1]], 2, "gpipe", tensor_parallel=4))
    mlp = build("torch_mlp")[0]
    with pytest.raises(PipelineError, match="whole column/row pairs"):
        check_tensor_parallel(mlp, find_layout(mlp),
                              PipelineSpec.from_stages([[0, 1], [2, 2]], 2, "gpipe", tensor_parallel=2))
    with pytest.raises(PipelineError, match="1F1B needs at least as many microbatches"):
        check_pipeline(spec([[0, 0], [1, 1]], mb=1, schedule="1f1b"), 2, 2, 4)
    check_pipeline(spec([[0, 0], [1, 1], [2, 2], [3, 3]], schedule="interleaved_1f1b"), 4, 2, 4)


def test_layouts_found():
    assert find_layout(build("gpt2")[0]).blocks == "transformer.h"
    assert find_layout(build("llama")[0]).count == 2
    assert find_layout(build("torch_mlp")[0]).family == "mlp"
    with pytest.raises(PipelineError, match="CNN: no known block layout"):
        find_layout(build("torch_cnn")[0])
