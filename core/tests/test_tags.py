"""The tag namespace: every kind of traffic mapped into the range a backend declares."""

from __future__ import annotations

import pytest
from pg_core.backend import MAX_TAG, Capabilities
from pg_core.errors import NotSupportedError
from pg_core.tags import COLLECTIVE, OBJECT_COLLECTIVE, TagMap, check_tag


@pytest.mark.parametrize("max_tag", [MAX_TAG, 2**31 - 1, 2**16, 7, 3])
def test_every_kind_maps_into_the_declared_range_without_aliasing(max_tag):
    tags = TagMap(max_tag, "b")
    users = [*range(min(tags.limit, 50)), tags.limit - 1]
    user_wire = {tags.user(t) for t in users}
    message_wire = {tags.message(t) for t in users}
    core = {tags.collective, tags.object_collective}
    assert core == {COLLECTIVE, OBJECT_COLLECTIVE}
    assert len(user_wire) == len(set(users)) and len(message_wire) == len(set(users))
    assert not user_wire & message_wire and not (user_wire | message_wire) & core
    assert all(0 <= w <= max_tag for w in user_wire | message_wire | core)
    with pytest.raises(NotSupportedError, match="below"):
        tags.user(tags.limit)
    with pytest.raises(NotSupportedError, match="below"):
        tags.message(tags.limit)


def test_the_widest_range_keeps_the_user_tags_of_before():
    assert TagMap(MAX_TAG, "b").limit == 2**62 - 1
    assert TagMap(2**31 - 1, "gloo").limit == 2**30 - 1


def test_a_backend_without_tags_takes_tag_zero_only():
    tags = TagMap(None, "nccl")
    assert tags.ordered_per_peer
    assert tags.user(0) == tags.message(0) == tags.collective == tags.object_collective == 0
    with pytest.raises(NotSupportedError, match="carries no tags"):
        tags.user(1)


def test_user_tags_are_non_negative_ints():
    assert check_tag(5) == 5
    with pytest.raises(ValueError, match="tag must be >= 0, got -1"):
        check_tag(-1)
    with pytest.raises(TypeError):
        check_tag(True)
    with pytest.raises(TypeError):
        check_tag(1.0)


@pytest.mark.parametrize("bad", [2, -1, 2**63, True])
def test_capabilities_refuse_a_tag_range_that_cannot_carry_the_core(bad):
    with pytest.raises(ValueError, match="max_tag"):
        Capabilities(max_tag=bad)
