"""StepMemo (integrations/hf/attention.py): a bound backend's per-forward values, made once per forward and mask
and made again whenever either changes (a new read state, another mask, the mask written in place)."""
import weakref

import torch

from kvpos.integrations.hf import AttentionCall, StepMemo


def _call(state, mask, window=None):
    return AttentionCall(0, torch.zeros(1, 1, 1, 4), None, None, mask, 1.0, lambda: None, 4, None, None, window,
                         state)


class Forward:
    """Stands for a forward's read state (held weakly by StepMemo)."""


def test_step_memo_makes_once_per_forward_and_mask_and_again_on_any_change():
    memo, made = StepMemo(), []
    make = lambda: made.append(1) or len(made)                                   # noqa: E731
    fw1, fw2 = Forward(), Forward()
    full, sliding = torch.ones(1, 1, 1, 4, dtype=torch.bool), torch.ones(1, 1, 1, 4, dtype=torch.bool)
    assert [memo.get(_call(fw1, full), make) for _ in range(3)] == [1, 1, 1]    # the layers of one forward
    assert memo.get(_call(fw1, sliding, window=2), make) == 2                  # another layer type's mask
    assert memo.get(_call(fw1, full), make) == 1                                # both kept within the forward
    full[..., 0] = False                                                        # written in place
    assert memo.get(_call(fw1, full), make) == 3
    assert memo.get(_call(fw2, full), make) == 4                                # a new forward
    assert memo.get(_call(fw2, None), make) == 5 and memo.get(_call(fw2, None), make) == 5   # no mask: kept too
    assert memo.get(_call(None, full), make) == 6 and memo.get(_call(None, full), make) == 7  # no read state
    memo.get(_call(fw2, full), make)
    gone = weakref.ref(fw2)
    del fw2                                                                     # the forward ends
    assert gone() is None                                                       # the memo did not keep its state
