"""Head dims 192/256: on cuDNN older than 9.18 (Hopper) the backward is wrong on live
rows too, a failure no post-pass can repair. This test documents it: expected to fail
there (strict), expected to pass on newer cuDNN, with the post-pass installed either way.
"""

from __future__ import annotations

import pytest

from te_gqa_fix.affected import verdict
from te_gqa_fix.reproduce import (
    compare,
    exact,
    large_head_dim_batch,
    poison_allocator,
    random_inputs,
    references,
    te_backward,
    te_forward,
)
from te_gqa_fix.wrapper import unwrap, wrapper_for

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("d", [192, 256])
def test_large_head_dim(te, capability, cudnn, affected, d, heads, record, request):
    if verdict(capability, cudnn, d).status == "unrepairable":
        request.applymarker(
            pytest.mark.xfail(
                strict=True, reason="cuDNN < 9.18 on Hopper: d > 128 backward wrong on live rows"
            )
        )
    batch = large_head_dim_batch(d, heads)
    random_inputs(batch, seed=d)
    te_forward(batch)
    wrapper = wrapper_for(unwrap(te.cpp_extensions.fused_attn.fused_attn_bwd))
    poison_allocator(1000.0)
    res = compare(batch, te_backward(batch, fn=wrapper), references(batch))
    record(
        cudnn=".".join(map(str, cudnn)),
        affected=affected,
        d=d,
        heads=f"{heads[0]}/{heads[1]}",
        exact=exact(res),
        **res,
    )
    assert exact(res), res
