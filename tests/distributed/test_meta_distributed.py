"""Meta models on gloo ranks: each rank allocates and initialises or loads only its stages,
and the step equals the eager model's (float64)."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from pipecompile import zoo
from pipecompile.weights.materialize import init_weights
from tests.distributed.ranks import run_ranks
from tests.distributed.meta_cases import SIZES, ids, meta_gpt_steps
from tests.support.reference import reference_step


def _check(results, model):
    x = ids()
    ref_loss, ref_grads = reference_step(model, (x,), {}, x, zoo.lm_loss, 4)
    ref_params = dict(model.named_parameters())
    seen = set()
    for rank, r in enumerate(results):
        assert "error" not in r and "died" not in r, (rank, r)
        assert r["meta_before"] and r["missing"] == []
        assert abs(r["loss"].item() - ref_loss.item()) < 1e-12, rank
        for n, p in r["params"].items():
            assert torch.equal(p, ref_params[n].detach()), (rank, n)
        for n, g in r["grads"].items():
            scale = ref_grads[n].abs().max().item() or 1.0
            assert (g - ref_grads[n]).abs().max().item() / scale <= 1e-10, (rank, n)
        seen |= set(r["params"])
        # a rank leaves every tensor of the other ranks' stages on meta
        assert set(r["still_meta"]).isdisjoint(r["params"]), rank
        assert r["still_meta"], rank
    assert seen == set(ref_params)


def test_meta_model_on_two_ranks_init_or_load_equals_eager(tmp_path):
    torch.manual_seed(123)
    initialised = zoo.GPT(**SIZES).double()
    torch.manual_seed(123)
    init_weights(initialised, dict(initialised.named_parameters(remove_duplicate=False)))
    torch.manual_seed(5)
    loaded = zoo.GPT(**SIZES).double()
    state = {k: v for k, v in loaded.state_dict().items() if k != "lm_head.weight"}  # tie once
    save_file(state, str(tmp_path / "gpt.safetensors"))
    results = run_ranks(meta_gpt_steps, 2, 2, str(tmp_path / "gpt.safetensors"))
    assert all("error" not in r and "died" not in r for r in results), results
    _check([r[0] for r in results], initialised)
    _check([r[1] for r in results], loaded)
