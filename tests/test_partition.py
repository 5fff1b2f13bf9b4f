"""Partitioning layers into stages."""

import pytest

from tf_gpipe.partition import even_balance, split_by_balance


def test_even_balance_puts_remainder_first():
    assert even_balance(10, 4) == [3, 3, 2, 2]
    assert even_balance(4, 4) == [1, 1, 1, 1]
    assert even_balance(5, 1) == [5]


def test_split_by_balance_keeps_order():
    assert split_by_balance(list("abcdef"), None, [1, 3, 2]) == [["a"], ["b", "c", "d"], ["e", "f"]]
    assert split_by_balance(list("abcde"), 2, None) == [["a", "b", "c"], ["d", "e"]]


def test_bad_balance_suggests_a_good_one():
    with pytest.raises(ValueError, match=r"balance=\[2, 2, 1\]"):
        split_by_balance(list("abcde"), None, [2, 2, 2])
    with pytest.raises(ValueError, match="num_stages=2"):
        split_by_balance(list("abcde"), 3, [3, 2])
    with pytest.raises(ValueError, match="positive integers"):
        split_by_balance(list("abcde"), None, [5, 0])
    with pytest.raises(ValueError, match="greater than the number of layers"):
        split_by_balance(list("ab"), 3, None)
