"""``kept_on``: values derived from a tensor, computed once and dropped when the tensor changes in place."""

import torch

from tessel.kernels._memo import kept_on, kept_with


def _counter():
    calls = []

    def make():
        calls.append(1)
        return torch.tensor(float(len(calls)))

    return calls, make


def test_a_value_is_made_once_per_key_and_tensor():
    t, other = torch.arange(4), torch.arange(4)
    calls, make = _counter()
    first = kept_on(t, "a", make)
    assert kept_on(t, "a", make) is first and len(calls) == 1
    assert kept_on(t, "b", make) is not first and len(calls) == 2  # another key
    assert kept_on(other, "a", make) is not first and len(calls) == 3  # another tensor, equal contents
    assert kept_on(t[:], "a", make) is not first  # a view is another tensor


def test_an_in_place_change_drops_what_was_kept():
    t = torch.arange(4)
    calls, make = _counter()
    first = kept_on(t, "a", make)
    t[0] = 7
    again = kept_on(t, "a", make)
    assert again is not first and len(calls) == 2
    assert kept_on(t, "a", make) is again and len(calls) == 2
    t[1:].add_(1)  # through a view: the version counter is shared
    assert kept_on(t, "a", make) is not again and len(calls) == 3


def test_nothing_is_kept_under_inference_mode_or_for_inference_tensors():
    t = torch.arange(4)
    calls, make = _counter()
    with torch.inference_mode():
        kept_on(t, "a", make)
        kept_on(t, "a", make)
        frozen = torch.arange(4)
    assert len(calls) == 2
    kept_on(frozen, "a", make)
    kept_on(frozen, "a", make)
    assert len(calls) == 4
    # what training keeps afterwards is a normal tensor, usable in autograd
    kept = kept_on(t, "a", make)
    assert not kept.is_inference()


def test_a_value_of_two_tensors_is_kept_while_both_are_unchanged():
    t, other = torch.arange(4), torch.arange(3)
    calls, make = _counter()
    first = kept_with(t, other, "pair", make)
    assert kept_with(t, other, "pair", make) is first and len(calls) == 1
    other[0] = 5  # the second tensor changed in place
    second = kept_with(t, other, "pair", make)
    assert second is not first and len(calls) == 2
    assert kept_with(t, other.clone(), "pair", make) is not second  # another tensor with the same contents
    t[0] = 1  # the first changed
    assert kept_with(t, other, "pair", make) is not second and len(calls) == 4


def test_a_value_of_two_tensors_does_not_keep_the_second_alive():
    import gc
    import weakref

    t = torch.arange(4)
    other = torch.arange(3)
    calls, make = _counter()
    kept_with(t, other, "pair", make)
    gone = weakref.ref(other)
    del other
    gc.collect()
    assert gone() is None
    # a new tensor, perhaps at the old one's address, is never given the old value
    for _ in range(20):
        fresh = torch.arange(3)
        kept_with(t, fresh, "pair", make)
        del fresh
    assert len(calls) == 21


def test_nothing_is_kept_for_two_tensors_under_inference_mode():
    t, other = torch.arange(4), torch.arange(3)
    calls, make = _counter()
    with torch.inference_mode():
        kept_with(t, other, "pair", make)
        kept_with(t, other, "pair", make)
    assert len(calls) == 2
