from hypothesis import given
from hypothesis import strategies as st

from kvfuzz.traces import GenPrompt, TokenPrompt, expand
from kvfuzz.traces.prompts import TOKEN_HIGH, TOKEN_LOW


def test_expansion_is_pinned():
    # Finding files carry only the spec: these exact tokens must never change.
    assert expand(GenPrompt(length=8, seed=1)) == [462, 399, 471, 159, 91, 189, 59, 302]
    assert expand(GenPrompt(length=6, prefix_group="g", prefix_len=4, seed=9))[:4] == [465, 47, 213, 257]


def test_explicit_prompt_unchanged():
    assert expand(TokenPrompt(token_ids=[1, 2, 3])) == [1, 2, 3]


@given(length=st.integers(1, 3000), a=st.integers(0, 3000), b=st.integers(0, 3000),
       s1=st.integers(0, 2**30), s2=st.integers(0, 2**30))
def test_prefix_group_members_share_exactly_their_common_prefix(length, a, b, s1, s2):
    pa, pb = min(a, length), min(b, length)
    x = expand(GenPrompt(length=length, prefix_group="grp", prefix_len=pa, seed=s1))
    y = expand(GenPrompt(length=length, prefix_group="grp", prefix_len=pb, seed=s2))
    k = min(pa, pb)
    assert len(x) == len(y) == length
    assert x[:k] == y[:k]
    assert all(TOKEN_LOW <= t < TOKEN_HIGH for t in x)
    assert x == expand(GenPrompt(length=length, prefix_group="grp", prefix_len=pa, seed=s1))


def test_different_groups_and_seeds_differ():
    a = expand(GenPrompt(length=64, prefix_group="g1", prefix_len=64))
    b = expand(GenPrompt(length=64, prefix_group="g2", prefix_len=64))
    c = expand(GenPrompt(length=64, seed=1))
    d = expand(GenPrompt(length=64, seed=2))
    assert a != b and c != d
