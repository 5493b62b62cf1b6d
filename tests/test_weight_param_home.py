"""The embedded engine's parameter homes: a bucket that fits the model is received straight into its parameters
(they become views of one flat buffer in bucket order); a bucket that does not fit gets no home."""
from __future__ import annotations

import torch

from glue.embedded_engine.weight_update import ParameterBuckets
from weight_sync.buckets import pack_bucket, plan_buckets


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def test_a_fitting_bucket_homes_the_parameters_so_bytes_written_into_it_are_the_weights():
    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    specs = [(n, "float32", tuple(p.shape)) for n, p in model.named_parameters()]
    (layout,) = plan_buckets(specs, bucket_bytes=1 << 20)
    homes = ParameterBuckets(model)
    flat = homes.home(layout)
    assert flat is not None and flat.numel() == layout.nbytes == 4 * (12 + 3 + 6 + 2)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # homing keeps the values
    assert homes.home(layout) is flat  # the same buffer for every later bucket of this layout
    new = {n: torch.full(p.shape, float(i)) for i, (n, p) in enumerate(model.named_parameters())}
    pack_bucket(layout, new, flat)  # what a broadcast into `flat` does
    assert all(torch.equal(p, new[n]) for n, p in model.named_parameters())
    # layer 0: weights 0, bias 1 -> [1, 1, 1]; layer 1: weights 2, bias 3 -> 2 * 3 + 3 = 9
    assert torch.equal(model(torch.ones(1, 4)), torch.full((1, 2), 9.0))


def test_buckets_that_do_not_fit_get_no_home_and_a_new_layout_takes_the_parameters_over():
    model = _model()
    homes = ParameterBuckets(model)
    assert homes.home(plan_buckets([("0.weight", "float32", (4, 3))], 1 << 20)[0]) is None  # wrong shape
    assert homes.home(plan_buckets([("0.weight", "float16", (3, 4))], 1 << 20)[0]) is None  # wrong dtype
    assert homes.home(plan_buckets([("nope", "float32", (3,))], 1 << 20)[0]) is None  # unknown name
    assert homes.home(plan_buckets([("0.bias", "float32", (3,))] * 2, 1 << 20)[0]) is None  # one parameter twice
    specs = [(n, "float32", tuple(p.shape)) for n, p in model.named_parameters()]
    whole = homes.home(plan_buckets(specs, 1 << 20)[0])
    first, second = plan_buckets(specs, bucket_bytes=4 * 15)  # the same weights in two buckets
    flat = homes.home(first)
    assert flat is not None and homes.home(second) is not None and len(homes.homes) == 2  # the whole-model home is gone
    whole.fill_(0)  # the old buffer no longer backs the parameters
    assert model[0].weight.abs().sum() > 0
    flat.fill_(0)
    assert model[0].weight.abs().sum() == 0 and model[0].bias.abs().sum() == 0
